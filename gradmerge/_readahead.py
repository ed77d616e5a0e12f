"""Reading memory-mapped safetensors ahead of use: where each tensor's bytes lie, and a hint to
the kernel to start reading a byte range in the background.

A streaming merge touches its inputs' mapped pages unit by unit; on a cold page cache every
first touch waits for the disk, and nothing is read while the unit's arithmetic runs. Asking the
kernel to read the NEXT unit's ranges (``posix_fadvise(POSIX_FADV_WILLNEED)``, which starts the
reads and returns) before computing the current one lets the disk and the CPU work at once. It
is a hint: it changes no value, and where the call does not exist (not POSIX) it does nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path


def data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Tensor name → (start, end) of its bytes, counted from the beginning of the safetensors
    file ``path``. The header is not validated here (the readers do that); a file whose header
    cannot be read gives no offsets, so nothing is read ahead in it.

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from safetensors.torch import save_file
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_file({"a": torch.ones(2), "b": torch.ones(3)}, f"{d}/x.safetensors")
        ...     offsets = data_offsets(Path(d) / "x.safetensors")
        ...     [end - start for start, end in offsets.values()]
        [8, 12]
    """
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        base = 8 + length
        return {
            name: (base + int(entry["data_offsets"][0]), base + int(entry["data_offsets"][1]))
            for name, entry in header.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return {}


class Readahead:
    """Open files whose byte ranges are read ahead on request (:meth:`advise`)."""

    def __init__(self, files: Sequence[Path]) -> None:
        self._fds = [os.open(f, os.O_RDONLY) for f in files] if _AVAILABLE else []

    def advise(self, index: int, start: int, length: int) -> None:
        """Start reading ``length`` bytes of file ``index`` from ``start`` into the page cache."""
        if self._fds and length > 0:
            # a file system that takes no advice raises: the reads then happen on use
            with contextlib.suppress(OSError):
                os.posix_fadvise(self._fds[index], start, length, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


_AVAILABLE = hasattr(os, "posix_fadvise")


def row_range(start: int, end: int, shape: Sequence[int], rows: slice | None) -> tuple[int, int]:
    """The (start, length) of ``rows`` (all rows when ``None``) of a tensor stored at
    [start, end) with ``shape``, rows along its first dimension."""
    if rows is None or not shape or shape[0] == 0:
        return start, end - start
    row = (end - start) // shape[0]
    first, stop = rows.indices(shape[0])[:2]
    return start + first * row, max(0, stop - first) * row
