"""Every method of the registry (gradmerge.methods.registry) round-trips YAML → dry run → merge.

The cases are data: one YAML configuration and one in-memory reference per registered method,
on a tiny K-FAC workspace (an MLP whose LayerNorm has a diagonal block). For each method: the
YAML file parses into the job's configuration, ``gradmerge <job> --dry-run`` checks it and writes
nothing, the dry run's systems (the record's ``system``) are positive definite on every merged
unit, and the streamed result equals the gm.* rule on whole state dicts, exactly. A method added
to the registry without a case here fails :func:`test_every_method_has_a_case`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from safetensors.torch import load_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.errors import ConfigError
from gradmerge.jobs import MergeConfig, RemoveConfig, plan_merge, plan_remove, run_merge, run_remove
from gradmerge.jobs.conditioning import check_systems
from gradmerge.jobs.config import KEYS, load
from gradmerge.methods import registry
from proofs_tests.workspace import Workspace, assert_same, make_workspace

ALPHAS = [0.7, 0.4]


@dataclass(frozen=True)
class Case:
    config: Callable[[Workspace], dict[str, Any]]
    reference: Callable[[Workspace], dict[str, Any]]


def _models(ws: Workspace, curvature: bool = True) -> list[dict[str, Any]]:
    return [
        {"model": m.name, "alpha": a, **({"curvature": c.name} if curvature else {})}
        for m, c, a in zip(ws.models, ws.curvatures, ALPHAS, strict=True)
    ]


def _regmean_reference(ws: Workspace) -> dict[str, Any]:
    fts = [ws.load(m) for m in ws.models]
    grams = []
    for path in ws.curvatures:
        c = gm.load_curvature(path)
        kfac = next(b for b in c.blocks if isinstance(b, gm.KFAC))
        # the weights' inputs (bias column left out: RegMean averages the biases)
        grams.append({m: kfac.counts[m] * t[0][0][:-1, :-1] for m, t in kfac.terms.items()})
    return gm.regmean(fts, grams, alphas=ALPHAS)  # the YAML's default r is gm.regmean's


REST = {"delta": 1e-1, "curvature": "base.curvature.safetensors"}

CASES: dict[str, Case] = {
    "task_arithmetic": Case(
        lambda ws: {"base_model": ws.base.name, "models": _models(ws, False)},
        lambda ws: gm.task_arithmetic(
            ws.load(ws.base), [ws.load(m) for m in ws.models], alphas=ALPHAS
        ),
    ),
    "fisher_average": Case(
        lambda ws: {"models": _models(ws), "damping": 1e-3},
        lambda ws: gm.fisher_average(
            [ws.load(m) for m in ws.models],
            [ws.curvature(c) + 1e-3 for c in ws.curvatures],
            alphas=ALPHAS,
        ),
    ),
    "gradient_matching": Case(
        lambda ws: {"base_model": ws.base.name, "models": _models(ws), "prior": {"delta": 1e-2}},
        lambda ws: gm.gradient_matching(
            ws.load(ws.base),
            [ws.load(m) for m in ws.models],
            [ws.curvature(c) for c in ws.curvatures],
            prior=1e-2,
            alphas=ALPHAS,
        ),
    ),
    "regmean": Case(lambda ws: {"models": _models(ws)}, _regmean_reference),
    "tsv_merge": Case(
        lambda ws: {"base_model": ws.base.name, "models": _models(ws, False)},
        lambda ws: gm.tsv_merge(ws.load(ws.base), [ws.load(m) for m in ws.models], alphas=ALPHAS),
    ),
    "iso_c": Case(
        lambda ws: {"base_model": ws.base.name, "models": _models(ws, False), "average": ["2.*"]},
        lambda ws: gm.iso_c(
            ws.load(ws.base),
            [ws.load(m) for m in ws.models],
            alphas=ALPHAS,
            average=["2.weight", "2.bias"],  # the LayerNorm; its weight is 1-D: averaged anyway
        ),
    ),
    "iso_cts": Case(
        lambda ws: {
            "base_model": ws.base.name,
            "models": _models(ws, False),
            "common_space_fraction": 0.5,
            "average": ["3.weight"],
        },
        lambda ws: gm.iso_cts(
            ws.load(ws.base),
            [ws.load(m) for m in ws.models],
            alphas=ALPHAS,
            common_space_fraction=0.5,
            average=["3.weight"],
        ),
    ),
    "remove": Case(
        lambda ws: {
            "base_model": ws.base.name,
            "model": ws.models[0].name,
            "curvature": ws.curvatures[0].name,
            "prior": {"delta": 1e-2},
            "remaining": REST,
            "alpha": 0.5,
            "step_check": "ignore",  # random curvatures: large steps are expected
        },
        lambda ws: gm.remove(
            ws.load(ws.base),
            ws.load(ws.models[0]),
            ws.curvature(ws.curvatures[0]),
            remaining=ws.curvature(ws.base_curvature) + 1e-1,
            prior=1e-2,
            alpha=0.5,
        ),
    ),
    "remerge": Case(  # the gradient_matching merge of both models, without the second
        lambda ws: {
            "merge": ws.yaml(
                "merged.yaml",
                {
                    "method": "gradient_matching",
                    **CASES["gradient_matching"].config(ws),
                },
            ).name,
            "without": [1],
        },
        lambda ws: gm.gradient_matching(
            ws.load(ws.base),
            [ws.load(ws.models[0])],
            [ws.curvature(ws.curvatures[0])],
            prior=1e-2,
            alphas=ALPHAS[:1],
        ),
    ),
    "influence_remove": Case(
        lambda ws: {
            "base_model": ws.base.name,
            "gradient": ws.gradient.name,
            "remaining": REST,
            "step_check": "ignore",
        },
        lambda ws: gm.influence_remove(
            ws.load(ws.base),
            ws.load(ws.gradient),
            remaining=ws.curvature(ws.base_curvature) + 1e-1,
        ),
    ),
}

JOBS = {
    "merge": (MergeConfig, plan_merge, run_merge),
    "remove": (RemoveConfig, plan_remove, run_remove),
}


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("registry"), "kfac")


def test_every_method_has_a_case():
    assert sorted(CASES) == sorted(m.name for m in registry.REGISTRY)


@pytest.mark.parametrize("method", registry.REGISTRY, ids=lambda m: m.name)
def test_yaml_dry_run_and_merge(method, ws, tmp_path, capsys):
    """``gradmerge JOB`` reads each method's YAML (:func:`load`: a method that runs as another
    job, ``remerge``, becomes that job's configuration) and runs it as its record says."""
    config_type, plan, run = JOBS[method.runs]
    path = ws.yaml(f"{method.name}.yaml", {"method": method.name, **CASES[method.name].config(ws)})
    cfg = load(path, method.command)
    assert isinstance(cfg, config_type)
    ran = method.name if method.runs == method.command else "gradient_matching"  # remerge's merge
    assert cfg.method == ran and cfg.to_dict()["method"] == ran
    name, job, method = (
        method.name,
        method.command,
        registry.get(ran),
    )  # remerge: as the merge it runs

    # the dry run: the command writes nothing; every checked system is positive definite
    out = tmp_path / "out"
    assert cli.main([job, str(path), str(out), "--dry-run", "--no-progress"]) == 0
    assert not out.exists()
    assert ran in capsys.readouterr().out
    units = [u for u in plan(cfg).units if u.merged]
    checks = check_systems(cfg)
    if method.name == "regmean":  # judged by gm.regmean's own check, on its K-FAC layers
        assert checks and {c.keys for c in checks} <= {u.keys for u in units}
        assert all(c.ok for c in checks), checks
    elif method.system is None:
        assert checks == []
    else:
        assert [c.keys for c in checks] == [u.keys for u in units]
        assert all(c.ok and c.min_eigenvalue > 0 for c in checks), checks

    # the run equals the in-memory rule on whole state dicts
    run(cfg, out, progress=False)
    assert_same(load_file(out / "model.safetensors"), CASES[name].reference(ws))


VALUES = {
    "base_model": "base.safetensors",
    "model": "ft0.safetensors",
    "curvature": "ft0.curvature.safetensors",
    "gradient": "gradient.safetensors",
    "prior": {"delta": 1.0},
    "damping": 1.0,
    "off_diagonal": 0.5,
    "common_space_fraction": 0.5,
    "average": ["*"],
    "embeddings": "gram",
    "merge": "merged.yaml",
    "without": [0],
}

REFUSED = [
    (m, key) for m in registry.REGISTRY for key in KEYS[m.command] if m.need(key) == "forbidden"
]


@pytest.mark.parametrize(("method", "key"), REFUSED, ids=lambda x: getattr(x, "name", x))
def test_keys_a_method_does_not_use_are_refused(method, key, ws):
    """Each key the record refuses is refused by the YAML reader, with the methods using it."""
    config = {"method": method.name, **CASES[method.name].config(ws)}
    read = JOBS[method.command][0].from_dict if method.runs == method.command else _remerge
    if method.command == "merge" and key == "curvature":
        config["models"] = [{**config["models"][0], "curvature": VALUES[key]}]
        where = "models[0].curvature"
    else:
        config[key] = VALUES[key]
        where = key
    users = [m.name for m in registry.methods(method.command) if key in m.uses]
    assert users, key
    with pytest.raises(
        ConfigError, match=rf"`{re.escape(where)}` is not used by method {method.name}:"
    ) as e:
        read(config, root=ws.root)
    assert all(name in str(e.value) for name in users)


def _remerge(config, root):
    from gradmerge.jobs.config import remerge_config

    return remerge_config(config, root=root)


def test_help_lists_every_merge_method(capsys):
    with pytest.raises(SystemExit):
        cli.main(["merge", "--help"])
    help_text = capsys.readouterr().out
    for m in registry.methods("merge"):
        assert m.summary.splitlines()[0] in help_text and m.name in help_text


def test_unknown_method_names_the_registered_ones():
    with pytest.raises(gm.ArgumentError, match="expected one of task_arithmetic, fisher_average"):
        registry.get("ties")
