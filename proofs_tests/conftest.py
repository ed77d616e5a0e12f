"""Hypothesis profiles: `ci` (derandomised, bounded: the default under CI=true), `dev` (the
default locally) and `thorough` (HYPOTHESIS_PROFILE=thorough, for a deeper search)."""

import os

from hypothesis import HealthCheck, settings

_common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", max_examples=20, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=20, **_common)
settings.register_profile("thorough", max_examples=500, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
