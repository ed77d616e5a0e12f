"""The engine's background thread (gradmerge.jobs.background): calls in order, at most ``depth``
pending, the first error raised on the caller's thread, nothing run after it."""

from __future__ import annotations

import threading

import pytest

from gradmerge.jobs.background import Background, Skipped


def test_calls_run_in_order_on_one_other_thread():
    seen: list[tuple[int, str]] = []
    with Background(depth=3) as bg:
        for i in range(20):
            bg.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
        bg.drain()
    assert [i for i, _ in seen] == list(range(20))
    names = {name for _, name in seen}
    assert len(names) == 1 and names != {threading.current_thread().name}


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_at_most_depth_calls_are_pending(depth):
    """The order is forced, not timed: each pending call blocks until ``release``, and its
    future records when ``submit`` waits for it (and then releases the calls). The first
    ``depth`` submits never wait; the next waits for the oldest, before it returns."""
    release = threading.Event()
    started: list[int] = []
    waits: list[str] = []

    def blocked(i):
        started.append(i)
        assert release.wait(60)

    def watched(future, i):
        result = future.result

        def waited(*args, **kwargs):  # submit (or drain) waits for call i
            waits.append(f"wait {i}")
            release.set()
            return result(*args, **kwargs)

        future.result = waited

    bg = Background(depth=depth)
    for i in range(depth):
        watched(bg.submit(blocked, i), i)  # fewer than ``depth`` pending before each: no wait
    assert waits == [] and not release.is_set()
    watched(bg.submit(blocked, depth), depth)  # ``depth`` pending: waits for the oldest first
    waits.append("returned")
    assert waits == ["wait 0", "returned"]
    bg.drain()
    bg.close()
    assert started == list(range(depth + 1))


def test_the_first_error_comes_back_and_nothing_runs_after_it():
    ran: list[int] = []

    def work(i):
        if i == 2:
            raise OSError(28, "No space left on device")
        ran.append(i)

    bg = Background(depth=8)
    for i in range(6):
        bg.submit(work, i)
    with pytest.raises(OSError, match="No space left"):
        bg.drain()
    bg.close()
    assert ran == [0, 1]
    later = Background(depth=1)
    later.submit(work, 2)
    with pytest.raises(OSError):
        later.submit(work, 3)  # the error surfaces at the next submit too
    with pytest.raises(Skipped):  # and what was queued after it never runs
        later.submit(work, 4).result()
    later.close()
    assert ran == [0, 1]


def test_close_waits_for_pending_calls_without_raising_their_errors():
    ran = []

    def fail():
        raise RuntimeError("ignored by close")

    bg = Background(depth=4)
    bg.submit(lambda: ran.append(1))
    bg.submit(fail)
    bg.close()
    assert ran == [1]


def test_depth_zero_runs_each_call_on_the_callers_thread_and_still_stops_after_a_failure():
    seen = []

    def work(i):
        if i == 1:
            raise ValueError("bad")
        seen.append((i, threading.current_thread().name))

    bg = Background(depth=0)
    assert bg.submit(work, 0).result() is None
    with pytest.raises(ValueError, match="bad"):
        bg.submit(work, 1)
    with pytest.raises(Skipped):
        bg.submit(work, 2)
    bg.drain()
    bg.close()
    assert seen == [(0, threading.current_thread().name)]
