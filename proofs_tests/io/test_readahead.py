"""The read-ahead hints (gradmerge.foundation.readahead): given by one background thread, in order,
without blocking the caller, and dropped for a closed file."""

from __future__ import annotations

import os
import threading

import pytest

from gradmerge.foundation import readahead
from gradmerge.foundation.readahead import Readahead

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")


@pytest.fixture
def files(tmp_path):
    paths = [tmp_path / "a.bin", tmp_path / "b.bin"]
    for p in paths:
        p.write_bytes(bytes(1 << 16))
    return paths


@pytest.fixture
def given(monkeypatch):
    """(file, start, length, thread name) of every WILLNEED hint given."""
    seen: list[tuple[str, int, int, str]] = []
    real = os.posix_fadvise

    def record(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_WILLNEED
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        seen.append((name, offset, length, threading.current_thread().name))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    return seen


def test_hints_are_given_in_order_by_the_background_thread(files, given):
    ahead = Readahead(files)
    asked = [(1, 0, 4096), (0, 8192, 100), (1, 4096, 0), (0, 0, 65536)]  # a length 0 asks nothing
    for index, start, length in asked:
        ahead.advise(index, start, length)
    assert readahead.settle(10)
    ahead.close()
    assert given == [
        ("b.bin", 0, 4096, "gradmerge-readahead"),
        ("a.bin", 8192, 100, "gradmerge-readahead"),
        ("a.bin", 0, 65536, "gradmerge-readahead"),
    ]


def test_advise_returns_while_a_hint_blocks_and_close_drops_the_waiting_ones(
    files, given, monkeypatch
):
    """The order is forced, not timed: the hint being given blocks until ``release``, which
    ``close`` sets only once it has found that hint's lock held (so close must wait for it)."""
    release, entered = threading.Event(), threading.Event()
    record = os.posix_fadvise
    order: list[str] = []

    def slow(fd, offset, length, advice):
        entered.set()
        assert release.wait(60)
        order.append("hint given")
        return record(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", slow)
    ahead = Readahead(files)
    lock = ahead._lock

    class Watched:  # the object's lock, telling when close finds it held
        def __enter__(self):
            if threading.current_thread() is closer and lock.locked():
                order.append("close waits")
                release.set()
            return lock.__enter__()

        def __exit__(self, *exc):
            return lock.__exit__(*exc)

    ahead._lock = Watched()
    closer = threading.Thread(target=ahead.close)
    ahead.advise(0, 0, 10)  # the thread blocks in this one
    assert entered.wait(60)
    ahead.advise(1, 0, 20)  # returns at once although the thread is busy
    ahead.advise(0, 10, 30)
    closer.start()
    closer.join(60)
    assert not closer.is_alive()
    assert order == ["close waits", "hint given"]  # close waited for the hint on its files ...
    assert readahead.settle(60)
    assert [g[:3] for g in given] == [("a.bin", 0, 10)]  # ... and drops the ones still waiting
    ahead.advise(0, 0, 10)  # a closed object asks nothing
    assert readahead.settle(60)
    assert len(given) == 1


def test_a_file_system_that_refuses_advice_is_not_an_error(files, monkeypatch):
    def refuse(*args):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    ahead = Readahead(files)
    ahead.advise(0, 0, 10)
    assert readahead.settle(10)
    ahead.advise(1, 0, 10)  # the thread survived the refusal
    assert readahead.settle(10)
    ahead.close()
