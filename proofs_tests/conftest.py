"""Test-wide settings. Hypothesis profiles: `ci` (derandomised, bounded: the default everywhere, so
that a run's verdict is the same on every machine and every run), `dev` (HYPOTHESIS_PROFILE=dev:
new random examples each run, to explore) and `thorough` (HYPOTHESIS_PROFILE=thorough, a deeper
search)."""

import os

import torch
from hypothesis import HealthCheck, settings

# The problems are tiny float64 systems: with several intra-op threads on a loaded 2-core machine a
# 150×3 @ 3×4 product took ~23 ms (threads waiting on each other) against 5 µs on one thread.
torch.set_num_threads(1)

_common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", max_examples=20, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=20, **_common)
settings.register_profile("thorough", max_examples=500, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
