"""Progress of long steps on stderr: a bar on a terminal, plain timed log lines elsewhere.

On a terminal, a tqdm bar. When stderr is not a terminal (a log file, a batch job, CI), a bar's
carriage returns would be noise or nothing, so instead one plain line every ``interval`` seconds
(``GRADMERGE_PROGRESS_INTERVAL``, default 30) and one at the end:

    gradmerge merge: 12/148 tensors, 1.2 GB/13.8 GB (9%), 96.0 MB/s, ETA 2m11s
    curvature kfac empirical (pass 1 of up to 2): 4096/10000 examples (41%), 310 examples/s, ETA 19s

Example:
    >>> import io
    >>> log = io.StringIO()
    >>> p = Progress("estimate", total=4, unit="examples", stream=log, interval=0.0)
    >>> p.update(2); p.update(2); p.close()
    >>> lines = log.getvalue().splitlines()
    >>> lines[0].startswith("estimate: 2/4 examples (50%)"), "ETA" in lines[0], len(lines)
    (True, True, 3)
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, TextIO

from gradmerge.foundation.text import byte_size

DEFAULT_INTERVAL = 30.0
"""Seconds between two log lines when stderr is not a terminal."""


class Progress:
    """Progress of one step: ``update(n)`` as work is done, ``close()`` at the end.

    Args:
        label: what is running (the line's prefix).
        total: the amount of work, if known (for the percentage and the ETA).
        unit: what ``n`` counts (``"examples"``, ``"B"``); ``"B"`` is shown as kB/MB/GB.
        items: a second count shown with it (e.g. ``"tensors"``), advanced by ``update(n, k)``.
        items_total: its total.
        stream: where to write (default: stderr).
        interval: seconds between log lines (default: ``GRADMERGE_PROGRESS_INTERVAL`` or 30).
    """

    def __init__(
        self,
        label: str,
        total: float | None = None,
        *,
        unit: str = "batches",
        items: str | None = None,
        items_total: int | None = None,
        stream: TextIO | None = None,
        interval: float | None = None,
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.items, self.items_total = items, items_total
        self.stream = stream if stream is not None else sys.stderr
        self.interval = _interval() if interval is None else interval
        self.done, self.count = 0.0, 0
        self.start = self.last = time.perf_counter()
        self.bar: Any = None
        if _is_terminal(self.stream):
            from tqdm import tqdm

            scale = unit == "B"
            self.bar = tqdm(total=total, desc=label, unit=unit, unit_scale=scale, file=self.stream)

    def update(self, n: float = 1, items: int = 0) -> None:
        """``n`` more units (and ``items`` more items) done."""
        self.done += n
        self.count += items
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if now - self.last >= self.interval:
            self.last = now
            self._line(now)

    def close(self) -> None:
        """End the bar, or write the final log line."""
        if self.bar is not None:
            self.bar.close()
        else:
            self._line(time.perf_counter(), final=True)

    def _line(self, now: float, final: bool = False) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        parts = []
        if self.items is not None:
            of = f"/{self.items_total}" if self.items_total is not None else ""
            parts.append(f"{self.count}{of} {self.items}")
        if self.total:
            done = _amount(self.done, self.unit, bare=self.unit != "B")
            share = f" ({100 * self.done / self.total:.0f}%)"
            parts.append(f"{done}/{_amount(self.total, self.unit)}{share}")
        else:
            parts.append(_amount(self.done, self.unit))
        parts.append(f"{_amount(rate, self.unit)}/s")
        if final:
            parts.append(f"done in {_duration(elapsed)}")
        elif self.total and rate > 0:
            parts.append(f"ETA {_duration((self.total - self.done) / rate)}")
        print(f"{self.label}: {', '.join(parts)}", file=self.stream, flush=True)


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("GRADMERGE_PROGRESS_INTERVAL", DEFAULT_INTERVAL)))
    except ValueError:
        return DEFAULT_INTERVAL


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty()) if callable(isatty) else False


def _amount(value: float, unit: str, bare: bool = False) -> str:
    if unit == "B":
        return byte_size(value)
    number = f"{value:.0f}" if float(value).is_integer() or value >= 100 else f"{value:.1f}"
    return number if bare else f"{number} {unit}"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
