"""Collectives with a time limit: the control plane and the reductions of a distributed estimate.

Two kinds of traffic:

- small Python objects (options, fingerprints, each rank's status) are exchanged with
  :meth:`Comm.exchange`: a ``monitored_barrier`` with the stated ``timeout`` followed by an
  ``all_gather_object``, on a gloo group (the given group if it is gloo, else a gloo group over the
  same ranks, created for this computation and destroyed after it). Every rank gets every rank's
  object, so every rank takes the same decision. A rank that crashed is noticed at once (its
  connection closes); one that hangs, after ``timeout``; either way every waiting rank raises
  :class:`DistributedError`, never hangs longer than ``timeout``.
- tensors are summed with ``all_reduce`` (:meth:`Comm.all_reduce`), packed into flat buckets of one
  dtype and device: CPU tensors on the gloo group, accelerator tensors on the given group (NCCL).
  The sums are in the tensors' own dtype (the estimators' accumulation dtype: float64 for float64
  models, float32 otherwise).

Example (one rank):
    >>> import torch, torch.distributed as dist
    >>> from gradmerge.distributed.comm import Comm
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> with Comm.open(None, timeout=60.0) as comm:
    ...     t = torch.ones(3)
    ...     comm.all_reduce([t])
    ...     comm.exchange("say hello", f"hello from rank {comm.rank}"), t
    (['hello from rank 0'], tensor([1., 1., 1.]))
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradmerge.distributed.errors import DistributedError
from gradmerge.errors import ArgumentError

BUCKET_BYTES = 64 << 20
"""Largest flat buffer ``all_reduce`` packs small tensors into (larger tensors go alone)."""


class Comm:
    """This rank's view of a process group, with a control-plane gloo group and a timeout."""

    def __init__(self, group: Any, control: Any, timeout: timedelta, owns_control: bool) -> None:
        self.group, self.control, self.timeout = group, control, timeout
        self._owns_control = owns_control
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    @classmethod
    @contextmanager
    def open(cls, group: Any, timeout: float | timedelta) -> Iterator[Comm]:
        """A :class:`Comm` over ``group`` (None: the default group), closed on exit.

        Raises:
            ArgumentError: torch.distributed is unavailable or not initialised; a bad timeout.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise ArgumentError(
                "torch.distributed is not initialised: launch with torchrun and call "
                "torch.distributed.init_process_group() first (or use gm.estimate_curvature "
                "for a single process)"
            )
        span = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        if span.total_seconds() <= 0:
            raise ArgumentError(f"timeout must be positive, got {timeout!r}")
        if dist.get_rank(group) < 0:
            raise ArgumentError("this process is not a member of the given process group")
        owns = dist.get_backend(group) != "gloo"
        control = group
        if owns:  # NCCL and mixed backends have no monitored_barrier: a gloo group beside them
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            control = dist.new_group(
                ranks, timeout=span, backend="gloo", use_local_synchronization=True
            )
        comm = cls(group, control, span, owns)
        try:
            yield comm
        finally:
            if owns:
                dist.destroy_process_group(control)

    def exchange(self, phase: str, payload: Any) -> list[Any]:
        """Every rank's ``payload``, in rank order, or :class:`DistributedError` within ``timeout``.

        ``phase`` says what the ranks are about to do (for the error message).
        """
        try:
            dist.monitored_barrier(group=self.control, timeout=self.timeout, wait_all_ranks=True)
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, payload, group=self.control)
        except RuntimeError as err:  # DistBackendError and gloo's connection errors
            raise DistributedError(
                f"rank {self.rank}: waiting for the other ranks to {phase}, not all of them "
                "answered: a rank crashed or was killed (noticed at once), or is stuck, e.g. in "
                f"its data loader, or slower than the timeout of {self.timeout.total_seconds():g} s;"
                f" see its log. (torch.distributed: {_first_line(err)})"
            ) from err
        return gathered

    def all_reduce(self, tensors: Sequence[Tensor]) -> None:
        """Sum every tensor over the ranks, in place (same shapes and dtypes on every rank)."""
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        for (device, dtype), members in groups.items():
            group = self.control if device.type == "cpu" else self.group
            for bucket in _buckets(members, BUCKET_BYTES // dtype.itemsize):
                if len(bucket) == 1 and bucket[0].is_contiguous():
                    dist.all_reduce(bucket[0], op=dist.ReduceOp.SUM, group=group)
                    continue
                flat = torch.cat([t.reshape(-1) for t in bucket])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
                start = 0
                for t in bucket:
                    t.copy_(flat[start : start + t.numel()].view_as(t))
                    start += t.numel()


def _buckets(tensors: list[Tensor], limit: int) -> Iterator[list[Tensor]]:
    """Consecutive runs of ``tensors`` of at most ``limit`` elements (a larger tensor alone)."""
    bucket: list[Tensor] = []
    size = 0
    for t in tensors:
        if bucket and size + t.numel() > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
