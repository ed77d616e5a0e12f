"""The output guard's conformance grid (issue 29): every command that writes, run through the
command line, × how its output relates to an input × ``--overwrite`` × a fault.

Each command that writes declares itself to the guard (``writes=`` in its parser's defaults,
:mod:`gradmerge.commands._writes`); :data:`CASES` holds one entry per declared command (the
first test fails when a command declares itself without an entry here, or an entry's command
stops declaring), with its argv around an output path and the inputs its output can collide
with. Every case asserts the exit code, the message (one shape: ``ROLE OUT is|lies inside|
contains WHAT PATH`` for a collision, ``ROLE OUT could not be written: CAUSE; nothing was
written`` for a fault), that every input's bytes are unchanged and that nothing partial exists
(the workspace and the scratch folder hold exactly the files they held before; a full disk holds
only its filler).

The faults use real file systems where the process may mount them (root with CAP_SYS_ADMIN, as
in the project's containers): a tiny tmpfs filled to the last byte (a full disk) and a
read-only tmpfs; without that, the full disk is skipped and the read-only folder is a 0555
folder (which a non-root user cannot write to).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import save_file

from gradmerge import cli
from gradmerge.commands import distributed
from proofs_tests.reliability.test_adapter_base import _adapter
from proofs_tests.text_models import bert_classifier

ROWS = [
    ("the movie was very good", "positive"),
    ("a dull film", "negative"),
    ("the plot is not bad", "neutral"),
    ("a big red dog ran fast", "positive"),
]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """base/, ft/ (another BERT), adapter/ (a LoRA adapter over ``base``), tok/ (a tokenizer
    folder), data.jsonl and data2.jsonl, ft.curvature.safetensors, fisher/ (an official-format
    Fisher) and the merge, inspect, remove and refine YAML files."""
    root = tmp_path_factory.mktemp("guard")
    bert_classifier(root / "base")
    bert_classifier(root / "ft", seed=1)
    _adapter(root / "adapter", "base")
    transformers.AutoTokenizer.from_pretrained(root / "base").save_pretrained(root / "tok")
    for name, rows in (("data.jsonl", ROWS), ("data2.jsonl", ROWS[::-1])):  # other bytes:
        (root / name).write_text(  # evaluate refuses two DATA holding the same
            "".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows)
        )
    argv = ["curvature", str(root / "ft"), str(root / "data.jsonl")]
    assert cli.main([*argv, str(root / "ft.curvature.safetensors"), "--no-progress"]) == 0
    (root / "fisher").mkdir()
    save_file({"w": torch.rand(3) + 0.1}, root / "fisher" / "model.safetensors")
    configs = {
        "merge.yaml": {
            "method": "task_arithmetic",
            "base_model": "base",
            "models": [{"model": "ft"}],
        },
        "remove.yaml": {
            "method": "remove",
            "base_model": "base",
            "model": "ft",
            "curvature": "ft.curvature.safetensors",
            "prior": {"delta": 1.0},
            "remaining": {"delta": 1.0},
            "step_check": "ignore",
            "rounding_check": "ignore",
        },
        "inspect.yaml": {
            "method": "gradient_matching",
            "base_model": "base",
            "models": [{"model": "ft", "curvature": "ft.curvature.safetensors"}],
            "prior": {"delta": 1.0},
        },
        "refine.yaml": {
            "start": "ft",
            "base_model": "base",
            "models": [{"model": "ft", "data": "data.jsonl"}],
            "prior": {"delta": 1.0},
            "steps": 1,
            "structure": "diag",
            "batch_size": 4,
            "device": "cpu",
        },
    }
    for name, config in configs.items():
        (root / name).write_text(yaml.safe_dump(config))
    return root


@dataclass
class Case:
    """One command that writes: its argv around OUT (a function of the workspace and OUT), the
    role and kind of OUT, and the inputs OUT can collide with: relation → (OUT as a function of
    the workspace, the relation word and the input's role the message names)."""

    argv: Callable[[Path, Path], list[str]]
    role: str
    kind: str
    collisions: dict[str, tuple[Callable[[Path], Path], str, str]] = field(default_factory=dict)
    main: Callable[[list[str]], int] = cli.main
    suffix: str = ".json"
    """A file output's suffix (convert-curvature wants .safetensors)."""


def _reading(command: str, *flags: str) -> Callable[[Path, Path], list[str]]:
    """argv of a command reading the adapter MODEL and DATA with a --tokenizer folder."""

    def argv(ws: Path, out: Path) -> list[str]:
        model, data, tok = (str(ws / n) for n in ("adapter", "data.jsonl", "tok"))
        head = [command, model, data] if command == "evaluate" else [command, model, data, str(out)]
        tail = ["--out", str(out)] if command == "evaluate" else []
        return [*head, *tail, "--tokenizer", tok, "--no-progress", "--device", "cpu", *flags]

    return argv


READING = {  # the collisions of a command reading MODEL (an adapter), DATA and --tokenizer
    "is": (lambda ws: ws / "data.jsonl", "is", "DATA"),
    "inside": (lambda ws: ws / "adapter" / "out.json", "lies inside", "MODEL"),
    "contains": (lambda ws: ws, "contains", "MODEL"),
    "symlink": (lambda ws: _link(ws, ws / "data.jsonl"), "is", "DATA"),
    "adapter base": (
        lambda ws: ws / "base" / "model.safetensors",
        "lies inside",
        "the base of LoRA adapter MODEL",
    ),
    "tokenizer": (lambda ws: ws / "tok" / "out.json", "lies inside", "--tokenizer"),
}


def _config_collisions(first: str) -> dict[str, tuple[Callable[[Path], Path], str, str]]:
    """The collisions of a folder output of a command reading CONFIG (``first``: the role of
    the YAML's first model, ``models[0].model`` or ``model``)."""
    return {
        "is": (lambda ws: ws / "ft", "is", first),
        "inside": (lambda ws: ws / "ft" / "out", "lies inside", first),
        "contains": (lambda ws: ws, "contains", "CONFIG"),
        "symlink": (lambda ws: _link(ws, ws / "ft"), "is", first),
    }


def _yaml(command: str, name: str, *flags: str) -> Callable[[Path, Path], list[str]]:
    return lambda ws, out: [command, str(ws / name), str(out), *flags]


def _tune(flag: str) -> Callable[[Path, Path], list[str]]:
    def argv(ws: Path, out: Path) -> list[str]:
        head = ["tune", str(ws / "merge.yaml"), str(ws / "data.jsonl"), "--scales", "1"]
        return [*head, "--no-progress", "--device", "cpu", flag, str(out)]

    return argv


CASES: dict[str, Case] = {
    "curvature": Case(_reading("curvature", "--structure", "diag"), "OUT", "file", READING),
    "gradient": Case(_reading("gradient"), "OUT", "file", READING),
    "evaluate": Case(_reading("evaluate"), "--out", "file", READING),
    "evaluate --data": Case(  # several DATA: each one is an input
        lambda ws, out: ["evaluate", str(ws / "ft"), "--data", str(ws / "data.jsonl"),
                         str(ws / "data2.jsonl"), "--out", str(out), "--no-progress"],
        "--out",
        "file",
        {
            "is": (lambda ws: ws / "data2.jsonl", "is", "DATA"),
            "inside": (lambda ws: ws / "ft" / "out.json", "lies inside", "MODEL"),
            "contains": (lambda ws: ws, "contains", "MODEL"),
            "symlink": (lambda ws: _link(ws, ws / "data2.jsonl"), "is", "DATA"),
        },
    ),
    "convert-curvature": Case(
        lambda ws, out: ["convert-curvature", str(ws / "fisher"), str(out)],
        "OUT",
        "file",
        {
            "is": (lambda ws: ws / "fisher", "is", "SRC"),
            "inside": (lambda ws: ws / "fisher" / "F.safetensors", "lies inside", "SRC"),
            "contains": (lambda ws: ws, "contains", "SRC"),
            "symlink": (lambda ws: _link(ws, ws / "fisher"), "is", "SRC"),
        },
        suffix=".safetensors",
    ),
    "inspect": Case(
        lambda ws, out: ["inspect", str(ws / "ft.curvature.safetensors"), "--json", str(out)],
        "--json",
        "file",
        {
            "is": (lambda ws: ws / "ft.curvature.safetensors", "is", "CURVATURE"),
            "inside": (
                lambda ws: ws / "ft.curvature.safetensors" / "x.json",
                "lies inside",
                "CURVATURE",
            ),
            "contains": (lambda ws: ws, "contains", "CURVATURE"),
            "symlink": (lambda ws: _link(ws, ws / "ft.curvature.safetensors"), "is", "CURVATURE"),
        },
    ),
    "inspect --json CONFIG": Case(  # the YAML and every path in it are the inputs
        lambda ws, out: ["inspect", str(ws / "inspect.yaml"), "--json", str(out)],
        "--json",
        "file",
        {
            "is": (lambda ws: ws / "ft.curvature.safetensors", "is", "models[0].curvature"),
            "inside": (lambda ws: ws / "ft" / "x.json", "lies inside", "models[0].model"),
            "contains": (lambda ws: ws, "contains", "CONFIG"),
            "symlink": (lambda ws: _link(ws, ws / "inspect.yaml"), "is", "CONFIG"),
        },
    ),
    "merge": Case(
        _yaml("merge", "merge.yaml", "--no-progress"),
        "OUT_DIR",
        "folder",
        _config_collisions("models[0].model"),
    ),
    "remove": Case(
        _yaml("remove", "remove.yaml", "--no-progress"),
        "OUT_DIR",
        "folder",
        {**_config_collisions("model"), "curvature": (
            lambda ws: ws / "ft.curvature.safetensors", "is", "curvature"
        )},
    ),
    "refine": Case(
        _yaml("refine", "refine.yaml"),
        "OUT_DIR",
        "folder",
        {**_config_collisions("start"), "data": (
            lambda ws: ws / "data.jsonl", "is", "models[0].data"
        )},
    ),
    "tune --out-dir": Case(
        _tune("--out-dir"),
        "--out-dir",
        "folder",
        {**_config_collisions("models[0].model"), "data": (
            lambda ws: ws / "data.jsonl", "is", "DATA"
        )},
    ),
    "tune --out": Case(
        _tune("--out"),
        "--out",
        "file",
        {
            "is": (lambda ws: ws / "data.jsonl", "is", "DATA"),
            "inside": (lambda ws: ws / "ft" / "t.json", "lies inside", "models[0].model"),
            "contains": (lambda ws: ws, "contains", "CONFIG"),
            "symlink": (lambda ws: _link(ws, ws / "merge.yaml"), "is", "CONFIG"),
        },
    ),
    "materialize": Case(
        lambda ws, out: ["materialize", str(ws / "adapter"), str(out)],
        "OUT",
        "folder",
        {
            "is": (lambda ws: ws / "adapter", "is", "ADAPTER"),
            "inside": (lambda ws: ws / "adapter" / "full", "lies inside", "ADAPTER"),
            "contains": (lambda ws: ws, "contains", "ADAPTER"),
            "symlink": (lambda ws: _link(ws, ws / "adapter"), "is", "ADAPTER"),
            "adapter base": (lambda ws: ws / "base", "is", "the base of LoRA adapter ADAPTER"),
        },
    ),
    "demo": Case(lambda ws, out: ["demo", "--quick", "--device", "cpu", "--out", str(out)],
                 "--out", "folder"),
    # the torchrun forms: the same declarations, applied by their own main before any rank works
    "torchrun curvature": Case(
        _reading("curvature", "--structure", "diag"), "OUT", "file", READING, distributed.main
    ),
    "torchrun merge": Case(
        _yaml("merge", "merge.yaml", "--no-progress"),
        "OUT_DIR",
        "folder",
        _config_collisions("models[0].model"),
        distributed.main,
    ),
    "torchrun remove": Case(
        _yaml("remove", "remove.yaml", "--no-progress"),
        "OUT_DIR",
        "folder",
        _config_collisions("model"),
        distributed.main,
    ),
}  # fmt: skip


def _link(ws: Path, target: Path) -> Path:
    """A symlink to ``target`` in a folder beside the workspace (made once)."""
    folder = ws.parent / f"{ws.name}-links"
    folder.mkdir(exist_ok=True)
    link = folder / f"to-{target.name}"
    if not link.is_symlink():
        link.symlink_to(target)
    return link


def test_every_command_that_writes_has_a_case():
    declared = set()
    for prefix, parser in (("", cli.build_parser()), ("torchrun ", distributed.build_parser())):
        (sub,) = [a for a in parser._actions if a.choices and isinstance(a.choices, dict)]
        for name, command in sub.choices.items():
            if command.get_default("writes") is not None:
                declared.add(prefix + name)
    cased = {name.split(" --")[0] for name in CASES}
    assert declared == cased
    assert "verify" not in declared  # it writes nothing


# ----- helpers ------------------------------------------------------------------------------------
def _run(case: Case, argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = case.main(argv)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


def _snapshot(*roots: Path) -> dict[str, str]:
    """Every entry under ``roots`` (hidden ones too): a file's SHA-256, a link's target, 'dir'."""
    found = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_symlink():
                found[str(path)] = f"-> {os.readlink(path)}"
            elif path.is_dir():
                found[str(path)] = "dir"
            else:
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


class _FakeResults:
    """What the demo's writer needs of a study's results (the study itself takes 30 s)."""

    def to_dict(self) -> dict[str, int]:
        return {"merged": 1}

    def summary(self) -> str:
        return "a table"


@pytest.fixture
def cheap_demo(monkeypatch):
    monkeypatch.setattr("gradmerge.demo.study.run_study", lambda *a, **k: _FakeResults())
    monkeypatch.setattr(
        "gradmerge.demo.plots.write_plots",
        lambda results, folder: (folder / "plot.png").write_bytes(b"\x89PNG" + bytes(4096)),
    )


def _mount(where: Path, options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True
    )
    return done.returncode == 0


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory) -> Iterator[Path]:
    """A 64 kB tmpfs filled to the last byte by ``filler``: files can be created, not written."""
    where = tmp_path_factory.mktemp("full")
    if shutil.which("mount") is None or not _mount(where, "size=64k"):
        pytest.skip("mounting a small file system needs root with CAP_SYS_ADMIN")
    try:
        fd = os.open(where / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, bytes(4096))
        os.close(fd)
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


@pytest.fixture(scope="module")
def read_only(tmp_path_factory) -> Iterator[Path]:
    """A read-only file system (a tmpfs mounted ro), or a 0555 folder where mounting is not
    allowed (then the test needs a user the permissions stop)."""
    where = tmp_path_factory.mktemp("ro")
    if shutil.which("mount") is not None and _mount(where, "size=64k,ro"):
        try:
            yield where
        finally:
            subprocess.run(["umount", str(where)], check=False)
        return
    where.chmod(0o555)
    if os.access(where, os.W_OK):
        pytest.skip("no read-only folder here: cannot mount, and permissions do not stop root")
    yield where
    where.chmod(0o755)


def _name(case: Case, stem: str = "out") -> str:
    return stem if case.kind == "folder" else stem + case.suffix


# ----- the grid: collisions × --overwrite ------------------------------------------------------------
COLLISIONS = [
    (command, relation, overwrite)
    for command, case in CASES.items()
    for relation in case.collisions
    for overwrite in (False, True)
]


@pytest.mark.parametrize(
    ("command", "relation", "overwrite"),
    COLLISIONS,
    ids=[f"{c}-{r}-{'overwrite' if o else 'plain'}" for c, r, o in COLLISIONS],
)
def test_an_output_colliding_with_an_input_is_refused(ws, tmp_path, capsys, monkeypatch, command,
                                                      relation, overwrite):  # fmt: skip
    case = CASES[command]
    if command.startswith("torchrun"):  # as torchrun sets them; refused before any rank works
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
    target, word, role = case.collisions[relation]
    out = target(ws)
    before = _snapshot(ws, tmp_path)
    code, err = _run(case, [*case.argv(ws, out), *(["--overwrite"] if overwrite else [])], capsys)
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert re.search(rf"error: {re.escape(case.role)} {re.escape(str(out))} {word} {re.escape(role)} ",
                     last), last  # fmt: skip
    assert "writing it would replace, delete or add to an input" in last
    assert _snapshot(ws, tmp_path) == before  # inputs' bytes unchanged, nothing partial


# ----- the grid: faults × --overwrite ---------------------------------------------------------------
FAULTS = ["read-only folder", "parent is a file", "other kind in the way", "full disk"]
FAULT_CASES = [
    (command, fault, overwrite)
    for command in CASES
    if not command.startswith("torchrun")
    for fault in FAULTS
    for overwrite in (False, True)
]


@pytest.mark.parametrize(
    ("command", "fault", "overwrite"),
    FAULT_CASES,
    ids=[f"{c}-{f}-{'overwrite' if o else 'plain'}" for c, f, o in FAULT_CASES],
)
def test_a_fault_is_one_typed_line_and_leaves_nothing(
    ws, tmp_path, capsys, request, cheap_demo, command, fault, overwrite
):
    case = CASES[command]
    if fault == "read-only folder":
        out, code, message = (
            request.getfixturevalue("read_only") / _name(case),
            2,
            ("could not be written: read-only file system"),
        )
    elif fault == "parent is a file":
        (tmp_path / "a-file").write_text("x")
        out, code = tmp_path / "a-file" / _name(case), 2
        message = f"cannot be written: {tmp_path / 'a-file'} is a file, not a folder"
    elif fault == "other kind in the way":
        out, code = tmp_path / _name(case, "in-the-way"), 2
        if case.kind == "file":
            out.mkdir()
            message = "is a folder; give a file name"
        else:
            out.write_text("x")
            message = "is a file; give a folder name"
    else:
        out, code = request.getfixturevalue("full_disk") / _name(case), 1
        message = "could not be written: no space left on device; nothing was written"
    before = _snapshot(ws, tmp_path, out.parent)
    got, err = _run(case, [*case.argv(ws, out), *(["--overwrite"] if overwrite else [])], capsys)
    assert got == code, err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and message in last, err
    assert str(out) in last
    assert _snapshot(ws, tmp_path, out.parent) == before  # nothing partial, inputs unchanged


@pytest.mark.parametrize("command", [c for c in CASES if not c.startswith("torchrun")])
def test_a_missing_parent_is_made_and_the_output_written(ws, tmp_path, capsys, cheap_demo,
                                                         command):  # fmt: skip
    case = CASES[command]
    out = tmp_path / "new" / "deeper" / _name(case)
    before = _snapshot(ws)
    code, err = _run(case, case.argv(ws, out), capsys)
    assert code == 0, err
    assert out.is_dir() if case.kind == "folder" else out.is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no staging left
    assert _snapshot(ws) == before


def test_the_base_of_an_adapter_named_in_a_yaml_is_an_input(ws, tmp_path, capsys):
    """A merge YAML's LoRA adapter reads the base its adapter_config.json names, which the YAML
    does not: writing there is refused as for `gradmerge curvature ADAPTER` (issue 29, case 2)."""
    config = tmp_path / "adapter.yaml"
    merge = {"method": "task_arithmetic", "base_model": str(ws / "ft")}
    config.write_text(yaml.safe_dump({**merge, "models": [{"model": str(ws / "adapter")}]}))
    out = ws / "base" / "merged"
    before = _snapshot(ws)
    code, err = _run(CASES["merge"], ["merge", str(config), str(out), "--overwrite"], capsys)
    assert code == 2
    assert f"OUT_DIR {out} lies inside the base of LoRA adapter models[0].model" in err
    assert _snapshot(ws) == before
