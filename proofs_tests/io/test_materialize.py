"""``gradmerge materialize ADAPTER OUT`` against peft's ``merge_and_unload()``.

Oracle: peft (a test dependency) merges the same adapter into its base and saves it with
``save_pretrained``; the folder gradmerge writes holds the same tensors (names, dtypes, values to
float64 round-off; every tensor the adapter does not change bit for bit), loads in transformers
as the same model (same logits), and the command refuses to write over or into its inputs.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from gradmerge import cli
from gradmerge.io.materialize import RECORD, materialize
from proofs_tests.text_models import bert_classifier, gpt2_lm, lora_adapter

peft = pytest.importorskip("peft")


def _adapter(model, folder, seed, base, **options):
    """A random adapter of ``model`` saved to ``folder`` over ``base``; peft's merged model."""
    return lora_adapter(model, folder, seed, base=base, **options).merge_and_unload()


def _shards(folder):
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_materialize_equals_peft_merge_and_unload(tmp_path, kind):
    if kind == "bert":
        base = bert_classifier(tmp_path / "base")
        model = transformers.BertForSequenceClassification.from_pretrained(base)
        options = {
            "task_type": "SEQ_CLS",
            "r": 2,
            "lora_alpha": 4,
            "target_modules": ["query", "value"],
        }
    else:  # Conv1D (fan_in_fan_out), rsLoRA, a per-module rank
        base = gpt2_lm(tmp_path / "base")
        model = transformers.GPT2LMHeadModel.from_pretrained(base)
        options = {
            "r": 2,
            "lora_alpha": 3,
            "target_modules": ["c_attn", "c_fc"],
            "fan_in_fan_out": True,
            "use_rslora": True,
            "rank_pattern": {"c_fc": 3},
        }
    merged = _adapter(model, tmp_path / "ad", 4, base, **options)
    merged.save_pretrained(tmp_path / "peft")
    argv = ["materialize", str(tmp_path / "ad"), str(tmp_path / "out"), "--max-shard-size", "4kB"]
    assert cli.main(argv) == 0
    ours, theirs = _shards(tmp_path / "out"), _shards(tmp_path / "peft")
    theta0 = _shards(base)
    assert sorted(ours) == sorted(theta0)
    record = json.loads((tmp_path / "out" / RECORD).read_text())
    changed = set(record["output"]["changed"])
    assert changed and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    for key, value in ours.items():
        assert value.dtype == theta0[key].dtype, key
        if key in theirs:  # peft ties GPT-2's lm_head to wte and saves it once
            torch.testing.assert_close(value, theirs[key], rtol=1e-13, atol=1e-15, msg=key)
        if key not in changed:
            assert torch.equal(value, theta0[key]), key
        else:
            assert not torch.equal(value, theta0[key]), key
    # the folder is a model transformers loads (config and tokenizer copied): the same logits
    cls = type(merged)
    loaded = cls.from_pretrained(tmp_path / "out").eval()
    tokens = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")(
        "the cat sat", return_tensors="pt"
    )
    tokens.pop("token_type_ids", None) if kind == "gpt2" else None
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(**tokens).logits, merged.eval()(**tokens).logits, rtol=1e-12, atol=1e-12
        )


def test_materialize_refuses_to_overwrite_its_inputs_and_existing_folders(tmp_path, capsys):
    base = bert_classifier(tmp_path / "base")
    model = transformers.BertForSequenceClassification.from_pretrained(base)
    _adapter(model, tmp_path / "ad", 1, base, r=2, lora_alpha=4, target_modules=["query"])
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for out, message in (
        (tmp_path / "ad", "OUT .* is ADAPTER"),
        (tmp_path / "base", "OUT .* is the base of LoRA adapter ADAPTER"),
        (tmp_path / "ad" / "full", "OUT .* lies inside ADAPTER"),
        (tmp_path, "OUT .* contains ADAPTER"),
    ):
        for extra in ([], ["--overwrite"]):
            with pytest.raises(SystemExit) as exit_:
                cli.main(["materialize", str(tmp_path / "ad"), str(out), *extra])
            assert exit_.value.code == 2
            err = capsys.readouterr().err
            assert __import__("re").search(message, err), err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    (tmp_path / "exists").mkdir()
    with pytest.raises(SystemExit):
        cli.main(["materialize", str(tmp_path / "ad"), str(tmp_path / "exists")])
    assert "exists" in capsys.readouterr().err and not any((tmp_path / "exists").iterdir())
    done = materialize(tmp_path / "ad", tmp_path / "exists", overwrite=True)
    assert done.changed == 1 and (tmp_path / "exists" / "config.json").is_file()
    with pytest.raises(SystemExit) as exit_:  # a full model folder needs no materialising
        cli.main(["materialize", str(base), str(tmp_path / "x")])
    assert exit_.value.code == 2 and "not a PEFT adapter folder" in capsys.readouterr().err
