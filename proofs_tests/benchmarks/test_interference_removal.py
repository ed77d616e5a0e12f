"""benchmarks/interference_removal.py's pieces that need no study: the equal-compute baselines'
training loop (its pass count, and NegGrad+'s first step against autograd of its loss), and the
removal plot and table of a report (the quick run of test_interference.py runs the rows)."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks import interference as study
from benchmarks.interference_removal import train_steps
from benchmarks.paper_recipe import batches, pooled

transformers = pytest.importorskip("transformers")

LR = 1e-3


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).eval()


def _data(seed: int, n: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(1, 30, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
         .tolist(), i % 2)
        for i in range(n)
    ]  # fmt: skip


def test_the_baseline_spends_the_passes_it_is_given():
    rest = [_data(1, 20), _data(2, 12)]  # batches of 16: 16 + 4 and 12 texts per epoch
    assert train_steps(_bert(), rest, texts=1, lr=LR, batch_size=16, seed=0) in (4, 12, 16)
    spent = train_steps(_bert(), rest, texts=40, lr=LR, batch_size=16, seed=0)
    assert 40 <= spent < 40 + 16
    spent = train_steps(_bert(), rest, texts=40, lr=LR, batch_size=16, seed=0, forget=_data(3, 10))
    assert 40 <= spent < 40 + 2 * 16  # a NegGrad+ step spends a rest and a forget batch


def test_neggrad_plus_first_step_follows_the_gradient_of_its_loss():
    """AdamW's first step moves each weight by −lr·g/(|g| + ε) (bias-corrected moments): its sign
    is −sign(g), g = ∇[CE(rest batch) − CE(forget batch)], computed here by autograd."""
    rest, forget = [_data(1, 16)], _data(3, 16)
    model = _bert()
    ref = copy.deepcopy(model)
    train_steps(model, rest, texts=16, lr=LR, batch_size=16, seed=0, forget=forget)
    (b,) = list(batches(rest[0], 16, 0))  # the one batch each draws (seed·1000 + epoch 0)
    (f,) = list(batches(forget, 16, 500))
    loss = 0.0
    for batch, sign in ((b, 1.0), (f, -1.0)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = ref.classifier(pooled(ref, batch))
        loss = loss + sign * torch.nn.functional.cross_entropy(logits.float(), batch["labels"])
    loss.backward()
    moved = checked = 0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if q.grad is None:
            continue
        big = q.grad.abs() > 1e-4
        step = (p - q).detach()
        assert torch.all(torch.sign(step[big]) == -torch.sign(q.grad[big])), name
        torch.testing.assert_close(step[big].abs(), torch.full_like(step[big], LR), rtol=1e-2,
                                   atol=1e-6)  # fmt: skip
        moved += int(big.sum())
        checked += 1
    assert checked and moved > 100


def _report():
    def row(name, removed, rest, frac):
        return {"method": name, "correct": {"dutch": "1", "snippets": "1"},
                "removed-set accuracy": removed, "remaining mean accuracy": rest,
                "cost": {"fraction of retraining": frac}}  # fmt: skip

    rows = [row("gold: retrained without", 0.6, 0.8, 1.0), row("from M | x", 0.7, 0.79, 0.3)]
    return {
        "summary": [],
        "removal": [{"removed": "dutch", "rows": rows, "negation chosen": "n | negation α=1"}],
        "removal comparisons": [
            {
                "method": "from M | x",
                "removed: model − gold": {"difference": 0.1, "ci95": [0.05, 0.15]},
                "mean KL(gold ‖ model), per seed": [0.2],
                "KL on the removed set, mean over seeds": 0.5,
                "KL on the remaining sets, mean over seeds": 0.125,
            },
        ],
    }


def test_a_removal_only_report_has_its_plot_and_table_with_costs(tmp_path):
    report = _report()
    study.plot(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 10_000
    text = study.markdown(report)
    assert "| from M · x | +10.0 [+5.0, +15.0] | — | 0.50 · 0.12 | 0.30 |" in text


def test_removal_comparisons_split_the_kl_into_the_removed_set_and_the_rest():
    """KL(gold ‖ model) of each row, per dataset from the scores' losses, then its mean on the
    removed set and over the remaining sets, mean over seeds: against kl_binary by hand."""
    import math

    gold = {"dutch": {"loss": [math.log(2)] * 2, "correct": "11"},
            "snippets": {"loss": [math.log(2)] * 2, "correct": "11"}}  # fmt: skip
    model = {"dutch": {"loss": [-math.log(0.9)] * 2, "correct": "11"},
             "snippets": {"loss": [math.log(2)] * 2, "correct": "11"}}  # fmt: skip
    for s in (gold, model):
        for d in s.values():
            d |= {"accuracy": 1.0, "n": 2}
    rows = [study.removal_row("gold: retrained without", gold, gold, "dutch"),
            study.removal_row("from M | x", model, gold, "dutch")]  # fmt: skip
    seeds = [{"removal": {"removed": "dutch", "rows": rows}}] * 2
    (entry,) = study.removal_comparisons(seeds, resamples=10)
    kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert entry["KL on the removed set, mean over seeds"] == pytest.approx(kl)
    assert entry["KL on the remaining sets, mean over seeds"] == pytest.approx(0.0, abs=1e-12)


def test_gradient_norm_is_the_norm_over_every_tensor_of_the_file(tmp_path):
    from safetensors.torch import save_file

    from benchmarks.interference_removal import gradient_norm

    save_file({"a": torch.tensor([3.0, 0.0]), "b.weight": torch.tensor([[4.0], [12.0]])},
              str(tmp_path / "g.safetensors"))  # fmt: skip
    assert gradient_norm(tmp_path / "g.safetensors") == pytest.approx(13.0)


def test_the_second_baseline_budget_is_capped_at_retraining():
    """The costliest removal's passes (11,020 in the study, 123% of retraining's 8,960) are
    capped at retraining's, the label saying so; below retraining the label and name are kept
    (the run in progress caches rows by name); --quick has the 10% budget only."""
    from benchmarks.interference_removal import COSTLIEST, baseline_budgets

    capped = baseline_budgets(8960, 11020)
    assert capped == {
        "10% of retraining": 896,
        f"retraining's: {COSTLIEST} 11020, capped": 8960,
    }
    assert max(capped.values()) <= 8960
    assert baseline_budgets(8960, 4000) == {"10% of retraining": 896, COSTLIEST: 4000}
    assert baseline_budgets(8960, 11020, quick=True) == {"10% of retraining": 896}
    assert baseline_budgets(None, 11020) == {COSTLIEST: 11020}  # no retraining cost: no cap


def test_gradient_evaluations_per_step_come_from_the_refine_record():
    """``gradient evaluations, steps`` counts R at θ^0 once and each step's line-search trials:
    2 steps of 12 and 13 trials record 26 (the study's 2 steps); per step 12.5."""
    from benchmarks.interference_removal import evaluations_per_step

    record = {
        "steps": [{"step": 0}, {"step": 1}, {"step": 2}],
        "passes": {"gradient evaluations, steps": [26], "examples": [310]},
    }
    assert evaluations_per_step(record) == [12.5]
    record["steps"] = [{"step": 0}]
    assert evaluations_per_step(record) == []
