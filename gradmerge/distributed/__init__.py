"""Data-parallel curvature estimation on torch.distributed (launch with ``torchrun``).

Each rank estimates the curvature on its own shard of the data; the per-rank SUMS over examples are
added with ``all_reduce``, so the result equals the single-process estimate on all the data (see
:mod:`gradmerge.distributed.estimate` for the exact statement, Monte-Carlo Fishers included).

- :func:`estimate_curvature` — ``gm.estimate_curvature`` across ranks (DDP models accepted; FSDP
  refused), with agreement checks and a timeout: failures raise :class:`DistributedError` on every
  rank; :func:`estimate_with` the same with a ``gm.EstimateOptions``.
- :func:`shard`, :func:`shard_range` — contiguous parts of the data, no padding, no dropping.
- :func:`rank_seed` — the per-rank seed of Monte-Carlo draws.
- :func:`model_fingerprint` — what the ranks compare to be sure they hold the same model.
- :func:`run_merge`, :func:`run_remove` — the streaming merge/removal of
  :mod:`gradmerge.jobs` with its units split over the ranks, each rank writing its own
  shards, one index at the end (:mod:`gradmerge.distributed.merge`; imported on first use).
- ``torchrun -m gradmerge.commands.distributed curvature|merge|remove ...`` — the command line
  (:mod:`gradmerge.commands.distributed`); process-group helpers in
  :mod:`gradmerge.distributed.launch`.
"""

from typing import Any

from gradmerge.distributed.errors import DistributedError
from gradmerge.distributed.estimate import (
    DEFAULT_TIMEOUT,
    estimate_curvature,
    estimate_with,
    rank_seed,
)
from gradmerge.distributed.fingerprint import ModelFingerprint, model_fingerprint
from gradmerge.distributed.shard import shard, shard_range


def __getattr__(name: str) -> Any:
    """``run_merge``/``run_remove``, imported on first use (they load the checkpoint layer)."""
    if name in ("run_merge", "run_remove"):
        from gradmerge.distributed import merge

        return getattr(merge, name)
    raise AttributeError(f"module 'gradmerge.distributed' has no attribute {name!r}")


__all__ = [
    "DEFAULT_TIMEOUT",
    "DistributedError",
    "ModelFingerprint",
    "estimate_curvature",
    "estimate_with",
    "model_fingerprint",
    "rank_seed",
    "run_merge",
    "run_remove",
    "shard",
    "shard_range",
]
