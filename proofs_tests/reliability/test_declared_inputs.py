"""Every path a job's YAML can name is an input the output guard protects: the conformance grid
of the output guard (test_output_guard.py) over the configuration keys, derived from the
declarations, so that a new method or a new key cannot forget one.

For every method of the registry (:data:`gradmerge.methods.registry.REGISTRY`) the grid reads the
declarations of the YAML that method reads (:data:`gradmerge.jobs.config.READS`: a merge's
``MergeConfig`` with its ``models[]``, a removal's ``RemoveConfig``, ``remerge``'s ``Remerge``,
each with the precision terms nested in them), keeps the keys whose type holds a ``Path`` and
that the method uses (required or allowed by its record, :meth:`MergeMethod.need`), writes one
YAML that names a distinct file or folder under each of them (``merge:`` a merge YAML that
itself names every merge key, ``without:`` one of that merge's models), and then gives each of
those paths as OUT_DIR, with ``--overwrite``: the command must refuse it (exit 2, the guard's
one line naming the key) and leave every byte as it was; the library's own check
(:func:`gradmerge.jobs.engine.check_output`) must refuse it too.

Two checks keep the grid honest: every declared setting whose type holds a ``Path`` is declared
with a path kind (:data:`gradmerge.foundation.settings.PATH_KINDS`), and the grid fails on a
configuration whose inputs leave a key out (the remerge of issue 38, whose ``merge:`` and
``without:`` were not inputs: ``gradmerge remove remerge.yaml cfg --overwrite`` replaced the folder
holding the merge YAML, and ``... bert-a --overwrite`` the fine-tuned model it left out).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from gradmerge import cli
from gradmerge.errors import OutputOverlapError
from gradmerge.foundation.settings import PATH_KINDS, Setting, declared, setting
from gradmerge.jobs import config as job_config
from gradmerge.jobs.engine import check_output
from gradmerge.methods import registry
from gradmerge.methods.base import MergeMethod

# ----- what the declarations say ------------------------------------------------------------------


def _holds_path(hint: Any) -> bool:
    """Whether a type is, or holds (in a union, a tuple), a ``Path``."""
    return hint is Path or any(_holds_path(a) for a in typing.get_args(hint))


def _nested(hint: Any) -> type | None:
    """The configuration dataclass a type holds (``CurvatureTerm | None``, ``tuple[ModelInput,
    ...]``), if any."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    return next((n for a in typing.get_args(hint) if (n := _nested(a)) is not None), None)


def _settings(cls: type) -> list[tuple[str, Setting, Any]]:
    """(key, declaration, resolved type) of every declared setting of ``cls``."""
    hints = typing.get_type_hints(cls)
    return [(key, s, hints[key]) for key, s in declared(cls).items()]


def _reachable() -> list[type]:
    """Every configuration class a job's YAML is read with, and those nested in them."""
    found: list[type] = []
    todo = [c for classes in job_config.READS.values() for c in classes]
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.append(cls)
        todo += [n for _, _, hint in _settings(cls) if (n := _nested(hint)) is not None]
    return found


def undeclared_paths(classes: list[type]) -> list[str]:
    """``Class.key`` of every setting whose type holds a ``Path`` but whose kind is not a path
    kind (and is no mapping of a nested configuration): the guard's walk finds its paths today
    (by value), but nothing declares them as inputs."""
    wrong = []
    for cls in classes:
        for key, s, hint in _settings(cls):
            nested = _nested(hint)
            if s.kind == "mapping" and nested is not None:
                continue  # walked through its own declarations
            if _holds_path(hint) != (s.kind in PATH_KINDS):
                wrong.append(f"{cls.__name__}.{key} ({s.kind})")
    return wrong


def test_every_setting_that_holds_a_path_is_declared_as_one():
    classes = _reachable()
    assert {c.__name__ for c in classes} >= {
        "MergeConfig", "ModelInput", "CurvatureTerm", "RemoveConfig", "Remerge", "KroneckerCG"
    }  # fmt: skip
    assert undeclared_paths(classes) == []


def test_a_path_declared_as_another_kind_is_found():
    @dataclasses.dataclass(frozen=True)
    class Careless:
        notes: Path | None = setting(None, "a file of notes.", kind="strings")
        data: tuple[int | Path, ...] = setting((), "indices or files.", kind="selection")
        count: int = setting(1, "a number.", kind="integer")

    assert undeclared_paths([Careless]) == ["Careless.notes (strings)"]


# ----- one YAML per method, a path under every path-valued key it uses ------------------------------


def _top(m: MergeMethod) -> type:
    """The declaration ``m``'s YAML is read with."""
    if m.runs != m.command:
        return job_config.Remerge
    return job_config.MergeConfig if m.command == "merge" else job_config.RemoveConfig


def _uses(m: MergeMethod, key: str, s: Setting) -> bool:
    """Whether method ``m`` takes setting ``key`` (its record, and what the key goes with)."""
    if s.per_method and m.need(key) == "forbidden":
        return False
    return not (s.requires in job_config.KEYS[m.command] and s.requires not in m.uses)


def _path_keys(m: MergeMethod, cls: type) -> int:
    """How many path-valued keys of ``cls`` (and the configurations nested in it) ``m`` uses."""
    count = 0
    for key, s, hint in _settings(cls):
        nested = _nested(hint)
        if _uses(m, key, s):
            count += _path_keys(m, nested) if s.kind == "mapping" and nested else _holds_path(hint)
    return count


class Builder:
    """Writes a YAML for one method whose path-valued keys each name a fresh file or folder,
    and records them as the guard should name them: ``{role: path}``."""

    def __init__(self, root: Path) -> None:
        self.root, self.count = root, 0
        self.paths: dict[str, Path] = {}

    def fresh(self, role: str, kind: str) -> str:
        self.count += 1
        path = self.root / f"p{self.count}"
        if kind == "file":
            path = path.with_suffix(".safetensors")
            save_file({"w": torch.zeros(1)}, path)
        else:
            path.mkdir()
            save_file({"w": torch.zeros(1)}, path / "model.safetensors")
        self.paths[role] = path
        return path.name

    def mapping(self, m: MergeMethod, cls: type, prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {"delta": 1.0} if "delta" in declared(cls) else {}
        for key, s, hint in _settings(cls):
            role = f"{prefix}{key}"
            nested = _nested(hint)
            if not _uses(m, key, s) or key == "method":
                continue
            if s.kind == "mapping" and nested is not None:
                if typing.get_origin(hint) is tuple:  # a list of mappings: two of them
                    entries = [self.mapping(m, nested, f"{role}[{i}].") for i in range(2)]
                    out[key] = entries
                elif any(_holds_path(h) for _, _, h in _settings(nested)):
                    out[key] = self.mapping(m, nested, f"{role}.")
            elif s.kind == "selection":
                out[key] = [self.selected(role)]
            elif key == "merge":  # a merge YAML that names every merge key
                out[key] = self.merge_yaml(role)
            elif _holds_path(hint):
                if typing.get_origin(hint) is not tuple and tuple in map(
                    typing.get_origin, typing.get_args(hint)
                ):  # one path or a list: the list
                    out[key] = [self.fresh(f"{role}[{i}]", s.kind) for i in range(2)]
                else:
                    out[key] = self.fresh(role, s.kind)
        return out

    def merge_yaml(self, role: str) -> str:
        """A merge YAML (beside the others) under the merge method that uses the most
        path-valued keys; its paths are inputs under ``merge.KEY``."""
        fullest = max(registry.methods("merge"), key=lambda m: _path_keys(m, _top(m)))
        inner = Builder(self.root)
        inner.count = self.count + 100
        body = {"method": fullest.name, **inner.mapping(fullest, job_config.MergeConfig, "")}
        self.count = inner.count
        (self.root / "merge.yaml").write_text(yaml.safe_dump(body))
        self.paths[role] = self.root / "merge.yaml"
        self.paths.update({f"{role}.{k}": p for k, p in inner.paths.items()})
        return "merge.yaml"

    def selected(self, role: str) -> str:
        """An entry of ``without``: the path of the merge's first model."""
        model = self.paths["merge.models[0].model"]
        self.paths[f"{role}[0]"] = model
        return model.name


def build(m: MergeMethod, root: Path) -> tuple[Path, dict[str, Path]]:
    """``m``'s YAML under ``root`` and the ``{role: path}`` it names."""
    builder = Builder(root)
    body = {"method": m.name, **builder.mapping(m, _top(m), "")}
    config = root / f"{m.name}.yaml"
    config.write_text(yaml.safe_dump(body))
    return config, builder.paths


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


def refused_everywhere(m: MergeMethod, root: Path, capsys) -> dict[str, Path]:
    """Give each path ``m``'s YAML names as OUT_DIR, with --overwrite: the command and the
    library must refuse each, naming a key that holds it, and change nothing. Returns the
    roles checked."""
    config, paths = build(m, root)
    for role, path in paths.items():
        holders = {r for r, p in paths.items() if p == path}
        before = _snapshot(root)
        with pytest.raises(SystemExit) as exit_:
            cli.main([m.command, str(config), str(path), "--overwrite", "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_.value.code == 2, f"{m.name}: OUT_DIR = {role} was not refused: {err}"
        found = re.search(rf"OUT_DIR {re.escape(str(path))} is (\S+) ", err)
        assert found and found.group(1) in holders, f"{m.name}, {role}: {err}"
        loaded = job_config.load(config, m.command)
        with pytest.raises(OutputOverlapError, match=re.escape(f"OUT_DIR {path} is ")):
            check_output(loaded, path, overwrite=True)
        assert _snapshot(root) == before
    return paths


@pytest.mark.parametrize("method", [m.name for m in registry.REGISTRY])
def test_every_path_valued_key_of_every_method_is_an_input(tmp_path, capsys, method):
    m = registry.get(method)
    checked = refused_everywhere(m, tmp_path, capsys)
    named = {re.sub(r"\[\d+\]", "[]", role) for role in checked}
    # the grid covers every key the method uses (its record) and every model's paths
    wanted = {"models[].model", "models[].adapter_base"} if m.command == "merge" else set()
    wanted |= {k for k in m.uses if k not in ("damping", "off_diagonal", "embeddings",
                                              "common_space_fraction", "average")}  # fmt: skip
    wanted = {
        "models[].curvature" if k == "curvature" and m.command == "merge" else k for k in wanted
    }
    wanted = {"prior.curvature[]" if k == "prior" else k for k in wanted}
    wanted = {"without[]" if k == "without" else k for k in wanted}
    assert wanted <= named, sorted(wanted - named)
    if m.name == "remerge":  # the merge it names: every path in it
        assert {"merge.base_model", "merge.models[].model", "merge.models[].curvature",
                "merge.prior.curvature[]"} <= named  # fmt: skip


def test_the_grid_fails_when_a_key_is_not_an_input(tmp_path, capsys, monkeypatch):
    """The grid catches the remerge of issue 38: its ``merge:`` and ``without:`` not inputs."""
    monkeypatch.setattr(job_config, "path_inputs", lambda value, key: [])
    with pytest.raises(AssertionError, match=r"^remerge, merge: .* is a file; give a folder"):
        refused_everywhere(registry.get("remerge"), tmp_path, capsys)


# ----- issue 38, cases 1 and 2, with the merge they would destroy -----------------------------------


@pytest.fixture
def remerge(tmp_path):
    """base/, bert-a/ and bert-b/ (one tensor each), cfg/merge.yaml (task arithmetic of a and b)
    and r/remerge.yaml (the merge without a, by index) and r/by-path.yaml (by path)."""
    for i, name in enumerate(("base", "bert-a", "bert-b")):
        (tmp_path / name).mkdir()
        save_file({"w": torch.arange(3.0) * (i + 1)}, tmp_path / name / "model.safetensors")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "r").mkdir()
    merge = {
        "method": "task_arithmetic",
        "base_model": "../base",
        "models": [{"model": "../bert-a"}, {"model": "../bert-b"}],
    }
    (tmp_path / "cfg" / "merge.yaml").write_text(yaml.safe_dump(merge))
    for name, without in (("remerge.yaml", [0]), ("by-path.yaml", ["../bert-a"])):
        remerge = {"method": "remerge", "merge": "../cfg/merge.yaml", "without": without}
        (tmp_path / "r" / name).write_text(yaml.safe_dump(remerge))
    return tmp_path


@pytest.mark.parametrize(
    ("config", "out", "message"),
    [
        ("remerge.yaml", "cfg", "OUT_DIR {out} contains merge {root}/r/../cfg/merge.yaml"),
        ("by-path.yaml", "bert-a", "OUT_DIR {out} is without[0] {root}/r/../bert-a"),
        ("remerge.yaml", "bert-a", "OUT_DIR {out} is merge.models[0].model"),
        ("remerge.yaml", "cfg/merge.yaml", "OUT_DIR {out} is merge {root}/r/../cfg/merge.yaml"),
    ],
)
def test_a_remerge_does_not_replace_what_it_reads(remerge, capsys, config, out, message):
    before = _snapshot(remerge)
    target = remerge / out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["remove", str(remerge / "r" / config), str(target), "--overwrite"])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.format(out=target, root=remerge) in last
    assert "writing it would replace, delete or add to an input" in last
    assert _snapshot(remerge) == before


def test_a_remerge_still_writes_the_merge_of_the_tasks_that_stay(remerge, capsys):
    out = remerge / "out"
    assert cli.main(["remove", str(remerge / "r" / "by-path.yaml"), str(out), "--no-progress"]) == 0
    # task arithmetic of bert-b alone: base + (b − base) = b
    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.arange(3.0) * 3)


@pytest.mark.parametrize(("changed", "caught"), [("bert-a", False), ("bert-b", True)])
def test_a_remerge_checks_what_it_reads_while_it_runs(
    remerge, capsys, monkeypatch, changed, caught
):
    """The models a remerge leaves out are protected (above) but not read: one rewritten while it
    runs does not stop it; a model it merges does (docs/reliability.md, inputs that change)."""
    from gradmerge.io import writer

    original, done = writer.ShardedWriter.write, []

    def write_and_change(self, name, tensor):
        if not done:  # after the inputs were opened, before the output is published
            target = remerge / changed / "model.safetensors"
            save_file({"w": torch.full((3,), 7.0)}, target)
            os.utime(target, ns=(0, 10**9))
            done.append(1)
        return original(self, name, tensor)

    monkeypatch.setattr(writer.ShardedWriter, "write", write_and_change)
    out = remerge / "out"
    code = cli.main(["remove", str(remerge / "r" / "remerge.yaml"), str(out), "--no-progress"])
    err = capsys.readouterr().err
    if caught:
        assert code == 1 and "merge.models[1].model" not in err and not out.exists()
        assert f"models[0].model {remerge}/r/../cfg/../bert-b/model.safetensors changed" in err
    else:
        assert code == 0 and done, err
        assert torch.equal(load_file(out / "model.safetensors")["w"], torch.arange(3.0) * 3)
