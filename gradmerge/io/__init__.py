"""Reading and writing: checkpoints, LoRA adapters, the official curvature format, models and data.

- :func:`open_checkpoint` — a ``.safetensors`` file, a shard folder with its index, or a Hugging
  Face model folder, read tensor by tensor (:mod:`~gradmerge.io.reader`);
- :class:`ShardedWriter`, :func:`staged_output` — sharded safetensors written atomically into a
  staging folder that appears under its name only when complete (:mod:`~gradmerge.io.writer`);
- :mod:`~gradmerge.io.lora` — PEFT LoRA adapters, applied to a state dict or read as lazily
  merged checkpoints θ_0 + (α/r)·B·A;
- :mod:`~gradmerge.io.official` — the paper's official Fisher files converted to curvature files;
- :mod:`~gradmerge.io.sources` — the MODEL and DATA arguments of the commands, from its parts:
  :mod:`~gradmerge.io.models` (Hugging Face folders, adapters), :mod:`~gradmerge.io.data` (tensor
  files, bounded entry points), :mod:`~gradmerge.io.entry_points` (``module:function``) and
  :mod:`~gradmerge.io.text_data` (JSONL/CSV/TXT text, tokenised);
- :mod:`~gradmerge.io.fingerprint` — fingerprints of a checkpoint's weight values;
- :mod:`~gradmerge.io.forms` — the forms of MODEL and DATA, for the commands' help.

The names above load on first access, so that the command line's help imports no torch.

This layer imports no job (:mod:`gradmerge.jobs`) and no estimator (:mod:`gradmerge.estimate`).

Example:
    >>> from gradmerge.io import open_checkpoint                     # doctest: +SKIP
    >>> ckpt = open_checkpoint("model.safetensors")                   # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradmerge.foundation.lazy import lazy_names

if TYPE_CHECKING:  # loaded on first access (PEP 562), so that gradmerge.io.forms needs no torch
    from gradmerge.io.reader import Checkpoint, open_checkpoint
    from gradmerge.io.writer import ShardedWriter, staged_output

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "open_checkpoint": "gradmerge.io.reader",
        "Checkpoint": "gradmerge.io.reader",
        "ShardedWriter": "gradmerge.io.writer",
        "staged_output": "gradmerge.io.writer",
    },
)

__all__ = ["open_checkpoint", "Checkpoint", "ShardedWriter", "staged_output"]
