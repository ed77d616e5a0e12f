"""Reading memory-mapped safetensors ahead of use: where each tensor's bytes lie, and a hint to
the kernel to start reading a byte range in the background.

A streaming merge touches its inputs' mapped pages unit by unit; on a cold page cache every
first touch waits for the disk, and nothing is read while the unit's arithmetic runs. Asking the
kernel to read the NEXT unit's ranges (``posix_fadvise(POSIX_FADV_WILLNEED)``, which starts the
reads and returns) before computing the current one lets the disk and the CPU work at once. It
is a hint: it changes no value, and where the call does not exist (not POSIX) it does nothing.

The hints are given by one background thread, in the order they were asked for: a large range's
``WILLNEED`` blocks its caller while the device's request queue is full, which on the caller's
thread would stop the arithmetic until most of that range was read (the reads would no longer
overlap it). The thread holds no tensor and changes no value; a hint still waiting when its file
is closed is dropped.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import struct
import threading
from collections.abc import Callable, Sequence
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
    """Open files whose byte ranges are read ahead on request (:meth:`advise`), by the module's
    background thread."""

    def __init__(self, files: Sequence[Path]) -> None:
        self._fds = [os.open(f, os.O_RDONLY) for f in files] if _AVAILABLE else []
        self._lock = threading.Lock()  # held while one of this object's hints is given
        self._closing = False

    def advise(self, index: int, start: int, length: int) -> None:
        """Ask for ``length`` bytes of file ``index`` from ``start`` to be read into the page
        cache; returns at once (the hint is given by the background thread, in order)."""
        if self._fds and length > 0 and not self._closing:
            fd = self._fds[index]
            _worker().put(lambda: self._give(fd, start, length))

    def _give(self, fd: int, start: int, length: int) -> None:
        with self._lock:
            if not self._closing:  # a hint for a file being closed is dropped
                # a file system that takes no advice raises: the reads then happen on use
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        self._closing = True  # no hint starts from now on ...
        with self._lock:  # ... and the one being given on these files ends first
            fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


_queue: queue.SimpleQueue[Callable[[], None]] | None = None
_pid = 0
_started = threading.Lock()


def _worker() -> queue.SimpleQueue[Callable[[], None]]:
    """The queue of the thread that gives the hints (started on first use; a daemon, so that it
    never keeps a process alive; a forked child starts its own)."""
    global _queue, _pid
    with _started:
        if _queue is None or _pid != os.getpid():
            _queue, _pid = queue.SimpleQueue(), os.getpid()
            thread = threading.Thread(target=_run, args=(_queue,), name="gradmerge-readahead")
            thread.daemon = True
            thread.start()
        return _queue


def _run(tasks: queue.SimpleQueue[Callable[[], None]]) -> None:
    while True:
        tasks.get()()


def settle(timeout: float | None = None) -> bool:
    """Wait until every hint asked for so far was given or dropped; whether it was in time."""
    done = threading.Event()
    _worker().put(done.set)
    return done.wait(timeout)


_AVAILABLE = hasattr(os, "posix_fadvise")


def row_range(start: int, end: int, shape: Sequence[int], rows: slice | None) -> tuple[int, int]:
    """The (start, length) of ``rows`` (all rows when ``None``) of a tensor stored at
    [start, end) with ``shape``, rows along its first dimension."""
    if rows is None or not shape or shape[0] == 0:
        return start, end - start
    row = (end - start) // shape[0]
    first, stop = rows.indices(shape[0])[:2]
    return start + first * row, max(0, stop - first) * row
