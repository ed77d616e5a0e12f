"""One way to a merge's report: ``gm.with_solution(rule, ...)`` returns a ``gm.Merged`` (the rule's
parameters, bit for bit, and the report of its solve); the rules themselves return parameters,
and the removed ``return_solution=`` names its replacement."""

import dataclasses

import pytest
import torch

import gradmerge as gm

DT = torch.float64


def _spd(gen, n):
    m = torch.randn(n, n, dtype=DT, generator=gen)
    return m @ m.T / n + 0.5 * torch.eye(n, dtype=DT)


def _problem(seed=0):
    """Two tasks with K-FAC curvatures on one layer (with δ·I: three terms, solved by CG)."""
    gen = torch.Generator().manual_seed(seed)
    terms = [(_spd(gen, 5), _spd(gen, 4)) for _ in range(2)]
    base = {"m.weight": torch.randn(4, 5, dtype=DT, generator=gen)}
    fts = [
        {"m.weight": base["m.weight"] + torch.randn(4, 5, dtype=DT, generator=gen)}
        for _ in range(2)
    ]
    return base, fts, terms


def _cases():
    base, fts, terms = _problem()
    ks = [gm.KFAC({"m": t}) for t in terms]
    diag = gm.Diagonal({"m.weight": torch.rand(4, 5, dtype=DT) + 0.1})
    grad = {"m.weight": torch.randn(4, 5, dtype=DT)}
    return {
        "gradient_matching, K-FAC": (
            gm.gradient_matching,
            (base, fts, ks),
            {"prior": 0.1, "alphas": [0.7, 1.2]},
        ),
        "gradient_matching, diagonal": (
            gm.gradient_matching,
            (base, fts, [diag, diag]),
            {"prior": 0.1},
        ),
        "remove, K-FAC": (
            gm.remove,
            (base, fts[0], ks[0]),
            {"remaining": ks[1] + 0.1, "prior": 0.1, "alpha": 0.5},
        ),
        "remove, diagonal": (
            gm.remove,
            (base, fts[0], diag),
            {"remaining": diag + 1.0, "prior": 0.1},
        ),
        "influence_remove": (gm.influence_remove, (base, grad), {"remaining": ks[1] + 0.1}),
    }


CASES = _cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_parameters_are_the_rules_bit_for_bit(case):
    rule, args, kwargs = CASES[case]
    plain = rule(*args, **kwargs)
    merged = gm.with_solution(rule, *args, **kwargs)
    assert isinstance(plain, dict) and isinstance(merged, gm.Merged)
    assert isinstance(merged.solution, gm.Solution) and merged.solution.success
    assert plain.keys() == merged.params.keys()
    assert all(torch.equal(plain[k], merged.params[k]) for k in plain)
    with pytest.raises(dataclasses.FrozenInstanceError):
        merged.params = {}  # type: ignore[misc]


def test_the_report_is_the_residual_of_eq6_recomputed_here():
    """H̄ x = Σ_t α_t (H_0 + H_t) τ_t with H_0 = δ·I and H_t = A_t ⊗ G_t acting as V ↦ G_t V A_t:
    the reported relative residual is the one of x = θ − θ_LLM, computed from the terms."""
    base, fts, terms = _problem(1)
    ks = [gm.KFAC({"m": t}) for t in terms]
    alphas, delta = [0.7, 1.2], 0.1
    merged = gm.with_solution(
        gm.gradient_matching,
        base,
        fts,
        ks,
        prior=delta,
        alphas=alphas,
        solver=gm.KroneckerCG(tol=1e-9),
    )
    x = merged.params["m.weight"] - base["m.weight"]
    taus = [ft["m.weight"] - base["m.weight"] for ft in fts]
    weighted = list(zip(alphas, terms, strict=True))
    h_bar_x = delta * x + sum(a * g @ x @ A for a, (A, g) in weighted)
    rhs = sum(a * (delta * t + g @ t @ A) for (a, (A, g)), t in zip(weighted, taus, strict=True))
    residual = float(torch.linalg.norm(rhs - h_bar_x) / torch.linalg.norm(rhs))
    part = merged.solution.parts["m"]
    assert part.success and residual <= 1e-9
    assert part.residual == pytest.approx(residual, rel=1e-3, abs=1e-14)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_old_keyword_names_its_replacement(case):
    rule, args, kwargs = CASES[case]
    message = rf"{rule.__name__}\(return_solution=\.\.\.\) no longer exists.*gm\.with_solution\(gm\.{rule.__name__}"
    with pytest.raises(gm.ArgumentError, match=message):
        rule(*args, **kwargs, return_solution=True)
    with pytest.raises(gm.ArgumentError, match=message):
        gm.with_solution(rule, *args, **kwargs, return_solution=True)


def test_other_unknown_keywords_are_type_errors_as_python_raises_them():
    rule, args, kwargs = CASES["gradient_matching, diagonal"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'alpha'"):
        rule(*args, **kwargs, alpha=1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'alpha'"):
        gm.with_solution(rule, *args, **kwargs, alpha=1.0)
    with pytest.raises(TypeError, match="prior"):
        gm.with_solution(rule, *args)  # a missing argument, as the rule itself refuses it


@pytest.mark.parametrize("rule", [gm.task_arithmetic, gm.fisher_average, gm.regmean, gm.tsv_merge])
def test_rules_that_solve_no_system_are_refused(rule):
    with pytest.raises(gm.ArgumentError, match=rf"got {rule.__name__}: call it directly"):
        gm.with_solution(rule, [{"w": torch.zeros(2)}], [])


@pytest.mark.parametrize("rule", [gm.gradient_matching, gm.remove, gm.influence_remove])
def test_each_solving_rule_declares_its_report_with_its_own_parameters(rule):
    """``with_solution`` keeps no list of rules and re-binds nothing: each rule's module declares
    its implementation with the report (``reports``), whose parameters are the rule's own."""
    import inspect

    from gradmerge.merge.matching import SOLUTION

    solved = getattr(rule, SOLUTION)
    assert inspect.signature(solved).parameters == inspect.signature(rule).parameters


def test_a_new_solving_rule_needs_only_its_declaration():
    from gradmerge.merge.matching import reports

    def doubled(base, *, by=2.0):
        return _doubled(base, by=by).params

    @reports(doubled)
    def _doubled(base, *, by=2.0):
        return gm.Merged({k: by * v for k, v in base.items()}, gm.Solution({}, "exact (test)"))

    out = gm.with_solution(doubled, {"w": torch.ones(1, dtype=DT)}, by=3.0)
    assert out.params["w"].item() == 3.0 and out.solution.result is gm.Result.successful
    with pytest.raises(TypeError, match="'bye'"):
        gm.with_solution(doubled, {"w": torch.ones(1, dtype=DT)}, bye=3.0)
