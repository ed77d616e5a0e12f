"""PEFT LoRA adapter folders as fine-tuned models, against peft's own merge_and_unload.

Oracle: ``peft``'s ``merge_and_unload()`` on the same adapter (tiny float64 BERT classifier with
LoRA on its attention and dense layers and a saved classification head; tiny GPT-2 with LoRA on
its Conv1D ``c_attn``, ``fan_in_fan_out``, rsLoRA and a per-module rank). Then `gradmerge merge`,
`remove` and `curvature` with adapter folders equal the same commands on the merged full folders.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.errors import FileFormatError, StructureError
from gradmerge.io import open_checkpoint
from gradmerge.io.lora import LoraCheckpoint
from proofs_tests.io.test_official_curvature import _Payload
from proofs_tests.text_models import bert_classifier, gpt2_lm
from proofs_tests.text_models import lora_adapter as _adapter

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = bert_classifier(root / "base")
    adapters, merged = [], []
    for t in range(2):
        model = transformers.BertForSequenceClassification.from_pretrained(base)
        wrapped = _adapter(
            model,
            root / f"ad{t}",
            10 + t,
            task_type="SEQ_CLS",
            r=2 + t,
            lora_alpha=4,
            target_modules=["query", "value", "dense"],
        )
        cfg = json.loads((root / f"ad{t}" / "adapter_config.json").read_text())
        cfg["base_model_name_or_path"] = str(base)
        (root / f"ad{t}" / "adapter_config.json").write_text(json.dumps(cfg))
        full = wrapped.merge_and_unload()
        full.save_pretrained(root / f"full{t}")
        adapters.append(root / f"ad{t}")
        merged.append(root / f"full{t}")
    return root, base, adapters, merged


def _assert_checkpoint_equals(adapter, base_folder, full_folder):
    with open_checkpoint(base_folder) as base, open_checkpoint(full_folder) as full:
        view = LoraCheckpoint(adapter, base)
        assert sorted(view.keys()) == sorted(full.keys())
        changed = 0
        for key in full:
            torch.testing.assert_close(
                view.get(key), full.get(key), rtol=1e-12, atol=1e-14, msg=key
            )
            changed += not torch.equal(full.get(key), base.get(key))
        assert changed >= len(view.updates) + len(view.saved)  # every update is checked


def test_bert_adapters_equal_peft_merge_and_unload(bert):
    _, base, adapters, merged = bert
    for adapter, full in zip(adapters, merged, strict=True):
        _assert_checkpoint_equals(adapter, base, full)


def test_gpt2_conv1d_rslora_and_rank_pattern_equal_peft(tmp_path):
    base = gpt2_lm(tmp_path / "base")
    model = transformers.GPT2LMHeadModel.from_pretrained(base)
    wrapped = _adapter(
        model,
        tmp_path / "ad",
        3,
        r=2,
        lora_alpha=3,
        target_modules=["c_attn", "c_fc"],
        fan_in_fan_out=True,
        use_rslora=True,
        rank_pattern={"c_fc": 3},
    )
    wrapped.merge_and_unload().save_pretrained(tmp_path / "full")
    _assert_checkpoint_equals(tmp_path / "ad", base, tmp_path / "full")


def _yaml(root, name, config):
    (root / name).write_text(yaml.safe_dump(config))
    return str(root / name)


@pytest.mark.parametrize("method", ["task_arithmetic", "gradient_matching"])
def test_merging_adapters_equals_merging_the_merged_models(bert, tmp_path, method):
    _, base, adapters, merged = bert
    gm.Diagonal(
        {
            k: torch.rand(v.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
            for k, v in load_file(str(base / "model.safetensors")).items()
            if v.is_floating_point()
        }
    ).save(tmp_path / "c.safetensors")
    outs = {}
    for kind, models in (("adapters", adapters), ("full", merged)):
        config = {
            "method": method,
            "base_model": str(base),
            "models": [{"model": str(m)} for m in models],
        }
        if method == "gradient_matching":
            config["models"] = [
                {"model": str(m), "curvature": str(tmp_path / "c.safetensors")} for m in models
            ]
            config["prior"] = {"delta": 0.1}
        path = _yaml(tmp_path, f"{kind}.yaml", config)
        assert cli.main(["merge", path, str(tmp_path / kind), "--no-progress"]) == 0
        outs[kind] = load_file(str(tmp_path / kind / "model.safetensors"))
    for key, value in outs["full"].items():
        torch.testing.assert_close(outs["adapters"][key], value, rtol=1e-12, atol=1e-14, msg=key)


def test_curvature_of_an_adapter_equals_that_of_the_merged_model(bert, tmp_path):
    _, base, adapters, merged = bert
    rows = [
        {"text": "the movie was very good", "label": "positive"},
        {"text": "a dull film", "label": "negative"},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for kind, model in (("adapter", adapters[0]), ("full", merged[0])):
        argv = [str(model), str(tmp_path / "d.jsonl"), str(tmp_path / f"{kind}.safetensors")]
        if kind == "full":
            argv += ["--tokenizer", str(base)]
        else:  # over the whole materialised model (the default is its adapted parameters)
            argv += ["--whole-model"]
        assert cli.main(["curvature", *argv, "--no-progress"]) == 0
    a, b = (load_file(str(tmp_path / f"{k}.safetensors")) for k in ("adapter", "full"))
    for key, value in b.items():
        torch.testing.assert_close(a[key], value, rtol=1e-10, atol=1e-14, msg=key)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "use_dora: true (DoRA) is not supported"),
        ({"bias": "all"}, "bias: 'all' (trained biases) is not supported"),
        ({"alpha_pattern": {"query": 8}}, "alpha_pattern (per-module alphas) is not supported"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
        ({"r": 0}, "`r` must be a positive number"),
    ],
)
def test_settings_it_cannot_express_are_refused(bert, tmp_path, change, message):
    _, base, adapters, _ = bert
    folder = tmp_path / "ad"
    folder.mkdir()
    cfg = {**json.loads((adapters[0] / "adapter_config.json").read_text()), **change}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    (folder / "adapter_model.safetensors").write_bytes(
        (adapters[0] / "adapter_model.safetensors").read_bytes()
    )
    with (
        open_checkpoint(base) as b,
        pytest.raises((StructureError, FileFormatError), match=re.escape(message)),
    ):
        LoraCheckpoint(folder, b)


def test_an_adapter_of_another_model_and_broken_files_are_refused(bert, tmp_path, capsys):
    _, base, adapters, _ = bert
    folder = tmp_path / "ad"
    folder.mkdir()
    (folder / "adapter_config.json").write_text((adapters[0] / "adapter_config.json").read_text())
    tensors = load_file(str(adapters[0] / "adapter_model.safetensors"))
    tensors["base_model.model.no.such.layer.lora_A.weight"] = torch.zeros(2, 8)
    tensors["base_model.model.no.such.layer.lora_B.weight"] = torch.zeros(8, 2)
    save_file(tensors, folder / "adapter_model.safetensors")
    with (
        open_checkpoint(base) as b,
        pytest.raises(StructureError, match=r"no\.such\.layer\.weight"),
    ):
        LoraCheckpoint(folder, b)
    (folder / "adapter_model.safetensors").unlink()
    with open_checkpoint(base) as b, pytest.raises(FileFormatError, match="no adapter_model"):
        LoraCheckpoint(folder, b)
    embedding = {
        "base_model.model.bert.embeddings.word_embeddings.lora_embedding_A": torch.ones(2, 3)
    }
    save_file(embedding, folder / "adapter_model.safetensors")
    with open_checkpoint(base) as b, pytest.raises(StructureError, match="LoRA embedding"):
        LoraCheckpoint(folder, b)


def test_a_pickled_adapter_is_read_with_weights_only(bert, tmp_path):
    _, base, adapters, _ = bert
    folder = tmp_path / "ad"
    folder.mkdir()
    (folder / "adapter_config.json").write_text((adapters[0] / "adapter_config.json").read_text())
    torch.save({"x": _Payload(str(tmp_path / "pwned"))}, folder / "adapter_model.bin")
    with open_checkpoint(base) as b, pytest.raises(FileFormatError, match="weights_only=True"):
        LoraCheckpoint(folder, b)
    assert not (tmp_path / "pwned").exists()
