"""The suite's own settings (proofs_tests/conftest.py): its verdict is the same on every run."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings


@pytest.mark.skipif("HYPOTHESIS_PROFILE" in os.environ, reason="a profile was chosen explicitly")
def test_the_default_hypothesis_profile_is_derandomised_and_bounded():
    """Without HYPOTHESIS_PROFILE every property test draws the same examples on every run and
    machine (``ci``, with or without CI=true), at most 20 each, with no deadline: no verdict
    depends on a random draw or on how fast a loaded machine runs an example."""
    current = settings.default
    assert current.derandomize and current.max_examples == 20 and current.deadline is None


def test_torch_computes_on_one_thread():
    assert torch.get_num_threads() == 1
