"""The process group of a ``torchrun`` job: its initialisation, each rank's device, rank 0's file.

Library helpers of the data-parallel commands (:mod:`gradmerge.commands.distributed`), usable from
any script that ``torchrun`` starts.

Example (under ``torchrun --nproc-per-node 2``)::

    device = rank_device("auto")              # cuda:LOCAL_RANK when CUDA is available
    created = init_from_env("auto", device, timeout=1800.0)
    curvature = gm.distributed.estimate_curvature(model, gm.distributed.shard(batches))
    save_on_rank0(curvature, "task.curvature.safetensors", timeout=1800.0)
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradmerge.distributed.comm import Comm
from gradmerge.distributed.errors import DistributedError
from gradmerge.foundation.devices import resolve_device


def rank_device(choice: str) -> torch.device:
    """This rank's device: the CPU for ``"cpu"`` (or ``"auto"`` without CUDA), else
    ``cuda:LOCAL_RANK`` (made the current CUDA device)."""
    if resolve_device(choice).type == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_from_env(backend: str, device: torch.device, timeout: float) -> bool:
    """Initialise the default process group from torchrun's environment; False if it was.

    ``backend`` ``"auto"`` is gloo on the CPU, else NCCL for CUDA tensors and gloo for the rest.

    Raises:
        DistributedError: RANK/WORLD_SIZE are not set (not started by torchrun).
    """
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise DistributedError(
            "RANK/WORLD_SIZE are not set: launch with torchrun, e.g. "
            "torchrun --nproc-per-node 2 -m gradmerge.commands.distributed curvature MODEL DATA OUT"
        )
    if backend == "auto":
        backend = "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout))
    return True


def save_on_rank0(curvature: Any, out: str, timeout: float) -> None:
    """Rank 0 writes ``out`` (atomically, ``curvature.save``); every rank learns whether it worked.

    Raises:
        DistributedError: on every rank, when rank 0 could not write.
    """
    failure = None
    if dist.get_rank() == 0:
        try:
            curvature.save(out)
        except Exception as err:
            failure = f"{type(err).__name__}: {err}"
    with Comm.open(None, timeout) as comm:
        failures = comm.exchange("finish writing", failure)
    if failures[0] is not None:
        raise DistributedError(f"rank 0 could not write {out}: {failures[0]}", {0: failures[0]})
