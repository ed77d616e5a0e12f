"""``gm.refine``'s line search bounded by ``max_backtracking`` (gradmerge/merge/refinement.py),
counted in gradient calls, not time, on 1-D toys where the answer is known in closed form.

Toy 1, overshoot: R(θ) = θ³ (loss θ⁴/4), fixed curvature 0.1, θ^0 = 1: d = R/0.1 = 10, the
trial points 1 − 10·2^−j are −9, −4, −1.5, −0.25 with |R| = 729, 64, 3.375, 0.0156: the fourth
is the first below |R(1)| = 1. Toy 2, no descent: R(θ) = −(θ − 1) (a concave loss) with
curvature 1: every trial θ − t·d = θ + t(θ − 1) has |R| = (1 + t)|θ − 1|, so no step is taken
and each step costs exactly ``max_backtracking`` gradient calls."""

import pytest
import torch

import gradmerge as gm
from gradmerge.merge.refinement import MAX_BACKTRACKING


class Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, theta):
        self.calls += 1
        return {"w": self.fn(theta["w"])}


ZERO = {"w": torch.zeros(1, dtype=torch.float64)}
ONE = {"w": torch.ones(1, dtype=torch.float64)}


def _refine(grad, curvature, start, **kw):
    return gm.refine(start, ZERO, [grad], [gm.Diagonal({"w": torch.tensor([curvature], dtype=torch.float64)})],
                     prior=0.0, **kw)  # fmt: skip


@pytest.mark.parametrize(("trials", "taken"), [(4, True), (3, False), (1, False)])
def test_overshooting_step_is_taken_only_within_the_bound(trials, taken):
    grad = Counted(lambda w: w**3)
    out = _refine(grad, 0.1, ONE, steps=1, max_backtracking=trials)
    want = 1.0 - 10.0 / 8 if taken else 1.0  # the fourth trial, θ = −0.25, or no step
    assert float(out[0]["w"]) == pytest.approx(want, rel=1e-12)
    assert grad.calls == 1 + (4 if taken else trials)  # R(θ^0), then one call per trial


def test_default_keeps_thirty_trials_per_step():
    assert MAX_BACKTRACKING == 30
    grad = Counted(lambda w: -(w - 1.0))
    start = {"w": torch.full((1,), 3.0, dtype=torch.float64)}
    out = _refine(grad, 1.0, start, steps=2)
    assert [float(t["w"]) for t in out] == [3.0, 3.0]  # no descent: no step taken
    assert grad.calls == 1 + 2 * 30


@pytest.mark.parametrize("trials", [1, 2, 5])
def test_cost_is_bounded_by_one_plus_steps_times_trials(trials):
    grad = Counted(lambda w: -(w - 1.0))
    start = {"w": torch.full((1,), 3.0, dtype=torch.float64)}
    _refine(grad, 1.0, start, steps=3, max_backtracking=trials)
    assert grad.calls == 1 + 3 * trials


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_max_backtracking_is_refused(bad):
    with pytest.raises(gm.ArgumentError, match="max_backtracking"):
        _refine(Counted(lambda w: w), 1.0, ONE, max_backtracking=bad)
