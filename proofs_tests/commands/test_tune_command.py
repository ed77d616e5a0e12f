"""`gradmerge tune CONFIG DATA... --scales GRID`: the criterion against brute force, the choice.

Tiny float64 BERT classifiers (proofs_tests/text_models.py): a base and two fine-tunes (a few
Adam steps on their own training data). References, computed here without gradmerge's merge or
evaluation code: each setting's merged weights by hand (task arithmetic θ_0 + s Σ_t α_t τ_t;
diagonal gradient matching elementwise, θ_0 + Σ_t sα_t (δ + h_t) τ_t / (δ + Σ_t sα_t h_t)), loaded
into Hugging Face's model; its loss one example at a time (HF's cross-entropy); the summed
gradients by HF's loss × N and autograd. The choice must be the grid point of least criterion,
and `--out-dir` must hold exactly what `gradmerge merge` writes at that setting.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import transformers
import yaml
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from gradmerge import cli
from gradmerge.errors import ArgumentError
from gradmerge.jobs.config import MergeConfig
from gradmerge.jobs.tune import choose, settings
from proofs_tests.text_models import LABELS, bert_classifier

TASKS = {
    "a": [
        ("the movie was very good", "positive"),
        ("a dull film", "negative"),
        ("the plot is not bad", "neutral"),
        ("a very good fun film", "positive"),
        ("bad actor dull plot", "negative"),
    ],
    "b": [
        ("the cat sat on the mat", "neutral"),
        ("a big red dog ran fast", "positive"),
        ("the small cat is slow", "negative"),
        ("blue dog", "neutral"),
        ("the dog ran", "positive"),
        ("a slow small cat", "negative"),
    ],
}


def _fine_tune(base, rows, seed):
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification.from_pretrained(base)
    tok = transformers.AutoTokenizer.from_pretrained(base)
    enc = tok([t for t, _ in rows], padding=True, return_tensors="pt")
    labels = torch.tensor([LABELS.index(y) for _, y in rows])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(8):
        optimizer.zero_grad()
        model(**enc, labels=labels).loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    base = bert_classifier(root / "base")
    tok = transformers.AutoTokenizer.from_pretrained(base)
    for i, (task, rows) in enumerate(TASKS.items()):
        (root / f"{task}.jsonl").write_text(
            "".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows)
        )
        _fine_tune(base, rows, i).save_pretrained(root / f"ft-{task}")
        tok.save_pretrained(root / f"ft-{task}")
        argv = ["curvature", str(root / f"ft-{task}"), str(root / f"{task}.jsonl")]
        assert cli.main([*argv, str(root / f"{task}.curvature.safetensors"), "--no-progress"]) == 0
    return root


def _config(root, name, method, **extra):
    models = [
        {
            "model": f"ft-{t}",
            **({"curvature": f"{t}.curvature.safetensors"} if method != "task_arithmetic" else {}),
        }
        for t in TASKS
    ]
    models[1]["alpha"] = 0.5
    body = {"method": method, "base_model": "base", "models": models, "compute_dtype": "float64"}
    (root / name).write_text(yaml.safe_dump({**body, **extra}))
    return root / name


def _tune(root, config, *flags):
    argv = ["tune", str(config), str(root / "a.jsonl"), str(root / "b.jsonl"), "--no-progress"]
    return cli.main([*argv, *map(str, flags)])


def _weights(folder):
    return load_file(str(folder / "model.safetensors"))


def _load(root, weights):
    model = transformers.BertForSequenceClassification.from_pretrained(root / "base").eval()
    model.load_state_dict(weights, strict=False)
    return model


def _mean_loss(model, root, task):
    """HF's cross-entropy, one example at a time, averaged; ``task`` a name of TASKS or rows."""
    tok = transformers.AutoTokenizer.from_pretrained(root / "base")
    with torch.no_grad():
        losses = [
            float(model(**tok(t, return_tensors="pt"), labels=torch.tensor([LABELS.index(y)])).loss)
            for t, y in (TASKS[task] if isinstance(task, str) else task)
        ]
    return sum(losses) / len(losses)


def _gradient(model, root, task):
    """Σ_i ∇ℓ_i: HF's mean loss × N on the padded batch, by autograd; ``task`` as above."""
    tok = transformers.AutoTokenizer.from_pretrained(root / "base")
    rows = TASKS[task] if isinstance(task, str) else task
    enc = tok([t for t, _ in rows], padding=True, return_tensors="pt")
    model.zero_grad()
    labels = torch.tensor([LABELS.index(y) for _, y in rows])
    (model(**enc, labels=labels).loss * len(rows)).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def _task_arithmetic(root, scale):
    base = _weights(root / "base")
    out = dict(base)
    for task, alpha in zip(TASKS, (1.0, 0.5), strict=True):
        ft = _weights(root / f"ft-{task}")
        for k, v in base.items():
            if v.is_floating_point():
                out[k] = out[k] + scale * alpha * (ft[k] - v)
    return out


def _gradient_matching(root, scale, delta):
    """Eq. 6 with diagonal curvatures, elementwise, H_0 = δ."""
    base = _weights(root / "base")
    fts = [_weights(root / f"ft-{t}") for t in TASKS]
    hs = [  # the file stores each diagonal under "diag/<name>"
        {
            k.removeprefix("diag/"): v
            for k, v in load_file(str(root / f"{t}.curvature.safetensors")).items()
        }
        for t in TASKS
    ]
    assert set(hs[0]) == {k for k, v in base.items() if v.is_floating_point()}
    out = dict(base)
    for k in hs[0]:
        numerator = torch.zeros_like(base[k])
        precision = torch.full_like(base[k], delta)
        for ft, h, alpha in zip(fts, hs, (1.0, 0.5), strict=True):
            numerator += scale * alpha * (delta + h[k]) * (ft[k] - base[k])
            precision += scale * alpha * h[k]
        out[k] = base[k] + numerator / precision
    return out


def _report(path):
    return json.loads(path.read_text())


def test_the_training_loss_criterion_and_the_choice(setup, tmp_path):
    config = _config(setup, "ta.yaml", "task_arithmetic")
    scales = [0.0, 0.5, 1.0, 1.5]
    out, merged = tmp_path / "tune.json", tmp_path / "chosen"
    grid = ",".join(map(str, scales))
    assert _tune(setup, config, "--scales", grid, "--out", out, "--out-dir", merged) == 0
    report = _report(out)
    expected = []
    for point, scale in zip(report["points"], scales, strict=True):
        assert point["scale"] == scale and point["alphas"] == [scale, 0.5 * scale]
        model = _load(setup, _task_arithmetic(setup, scale))
        losses = [_mean_loss(model, setup, t) for t in TASKS]
        for task, loss in zip(point["tasks"], losses, strict=True):
            assert math.isclose(task["mean_loss"], loss, rel_tol=1e-9), (scale, task)
            assert task["examples"] in (5, 6)
        assert math.isclose(point["criterion"], sum(losses), rel_tol=1e-9)
        expected.append(sum(losses))
    chosen = min(range(len(expected)), key=expected.__getitem__)
    assert report["chosen_index"] == chosen and report["chosen"]["scale"] == scales[chosen]
    assert len(set(round(v, 6) for v in expected)) == len(expected)  # a real choice
    # the kept model is the merge at the chosen setting, as `gradmerge merge` writes it
    again = _config(setup, "again.yaml", "task_arithmetic", scale=scales[chosen])
    assert cli.main(["merge", str(again), str(tmp_path / "merge"), "--no-progress"]) == 0
    ours, reference = _weights(merged), _weights(tmp_path / "merge")
    assert sorted(ours) == sorted(reference)
    for k, v in reference.items():
        assert torch.equal(ours[k], v), k
    assert json.loads((merged / "gradmerge_merge.json").read_text())["method"] == "task_arithmetic"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".gradmerge-tune")]


HELD_OUT = {
    "a": [("a good fun movie", "positive"), ("the dull plot", "negative"), ("a film", "neutral")],
    "b": [("the big dog ran", "positive"), ("a slow cat", "negative"), ("the mat", "neutral")],
}


def _accuracy(model, root, rows):
    tok = transformers.AutoTokenizer.from_pretrained(root / "base")
    with torch.no_grad():
        hits = [
            int(model(**tok(t, return_tensors="pt")).logits.argmax()) == LABELS.index(y)
            for t, y in rows
        ]
    return sum(hits) / len(hits)


def test_validation_data_are_reported_and_never_used_to_choose(setup, tmp_path):
    for task, rows in HELD_OUT.items():
        (tmp_path / f"{task}.val.jsonl").write_text(
            "".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows)
        )
    config = _config(setup, "ta.yaml", "task_arithmetic")
    scales = [0.0, 0.5, 1.0, 1.5]
    grid = ",".join(map(str, scales))
    assert _tune(setup, config, "--scales", grid, "--out", tmp_path / "plain.json") == 0
    flags = ["--validation", tmp_path / "a.val.jsonl", "--validation", tmp_path / "b.val.jsonl"]
    assert _tune(setup, config, "--scales", grid, "--out", tmp_path / "v.json", *flags) == 0
    plain, report = _report(tmp_path / "plain.json"), _report(tmp_path / "v.json")
    assert report["chosen_index"] == plain["chosen_index"]  # the choice ignores them
    assert [p["criterion"] for p in report["points"]] == [p["criterion"] for p in plain["points"]]
    scores = []
    for point, scale in zip(report["points"], scales, strict=True):
        model = _load(setup, _task_arithmetic(setup, scale))
        accuracies = [_accuracy(model, setup, rows) for rows in HELD_OUT.values()]
        assert [v["accuracy"] for v in point["validation"]] == accuracies
        scores.append(sum(accuracies) / 2)
    best = scores.index(max(scores))  # the first of the highest
    summary = report["validation"]
    assert summary["best_index"] == best and summary["best"]["scale"] == scales[best]
    assert summary["chosen_score"] == scores[report["chosen_index"]]
    assert summary["regret"] == scores[best] - scores[report["chosen_index"]] >= 0


def test_a_scale_by_delta_grid_for_gradient_matching(setup, tmp_path):
    config = _config(setup, "gm.yaml", "gradient_matching", prior={"delta": 1.0})
    out = tmp_path / "gm.json"
    assert _tune(setup, config, "--scales", "0.5,1", "--deltas", "0.01,10", "--out", out) == 0
    report = _report(out)
    grid = [(0.5, 0.01), (0.5, 10.0), (1.0, 0.01), (1.0, 10.0)]
    values = []
    for point, (scale, delta) in zip(report["points"], grid, strict=True):
        assert (point["scale"], point["delta"]) == (scale, delta)
        model = _load(setup, _gradient_matching(setup, scale, delta))
        value = sum(_mean_loss(model, setup, t) for t in TASKS)
        assert math.isclose(point["criterion"], value, rel_tol=1e-9), (scale, delta)
        values.append(value)
    assert report["chosen_index"] == min(range(4), key=values.__getitem__)
    assert report["merged_model"] is None


def test_the_gradient_mismatch_criterion(setup, tmp_path):
    config = _config(setup, "ta.yaml", "task_arithmetic")
    out = tmp_path / "mm.json"
    flags = ["--scales", "0.5,1", "--criterion", "mismatch", "--out", out]
    assert _tune(setup, config, *flags) == 0
    report = _report(out)
    fts = {t: _load(setup, _weights(setup / f"ft-{t}")) for t in TASKS}
    values = []
    for point, scale in zip(report["points"], (0.5, 1.0), strict=True):
        merged = _load(setup, _task_arithmetic(setup, scale))
        total = 0.0
        for task, entry in zip(TASKS, point["tasks"], strict=True):
            g, g_t = _gradient(merged, setup, task), _gradient(fts[task], setup, task)
            norm = math.sqrt(sum(float(((g[k] - g_t[k]) ** 2).sum()) for k in g))
            expected = norm / len(TASKS[task])
            assert math.isclose(entry["term"], expected, rel_tol=1e-8), (scale, task)
            total += expected
        assert math.isclose(point["criterion"], total, rel_tol=1e-8)
        values.append(total)
    assert report["chosen_index"] == min(range(2), key=values.__getitem__)


def test_a_failing_point_is_reported_and_skipped(setup, tmp_path, capsys):
    config = _config(setup, "ta.yaml", "task_arithmetic")
    out = tmp_path / "f.json"
    assert _tune(setup, config, "--scales", "1,1e300", "--out", out) == 0
    report = _report(out)
    assert report["points"][1]["criterion"] is None and report["points"][1]["error"]
    assert report["chosen_index"] == 0
    assert _tune(setup, config, "--scales", "1e300", "--out", tmp_path / "g.json") == 1
    assert "every setting failed" in capsys.readouterr().err
    assert _report(tmp_path / "g.json")["chosen"] is None


BAD = [
    # (name, config method and extras, flags, exit code, message)
    ("DATA count", ("task_arithmetic", {}), ["--scales", "1"], "drop-data", 2, "merges 2 models"),
    ("deltas without a prior", ("task_arithmetic", {}), ["--scales", "1", "--deltas", "1"], None,
     2, "has no prior"),
    ("prior scales without a prior curvature", ("gradient_matching", {"prior": {"delta": 1.0}}),
     ["--scales", "1", "--prior-scales", "1"], None, 2, "has none"),
    ("a negative alpha", ("task_arithmetic", {}), ["--scales", "-1"], None, 2, ">= 0"),
    ("a zero prior", ("gradient_matching", {"prior": {"delta": 1.0}}),
     ["--scales", "1", "--deltas", "0"], None, 2, "makes the prior H_0 zero"),
    ("not a grid", ("task_arithmetic", {}), ["--scales", "a,b"], None, 2, "comma-separated"),
    ("one --validation for two models", ("task_arithmetic", {}),
     ["--scales", "1", "--validation", "@a"], None, 2, "--validation DATA were given"),
    ("--out-dir inside the base", ("task_arithmetic", {}),
     ["--scales", "1", "--out-dir", "@base/tuned"], None, 2, "lies inside base_model"),
    ("a base that is no model folder", ("task_arithmetic", {"base_model": "base/model.safetensors"}),
     ["--scales", "1"], None, 1, "is not a Hugging Face folder"),
    ("--out-dir exists", ("task_arithmetic", {}), ["--scales", "1", "--out-dir", "@dir"], None,
     2, "exists; pass --overwrite"),
    ("a --base-data that does not exist", ("task_arithmetic", {}),
     ["--scales", "1", "--base-data", "no-base.jsonl"], None, 2, "no-base.jsonl does not exist"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "method", "flags", "variant", "code", "message"), BAD, ids=[c[0] for c in BAD]
)
def test_bad_input(setup, tmp_path, capsys, name, method, flags, variant, code, message):
    config = _config(setup, "bad.yaml", method[0], **method[1])
    datas = [str(setup / "a.jsonl")] + ([] if variant == "drop-data" else [str(setup / "b.jsonl")])
    (tmp_path / "dir").mkdir()
    paths = {
        "@dir": tmp_path / "dir",
        "@a": setup / "a.jsonl",
        "@base/tuned": setup / "base" / "tuned",
    }
    flags = [str(paths[f]) if f in paths else f for f in flags]
    argv = ["tune", str(config), *datas, *flags, "--no-progress", "--out", str(tmp_path / "o.json")]
    if code == 2:
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2
    else:
        assert cli.main(argv) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()
    assert not (setup / "base" / "tuned").exists()


# ----- the library ----------------------------------------------------------------------------
def test_settings_are_the_product_in_order():
    cfg = MergeConfig.from_dict(
        {
            "method": "gradient_matching",
            "base_model": ".",
            "models": [{"model": ".", "curvature": "."}],
            "prior": {"delta": 1.0, "curvature": ".", "scale": 2.0},
        },
        check_files=False,
    )
    points = settings(cfg, scales=[1, 2], deltas=[0.1, 0.2], prior_scales=[0, 3])
    assert [(p.scale, p.delta, p.prior_scale) for p in points] == [
        (s, d, c) for s in (1, 2) for d in (0.1, 0.2) for c in (0, 3)
    ]
    applied = points[1].apply(cfg)
    assert (applied.scale, applied.prior.delta, applied.prior.scale) == (1, 0.1, 3)
    assert cfg.prior.scale == 2.0  # the configuration itself is unchanged
    with pytest.raises(ArgumentError, match="empty"):
        settings(cfg, scales=[])
    with pytest.raises(ArgumentError, match="finite"):
        settings(cfg, scales=[float("nan")])


@given(st.lists(st.one_of(st.none(), st.floats(-1e6, 1e6)), max_size=8))
def test_choose_is_the_first_least_value(values):
    index = choose(values)
    present = [v for v in values if v is not None]
    if not present:
        assert index is None
        return
    assert values[index] == min(present)
    assert all(v is None or v > values[index] for v in values[:index])


@pytest.mark.parametrize("progress", [False, True])
def test_issue29_every_failed_points_reason_is_printed_in_every_mode(setup, tmp_path, capsys,
                                                                     progress):  # fmt: skip
    """``--no-progress`` printed "every setting failed (errors above)" with nothing above."""
    config = _config(setup, "ta.yaml", "task_arithmetic")
    argv = ["tune", str(config), str(setup / "a.jsonl"), str(setup / "b.jsonl"), "--scales",
            "1e300,2e300"] + ([] if progress else ["--no-progress"])  # fmt: skip
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert "every setting failed (each one's error is in the table)" in captured.err
    table = [line for line in captured.out.splitlines() if re.search(r" failed +\(", line)]
    assert len(table) == 2 and all("NonFiniteError" in line or "Overflow" in line for line in table)


def test_issue29_data_without_labels_are_refused_before_the_first_merge(setup, tmp_path, capsys,
                                                                        monkeypatch):  # fmt: skip
    (tmp_path / "unlabelled.jsonl").write_text(json.dumps({"text": "a film"}) + "\n")
    merges = []
    import gradmerge.jobs.engine as engine

    monkeypatch.setattr(engine, "run_merge", lambda *a, **k: merges.append(1))
    config = _config(setup, "ta.yaml", "task_arithmetic")
    argv = ["tune", str(config), str(setup / "a.jsonl"), str(tmp_path / "unlabelled.jsonl"),
            "--scales", "0.5,1", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "unlabelled.jsonl" in err and "label" in err and "every setting failed" not in err
    assert merges == []


def test_autocast_scores_each_point_within_bfloat16_rounding(setup, tmp_path):
    """--autocast bfloat16: every point's training losses equal the float32 ones to bfloat16's
    rounding (the same merges, the forward under torch.autocast)."""
    config = _config(setup, "ta-bf16.yaml", "task_arithmetic")
    reports = {}
    for flags in ([], ["--autocast", "bfloat16"]):
        out = tmp_path / f"tune{len(flags)}.json"
        assert _tune(setup, config, "--scales", "0.5,1", "--out", out, *flags) == 0
        reports[bool(flags)] = _report(out)
    for low, exact in zip(reports[True]["points"], reports[False]["points"], strict=True):
        assert low["scale"] == exact["scale"]
        for a, b in zip(low["tasks"], exact["tasks"], strict=True):
            assert a["examples"] == b["examples"]
            assert math.isclose(a["mean_loss"], b["mean_loss"], rel_tol=0.05)
        assert low["criterion"] != exact["criterion"]  # computed in bfloat16 indeed
