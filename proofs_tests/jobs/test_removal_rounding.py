"""Removal that cannot silently blow up (issue 22, item 3).

The README recipe "remove a task from a merge" with δ = 1e-12: rows only task B trained have
H̄_\\b = δ and (H_0 + H_B)/H̄_\\b ≈ 1e14, so Eq. 13 from the float32 merge multiplies the merge's
rounding into an error far above the step. The removal must be refused (dry run and real run
alike), the bound must bound the error it describes, and `method: remerge` must give the exact
answer: the merge without B.
"""

import torch
import yaml
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge.cli import main
from gradmerge.jobs import MergeConfig, run_merge
from gradmerge.jobs.config import remerge_config

DELTA = 1e-12


def _workspace(root):
    g = torch.Generator().manual_seed(0)
    base = {"emb.weight": 0.05 * torch.randn(40, 8, generator=g), "norm.weight": torch.ones(8)}
    seen_a = torch.zeros(40, 8)
    seen_a[:20] = 1.0  # task A saw the first 20 tokens; B saw all 40
    curv = {
        "a": {
            "emb.weight": 50 * torch.rand(40, 8, generator=g) * seen_a,
            "norm.weight": torch.rand(8, generator=g) + 1,
        },
        "b": {
            "emb.weight": 50 * torch.rand(40, 8, generator=g) + 1,
            "norm.weight": torch.rand(8, generator=g) + 1,
        },
    }
    save_file(base, root / "base.safetensors")
    for t in "ab":
        ft = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        save_file(ft, root / f"ft_{t}.safetensors")
        gm.Diagonal(curv[t]).save(root / f"{t}.curvature.safetensors")
    merge = {
        "method": "gradient_matching",
        "base_model": "base.safetensors",
        "models": [
            {"model": f"ft_{t}.safetensors", "curvature": f"{t}.curvature.safetensors"}
            for t in "ab"
        ],
        "prior": {"delta": DELTA},
    }
    (root / "merge.yaml").write_text(yaml.safe_dump(merge))
    assert main(["merge", str(root / "merge.yaml"), str(root / "merged"), "--no-progress"]) == 0
    remove = {
        "method": "remove",
        "base_model": "merged",
        "model": "ft_b.safetensors",
        "curvature": "b.curvature.safetensors",
        "prior": {"delta": DELTA},
        "remaining": {"delta": DELTA, "curvature": ["a.curvature.safetensors"]},
    }
    return remove


def test_amplified_rounding_is_refused_by_the_dry_run_and_the_real_run(tmp_path, capsys):
    remove = _workspace(tmp_path)
    for step_check in ("refuse", "ignore"):  # the step check refuses it too; then rounding
        remove["step_check"] = step_check
        (tmp_path / "remove.yaml").write_text(yaml.safe_dump(remove))
        _same_verdict(
            tmp_path, capsys, "max_relative_step" if step_check == "refuse" else "max_rounding"
        )


def _same_verdict(tmp_path, capsys, key):
    capsys.readouterr()
    dry = main(["remove", str(tmp_path / "remove.yaml"), str(tmp_path / "out"), "--dry-run"])
    dry_out = capsys.readouterr().out
    real = main(["remove", str(tmp_path / "remove.yaml"), str(tmp_path / "out"), "--no-progress"])
    real_err = capsys.readouterr().err
    assert dry == real == 1
    assert key in dry_out and key in real_err
    if key == "max_rounding":
        assert "method: remerge" in dry_out and "method: remerge" in real_err
    assert not (tmp_path / "out").exists()


def test_the_bound_bounds_the_error_it_describes(tmp_path):
    """Eq. 13 from the float32 merge vs Eq. 13 in float64 from the float64 merge: the difference
    is the amplified rounding of the stored merge; the reported bound must cover it."""
    remove = _workspace(tmp_path)
    remove["rounding_check"] = "warn"
    remove["step_check"] = "ignore"
    (tmp_path / "remove.yaml").write_text(yaml.safe_dump(remove))
    assert (
        main(["remove", str(tmp_path / "remove.yaml"), str(tmp_path / "out"), "--no-progress"]) == 0
    )
    record = __import__("json").loads((tmp_path / "out" / "gradmerge_remove.json").read_text())
    got = load_file(tmp_path / "out" / "model.safetensors")

    def wide(name):
        return {k: v.double() for k, v in load_file(tmp_path / name).items()}

    base, fts = wide("base.safetensors"), [wide("ft_a.safetensors"), wide("ft_b.safetensors")]
    hs = [
        gm.load_curvature(tmp_path / f"{t}.curvature.safetensors").to(dtype=torch.float64)
        for t in "ab"
    ]
    merged64 = gm.gradient_matching(base, fts, hs, prior=DELTA)
    exact = gm.remove(merged64, fts[1], hs[1], remaining=hs[0] + DELTA, prior=DELTA)
    error = sum(float(((got[k].double() - exact[k]) ** 2).sum()) for k in exact) ** 0.5
    bound = record["rounding"]["bound"]
    assert record["rounding"]["max_amplification"] > 1e12
    assert error > 1.0  # the blow-up of the issue: far above the task vectors (~0.06)
    assert error <= bound


def test_remerge_is_the_merge_without_the_task(tmp_path, capsys):
    _workspace(tmp_path)
    spec = {"method": "remerge", "merge": "merge.yaml", "without": ["ft_b.safetensors"]}
    (tmp_path / "remerge.yaml").write_text(yaml.safe_dump(spec))
    assert main(["remove", str(tmp_path / "remerge.yaml"), str(tmp_path / "out"), "--dry-run"]) == 0
    assert (
        main(["remove", str(tmp_path / "remerge.yaml"), str(tmp_path / "out"), "--no-progress"])
        == 0
    )
    only_a = MergeConfig.from_dict(
        {
            "method": "gradient_matching",
            "base_model": "base.safetensors",
            "models": [{"model": "ft_a.safetensors", "curvature": "a.curvature.safetensors"}],
            "prior": {"delta": DELTA},
        },
        root=tmp_path,
    )
    run_merge(only_a, tmp_path / "direct", progress=False)
    got, want = (load_file(tmp_path / d / "model.safetensors") for d in ("out", "direct"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    by_index = remerge_config(
        {"method": "remerge", "merge": "merge.yaml", "without": [1]}, root=tmp_path
    )
    assert [m.model.name for m in by_index.models] == ["ft_a.safetensors"]


def test_remerge_errors_name_the_key(tmp_path):
    _workspace(tmp_path)
    cases = [
        ({"without": [2]}, r"without\[0\]` = 2 is not an index"),
        ({"without": ["a.curvature.safetensors"]}, r"without\[0\].*none of the merge.s models"),
        ({"without": [0, 1]}, "leaves no model"),
        ({"without": []}, "non-empty list"),
        ({"without": [0], "alpha": 1}, "unknown key 'alpha'"),
    ]
    for extra, message in cases:
        spec = {"method": "remerge", "merge": "merge.yaml", **extra}
        with __import__("pytest").raises(gm.ConfigError, match=message):
            remerge_config(spec, root=tmp_path)
