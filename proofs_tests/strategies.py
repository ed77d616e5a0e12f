"""Hypothesis strategies for the problem specs of :mod:`gradmerge.theory.numeric.cases`.

They cover the same ranges as the specs' ``from_seed`` (see the field comments there), with the
number of tasks and the α_t drawn jointly, so a failure shrinks to a small readable problem.
"""

from __future__ import annotations

from hypothesis import strategies as st

from gradmerge.theory.numeric.cases import (
    LinearMergeSpec,
    LinearRemovalSpec,
    LogisticMergeSpec,
    LogisticRemovalSpec,
)

seeds = st.integers(0, 2**31 - 1)


def log_uniform(low_exp: float, high_exp: float) -> st.SearchStrategy[float]:
    """10**u with u uniform in [low_exp, high_exp]."""
    return st.floats(low_exp, high_exp).map(lambda u: float(10**u))


@st.composite
def _alphas(draw: st.DrawFn, tasks: st.SearchStrategy[int]) -> tuple[int, tuple[float, ...]]:
    t = draw(tasks)
    return t, tuple(draw(st.lists(st.floats(0.1, 2.0), min_size=t, max_size=t)))


@st.composite
def linear_merge_specs(draw: st.DrawFn) -> LinearMergeSpec:
    tasks, alphas = draw(_alphas(st.integers(1, 4)))
    return LinearMergeSpec(
        seed=draw(seeds),
        d=draw(st.integers(1, 8)),
        tasks=tasks,
        n_per_task=draw(st.integers(1, 12)),
        condition=draw(log_uniform(0, 6)),
        delta=draw(log_uniform(-2, 1)),
        prior_condition=draw(log_uniform(0, 3)),
        prior_scale=draw(log_uniform(-2, 2)),
        shift=draw(st.floats(0.1, 2.0)),
        covariate_shift=draw(st.floats(0.0, 1.0)),
        alphas=alphas,
    )


linear_removal_specs = st.builds(
    LinearRemovalSpec,
    seed=seeds,
    d=st.integers(1, 8),
    n_keep=st.integers(1, 19),
    n_remove=st.integers(1, 7),
    delta=log_uniform(-2, 1),
    alpha=st.floats(0.1, 2.0),
    condition=log_uniform(0, 6),
    prior_condition=log_uniform(0, 3),
    prior_scale=log_uniform(-2, 2),
    shift=st.floats(0.1, 2.0),
)


@st.composite
def logistic_merge_specs(draw: st.DrawFn) -> LogisticMergeSpec:
    tasks, alphas = draw(_alphas(st.integers(1, 3)))
    return LogisticMergeSpec(
        seed=draw(seeds),
        d=draw(st.integers(1, 5)),
        classes=draw(st.integers(2, 4)),
        tasks=tasks,
        n_per_task=draw(st.integers(5, 40)),
        shift=draw(st.floats(0.0, 1.5)),
        covariate_shift=draw(st.floats(0.0, 1.0)),
        delta=draw(log_uniform(-1, 1)),
        prior=draw(st.sampled_from(["isotropic", "fisher"])),
        prior_scale=draw(log_uniform(-2, 0)),
        alphas=alphas,
    )


logistic_removal_specs = st.builds(
    LogisticRemovalSpec,
    seed=seeds,
    d=st.integers(1, 5),
    classes=st.integers(2, 3),
    n_keep=st.integers(40, 119),
    n_remove=st.integers(1, 29),
    delta=log_uniform(-1, 1),
    alpha=st.floats(0.2, 2.0),
    shift=st.floats(0.0, 1.5),
    prior=st.sampled_from(["isotropic", "fisher"]),
    prior_scale=log_uniform(-2, 0),
)

STRATEGIES = {
    LinearMergeSpec: linear_merge_specs(),
    LinearRemovalSpec: linear_removal_specs,
    LogisticMergeSpec: logistic_merge_specs(),
    LogisticRemovalSpec: logistic_removal_specs,
}
