"""`gradmerge gradient MODEL DATA OUT`: the SUM of per-example gradients, against brute force.

References: a loop of per-example autograd gradients summed (tensor file, an MLP entry point), and
Hugging Face's own loss (mean cross-entropy × N, backward) on a tiny float64 BERT for text. The file
then drives a Koh & Liang removal, equal to gm.influence_remove in memory.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import transformers
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge import cli
from proofs_tests.text_models import LABELS, bert_classifier

ENTRY = textwrap.dedent(
    """
    import torch

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(),
                                   torch.nn.Linear(5, 3)).double()
    """
)


def _gradient(*argv):
    assert cli.main(["gradient", *map(str, argv), "--no-progress"]) == 0
    with safe_open(str(argv[2]), framework="pt") as f:
        meta = f.metadata()
    return load_file(str(argv[2])), meta


def test_the_sum_of_per_example_gradients_of_a_tensor_file(tmp_path):
    (tmp_path / "m.py").write_text(ENTRY)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (7,), generator=g)
    torch.save({"inputs": x, "targets": y}, tmp_path / "d.pt")
    ours, meta = _gradient(
        f"{tmp_path / 'm.py'}:mlp", tmp_path / "d.pt", tmp_path / "g.safetensors", "--batch-size", 3
    )
    namespace: dict = {}
    exec(ENTRY, namespace)
    model = namespace["mlp"]()
    expected = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    for i in range(7):  # brute force: one example at a time
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for k, p in model.named_parameters():
            expected[k] += p.grad
    assert sorted(ours) == sorted(expected)
    for k, v in expected.items():
        torch.testing.assert_close(ours[k], v, rtol=1e-12, atol=1e-14)
    assert meta["reduction"] == "sum" and meta["num_examples"] == "7"
    assert meta["format"] == "gradmerge-gradient/1"


def test_text_data_gives_hugging_faces_summed_loss_gradient(tmp_path):
    folder = bert_classifier(tmp_path / "bert")
    rows = [
        {"text": "the movie was very good", "label": "positive"},
        {"text": "a dull film", "label": "negative"},
        {"text": "the cat sat on the mat", "label": 1},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ours, meta = _gradient(folder, tmp_path / "d.jsonl", tmp_path / "g.safetensors")
    model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tok([r["text"] for r in rows], padding=True, return_tensors="pt")
    labels = torch.tensor([2, 0, 1])
    (model(**enc, labels=labels).loss * len(rows)).backward()  # HF's loss is the mean
    for k, p in model.named_parameters():
        torch.testing.assert_close(ours[k], p.grad, rtol=1e-10, atol=1e-13, msg=k)
    assert meta["num_examples"] == "3" and meta["source.examples"] == "3"
    assert LABELS[2] == "positive"


def test_the_gradient_file_drives_koh_and_liang(tmp_path):
    (tmp_path / "m.py").write_text(ENTRY)
    namespace: dict = {}
    exec(ENTRY, namespace)
    model = namespace["mlp"]()
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    save_file(base, tmp_path / "base.safetensors")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64)
    torch.save({"inputs": x, "targets": torch.tensor([0, 1, 2, 0, 1, 2])}, tmp_path / "d.pt")
    grad, _ = _gradient(f"{tmp_path / 'm.py'}:mlp", tmp_path / "d.pt", tmp_path / "g.safetensors")
    rest = gm.Diagonal({k: torch.full_like(v, 2.0) for k, v in base.items()})
    rest.save(tmp_path / "rest.curvature.safetensors")
    config = {
        "method": "influence_remove",
        "base_model": "base.safetensors",
        "gradient": "g.safetensors",
        "remaining": {"delta": 0.5, "curvature": "rest.curvature.safetensors"},
        "compute_dtype": "float64",
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(config))
    assert (
        cli.main(["remove", str(tmp_path / "r.yaml"), str(tmp_path / "out"), "--no-progress"]) == 0
    )
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    expected = gm.influence_remove(base, grad, remaining=rest + 0.5, alpha=1.0)
    for k, v in expected.items():
        torch.testing.assert_close(ours[k], v, rtol=1e-14, atol=1e-15)


def test_a_nan_gradient_is_an_error_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "m.py").write_text(ENTRY)
    x = torch.full((2, 3), float("nan"), dtype=torch.float64)
    torch.save({"inputs": x, "targets": torch.tensor([0, 1])}, tmp_path / "d.pt")
    code = cli.main(
        ["gradient", f"{tmp_path / 'm.py'}:mlp", str(tmp_path / "d.pt"), str(tmp_path / "g.st")]
    )
    assert code == 1
    assert "NaN" in capsys.readouterr().err
    assert not (tmp_path / "g.st").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--text-field", "x"], "--text-field apply to text DATA"),
        (["--max-examples", "0"], "--max-examples must be at least 1"),
    ],
)
def test_flags_are_checked_as_for_curvature(tmp_path, capsys, flags, message):
    (tmp_path / "m.py").write_text(ENTRY)
    torch.save({"inputs": torch.zeros(2, 3), "targets": torch.zeros(2)}, tmp_path / "d.pt")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["gradient", f"{tmp_path}/m.py:mlp", str(tmp_path / "d.pt"), "o.st", *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
