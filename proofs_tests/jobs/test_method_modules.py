"""Every method is one module of :mod:`gradmerge.methods` and one entry of the registry's list.

A method module holds its record ``METHOD`` (:class:`gradmerge.methods.base.MergeMethod`): the
YAML keys it requires, allows or refuses (each a method-specific key of its job,
:data:`gradmerge.jobs.config.KEYS`), its streamed rule — a function of that same module — or,
for a method that runs as another job (``remerge``), ``runs``, its help lines and its docs line
(docs/config.md's lists are generated from them). The registry's list and the modules agree:
each module's record is listed once, under the module's name, and every listed record comes
from a module of the package. A key that one method alone reads is declared in its module and
is the field of the job's configuration. The checks are run on a made-up module too, so that
they are not vacuous, and a made-up method added as one module and one list entry merges
through ``gradmerge merge`` (docs/architecture.md, "Adding a method").
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import types
from dataclasses import Field, fields
from pathlib import Path

import pytest
from safetensors.torch import load_file

import gradmerge as gm
import gradmerge.methods
from gradmerge import cli
from gradmerge.foundation.settings import declared
from gradmerge.jobs import reference
from gradmerge.jobs.config import KEYS, READS
from gradmerge.methods import registry
from gradmerge.methods.base import MergeMethod, MergeUnit, Solved
from proofs_tests.workspace import assert_same, make_workspace

SHARED = ("base", "registry")
"""The package's modules that are not methods."""

MODULES = sorted(
    m.name
    for m in pkgutil.iter_modules(gradmerge.methods.__path__)
    if m.name not in SHARED and not m.name.startswith("_")
)


def problems(module: types.ModuleType) -> list[str]:
    """What is missing or wrong in one method module (empty: nothing)."""
    name = module.__name__.rpartition(".")[2]
    method = getattr(module, "METHOD", None)
    if not isinstance(method, MergeMethod):
        return [f"{name}: no METHOD record"]
    found = []
    if method.name != name:
        found.append(f"{name}: its record is named {method.name!r}, not after its module")
    if method.command not in KEYS:
        return [*found, f"{name}: job {method.command!r} is neither merge nor remove"]
    if not method.keys:
        found.append(f"{name}: declares no keys")
    unknown = sorted(set(method.keys) - set(KEYS[method.command]))
    if unknown:
        found.append(f"{name}: keys {unknown} are not method-specific keys of a {method.command}")
    if method.rule is None and method.runs == method.command:
        found.append(f"{name}: no rule, and it runs as its own job")
    if method.rule is not None and (
        not inspect.isfunction(method.rule) or method.rule.__module__ != module.__name__
    ):
        found.append(f"{name}: its rule is not a function of its own module")
    if not method.summary.strip():
        found.append(f"{name}: no summary (its --help lines)")
    if not method.docs.strip() or "\n" in method.docs:
        found.append(f"{name}: no docs line (one line for docs/config.md)")
    if not (module.__doc__ or "").strip():
        found.append(f"{name}: no module docstring")
    return found


@pytest.mark.parametrize("name", MODULES)
def test_each_method_module_declares_its_keys_rule_and_docs_line(name):
    module = importlib.import_module(f"gradmerge.methods.{name}")
    assert problems(module) == []


def test_the_registry_lists_each_module_once_in_its_order():
    listed = [m.name for m in registry.REGISTRY]
    assert sorted(listed) == MODULES  # every module listed, nothing listed twice or from elsewhere
    assert len(set(listed)) == len(listed)
    for m in registry.REGISTRY:
        assert importlib.import_module(f"gradmerge.methods.{m.name}").METHOD is m
        assert registry.get(m.name) is m
    # the list's order is the order of the help and of docs/config.md's lists
    assert registry.names("merge") == tuple(m.name for m in listed_of("merge"))
    assert reference.tables()["merge_methods"].splitlines() == [
        f"- `{m.name}`: {m.docs}" for m in listed_of("merge")
    ]


def listed_of(job: str) -> list[MergeMethod]:
    return [m for m in registry.REGISTRY if m.command == job]


def test_every_method_specific_key_is_used_by_some_method():
    """A key declared ``per_method`` that no record requires or allows would be refused by
    every method: the records and the declarations agree both ways."""
    for job, keys in KEYS.items():
        used = set().union(*(m.uses for m in listed_of(job)))
        assert set(keys) <= used, f"{job}: {sorted(set(keys) - used)} used by no method"


def test_a_key_one_method_declares_is_that_configurations_field():
    """``off_diagonal`` (regmean), ``common_space_fraction`` (iso_cts), ...: a setting declared
    in a method module is the very field of its job's configuration, and that method uses it."""
    own = {}
    for name in MODULES:
        module = importlib.import_module(f"gradmerge.methods.{name}")
        for attr, value in vars(module).items():
            if attr.isupper() and isinstance(value, Field):
                own[id(value)] = (name, attr)
    assert own, "no method module declares a key of its own"
    found = {}
    for classes in READS.values():
        for cls in classes:
            for f in fields(cls):
                if id(f) in own:
                    found[own[id(f)]] = f.name
    assert sorted(found) == sorted(own.values())  # each one bound as a field ...
    for (name, _attr), key in found.items():  # ... and used by its method
        assert key in registry.get(name).uses
        assert declared(READS[registry.get(name).command][0])[key].per_method


def test_the_checks_catch_a_method_without_keys_rule_or_docs():
    def elsewhere(u: MergeUnit) -> Solved:
        return dict(u.base), None

    fake = types.ModuleType("gradmerge.methods.fake", "")
    fake.METHOD = MergeMethod("faked", "merge", "", {}, None)  # type: ignore[attr-defined]
    found = problems(fake)
    assert any("named 'faked'" in p for p in found)
    assert any("declares no keys" in p for p in found)
    assert any("no rule" in p for p in found)
    assert any("no summary" in p for p in found)
    assert any("no docs line" in p for p in found)
    assert any("no module docstring" in p for p in found)

    fake.METHOD = MergeMethod(  # type: ignore[attr-defined]
        "fake", "merge", "a line", {"off_diagnal": "optional"}, elsewhere, docs="one line."
    )
    fake.__doc__ = "A made-up method."
    elsewhere.__module__ = "proofs_tests.somewhere"
    assert problems(fake) == [
        "fake: keys ['off_diagnal'] are not method-specific keys of a merge",
        "fake: its rule is not a function of its own module",
    ]
    assert problems(types.ModuleType("gradmerge.methods.empty")) == ["empty: no METHOD record"]


def test_a_method_added_as_one_module_and_one_list_entry_runs(monkeypatch, tmp_path, capsys):
    """The claim of docs/architecture.md's "Adding a method": a new module (here made in the
    test: θ_LLM + Σ_t α_t τ_t / Σ_t α_t, the α-weighted mean of the task vectors) and its entry
    in the list are all `gradmerge merge`, its `--dry-run`, its refusals and docs/config.md's
    list need; the merge equals the in-memory rule it calls."""
    module = types.ModuleType("gradmerge.methods.task_mean", "The α-weighted mean task vector.")

    def task_mean(u: MergeUnit) -> Solved:
        weights = [a / sum(u.alphas) for a in u.alphas]
        return gm.task_arithmetic(u.base, u.finetuned, alphas=weights, kernel=u.kernel), None

    task_mean.__module__ = module.__name__
    module.METHOD = MergeMethod(  # type: ignore[attr-defined]
        "task_mean",
        "merge",
        "θ_LLM + Σ α_t τ_t / Σ α_t",
        {"base_model": "required"},
        task_mean,
        docs="the α-weighted mean of the task vectors.",
        coverage="none",
    )
    assert problems(module) == []
    listed = (*registry.REGISTRY, module.METHOD)  # the one line added to the list
    monkeypatch.setattr(registry, "REGISTRY", listed)
    monkeypatch.setattr(registry, "_BY_NAME", {m.name: m for m in listed})

    ws = make_workspace(tmp_path / "ws", "diag")
    config = {
        "method": "task_mean",
        "base_model": ws.base.name,
        "models": [
            {"model": m.name, "alpha": a} for m, a in zip(ws.models, (3.0, 1.0), strict=True)
        ],
    }
    path = ws.yaml("task_mean.yaml", config)
    out = tmp_path / "out"
    assert cli.main(["merge", str(path), str(out), "--dry-run", "--no-progress"]) == 0
    assert not out.exists()
    assert cli.main(["merge", str(path), str(out), "--no-progress"]) == 0
    expected = gm.task_arithmetic(
        ws.load(ws.base), [ws.load(m) for m in ws.models], alphas=[0.75, 0.25]
    )
    assert_same(load_file(out / "model.safetensors"), expected)

    refused = ws.yaml("refused.yaml", {**config, "damping": 1.0})
    assert cli.main(["merge", str(refused), str(tmp_path / "no"), "--no-progress"]) != 0
    err = capsys.readouterr().err  # the refusal names the new method and the key's users
    assert "task_mean" in err and "damping" in err and "is for fisher_average and regmean" in err
    assert reference.tables()["merge_methods"].endswith(
        "- `task_mean`: the α-weighted mean of the task vectors.\n"
    )


def _compared_names(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every string constant in ``names`` that a comparison (==, !=, in) reads."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                for c in ast.walk(side):
                    if isinstance(c, ast.Constant) and c.value in names:
                        found.append((node.lineno, c.value))
    return found


def test_the_jobs_and_commands_compare_with_no_method_name():
    """What a method does differently lives in its record (``system``, ``damping_at``,
    ``systems``, ``precheck``, ``bounds_rounding``, ``keys``), so no job or command module tests
    for a merge or removal method by name; the check finds such a test where there is one."""
    names = {m.name for m in registry.REGISTRY}
    root = Path(gradmerge.__file__).parent
    offenders = {
        str(path.relative_to(root)): hits
        for folder in ("jobs", "commands")
        for path in sorted((root / folder).glob("*.py"))
        if (hits := _compared_names(ast.parse(path.read_text()), names))
    }
    assert offenders == {}
    planted = ast.parse('if config.method == "regmean" or m in ("iso_c", "x"):\n    pass\n')
    assert _compared_names(planted, names) == [(1, "regmean"), (1, "iso_c")]
