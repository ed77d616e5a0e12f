"""benchmarks.kfac_choices: each named choice is the solver setting its name and docstring say
(the ``working`` and ``warm`` rows are float32 products, never what ``auto`` picks)."""

from __future__ import annotations

from benchmarks.kfac_choices import CHOICES


def test_each_choice_names_its_arithmetic_start_and_stopping():
    expected = {
        "working": ("working", False, False, None),
        "warm": ("working", True, False, None),
        "bfloat16": ("bfloat16", True, False, None),
        "approximate-0": (None, None, True, 0),
        "approximate-10": (None, None, True, 10),
    }
    assert set(CHOICES) == set(expected)
    for name, (arithmetic, warm, approximate, maxiter) in expected.items():
        spec = CHOICES[name]
        assert spec.approximate is approximate, name
        if approximate:
            assert spec.maxiter == maxiter, name
        else:
            assert (spec.arithmetic, spec.warm_start) == (arithmetic, warm), name
