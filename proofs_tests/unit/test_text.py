"""The message texts of :mod:`gradmerge.foundation.text`: byte counts in words, exactly.

``byte_size`` is the one formatter of byte counts: ``gradmerge merge``'s summary and ``--dry-run``
line and the progress lines (:mod:`gradmerge.jobs.progress`) all state sizes with it.
"""

from __future__ import annotations

import io

import pytest

from gradmerge.foundation.text import byte_size


@pytest.mark.parametrize(
    "nbytes, expected",
    [
        (0, "0 B"),
        (1, "1 B"),
        (999, "999 B"),
        (999.4, "999 B"),  # a rate: whole bytes below 1 kB
        (1000, "1.0 kB"),
        (1049, "1.0 kB"),
        (1050, "1.1 kB"),  # 1.05 is 1.0500000000000000444 in binary: rounds up
        (999_999, "1000.0 kB"),  # the unit is chosen before rounding
        (10**6, "1.0 MB"),
        (1e6, "1.0 MB"),
        (123_456_789, "123.5 MB"),
        (10**9 - 1, "1000.0 MB"),
        (10**9, "1.0 GB"),
        (1.5e9, "1.5 GB"),
        (13_800_000_000, "13.8 GB"),
        (5 * 10**12, "5000.0 GB"),  # no unit above GB
    ],
)
def test_byte_size_states_a_count_in_the_largest_decimal_unit(nbytes, expected):
    assert byte_size(nbytes) == expected


def test_progress_and_merge_state_bytes_with_it():
    """The progress lines' bytes are :func:`byte_size`'s; ``gradmerge merge`` keeps no formatter
    of its own."""
    from gradmerge.commands import merge
    from gradmerge.jobs.progress import Progress

    log = io.StringIO()
    p = Progress("write", 3e9, unit="B", stream=log, interval=0.0)
    p.update(999)
    p.update(1.5e9 - 999)
    first, second = log.getvalue().splitlines()
    assert first.startswith(f"write: 999 B/{byte_size(3e9)} (0%), ")
    assert second.startswith("write: 1.5 GB/3.0 GB (50%), ")
    assert not hasattr(merge, "_size")
    assert merge.byte_size is byte_size
