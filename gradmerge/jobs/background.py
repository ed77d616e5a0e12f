"""Work that the streaming engine hands to one background thread: writing each step's output
while the next step computes, and reading the inputs' fingerprints beside the pass.

On a merge whose inputs come from disk the engine waits for pages most of the time; writing an
output (copying it into the page cache, and waiting whenever the kernel throttles dirty pages)
on the same thread would add that time to the wait. :class:`Background` runs callables on one
thread in the order given (none after one that failed), keeps at most ``depth`` of them pending
(the caller then waits for the oldest: the outputs held are bounded) and raises a callable's
error on the caller's thread, at the next :meth:`Background.submit` or at
:meth:`Background.drain`. Nothing it runs changes a value: the output file is the same bytes in
the same order.

Example:
    >>> done = []
    >>> with Background(depth=2) as bg:
    ...     for i in range(5):
    ...         _ = bg.submit(done.append, i)
    ...     bg.drain()
    >>> done
    [0, 1, 2, 3, 4]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["Background", "Skipped"]


class Skipped(Exception):
    """A call not run because an earlier one failed (the earlier error is raised first)."""


class Background:
    """One background thread running callables in order, at most ``depth`` pending (``0``: each
    call runs on the caller's thread, as if there were no background)."""

    def __init__(self, depth: int = 2) -> None:
        self.depth = depth
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gradmerge-background")
        self._pending: deque[Future[Any]] = deque()
        self._failed = False

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; first waits for the oldest pending call while ``depth`` are
        pending (raising its error, if it failed). With ``depth=0``, run it here and now."""
        if self.depth == 0:
            done: Future[T] = Future()
            done.set_result(self._run(fn, *args))
            return done
        while len(self._pending) >= self.depth:
            self._pending.popleft().result()
        future = self._pool.submit(self._run, fn, *args)
        self._pending.append(future)
        return future

    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._failed:  # after a failure nothing more runs: the caller sees the first error
            raise Skipped("an earlier call failed")
        try:
            return fn(*args)
        except BaseException:
            self._failed = True
            raise

    def drain(self) -> None:
        """Wait for every pending call; raise the first error among them."""
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        """Wait for the pending calls, without raising their errors (the caller is leaving,
        normally after :meth:`drain` or with an error of its own), and end the thread."""
        self._pending.clear()
        self._pool.shutdown(wait=True)
