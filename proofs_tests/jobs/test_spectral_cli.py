"""`gradmerge merge` with tsv_merge, iso_c and iso_cts: three tiny checkpoints end to end.

The streamed merge (one tensor at a time) equals gm.tsv_merge / gm.iso_c / gm.iso_cts on whole
state dicts exactly, and the methods' YAML keys (``average``, ``common_space_fraction``) are
checked like every other key.
"""

from __future__ import annotations

import json
import re

import pytest
from safetensors.torch import load_file

import gradmerge as gm
from gradmerge import cli
from proofs_tests.workspace import assert_same, make_workspace

ALPHAS = [1.0, 0.5, 0.8]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("spectral"), "diag", tasks=3)


def _config(ws, method, **keys):
    models = [{"model": m.name, "alpha": a} for m, a in zip(ws.models, ALPHAS, strict=True)]
    return {"method": method, "base_model": ws.base.name, "models": models, **keys}


CASES = {  # method, its YAML keys, the in-memory call
    "tsv_merge": ({}, lambda b, f: gm.tsv_merge(b, f, alphas=ALPHAS)),
    "iso_c": ({"scale": 1.5}, lambda b, f: gm.iso_c(b, f, alphas=[1.5 * a for a in ALPHAS])),
    "iso_cts": ({}, lambda b, f: gm.iso_cts(b, f, alphas=ALPHAS)),
    "iso_cts-0.5": (
        {"common_space_fraction": 0.5, "average": ["3.*"]},
        lambda b, f: gm.iso_cts(
            b, f, alphas=ALPHAS, common_space_fraction=0.5, average=["3.weight", "3.bias"]
        ),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_merge_of_three_checkpoints_equals_the_in_memory_rule(ws, case, tmp_path, capsys):
    method = case.split("-")[0]
    keys, reference = CASES[case]
    path = ws.yaml(f"{case}.yaml", _config(ws, method, **keys))
    out = tmp_path / "merged"

    assert cli.main(["merge", str(path), str(out), "--dry-run", "--no-progress"]) == 0
    assert not out.exists() and "inputs fit together" in capsys.readouterr().out

    assert cli.main(["merge", str(path), str(out), "--no-progress"]) == 0
    assert (
        f"{method}: wrote 6 tensors (6 merged, 0 copied from the base)" in capsys.readouterr().out
    )
    expected = reference(ws.load(ws.base), [ws.load(m) for m in ws.models])
    assert_same(load_file(out / "model.safetensors"), expected)
    record = json.loads((out / "gradmerge_merge.json").read_text())
    assert record["config"]["method"] == method


@pytest.mark.parametrize(
    ("method", "keys", "message"),
    [
        (
            "iso_cts",
            {"common_space_fraction": 1.5},
            r"`common_space_fraction` .* must be in \[0, 1\], got 1.5",
        ),
        ("iso_cts", {"common_space_fraction": "most"}, "common_space_fraction"),
        (
            "tsv_merge",
            {"common_space_fraction": 0.5},
            "`common_space_fraction` is not used by method tsv_merge: .* is for iso_cts",
        ),
        ("iso_c", {"average": "3.weight"}, "`average` must be a list of names or globs"),
        (
            "iso_c",
            {"average": ["nothing.*"]},
            "average pattern 'nothing.\\*' matches no tensor of the base model",
        ),
        (
            "task_arithmetic",
            {"average": ["3.weight"]},
            "`average` is not used by method task_arithmetic: .* tsv_merge, iso_c and iso_cts",
        ),
    ],
)
def test_bad_keys_are_one_line_on_stderr_and_write_nothing(
    ws, method, keys, message, tmp_path, capsys
):
    path = ws.yaml(f"bad-{method}.yaml", _config(ws, method, **keys))
    out = tmp_path / "merged"
    assert cli.main(["merge", str(path), str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gradmerge merge: error:") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not out.exists()


def test_remerge_removes_a_task_from_a_spectral_merge(ws, tmp_path, capsys):
    """Eq. 13 does not undo TSV-M (it is not Eq. 6); `method: remerge` merges the other tasks
    again, with their own rank share ⌊r/2⌋ instead of ⌊r/3⌋."""
    ws.yaml("tsv.yaml", _config(ws, "tsv_merge"))
    path = ws.yaml("remerge.yaml", {"method": "remerge", "merge": "tsv.yaml", "without": [1]})
    out = tmp_path / "removed"
    assert cli.main(["remove", str(path), str(out), "--no-progress"]) == 0
    kept = [ws.models[0], ws.models[2]]
    expected = gm.tsv_merge(ws.load(ws.base), [ws.load(m) for m in kept], alphas=[1.0, 0.8])
    assert_same(load_file(out / "model.safetensors"), expected)


def test_a_common_space_fraction_too_small_for_a_matrix_is_refused_before_reading(tmp_path, capsys):
    """Two models, f = 0: the 3 × 4 matrix's 3 directions would go to the tasks as 2·round(3/2)
    = 4. Both the dry run and the run refuse it, naming the matrix, before reading a tensor."""
    ws2 = make_workspace(tmp_path / "two", "diag", tasks=2)
    models = [{"model": m.name} for m in ws2.models]
    config = {"method": "iso_cts", "base_model": ws2.base.name, "models": models}
    path = ws2.yaml("f0.yaml", {**config, "common_space_fraction": 0.0})
    for flags in (["--dry-run"], []):
        assert cli.main(["merge", str(path), str(tmp_path / "out"), "--no-progress", *flags]) == 1
        err = capsys.readouterr().err
        assert "rounds to 4 > 3: use a larger common_space_fraction" in err
        assert "('3.weight', 3×4)" in err and not (tmp_path / "out").exists()
    path = ws2.yaml(
        "f0-avg.yaml", {**config, "common_space_fraction": 0.0, "average": ["3.weight"]}
    )
    assert cli.main(["merge", str(path), str(tmp_path / "out"), "--no-progress"]) == 0
