"""``--autocast``: scoring under torch.autocast against the same scores in the model's dtype.

Reference: the float32 evaluation of the same float32 model (and its logits computed by hand
under autocast). Under bfloat16 autocast each logit carries bfloat16's relative rounding
(2⁻⁸ ≈ 4e-3 of the activations feeding it), so per-example losses agree to that order and every
prediction whose two top logits are further apart than that agrees exactly.
"""

from __future__ import annotations

import json

import pytest
import torch

from gradmerge import cli
from gradmerge.errors import ArgumentError
from gradmerge.evaluation import evaluate


def _mlp_batches(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    data = [(torch.randn(32, 16, generator=gen), torch.randint(0, 3, (32,), generator=gen))
            for _ in range(4)]  # fmt: skip
    return model.eval(), data


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_scores_match_the_float32_scores_within_the_dtype_rounding(dtype):
    model, data = _mlp_batches()
    exact = evaluate(model, data)
    low = evaluate(model, data, autocast=dtype)
    eps = torch.finfo(dtype).eps
    assert low.examples == exact.examples == 128
    for a, b in zip(low.loss_per_example, exact.loss_per_example, strict=True):
        assert a == pytest.approx(b, abs=40 * eps, rel=40 * eps)
    # predictions agree wherever the float32 margin exceeds the rounding
    logits = torch.cat([model(x) for x, _ in data]).detach()
    top2 = logits.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 40 * eps * logits.abs().amax(dim=1)
    pa, pb = torch.tensor(low.predictions), torch.tensor(exact.predictions)
    assert clear.sum() > 64  # most of the 128 examples
    assert torch.equal(pa[clear], pb[clear])
    # and the logits really were computed in the low dtype: the losses are not bit-equal
    assert low.loss_per_example != exact.loss_per_example


def test_autocast_rejects_other_dtypes():
    model, data = _mlp_batches()
    with pytest.raises(ArgumentError, match=r"autocast: expected torch.bfloat16"):
        evaluate(model, data, autocast=torch.float64)


def test_the_evaluate_command_takes_autocast(tmp_path, capsys):
    from proofs_tests.text_models import bert_classifier

    folder = bert_classifier(tmp_path / "bert", seed=0)
    data = tmp_path / "d.jsonl"
    rows = [("the movie was very good", "positive"), ("a dull film", "negative")] * 4
    data.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    reports = {}
    for flag in ([], ["--autocast", "bfloat16"]):
        out = tmp_path / f"r{len(flag)}.json"
        code = cli.main(["evaluate", str(folder), str(data), "--out", str(out), "--no-progress",
                         "--per-example", *flag])  # fmt: skip
        assert code == 0
        reports[bool(flag)] = json.loads(out.read_text())["models"][0]
    assert reports[True]["examples"] == reports[False]["examples"] == 8
    assert reports[True]["mean_loss"] == pytest.approx(reports[False]["mean_loss"], rel=0.05)
    with pytest.raises(SystemExit):
        cli.main(["evaluate", str(folder), str(data), "--autocast", "float64"])
    assert "invalid choice" in capsys.readouterr().err


def _stored_in(folder, dtype, out):
    """The BERT ``folder``'s model stored in ``dtype`` (with its tokenizer) at ``out``."""
    import transformers

    model = transformers.BertForSequenceClassification.from_pretrained(folder)
    model.to(dtype).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return out


OTHER = [(torch.bfloat16, "float16"), (torch.float16, "bfloat16")]


@pytest.mark.parametrize(("stored", "flag"), OTHER, ids=["bfloat16-weights", "float16-weights"])
def test_autocast_in_the_other_16_bit_dtype_scores_the_upcast_model(tmp_path, capsys, stored,
                                                                    flag):  # fmt: skip
    """bfloat16 weights under float16 autocast (and the reverse) raised torch's 'mixed dtype'
    from a layer norm. The command upcasts the weights to float32 (exact) and says so; the
    scores are then those of autocast on that float32 model, and within the autocast dtype's
    rounding of the float32 model's own scores."""
    import transformers

    from gradmerge.errors import ArgumentError
    from proofs_tests.text_models import bert_classifier

    folder = _stored_in(bert_classifier(tmp_path / "bert", seed=0), stored, tmp_path / "low")
    data = tmp_path / "d.jsonl"
    rows = [("the movie was very good", "positive"), ("a dull film", "negative"),
            ("the cat sat on the mat", "neutral")] * 3  # fmt: skip
    data.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    out = tmp_path / "r.json"
    code = cli.main(["evaluate", str(folder), str(data), "--out", str(out), "--no-progress",
                     "--per-example", "--autocast", flag])  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err
    assert f"{str(stored)[6:]} weights under --autocast {flag}: upcast to float32" in err
    row = json.loads(out.read_text())["models"][0]
    # the reference: the float32 model, scored as evaluate scores it (same batches, same order)
    model = transformers.BertForSequenceClassification.from_pretrained(folder)
    assert next(model.parameters()).dtype == stored
    from gradmerge.io.sources import load_data

    batches, order = load_data(str(data), model=model, tokenizer=str(folder)).by_length()
    upcast = model.float().eval()
    exact = evaluate(upcast, batches).in_order(order)
    low = AUTOCAST_DTYPES[flag]
    under = evaluate(upcast, batches, autocast=low).in_order(order)
    assert row["per_example"]["loss"] == under.loss_per_example  # what the command computed
    eps = torch.finfo(low).eps
    for a, b in zip(row["per_example"]["loss"], exact.loss_per_example, strict=True):
        assert a == pytest.approx(b, abs=40 * eps, rel=40 * eps)
    # the library refuses the combination with one line naming what works
    model = model.to(stored)
    with pytest.raises(ArgumentError, match=r"autocast works on float32/float64 weights"):
        evaluate(model, batches, autocast=low)


AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
