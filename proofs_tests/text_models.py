"""Tiny Hugging Face model folders with their own tokenizers, built offline (no download).

A word-level tokenizer over a fixed vocabulary (``tokenizers``), saved with the model by
``save_pretrained`` so that ``AutoTokenizer.from_pretrained(folder)`` finds it, as in a real model
folder. Weights are random (seeded) and float64, so that estimates compare to round-off.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "ran",
    "fast",
    "slow",
    "big",
    "small",
    "red",
    "blue",
    "good",
    "bad",
    "movie",
    "film",
    "was",
    "is",
    "not",
    "very",
    "fun",
    "dull",
    "plot",
    "actor",
]
LABELS = ("negative", "neutral", "positive")


def _fast(vocab: dict[str, int], unk: str, **special: str) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if "cls_token" in special:
        cls, sep = vocab[special["cls_token"]], vocab[special["sep_token"]]
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk, **special)


def bert_classifier(folder: Path, *, positions: int = 24, seed: int = 0) -> Path:
    """A 1-layer BERT sequence classifier (3 labels, named in label2id) with its tokenizer."""
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    tokenizer = _fast(
        vocab, "[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"
    )
    config = transformers.BertConfig(
        vocab_size=len(vocab),
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=12,
        max_position_embeddings=positions,
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={name: i for i, name in enumerate(LABELS)},
        pad_token_id=0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(seed)
    transformers.BertForSequenceClassification(config).double().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def gpt2_lm(folder: Path, *, positions: int = 16, seed: int = 0) -> Path:
    """A 1-layer GPT-2 language model with its tokenizer (no pad token, as GPT-2's own)."""
    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "<unk>", *WORDS])}
    tokenizer = _fast(vocab, "<unk>", eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    config = transformers.GPT2Config(
        vocab_size=len(vocab),
        n_embd=8,
        n_layer=1,
        n_head=2,
        n_positions=positions,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(config).double().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def lora_adapter(model, folder: Path, seed: int, *, base: Path | None = None, **options):
    """A peft LoRA adapter of ``model`` (``peft.LoraConfig(**options)``) whose LoRA and
    ``modules_to_save`` tensors are random (seeded, scale 0.1: B ≠ 0, so the adapter changes its
    targets), saved to ``folder``; with ``base``, its config names that folder as the base. Returns
    the peft model (``.merge_and_unload()`` is the reference every adapter path is checked with)."""
    import peft

    wrapped = peft.get_peft_model(model, peft.LoraConfig(**options))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    wrapped.save_pretrained(folder)
    if base is not None:
        config = json.loads((folder / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str(base)
        (folder / "adapter_config.json").write_text(json.dumps(config))
    return wrapped
