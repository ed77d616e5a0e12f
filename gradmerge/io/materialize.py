r"""A LoRA adapter written out as the full model it stands for: ``gradmerge materialize``.

For a PEFT LoRA folder over a base model θ_0, the folder written holds every tensor of θ_t =
θ_0 + s·B·A (:mod:`gradmerge.io.lora`: each target weight W_0 + s·B·A in the base's dtype, the
product formed in at least float32; the ``modules_to_save`` tensors the adapter stores; every
other tensor the base's, bit for bit), in the base's dtypes and Hugging Face layout
(``model.safetensors`` or shards with an index), with the base's config and tokenizer files
(the adapter folder's own tokenizer files take their place where it has them) and a record,
``gradmerge_materialize.json``. Any tool that reads a model folder — transformers, mergekit's
TIES/DARE, an evaluation harness — reads it; it equals peft's ``merge_and_unload()`` saved with
``save_pretrained``.

The folder is built beside OUT and renamed into place only when complete
(:func:`gradmerge.foundation.guard.staged_folder`); OUT may not be, lie inside or contain the
adapter or its base (:func:`gradmerge.foundation.guard.check`).

Example:
    >>> import json, tempfile, torch
    >>> from pathlib import Path
    >>> from safetensors.torch import load_file, save_file
    >>> with tempfile.TemporaryDirectory() as d:
    ...     (Path(d) / "base").mkdir(); (Path(d) / "ad").mkdir()
    ...     save_file({"fc.weight": torch.zeros(2, 3), "fc.bias": torch.ones(2)},
    ...               f"{d}/base/model.safetensors")
    ...     _ = (Path(d) / "ad/adapter_config.json").write_text(json.dumps(
    ...         {"peft_type": "LORA", "r": 1, "lora_alpha": 2, "target_modules": ["fc"],
    ...          "base_model_name_or_path": "base"}))
    ...     save_file({"base_model.model.fc.lora_A.weight": torch.ones(1, 3),
    ...                "base_model.model.fc.lora_B.weight": torch.ones(2, 1)},
    ...               f"{d}/ad/adapter_model.safetensors")
    ...     report = materialize(Path(d) / "ad", Path(d) / "out")
    ...     print(load_file(f"{d}/out/model.safetensors"), report.changed)
    {'fc.bias': tensor([1., 1.]), 'fc.weight': tensor([[2., 2., 2.],
            [2., 2., 2.]])} 1
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from gradmerge._version import __version__
from gradmerge.foundation import guard
from gradmerge.foundation.guard import Input, Output
from gradmerge.io import fingerprint
from gradmerge.io.lora import LoraCheckpoint, adapter_base, check_adapter_base, is_adapter
from gradmerge.io.reader import open_checkpoint
from gradmerge.io.writer import DEFAULT_SHARD_SIZE as DEFAULT_SHARD_SIZE
from gradmerge.io.writer import ShardedWriter, remove_stale_stages, staged_output

RECORD = "gradmerge_materialize.json"


@dataclass(frozen=True)
class Materialized:
    """What :func:`materialize` wrote: the folder, its files, the tensors (``changed`` of them
    differ from the base's: the LoRA targets and ``modules_to_save``), their bytes, the time."""

    out_dir: Path
    files: tuple[Path, ...]
    tensors: int
    changed: int
    bytes_written: int
    seconds: float


def inputs(adapter: str | os.PathLike[str], base: str | os.PathLike[str] | None) -> list[Input]:
    """What materialising ``adapter`` reads (for the output guard): the adapter folder and its
    base (``base`` when given, else the one its config names)."""
    found = [Input("ADAPTER", Path(adapter))]
    found.append(Input("the base of LoRA adapter ADAPTER", adapter_base(Path(adapter), base)))
    return found


def materialize(
    adapter: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    base: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    max_shard_size: int = DEFAULT_SHARD_SIZE,
) -> Materialized:
    """Write the LoRA adapter ``adapter`` applied to its base as a full model folder ``out_dir``
    (module docstring).

    Args:
        adapter: a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``).
        out_dir: the folder to write; it must not exist unless ``overwrite``.
        base: the base model folder (default: the adapter's ``base_model_name_or_path``,
            :func:`gradmerge.io.lora.adapter_base`).
        overwrite: replace an existing ``out_dir`` (only once the new one is complete).
        max_shard_size: the largest shard in bytes (a larger tensor gets one of its own).

    Raises:
        ArgumentError: ``adapter`` is not an adapter folder; its base cannot be found.
        AdapterBaseError: an ambiguous relative base (name it with ``base``).
        OutputExistsError, OutputOverlapError, OutputWriteError: the output guard's refusals.
        StructureError, FileFormatError: an adapter that does not fit its base, or that
            gradmerge cannot express (:mod:`gradmerge.io.lora`).
    """
    from gradmerge.errors import ArgumentError

    start = time.perf_counter()
    folder = Path(adapter)
    if not is_adapter(folder):
        raise ArgumentError(
            f"ADAPTER {folder} is not a PEFT adapter folder (no adapter_config.json): a full "
            "model folder needs no materialising"
        )
    base_folder = adapter_base(folder, base)
    target = Path(out_dir)
    guard.check([Output("OUT", target, "folder")], inputs(folder, base), overwrite=overwrite)
    snapshot = guard.Snapshot.of(inputs(folder, base))
    remove_stale_stages(target.absolute())
    with open_checkpoint(base_folder) as theta0:
        check_adapter_base(folder, theta0, None if base is None else Path(base))
        theta = LoraCheckpoint(folder, theta0)
        keys = theta.keys()
        entries = [(k, theta.shape(k), theta.dtype(k)) for k in keys]
        with staged_output(target, overwrite=overwrite, role="OUT") as stage:
            writer = ShardedWriter(stage, entries, max_shard_size)
            try:
                for k in keys:
                    writer.write(k, theta.get(k))
                shards = writer.finish()
            finally:
                writer.abort()
            assets = _copy_assets(theta0.assets(), folder, stage)
            record = stage / RECORD
            facts = _record(folder, base_folder, theta, shards, start)
            record.write_text(json.dumps(facts, indent=2) + "\n")
            written = sum(p.stat().st_size for p in shards)
            names = [p.name for p in (*shards, *assets, record)]
            snapshot.check()  # an input rewritten while read: nothing is published
    return Materialized(
        out_dir=target,
        files=tuple(target / n for n in names),
        tensors=len(keys),
        changed=len(theta.changed),
        bytes_written=written,
        seconds=time.perf_counter() - start,
    )


def _copy_assets(base_assets: list[Path], adapter: Path, stage: Path) -> list[Path]:
    """The base's config and tokenizer files, the adapter's own tokenizer files instead where it
    has them (a tokenizer trained with new tokens is saved with the adapter)."""
    chosen = {p.name: p for p in base_assets}
    for name in list(chosen):
        if name != "config.json" and (adapter / name).is_file():
            chosen[name] = adapter / name
    copied = []
    for name, src in sorted(chosen.items()):
        shutil.copyfile(src, stage / name)
        copied.append(stage / name)
    return copied


def _record(
    folder: Path,
    base_folder: Path,
    theta: LoraCheckpoint,
    shards: list[Path],
    start: float,
) -> dict[str, object]:
    """The record: versions, the inputs (paths and content fingerprints), what was written."""
    return {
        "gradmerge_version": __version__,
        "torch_version": torch.__version__,
        "command": "materialize",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "inputs": {
            "adapter": {"path": str(folder.resolve()), "fingerprint_sha256": theta.fingerprint},
            "base_model": {
                "path": str(base_folder.resolve()),
                "fingerprint_sha256": fingerprint.content_hash(
                    theta.base.keys(), theta.base.shape, theta.base.dtype, theta.base.rows
                ),
                "fingerprint_of": fingerprint.CONTENT_HASH_OF,
            },
        },
        "rule": "W_0 + s·B·A for every LoRA target (s = lora_alpha / r, or / √r with rsLoRA; "
        "transposed for fan_in_fan_out), the adapter's tensors for modules_to_save, the base's "
        "elsewhere; in the base's dtypes",
        "output": {
            "files": [p.name for p in shards],
            "tensors": len(theta.keys()),
            "changed": sorted(theta.changed),
        },
        "seconds": round(time.perf_counter() - start, 3),
    }
