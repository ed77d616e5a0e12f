"""Every numeric check of the appendix, over hypothesis-drawn problems.

For each kind of problem (linear/logistic × merge/removal), hypothesis draws problems and every
check of that kind runs on each: a statement that holds must have error ≤ tol (1e-9); a statement
as printed that is wrong (an erratum) must have error > tol. The merge and removal results inside
the checks come from the public gradmerge functions.
"""

import pytest
from hypothesis import given

from gradmerge.theory.numeric import ALL_CHECKS
from proofs_tests.strategies import STRATEGIES


def _run_all(spec_type, spec):
    failures = []
    for check in (c for c in ALL_CHECKS if c.spec_type is spec_type):
        error = check.run(spec)
        if check.expect and not error <= check.tol:
            failures.append(f"{check.id} ({check.where}) fails: error {error:.3e}")
        if not check.expect and not error > check.tol:
            failures.append(f"erratum {check.id} unexpectedly holds: error {error:.3e}")
    return failures


def _make_test(spec_type):
    @given(spec=STRATEGIES[spec_type])
    def test(spec):
        failures = _run_all(spec_type, spec)
        assert not failures, "\n".join(failures)

    return test


test_linear_merge_statements = _make_test(next(iter(STRATEGIES)))
for _spec_type in STRATEGIES:
    globals()[f"test_{_spec_type.__name__}_statements"] = _make_test(_spec_type)
del test_linear_merge_statements


def test_every_check_has_a_strategy():
    assert {c.spec_type for c in ALL_CHECKS} <= set(STRATEGIES)


def test_ids_are_unique_per_model():
    keys = [(c.id, c.model) for c in ALL_CHECKS]
    assert len(keys) == len(set(keys))


def test_each_erratum_has_a_corrected_statement():
    """Every printed statement shown wrong comes with a corrected one, at the same place."""
    for c in ALL_CHECKS:
        if not c.expect:
            assert c.id.endswith("-printed"), c.id
            fixes = [d for d in ALL_CHECKS if d.expect and d.where == c.where]
            assert any(d.id.endswith("-corrected") for d in fixes), c.id


@pytest.mark.parametrize("check", [c for c in ALL_CHECKS if not c.expect], ids=lambda c: c.id)
def test_errata_fail_by_a_wide_margin_on_default_cases(check):
    """The printed forms are not borderline: on the verify cases their error is ≥ 1e3 × tol."""
    assert min(check.error(seed) for seed in range(5)) > 1e3 * check.tol
