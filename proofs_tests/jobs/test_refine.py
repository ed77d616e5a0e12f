"""``gradmerge refine`` on a tiny Hugging Face classifier (a 1-layer BERT built from a config).

Two tasks of token sequences labelled by different rules; θ_t fine-tuned from θ_LLM with the prior
½δ‖θ − θ_LLM‖² (Eq. 15), the start a task-arithmetic merge. Checked: the per-step record (the
gradient mismatch falls at each of the 2 steps here, 625 → 385 → 101; it is not what
``gm.refine`` minimises, and a third step left it at 101 ± 0.3, up or down between runs; ‖R‖,
which ``gm.refine`` backtracks on, falls at every step taken); the
output equals ``gm.refine`` called in memory; ``gm.gradient_fn`` equals autograd on the summed
loss; bad inputs raise typed errors and write nothing.
"""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

import gradmerge as gm
from gradmerge.cli import main
from gradmerge.io.sources import load_data
from gradmerge.jobs.refine import RECORD, RefineConfig, run_refine

transformers = pytest.importorskip("transformers")

DELTA = 1.0
STEPS = 2


@dataclass
class Setting:
    root: Path
    base: Path
    start: Path
    models: list[Path]
    data: list[Path]


def _bert(seed: int, hidden: int = 8):
    cfg = transformers.BertConfig(
        vocab_size=20,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=8,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(cfg).eval()


def _task(rule: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 20, (32, 6), generator=g)
    labels = (ids[:, rule] % 3).long()
    return {"input_ids": ids, "labels": labels}  # a tensor file's mask is per label position


def _finetune(model, base: dict[str, torch.Tensor], data: dict[str, torch.Tensor]):
    """argmin Σ_i ℓ_i(θ) + (δ/2)‖θ − θ_LLM‖² by full-batch L-BFGS (Eq. 15)."""
    params = dict(model.named_parameters())
    opt = torch.optim.LBFGS(params.values(), max_iter=60, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logits = model(input_ids=data["input_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits, data["labels"], reduction="sum")
        loss = loss + 0.5 * DELTA * sum((params[k] - base[k]).square().sum() for k in params)
        loss.backward()
        return loss

    opt.step(closure)
    return model


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> Setting:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("refine")
    base = _bert(0)
    base.save_pretrained(root / "base")
    (root / "base" / "tokenizer_config.json").write_text('{"model_max_length": 8}\n')
    theta_llm = {k: v.detach().clone() for k, v in base.named_parameters()}
    models, data, finetuned = [], [], []
    for t, rule in enumerate((0, 5)):
        tensors = _task(rule, seed=t)
        save_file(tensors, str(root / f"task{t}.safetensors"))
        data.append(root / f"task{t}.safetensors")
        ft = _finetune(copy.deepcopy(base), theta_llm, tensors)
        ft.save_pretrained(root / f"ft{t}")
        models.append(root / f"ft{t}")
        finetuned.append({k: v.detach() for k, v in ft.named_parameters()})
    merged = gm.task_arithmetic(theta_llm, finetuned, alphas=1.0)
    start = copy.deepcopy(base)
    with torch.no_grad():
        for k, v in start.named_parameters():
            v.copy_(merged[k])
    start.save_pretrained(root / "start")
    (root / "start" / "tokenizer_config.json").write_text('{"model_max_length": 8}\n')
    return Setting(root, root / "base", root / "start", models, data)


def _config(setting: Setting, name: str = "refine.yaml", **changes) -> Path:
    config = {
        "start": "start",
        "base_model": "base",
        "models": [
            {"model": m.name, "data": d.name}
            for m, d in zip(setting.models, setting.data, strict=True)
        ],
        "prior": {"delta": DELTA},
        "steps": STEPS,
        "structure": "full",
        "fisher": "ggn",
        "batch_size": 10,
        "device": "cpu",
    } | changes
    path = setting.root / name
    path.write_text(yaml.safe_dump(config))
    return path


def test_cli_refines_and_records_a_falling_mismatch(setting, tmp_path, capsys):
    out = tmp_path / "refined"
    assert main(["refine", str(_config(setting)), str(out)]) == 0
    assert f"refine: {STEPS} steps" in capsys.readouterr().out
    record = json.loads((out / RECORD).read_text())
    steps = record["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS + 1))
    mismatch = [s["mismatch_total"] for s in steps]
    residual = [s["residual"] for s in steps]
    assert all(b < a for a, b in itertools.pairwise(mismatch))  # measured here, not a theorem
    assert all(b < a for a, b in itertools.pairwise(residual))  # gm.refine backtracks on ‖R‖
    assert all(s["mismatch_total"] == pytest.approx(sum(s["mismatch"])) for s in steps)
    assert record["config"]["steps"] == STEPS and record["command"] == "refine"
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    refined = transformers.BertForSequenceClassification.from_pretrained(out)
    start = transformers.BertForSequenceClassification.from_pretrained(setting.start)
    moved = sum(
        float((a - b).detach().norm())
        for a, b in zip(refined.parameters(), start.parameters(), strict=True)
    )
    assert moved > 0


def test_output_equals_gm_refine_in_memory(setting, tmp_path):
    out = tmp_path / "refined"
    report = run_refine(RefineConfig.from_yaml(_config(setting)), out)
    model = transformers.BertForSequenceClassification.from_pretrained(setting.start).eval()
    theta0 = {k: v.detach().clone() for k, v in model.named_parameters()}

    def params_of(folder: Path) -> dict[str, torch.Tensor]:
        m = transformers.BertForSequenceClassification.from_pretrained(folder)
        return {k: v.detach() for k, v in m.named_parameters()}

    base = params_of(setting.base)
    finetuned = [params_of(m) for m in setting.models]
    batches = [list(load_data(str(d), batch_size=10)) for d in setting.data]
    gradients = [gm.gradient_fn(model, b) for b in batches]

    def curvature(b):
        def at(theta):
            with torch.no_grad():
                for k, v in theta.items():
                    model.get_parameter(k).copy_(v)
            return gm.estimate_curvature(model, b, structure="full", fisher="ggn")

        return at

    iterates = gm.refine(
        theta0, base, gradients, [curvature(b) for b in batches], prior=DELTA, steps=STEPS
    )
    written = params_of(out)
    for k, v in iterates[-1].items():
        torch.testing.assert_close(written[k], v, rtol=1e-6, atol=1e-7)
    for k, theta in enumerate([theta0, *iterates]):
        expected = gm.gradient_mismatch(theta, finetuned, gradients).norms
        assert report.steps[k]["mismatch"] == pytest.approx(expected, rel=1e-5)
        # ‖R(θ^k)‖ from fresh gradients: the record's reuse of the mismatch's is not stale
        r = {n: DELTA * (theta[n] - base[n]) for n in theta}
        for grad in gradients:
            r = {n: r[n] + g for n, g in grad(theta).items()}
        norm = float(torch.sqrt(sum(v.double().square().sum() for v in r.values())))
        assert report.steps[k]["residual"] == pytest.approx(norm, rel=1e-5)


def test_gradient_fn_is_autograd_of_the_summed_loss(setting):
    """In float64, so that the two summation orders (per batch of 7 / all 32 rows) agree."""
    model = transformers.BertForSequenceClassification.from_pretrained(setting.start)
    model = model.double().eval()
    tensors = _task(0, seed=0)
    batches = list(load_data(str(setting.data[0]), batch_size=7))  # 32 rows: 4×7 + 4
    got = gm.gradient_fn(model, batches)({k: v.detach() for k, v in model.named_parameters()})
    logits = model(input_ids=tensors["input_ids"]).logits
    loss = torch.nn.functional.cross_entropy(logits, tensors["labels"], reduction="sum")
    names, params = zip(*model.named_parameters(), strict=True)
    expected = torch.autograd.grad(loss, params)
    for name, e in zip(names, expected, strict=True):
        torch.testing.assert_close(got[name], e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"steps": 0}, gm.ConfigError, "`steps` must be at least 1"),
        ({"steps": 1.5}, gm.ConfigError, "`steps` must be an integer"),
        ({"models": [{"model": "ft0", "data": "nowhere.safetensors"}]}, gm.MissingInputError,
         "nowhere.safetensors"),
        ({"models": [{"model": "ft0"}]}, gm.ConfigError, "needs `data`"),
        ({"prior": {"delta": 0.0}}, gm.ConfigError, "prior is zero"),
        ({"structure": "kfac", "fisher": "hessian"}, gm.ConfigError, "needs `structure: full`"),
        ({"step": 2}, gm.ConfigError, "did you mean 'steps'"),
        ({"max_backtracking": 0}, gm.ConfigError, "`max_backtracking` must be at least 1"),
        ({"max_backtracking": 2.5}, gm.ConfigError, "`max_backtracking` must be an integer"),
    ],
)  # fmt: skip
def test_bad_configurations_are_refused(setting, changes, error, message):
    with pytest.raises(error, match=message):
        RefineConfig.from_yaml(_config(setting, "bad.yaml", **changes))


def test_a_model_of_another_architecture_is_refused_and_nothing_written(setting, tmp_path):
    _bert(3, hidden=4).save_pretrained(setting.root / "other")
    config = _config(
        setting, "other.yaml", models=[{"model": "other", "data": setting.data[0].name}]
    )
    out = tmp_path / "refined"
    with pytest.raises(gm.StructureError, match=r"models\[0\]\.model"):
        run_refine(RefineConfig.from_yaml(config), out)
    assert not out.exists()
    assert main(["refine", str(config), str(out)]) == 1
    assert not out.exists()


def test_outputs_that_would_overwrite_an_input_or_exist_are_refused(setting, tmp_path, capsys):
    config = RefineConfig.from_yaml(_config(setting))
    for out, relation in ((setting.start, "is start"), (setting.root, "contains CONFIG")):
        with pytest.raises(gm.OutputOverlapError, match=f"OUT_DIR {out} {relation}"):
            run_refine(config, out, overwrite=True)
    with pytest.raises(gm.OutputOverlapError, match=r"lies inside models\[1\]\.model"):
        run_refine(config, setting.models[1] / "out", overwrite=True)
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(gm.OutputExistsError):
        run_refine(config, existing)
    with pytest.raises(SystemExit) as info:
        main(["refine", str(_config(setting)), str(setting.start), "--overwrite"])
    assert info.value.code == 2 and f"OUT_DIR {setting.start} is start" in capsys.readouterr().err
    assert (setting.start / "model.safetensors").is_file()


def test_text_data_is_tokenised_with_the_start_folders_tokenizer(tmp_path):
    """JSONL DATA, as `gradmerge curvature` takes it: one refinement step lowers ‖R‖."""
    from proofs_tests.text_models import LABELS, WORDS, bert_classifier

    base = bert_classifier(tmp_path / "base")
    model = transformers.BertForSequenceClassification.from_pretrained(base)
    theta_llm = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    models = []
    for t in range(2):
        folder = bert_classifier(tmp_path / f"ft{t}")  # same weights and tokenizer as base
        ft = transformers.BertForSequenceClassification.from_pretrained(folder)
        with torch.no_grad():
            for p in ft.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        ft.save_pretrained(folder)
        models.append({k: v.detach() for k, v in ft.named_parameters()})
        lines = [
            json.dumps(
                {"text": f"{WORDS[i % 26]} {WORDS[(3 * i + t) % 26]}", "label": LABELS[i % 3]}
            )
            for i in range(12)
        ]
        (tmp_path / f"task{t}.jsonl").write_text("\n".join(lines) + "\n")
    start = bert_classifier(tmp_path / "start")
    merged = gm.task_arithmetic(theta_llm, models, alphas=0.5)
    with torch.no_grad():
        for k, v in model.named_parameters():
            v.copy_(merged[k])
    model.save_pretrained(start)
    config = {
        "start": "start",
        "base_model": "base",
        "models": [{"model": f"ft{t}", "data": f"task{t}.jsonl"} for t in range(2)],
        "prior": {"delta": 1.0},
        "steps": 1,
        "structure": "diag",
        "device": "cpu",
        "text": {"max_length": 8},
    }
    (tmp_path / "refine.yaml").write_text(yaml.safe_dump(config))
    report = run_refine(RefineConfig.from_yaml(tmp_path / "refine.yaml"), tmp_path / "out")
    assert report.steps[1]["residual"] < report.steps[0]["residual"]
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    record = json.loads((tmp_path / "out" / RECORD).read_text())
    assert record["config"]["text"]["max_length"] == 8


def test_the_record_counts_the_passes_gm_refine_makes(setting, tmp_path):
    """``passes`` in the record: the gradient and curvature evaluations per task equal those of
    ``gm.refine`` called in memory with counting wrappers (steps), plus θ_t's gradient and the
    gradient at each of the K + 1 iterates (record: the mismatch's, which ‖R‖ reuses); one
    curvature per step."""
    out = tmp_path / "refined"
    run_refine(RefineConfig.from_yaml(_config(setting)), out)
    passes = json.loads((out / RECORD).read_text())["passes"]
    model = transformers.BertForSequenceClassification.from_pretrained(setting.start).eval()
    theta0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    base_model = transformers.BertForSequenceClassification.from_pretrained(setting.base)
    base = {k: v.detach() for k, v in base_model.named_parameters()}
    batches = [list(load_data(str(d), batch_size=10)) for d in setting.data]
    calls = {"gradient": [0, 0], "curvature": [0, 0]}

    def gradient(t, b):
        fn = gm.gradient_fn(model, b)

        def counted(theta):
            calls["gradient"][t] += 1
            return fn(theta)

        return counted

    def curvature(t, b):
        def at(theta):
            calls["curvature"][t] += 1
            with torch.no_grad():
                for k, v in theta.items():
                    model.get_parameter(k).copy_(v)
            return gm.estimate_curvature(model, b, structure="full", fisher="ggn")

        return at

    gm.refine(
        theta0,
        base,
        [gradient(t, b) for t, b in enumerate(batches)],
        [curvature(t, b) for t, b in enumerate(batches)],
        prior=DELTA,
        steps=STEPS,
    )
    assert passes["examples"] == [32, 32]
    assert passes["gradient evaluations, steps"] == calls["gradient"]
    assert passes["curvature evaluations"] == calls["curvature"] == [STEPS, STEPS]
    assert passes["gradient evaluations, record"] == [1 + (STEPS + 1)] * 2


def test_max_backtracking_is_read_passed_to_gm_refine_and_recorded(setting, tmp_path):
    """The YAML key bounds each step's trials: with 1, a step costs at most one gradient
    evaluation per task (``gradient evaluations, steps`` ≤ 1 + STEPS), and the record's config
    carries the key; its default is gm.refine's."""
    assert RefineConfig.from_yaml(_config(setting)).max_backtracking == 30
    config = RefineConfig.from_yaml(_config(setting, "one.yaml", max_backtracking=1))
    assert config.max_backtracking == 1
    out = tmp_path / "refined"
    run_refine(config, out)
    record = json.loads((out / RECORD).read_text())
    assert record["config"]["max_backtracking"] == 1
    assert all(n <= 1 + STEPS for n in record["passes"]["gradient evaluations, steps"])
