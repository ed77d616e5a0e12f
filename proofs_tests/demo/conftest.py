"""One quick demo run (seconds), shared by the tests of proofs_tests/demo."""

from __future__ import annotations

import pytest

from gradmerge.demo import DemoResults, run_demo


@pytest.fixture(scope="session")
def quick_results() -> DemoResults:
    """``run_demo(quick=True)`` on the CPU, seed 0, nothing written."""
    return run_demo(quick=True, device="cpu", seed=0, log=None)
