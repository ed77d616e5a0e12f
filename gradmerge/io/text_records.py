"""Text DATA's records: JSONL, CSV/TSV, plain text and ``datasets`` folders, read lazily.

The reading half of the text path (:mod:`gradmerge.io.text_data` tokenises what this yields):

- ``.jsonl``: one JSON object per line (blank lines skipped);
- ``.csv`` / ``.tsv``: a header row naming the columns;
- ``.txt``: one example per line (blank lines skipped), under the field ``text``;
- a folder written by ``datasets``' ``Dataset.save_to_disk`` (when ``datasets`` is installed;
  for a ``DatasetDict``, the folder of one split).

:class:`Records` re-reads its file from the start on every pass, so a file of any size takes
the memory of one record; a bad line is named by its number.

Example:
    >>> is_text_data("train.jsonl"), is_text_data("train.safetensors")
    (True, False)
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from gradmerge.errors import ArgumentError, FileFormatError
from gradmerge.foundation.settings import setting


@dataclass(frozen=True)
class TextOptions:
    """How records become examples: the ``--text-field`` ... ``--max-examples`` flags of the
    commands and the ``text`` mapping of a refinement, each field declared once (its meaning,
    default and flag; docs/config.md's ``text`` table). Imports no torch, so that the commands'
    help reads the declarations.

    Example:
        >>> TextOptions(label_field="gold").text_field
        'text'
    """

    text_field: str = setting(
        "text", "the field holding the text (`.txt`: always `text`).", flag="--text-field"
    )
    text_pair_field: str | None = setting(
        None,
        "a second text, tokenised as the pair's second segment (classification).",
        flag="--text-pair-field",
    )
    label_field: str = setting(
        "label",
        "the field holding the label, a name of the config's `label2id` or an id (classification).",
        flag="--label-field",
    )
    max_length: int | None = setting(
        None,
        "truncate longer sequences to this many tokens (special tokens included); none: no "
        "truncation, and a sequence longer than the model's positions is an error.",
        kind="integer",
        minimum=1,
        flag="--max-length",
    )
    max_examples: int | None = setting(
        None,
        "read at most this many records (the first ones).",
        kind="integer",
        minimum=1,
        flag="--max-examples",
    )


TEXT_SUFFIXES = (".jsonl", ".csv", ".tsv", ".txt")


def is_text_data(spec: str) -> bool:
    """Whether DATA names text: a file with a suffix of :data:`TEXT_SUFFIXES` or a folder."""
    return spec.endswith(TEXT_SUFFIXES) or Path(spec).is_dir()


def read_records(spec: str, max_examples: int | None = None) -> Records:
    """The records of a text DATA file or ``datasets`` folder, at most ``max_examples``, read
    lazily (:class:`Records`).

    Raises:
        ArgumentError: no such file; a folder that is not a saved ``datasets`` dataset, or
            ``datasets`` is not installed.
    """
    path = Path(spec)
    if path.is_dir():
        _dataset(path)  # checked now: a folder that is no dataset fails before any work
    elif not path.is_file():
        raise ArgumentError(f"DATA file {spec} does not exist")
    return Records(path, max_examples)


class Records:
    """The records of a text file or ``datasets`` folder, re-read from the start on every pass,
    so that a file of any size takes the memory of one record (module docstring).

    Iterating raises :class:`FileFormatError` for a line that is not a JSON object (or repeats
    a key), a CSV row with too many or too few fields, a file that is not UTF-8; a byte-order
    mark at the start of a file is skipped in every format.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = (Path(d) / "a.txt").write_text("\\ufeffone\\n\\ntwo\\n", encoding="utf-8")
        ...     list(Records(Path(d) / "a.txt"))
        [{'text': 'one'}, {'text': 'two'}]
    """

    def __init__(self, path: Path, limit: int | None = None) -> None:
        self.path, self.limit = path, limit

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        path = self.path
        if path.is_dir():
            records = _dataset_records(path)
        elif path.suffix == ".jsonl":
            records = _jsonl_records(path)
        elif path.suffix in (".csv", ".tsv"):
            records = _csv_records(path, "\t" if path.suffix == ".tsv" else ",")
        else:
            records = _txt_records(path)
        return records if self.limit is None else islice(records, self.limit)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with path.open(encoding="utf-8-sig") as f:  # -sig: a leading byte-order mark is skipped
            yield from enumerate(f, start=1)
    except UnicodeDecodeError as err:
        raise FileFormatError(f"DATA {path} is not UTF-8 text ({err})") from err


def _jsonl_records(path: Path) -> Iterator[Mapping[str, Any]]:
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as err:
            raise FileFormatError(
                f"DATA {path}, line {number}: not JSON ({err.msg}); a .jsonl file holds one "
                'JSON object per line, e.g. {"text": "...", "label": "positive"}'
            ) from err
        except ValueError as err:  # a repeated key, an integer of more digits than int() takes
            raise FileFormatError(f"DATA {path}, line {number}: {err}") from err
        if not isinstance(record, dict):
            raise FileFormatError(
                f"DATA {path}, line {number}: a JSON {type(record).__name__}; expected an "
                'object, e.g. {"text": "...", "label": "positive"}'
            )
        yield record


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a key given twice is refused (json keeps the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice in one object; give every field once")
        out[key] = value
    return out


def _csv_records(path: Path, delimiter: str) -> Iterator[Mapping[str, Any]]:
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f, delimiter=delimiter)
            columns = reader.fieldnames
            if not columns:
                raise FileFormatError(
                    f"DATA {path} is empty; expected a header row naming the columns, e.g. "
                    f"text{delimiter}label"
                )
            for row in reader:
                if None in row or None in row.values():
                    raise FileFormatError(
                        f"DATA {path}, line {reader.line_num}: {len(columns)} columns in the "
                        f"header {columns}, but this row has "
                        f"{'more' if None in row else 'fewer'}; quote fields that hold the "
                        f"delimiter {delimiter!r}"
                    )
                yield row
    except UnicodeDecodeError as err:
        raise FileFormatError(f"DATA {path} is not UTF-8 text ({err})") from err
    except csv.Error as err:
        raise FileFormatError(f"DATA {path} cannot be read as CSV ({err})") from err


def _txt_records(path: Path) -> Iterator[Mapping[str, Any]]:
    for _, line in _lines(path):
        if line.strip():
            yield {"text": line.rstrip("\r\n")}


def _dataset(path: Path) -> Any:
    try:
        import datasets
    except ImportError as err:
        raise ArgumentError(
            f"DATA {path} is a folder: reading a saved Hugging Face dataset needs the "
            "'datasets' package (pip install datasets), or give a .jsonl/.csv/.tsv/.txt file"
        ) from err
    if not (path / "dataset_info.json").is_file() and not (path / "dataset_dict.json").is_file():
        raise ArgumentError(
            f"DATA {path} is a folder but not a dataset saved with save_to_disk (no "
            "dataset_info.json); give a .jsonl/.csv/.tsv/.txt file or such a folder"
        )
    try:
        loaded = datasets.load_from_disk(str(path))  # memory-mapped: rows are read when used
    except Exception as err:  # datasets raises its own errors on damaged folders
        raise FileFormatError(f"DATA {path} cannot be read by datasets ({err})") from err
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        raise ArgumentError(
            f"DATA {path} holds the splits {splits}; give the folder of one, e.g. "
            f"{path / splits[0]}"
        )
    return loaded


def _dataset_records(path: Path) -> Iterator[Mapping[str, Any]]:
    for row in _dataset(path):
        yield dict(row)
