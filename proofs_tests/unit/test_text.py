"""The message texts of :mod:`gradmerge.foundation.text`: byte counts in words, exactly.

``byte_size`` is the one formatter of byte counts: ``gradmerge merge``'s summary and ``--dry-run``
line and the progress lines (:mod:`gradmerge.jobs.progress`) all state sizes with it.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradmerge import cli
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


# ----- parse_size: the YAML reader's and gradmerge materialize's one size parser -------------
EXPECT = "expected a size such as '5GB', '500MB' or '2GiB', got "
SIZES = [
    ("5GB", 5 * 10**9),
    ("500MB", 5 * 10**8),
    ("2GiB", 2 * 2**30),
    ("3TiB", 3 * 2**40),
    ("1 TB", 10**12),
    ("1.5kb", 1500),
    ("1.5GB", 1_500_000_000),
    ("1.1GB", 1_100_000_000),  # 1.1e9 as a float is 1100000000.0000002: rounded down
    ("2KiB", 2048),
    (" 3 mb ", 3_000_000),
    (".5GB", 500_000_000),
    ("100", 100),
    ("1.5B", 1),  # a fraction of a byte dropped
    ("9" * 30 + "TB", int(float("9" * 30) * 10**12)),  # huge but finite: the float's value
]
"""Strings read before the move, with the values both copies gave (the table was taken by
running the two copies, ``jobs.yaml_reader.parse_size`` and ``commands.materialize.size``)."""

NOT_SIZES = [
    ("", EXPECT + "''"),
    (" ", EXPECT + "' '"),
    ("-1GB", EXPECT + "'-1GB'"),
    ("+1GB", EXPECT + "'+1GB'"),
    ("1.5XB", EXPECT + "'1.5XB'"),
    ("5 parsecs", EXPECT + "'5 parsecs'"),
    ("GB", EXPECT + "'GB'"),
    ("1.", EXPECT + "'1.'"),
    ("nan", EXPECT + "'nan'"),
    ("NaN", EXPECT + "'NaN'"),
    ("inf", EXPECT + "'inf'"),
    ("1e9", EXPECT + "'1e9'"),
    ("1_000", EXPECT + "'1_000'"),
    ("٣GB", EXPECT + "'٣GB'"),  # only ASCII digits
    ("0", "a size must be positive, got '0'"),
    ("0GB", "a size must be positive, got '0GB'"),
    ("0.4", "a size must be positive, got '0.4'"),
    ("0.0000000001", "a size must be positive, got '0.0000000001'"),
]


@pytest.mark.parametrize("text, expected", SIZES)
def test_a_size_reads_the_same_in_yaml_and_on_the_command_line(text, expected):
    from gradmerge.commands.materialize import size
    from gradmerge.foundation.text import parse_size
    from gradmerge.jobs import parse_size as public
    from gradmerge.jobs.yaml_reader import parse_size as reader

    assert public is reader is parse_size
    assert parse_size(text) == expected
    assert size(text) == expected


@pytest.mark.parametrize("text, message", NOT_SIZES)
def test_a_bad_size_is_refused_with_each_callers_error(text, message):
    from gradmerge.commands.materialize import size
    from gradmerge.foundation.text import parse_size

    with pytest.raises(ValueError) as caught:
        parse_size(text)
    assert type(caught.value) is ValueError and str(caught.value) == message
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        size(text)
    assert str(refused.value) == (
        f"expected a positive size such as 5GB, 500MB or 2GiB, got {text!r}"
    )


@pytest.mark.parametrize(
    "value, error, message",
    [
        (7, None, 7),
        (10**30, None, 10**30),
        (0, ValueError, "a size must be positive, got 0"),
        (-1, ValueError, "a size must be positive, got -1"),
        (True, TypeError, "expected a size in bytes or a string such as '5GB', got True"),
        (1.5, TypeError, "expected a size in bytes or a string such as '5GB', got 1.5"),
        (None, TypeError, "expected a size in bytes or a string such as '5GB', got None"),
        (b"5GB", TypeError, "expected a size in bytes or a string such as '5GB', got b'5GB'"),
    ],
)
def test_a_yaml_size_that_is_not_a_string(value, error, message):
    """YAML gives ints too: taken as bytes; anything else is a TypeError, as before."""
    from gradmerge.foundation.text import parse_size

    if error is None:
        assert parse_size(value) == message
        return
    with pytest.raises(error) as caught:
        parse_size(value)
    assert type(caught.value) is error and str(caught.value) == message


def test_a_number_beyond_a_float_is_refused_not_an_overflow(tmp_path):
    """``9`` written 400 times is infinite as a float: both copies raised OverflowError (a
    traceback from ``gradmerge merge``, an uncaught error from argparse); now the refusal of any
    other string that is no size: a ConfigError naming the key, an argparse error (exit 2)."""
    from gradmerge.errors import ConfigError
    from gradmerge.foundation.text import parse_size
    from gradmerge.jobs.yaml_reader import Reader

    huge = "9" * 400 + "GB"
    with pytest.raises(ValueError, match=r"^expected a size such as"):
        parse_size(huge)
    with pytest.raises(ValueError, match=r"^expected a size such as"):
        parse_size("9" * 400)
    reader = Reader({"max_shard_size": huge}, "the merge config", tmp_path, False)
    with pytest.raises(ConfigError, match=r"^`max_shard_size`: expected a size such as"):
        reader.size("max_shard_size", 1)
    with pytest.raises(SystemExit) as exited:
        cli.main(["materialize", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", huge])
    assert exited.value.code == 2


def test_the_size_parser_imports_no_torch():
    """The reason it lives in the foundation: ``gradmerge materialize --help`` reads its
    ``--max-shard-size`` default without torch."""
    code = (
        "import sys\n"
        "from gradmerge.foundation.text import parse_size\n"
        "import gradmerge.commands.materialize\n"
        "assert parse_size('5GB') == 5 * 10**9\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_env()
    )
    assert done.stdout.strip() == "False"


def _env() -> dict[str, str]:
    """This process's environment, with the checkout under test first on the path."""
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
