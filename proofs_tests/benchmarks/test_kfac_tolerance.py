"""benchmarks/kfac_tolerance.py at toy size: each ``solver:`` setting merges through the CLI, and
its logits are compared with the tightest merge's (the reference row compares equal to itself)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.inprocess import run_cli
from benchmarks.record import read_result


def in_process(cmd: list[str], **_: object) -> dict[str, object]:
    """``record.run_measured``'s result for ``gradmerge ARGS``, the command run in this process
    (:func:`benchmarks.inprocess.run_cli`): the return code, the failure's last lines, the last
    JSON line of stdout (no memory samples: the benchmark's own runs measure those)."""
    assert Path(cmd[0]).name == "gradmerge", cmd
    done = run_cli(cmd[1:])
    result: dict[str, object] = {"wall_seconds": 0.0, "returncode": done.returncode}
    if done.returncode != 0:
        result["error"] = done.stderr.strip().splitlines()[-5:]
    lines = [ln for ln in done.stdout.strip().splitlines() if ln.startswith("{")]
    return result | (json.loads(lines[-1]) if lines else {})


def test_every_setting_merges_and_is_compared_with_the_reference(tmp_path, monkeypatch):
    """The commands run in this process (their imports paid once per suite; ``gradmerge merge``
    and ``curvature`` have their subprocess smokes elsewhere)."""
    pytest.importorskip("transformers")
    from benchmarks import device_check, kfac_tolerance

    monkeypatch.setattr(kfac_tolerance, "run_measured", in_process)
    paths = device_check.gpt2_inputs(tmp_path, quick=True)  # GPT-2 width 64, depth 2, 2 tasks
    for t, (model, data) in enumerate(zip(paths["models"], paths["data"], strict=True)):
        done = run_cli(["curvature", str(model), str(data),
                        str(tmp_path / f"ft{t}.kfac.safetensors"), "--structure", "kfac",
                        "--shift-labels", "--no-progress"])  # fmt: skip
        assert done.returncode == 0, done.stderr
    out = tmp_path / "tolerance.json"
    kfac_tolerance.main(
        ["--keep", str(tmp_path), "--delta", "0.1", "--tol", "1e-5", "--float32", "1e-5",
         "--bfloat16", "1e-5", "--approximate", "0", "--sequences", "2", "--length", "16",
         "--out", str(out)]
    )  # fmt: skip
    report = read_result(out)["results"]
    assert report["complete"]
    assert report["held_out_tokens"] == 2 * 2 * 16
    rows = {r["setting"]: r for r in report["rows"]}
    assert list(rows) == [
        "tol=1e-05",
        "tol=1e-05, float32 products",
        "tol=1e-05, bfloat16 products",
        "approximate maxiter=0",
    ]
    assert rows["tol=1e-05, float32 products"]["solver"] == {"tol": 1e-05, "arithmetic": "working"}
    assert all(r["returncode"] == 0 for r in rows.values())
    ref = rows["tol=1e-05"]
    assert ref["max_abs_logit_change"] == 0 and ref["top1_agreement"] == 1 and ref["kl_mean"] == 0
    for name in ("tol=1e-05", "tol=1e-05, float32 products", "tol=1e-05, bfloat16 products"):
        assert 0 <= rows[name]["max_residual"] <= 1e-5
    assert rows["approximate maxiter=0"]["cg_iterations"] == 0
    for r in rows.values():
        assert 0 <= r["top1_agreement"] <= 1 and r["kl_mean"] >= -1e-12
        assert r["relative_logit_change"] >= 0 and r["parameter_change"] >= 0
