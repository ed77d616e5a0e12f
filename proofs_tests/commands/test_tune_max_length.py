"""`gradmerge tune --max-length`: one value for every DATA, or one per task (the tasks trained at
one length, the base at another).

``--max-length 5,7,9`` with two DATA and ``--base-data`` cuts task a's DATA (and its
``--validation`` file) to 5 tokens, task b's to 7 and the base task's (``--base-data``,
``--base-validation``) to 9. Reference, without gradmerge's merge or evaluation code: each
setting's merged weights by hand (task arithmetic θ_0 + s Σ_t τ_t), loaded into Hugging Face's
model, and its cross-entropy one example at a time on the text as the tokenizer truncates it to
that task's length. Tiny random-weight float64 BERTs (proofs_tests/text_models.py).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

from gradmerge import cli
from proofs_tests.text_models import LABELS, bert_classifier

TEXTS = {  # long enough that 5, 7 and 9 tokens (with [CLS] and [SEP]) cut each one differently
    "a": [
        ("the movie was very good fun and the plot is not dull", "positive"),
        ("a dull film with a bad actor and a slow plot", "negative"),
    ],
    "b": [
        ("the big red dog ran fast on the mat", "positive"),
        ("the small blue cat sat on the mat and was slow", "neutral"),
    ],
    "base": [
        ("a good film is not a dull film and the plot was fun", "positive"),
        ("the cat is not on the mat the dog is", "negative"),
    ],
    "a.val": [("the film was not very good and the actor was bad", "negative")],
    "b.val": [("a red dog sat on a blue mat and ran", "neutral")],
    "base.val": [("the plot was very slow and not fun at all", "negative")],
}


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune-lengths")
    for seed, name in enumerate(("base", "a", "b")):
        bert_classifier(root / name, seed=seed)
        _spread(root / name, seed)
    for name, rows in TEXTS.items():
        (root / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows)
        )
    body = {
        "method": "task_arithmetic",
        "base_model": "base",
        "compute_dtype": "float64",  # θ_0 + 0·τ is θ_0 exactly
        "models": [{"model": "a"}, {"model": "b"}],
    }
    (root / "ta.yaml").write_text(yaml.safe_dump(body))
    return root


def _spread(folder, seed):
    """Weights drawn with std 0.5 (BERT's own 0.02 gives near-uniform logits, whose losses barely
    depend on where the text is cut)."""
    model = transformers.BertForSequenceClassification.from_pretrained(folder)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    model.save_pretrained(folder)


def _merged(root, scale):
    """θ_0 + s (τ_a + τ_b) in Hugging Face's model."""
    base = load_file(root / "base" / "model.safetensors")
    weights = dict(base)
    for name in ("a", "b"):
        ft = load_file(root / name / "model.safetensors")
        for k, v in base.items():
            if v.is_floating_point():
                weights[k] = weights[k] + scale * (ft[k] - v)
    model = transformers.BertForSequenceClassification.from_pretrained(root / "base").eval()
    model.load_state_dict(weights, strict=False)
    return model


def _mean_loss(model, root, rows, length):
    """HF's cross-entropy one example at a time, the text cut to ``length`` tokens."""
    tok = transformers.AutoTokenizer.from_pretrained(root / "base")
    losses = []
    with torch.no_grad():
        for text, label in rows:
            enc = tok(text, truncation=length is not None, max_length=length, return_tensors="pt")
            losses.append(float(model(**enc, labels=torch.tensor([LABELS.index(label)])).loss))
    return sum(losses) / len(losses)


def _tune(root, out, *flags):
    argv = ["tune", str(root / "ta.yaml"), str(root / "a.jsonl"), str(root / "b.jsonl")]
    argv += ["--scales", "0,1", "--out", str(out), "--no-progress", *flags]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a choice at the grid's edge warns
        assert cli.main(argv) == 0
    return json.loads(out.read_text())


def test_one_length_per_task_with_the_base_task_and_held_out_files(ws, tmp_path):
    held_out = ["--validation", ws / "a.val.jsonl", "--validation", ws / "b.val.jsonl"]
    flags = ["--base-data", ws / "base.jsonl", "--base-validation", ws / "base.val.jsonl"]
    report = _tune(ws, tmp_path / "t.json", "--max-length", "5,7,9", *map(str, held_out + flags))
    assert report["max_length"] == [5, 7, 9]  # recorded: each task's, the base task's last
    lengths = {"a": 5, "b": 7, "base": 9}
    for point, scale in zip(report["points"], (0.0, 1.0), strict=True):
        model = _merged(ws, scale)
        got = {
            "a": point["tasks"][0],
            "b": point["tasks"][1],
            "base": point["base"],
            "a.val": point["validation"][0],
            "b.val": point["validation"][1],
            "base.val": point["base_validation"],
        }
        for name, entry in got.items():
            length = lengths[name.removesuffix(".val")]
            want = _mean_loss(model, ws, TEXTS[name], length)
            assert entry["mean_loss"] == pytest.approx(want, rel=1e-9, abs=1e-12), name
            for other in {5, 7, 9, None} - {length}:  # the check tells the lengths apart
                assert abs(_mean_loss(model, ws, TEXTS[name], other) - want) > 1e-6, (name, other)


def test_one_length_for_every_data(ws, tmp_path):
    one = _tune(ws, tmp_path / "one.json", "--max-length", "7")
    each = _tune(ws, tmp_path / "each.json", "--max-length", "7,7")
    assert one["max_length"] == each["max_length"] == [7, 7]
    assert _tune(ws, tmp_path / "none.json")["max_length"] is None
    model = _merged(ws, 1.0)
    for t, name in enumerate(("a", "b")):
        want = _mean_loss(model, ws, TEXTS[name], 7)
        assert one["points"][1]["tasks"][t]["mean_loss"] == pytest.approx(want, rel=1e-9)
        assert (
            each["points"][1]["tasks"][t]["mean_loss"] == one["points"][1]["tasks"][t]["mean_loss"]
        )


COUNTS = [  # (--max-length, extra flags, the message)
    ("5,7,9", [], "--max-length gives 3 values for 2 DATA: give one for all, or 2 (one per DATA "
     "in order), e.g. --max-length 64,64"),
    ("5,7", ["--base-data", "base.jsonl"], "--max-length gives 2 values for 2 DATA and the base "
     "task: give one for all, or 3 (one per DATA in order, then the base task's)"),
    ("5,7", ["--base-validation", "base.val.jsonl"], "--max-length gives 2 values for 2 DATA and "
     "the base task"),
    ("5,0", [], "argument --max-length: expected a whole number >= 1 for every DATA, or one per "
     "DATA separated by commas (then the base task's), e.g. 64 or 64,64,128; got '5,0'"),
    ("5,", [], "argument --max-length: expected a whole number >= 1"),
    ("five", [], "argument --max-length: expected a whole number >= 1"),
]  # fmt: skip


@pytest.mark.parametrize(("lengths", "flags", "message"), COUNTS)
def test_lengths_that_do_not_fit_the_tasks_exit_2(ws, tmp_path, capsys, lengths, flags, message):
    flags = [str(ws / f) if f.endswith(".jsonl") else f for f in flags]
    argv = ["tune", str(ws / "ta.yaml"), str(ws / "a.jsonl"), str(ws / "b.jsonl"), "--scales", "1"]
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--max-length", lengths, *flags, "--out", str(tmp_path / "t.json")])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "t.json").exists()
