"""Text examples as batches: JSONL, CSV/TSV, plain text and ``datasets`` folders, tokenised.

The text path of ``gradmerge curvature MODEL DATA OUT`` (:mod:`gradmerge.io.sources`): records are
read from DATA, tokenised with the MODEL folder's own tokenizer (``AutoTokenizer``, offline) and
cut into padded batches that :func:`gradmerge.estimate_curvature` accepts. Formats:

- ``.jsonl``: one JSON object per line (blank lines skipped);
- ``.csv`` / ``.tsv``: a header row naming the columns;
- ``.txt``: one example per line (blank lines skipped), under the field ``text``;
- a folder written by ``datasets``' ``Dataset.save_to_disk`` (when ``datasets`` is installed;
  for a ``DatasetDict``, the folder of one split).

Two tasks, chosen by the model's class (``config.architectures``):

- sequence classification (``...ForSequenceClassification``): each record has a text (and,
  with ``text_pair_field``, a second text) and a label, a name of ``config.label2id`` or an integer
  id below ``config.num_labels``; ``labels`` has one entry per sequence;
- causal language modelling (``...ForCausalLM``, ``...LMHeadModel``): each record is a text; the
  targets are the next tokens, ``labels[:, s] = input_ids[:, s + 1]``, the last position and the
  padding set to ``ignore_index`` — the convention of ``--shift-labels`` for tensor files
  (:class:`gradmerge.io.sources.TensorBatches`), so a text file and its token file give the same
  curvature.

Each batch is padded on the right to its longest sequence (``attention_mask`` 0 on the padding,
which the estimators leave out). Sequences are checked before any estimate: token ids must be
below the model's vocabulary, and lengths at most its positions (``--max-length`` truncates, and
how many examples it cut is reported).

Example:
    >>> records = [{"text": "a b", "label": "pos"}, {"text": "b", "label": 0}]
    >>> [label_id(r["label"], {"neg": 0, "pos": 1}, 2, f"row {i}") for i, r in enumerate(records)]
    [1, 0]
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gradmerge._extras import require
from gradmerge._text import key_list
from gradmerge.errors import ArgumentError, FileFormatError, StructureError

TEXT_SUFFIXES = (".jsonl", ".csv", ".tsv", ".txt")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
)
CLASSIFICATION, CAUSAL_LM = "sequence classification", "causal language modelling"


@dataclass(frozen=True)
class TextOptions:
    """How records become examples (the ``--text-field`` ... ``--max-examples`` flags).

    Attributes:
        text_field: the field holding the text (``.txt``: always ``text``).
        text_pair_field: a second text, tokenised as the pair's second segment (classification).
        label_field: the field holding the label (classification).
        max_length: truncate longer sequences to this many tokens (special tokens included);
            None: no truncation, and a sequence longer than the model's positions is an error.
        max_examples: read at most this many records (the first ones).
    """

    text_field: str = "text"
    text_pair_field: str | None = None
    label_field: str = "label"
    max_length: int | None = None
    max_examples: int | None = None


def is_text_data(spec: str) -> bool:
    """Whether DATA names text: a file with a suffix of :data:`TEXT_SUFFIXES` or a folder."""
    return spec.endswith(TEXT_SUFFIXES) or Path(spec).is_dir()


# ----- records --------------------------------------------------------------------------------
def read_records(spec: str, max_examples: int | None = None) -> list[Mapping[str, Any]]:
    """The records of a text DATA file or ``datasets`` folder, at most ``max_examples``.

    Raises:
        ArgumentError: no such file; a folder that is not a saved ``datasets`` dataset, or
            ``datasets`` is not installed.
        FileFormatError: a line that is not a JSON object, a CSV row with too many or too few
            fields, an empty file.
    """
    path = Path(spec)
    if path.is_dir():
        records = _dataset_records(path, max_examples)
    elif not path.is_file():
        raise ArgumentError(f"DATA file {spec} does not exist")
    elif path.suffix == ".jsonl":
        records = _jsonl_records(path, max_examples)
    elif path.suffix in (".csv", ".tsv"):
        records = _csv_records(path, "\t" if path.suffix == ".tsv" else ",", max_examples)
    else:
        records = _txt_records(path, max_examples)
    if not records:
        raise FileFormatError(f"DATA {spec} holds no examples")
    return records


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with path.open(encoding="utf-8") as f:
            yield from enumerate(f, start=1)
    except UnicodeDecodeError as err:
        raise FileFormatError(f"DATA {path} is not UTF-8 text ({err})") from err


def _jsonl_records(path: Path, limit: int | None) -> list[Mapping[str, Any]]:
    records: list[Mapping[str, Any]] = []
    for number, line in _lines(path):
        if limit is not None and len(records) >= limit:
            break
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise FileFormatError(
                f"DATA {path}, line {number}: not JSON ({err.msg}); a .jsonl file holds one "
                'JSON object per line, e.g. {"text": "...", "label": "positive"}'
            ) from err
        if not isinstance(record, dict):
            raise FileFormatError(
                f"DATA {path}, line {number}: a JSON {type(record).__name__}; expected an "
                'object, e.g. {"text": "...", "label": "positive"}'
            )
        records.append(record)
    return records


def _csv_records(path: Path, delimiter: str, limit: int | None) -> list[Mapping[str, Any]]:
    records: list[Mapping[str, Any]] = []
    try:
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f, delimiter=delimiter)
            columns = reader.fieldnames
            if not columns:
                raise FileFormatError(
                    f"DATA {path} is empty; expected a header row naming the columns, e.g. "
                    f"text{delimiter}label"
                )
            for row in reader:
                if limit is not None and len(records) >= limit:
                    break
                if None in row or None in row.values():
                    raise FileFormatError(
                        f"DATA {path}, line {reader.line_num}: {len(columns)} columns in the "
                        f"header {columns}, but this row has "
                        f"{'more' if None in row else 'fewer'}; quote fields that hold the "
                        f"delimiter {delimiter!r}"
                    )
                records.append(row)
    except UnicodeDecodeError as err:
        raise FileFormatError(f"DATA {path} is not UTF-8 text ({err})") from err
    except csv.Error as err:
        raise FileFormatError(f"DATA {path} cannot be read as CSV ({err})") from err
    return records


def _txt_records(path: Path, limit: int | None) -> list[Mapping[str, Any]]:
    records: list[Mapping[str, Any]] = []
    for _, line in _lines(path):
        if limit is not None and len(records) >= limit:
            break
        if line.strip():
            records.append({"text": line.rstrip("\r\n")})
    return records


def _dataset_records(path: Path, limit: int | None) -> list[Mapping[str, Any]]:
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
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises its own errors on damaged folders
        raise FileFormatError(f"DATA {path} cannot be read by datasets ({err})") from err
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        raise ArgumentError(
            f"DATA {path} holds the splits {splits}; give the folder of one, e.g. "
            f"{path / splits[0]}"
        )
    rows = loaded if limit is None else loaded.select(range(min(limit, len(loaded))))
    return [dict(row) for row in rows]


def token_labels(
    tensors: Mapping[str, Tensor], shift: bool, ignore_index: int, source: str
) -> dict[str, Tensor]:
    """``tensors`` with their ``labels`` made the targets of each position's logits.

    With ``shift`` (Hugging Face's causal-LM convention, labels = input_ids), labels are shifted
    left by one: labels[:, s] ← labels[:, s + 1], the last position ``ignore_index``. Positions
    whose ``attention_mask`` is 0 become ``ignore_index`` (with ``shift``: where token s or s + 1
    is padding). One label per sequence (labels of shape (examples,)) is left as it is.

    Raises:
        StructureError: float labels; a mask of another shape than per-position labels;
            ``shift`` with labels that are not (examples, positions).
    """
    out = dict(tensors)
    labels, mask = tensors["labels"], tensors.get("attention_mask")
    if labels.is_floating_point():
        raise StructureError(
            f"{source}: labels must be integer class or token ids, got {labels.dtype}; for "
            "regression targets store 'inputs' and 'targets' and pass --loss mse"
        )
    ids = tensors.get("input_ids")
    if labels.ndim == 1 and ids is not None and ids.ndim == 2:  # one class per sequence
        if shift:
            raise StructureError(
                f"{source}: labels {tuple(labels.shape)} hold one class per sequence; "
                "--shift-labels applies to per-token labels (examples, positions): leave it out"
            )
        return out
    if mask is not None and mask.shape != labels.shape:
        raise StructureError(
            f"{source}: attention_mask {tuple(mask.shape)} and labels {tuple(labels.shape)} "
            "must have the same shape (one label per position), or labels must hold one class "
            f"per sequence, shape ({mask.shape[0]},)"
        )
    if shift:
        if labels.ndim != 2:
            raise StructureError(
                f"{source}: --shift-labels needs labels of shape (examples, positions), "
                f"got {tuple(labels.shape)}"
            )
        labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)], dim=1)
    if mask is not None:
        keep = mask != 0
        if shift:  # position s predicts token s + 1: both must be real tokens
            keep = keep & torch.cat([keep[:, 1:], torch.zeros_like(keep[:, :1])], dim=1)
        labels = torch.where(keep, labels, torch.full_like(labels, ignore_index))
    out["labels"] = labels
    return out


# ----- labels ---------------------------------------------------------------------------------
def label_id(value: Any, label2id: Mapping[str, int], num_labels: int, where: str) -> int:
    """A record's label as a class id: a name of ``label2id``, or an id (int or digits) below
    ``num_labels``.

    Raises:
        FileFormatError: an unknown name, an id out of range, or a value of another type; the
            message lists the known labels.
    """
    known = f"known labels: {key_list(list(label2id), limit=10)} or ids 0..{num_labels - 1}"
    if isinstance(value, str) and value in label2id:
        return int(label2id[value])
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        number = int(value)
    if number is None:
        raise FileFormatError(
            f"{where}: label {value!r} is not a label of the model's config.json ({known})"
        )
    if not 0 <= number < num_labels:
        raise FileFormatError(f"{where}: label id {number} is out of range ({known})")
    return number


# ----- tokenised batches ----------------------------------------------------------------------
def task_of(model: nn.Module) -> str:
    """:data:`CLASSIFICATION` or :data:`CAUSAL_LM`, from the model's class and config.

    Raises:
        ArgumentError: a model of neither kind.
    """
    config = getattr(model, "config", None)
    names = [type(model).__name__, *(getattr(config, "architectures", None) or [])]
    if any(n.endswith("ForSequenceClassification") for n in names):
        return CLASSIFICATION
    if any(n.endswith(("ForCausalLM", "LMHeadModel")) for n in names):
        return CAUSAL_LM
    raise ArgumentError(
        f"text DATA needs a sequence-classification or causal-LM model (a class ending in "
        f"ForSequenceClassification, ForCausalLM or LMHeadModel); MODEL is {names[0]}. Tokenise "
        "the data yourself into a tensor file or give a DATA entry point"
    )


def load_tokenizer(folder: str) -> Any:
    """``AutoTokenizer.from_pretrained(folder)``, offline.

    Raises:
        ArgumentError: ``folder`` is not a folder, or holds no tokenizer files.
        MissingExtraError: transformers or tokenizers is not installed
            (``pip install 'gradmerge[hf]'``).
    """
    if not Path(folder).is_dir():
        raise ArgumentError(
            f"text DATA is tokenised with a Hugging Face tokenizer folder; {folder!r} is not a "
            "folder (give MODEL as a Hugging Face folder, or --tokenizer FOLDER)"
        )
    files = sorted(p.name for p in Path(folder).iterdir() if p.name in TOKENIZER_FILES)
    if not files:  # AutoTokenizer would build an empty one from the config: every word unknown
        raise ArgumentError(
            f"{folder} holds no usable tokenizer (none of {', '.join(TOKENIZER_FILES)}); save one "
            "next to the model with tokenizer.save_pretrained(folder), or pass --tokenizer FOLDER"
        )
    require("hf", "text DATA (tokenised with the model folder's Hugging Face tokenizer)")
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise ArgumentError(
            f"{folder} holds no usable tokenizer ({err}); save one next to the model with "
            "tokenizer.save_pretrained(folder), or pass --tokenizer FOLDER"
        ) from err


def positions_of(model: nn.Module) -> int | None:
    """The longest sequence the model takes (``max_position_embeddings``, ``n_positions``)."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocabulary_of(model: nn.Module) -> int | None:
    """Rows of the model's input embedding (token ids must be below it)."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if isinstance(embedding, nn.Embedding):
        return int(embedding.num_embeddings)
    value = getattr(getattr(model, "config", None), "vocab_size", None)
    return value if isinstance(value, int) else None


class TextBatches:
    """Re-iterable, padded batches of tokenised text examples (module docstring).

    Args:
        records: the examples (mappings from field names to values), e.g. :func:`read_records`.
        model: the model the batches are for: its class names the task; its config gives the
            labels, the vocabulary and the positions the sequences are checked against.
        tokenizer: a Hugging Face tokenizer (``__call__`` returning ``input_ids``).
        options: fields and limits (:class:`TextOptions`).
        batch_size: examples per batch.
        ignore_index: the label of positions that count for nothing (causal LM).
        source: DATA's name, for messages.

    Attributes:
        task: :data:`CLASSIFICATION` or :data:`CAUSAL_LM`.
        examples, tokens, truncated: examples kept, their tokens (special tokens included, padding
            not), and how many examples ``max_length`` cut.

    Raises:
        ArgumentError: a missing field (the fields found are named), a task the model has not.
        FileFormatError: a text that is not a string, a bad label (:func:`label_id`).
        StructureError: a token id at or above the model's vocabulary; a sequence longer than the
            model's positions (without ``max_length``); an example without tokens.
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        *,
        model: nn.Module,
        tokenizer: Any,
        options: TextOptions = TextOptions(),
        batch_size: int = 16,
        ignore_index: int = -100,
        source: str = "DATA",
    ) -> None:
        self.task, self.batch_size, self.ignore_index = task_of(model), batch_size, ignore_index
        self.source, config = source, getattr(model, "config", None)
        self.examples: list[dict[str, Tensor]] = []
        self.labels: list[int] = []
        self.truncated = 0
        positions, vocabulary = positions_of(model), vocabulary_of(model)
        limit = options.max_length
        if limit is not None and positions is not None and limit > positions:
            raise ArgumentError(
                f"--max-length {limit} exceeds the model's {positions} positions; "
                f"give at most {positions}"
            )
        for index, record in enumerate(records):
            where = f"{source}, example {index}"
            encoded = self._encode(tokenizer, record, options, where)
            ids = encoded["input_ids"]
            if ids.numel() == 0:
                raise StructureError(f"{where}: the tokenizer gave no tokens for {record!r}")
            if vocabulary is not None and int(ids.max()) >= vocabulary:
                raise StructureError(
                    f"{where}: token id {int(ids.max())} is outside the model's vocabulary of "
                    f"{vocabulary}; the tokenizer does not belong to MODEL (give the model's own "
                    "tokenizer with --tokenizer)"
                )
            if positions is not None and ids.numel() > positions:
                raise StructureError(
                    f"{where}: {ids.numel()} tokens, but the model has {positions} positions; "
                    f"pass --max-length {positions} (or less) to truncate"
                )
            self.examples.append(encoded)
            if self.task == CLASSIFICATION:
                label2id = dict(getattr(config, "label2id", None) or {})
                num_labels = int(getattr(config, "num_labels", len(label2id)))
                self.labels.append(
                    label_id(
                        _field(record, options.label_field, "--label-field", where),
                        label2id,
                        num_labels,
                        where,
                    )
                )
        self.tokens = sum(int(e["input_ids"].numel()) for e in self.examples)
        self.pad_id = self._pad_id(tokenizer, config)

    def _encode(
        self, tokenizer: Any, record: Mapping[str, Any], options: TextOptions, where: str
    ) -> dict[str, Tensor]:
        texts = [_text(record, options.text_field, "--text-field", where)]
        if options.text_pair_field is not None:
            texts.append(_text(record, options.text_pair_field, "--text-pair-field", where))
        full = tokenizer(*texts, verbose=False)
        if options.max_length is not None and len(full["input_ids"]) > options.max_length:
            full = tokenizer(*texts, truncation=True, max_length=options.max_length)
            self.truncated += 1
        keys = ("input_ids", "attention_mask", "token_type_ids")
        return {k: torch.tensor(full[k], dtype=torch.long) for k in keys if k in full}

    def _pad_id(self, tokenizer: Any, config: Any) -> int:
        for candidate in (
            getattr(config, "pad_token_id", None),
            getattr(tokenizer, "pad_token_id", None),
        ):
            if isinstance(candidate, int):
                return candidate
        if self.task == CLASSIFICATION and len({len(e["input_ids"]) for e in self.examples}) > 1:
            raise ArgumentError(
                f"{self.source}: sequences of different lengths need padding, but neither the "
                "model's config nor its tokenizer has a pad_token_id; set pad_token_id in "
                "config.json (a sequence classifier finds each sequence's end by it)"
            )
        return 0  # padding is masked out: causal LMs never attend to it, its labels are ignored

    def __len__(self) -> int:
        return -(-len(self.examples) // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        for start in range(0, len(self.examples), self.batch_size):
            yield self.batch(range(start, min(start + self.batch_size, len(self.examples))))

    def by_length(self) -> tuple[list[dict[str, Tensor]], list[int]]:
        """The examples in batches of similar length (shortest first), and their order.

        Each batch is padded to its longest sequence, so grouping by length saves the compute
        spent on padding; what a model gives an example does not depend on its batch (padding
        is masked), up to rounding. ``order[j]`` is the index of the j-th example of the batches
        (``gm.Evaluation.in_order`` puts per-example results back into the data's order).
        """
        order = sorted(
            range(len(self.examples)), key=lambda i: self.examples[i]["input_ids"].numel()
        )
        size = self.batch_size
        return [self.batch(order[s : s + size]) for s in range(0, len(order), size)], order

    def batch(self, rows: Sequence[int]) -> dict[str, Tensor]:
        """The examples ``rows`` padded into one Hugging Face batch with ``labels``."""
        chosen = [self.examples[i] for i in rows]
        width = max(int(e["input_ids"].numel()) for e in chosen)
        out: dict[str, Tensor] = {}
        for key in chosen[0]:
            fill = self.pad_id if key == "input_ids" else 0
            out[key] = torch.stack(
                [
                    torch.nn.functional.pad(e[key], (0, width - e[key].numel()), value=fill)
                    for e in chosen
                ]
            )
        out.setdefault(
            "attention_mask",
            torch.stack([(torch.arange(width) < e["input_ids"].numel()).long() for e in chosen]),
        )
        if self.task == CLASSIFICATION:
            out["labels"] = torch.tensor([self.labels[i] for i in rows], dtype=torch.long)
            return out
        out["labels"] = out["input_ids"].clone()
        return token_labels(out, True, self.ignore_index, self.source)

    def summary(self) -> str:
        """One line: examples, tokens, truncation."""
        cut = f", {self.truncated} truncated" if self.truncated else ""
        return f"{len(self.examples)} examples, {self.tokens} tokens{cut} ({self.task})"

    def metadata(self) -> dict[str, str]:
        """What a curvature's metadata records about the examples (``source.*`` keys)."""
        return {
            "source.task": self.task,
            "source.examples": str(len(self.examples)),
            "source.tokens": str(self.tokens),
            "source.truncated": str(self.truncated),
        }


def _field(record: Mapping[str, Any], name: str, flag: str, where: str) -> Any:
    if name not in record:
        raise ArgumentError(
            f"{where} has no field {name!r} (fields: {key_list(list(record), limit=10)}); name "
            f"the right one with {flag}"
        )
    return record[name]


def _text(record: Mapping[str, Any], name: str, flag: str, where: str) -> str:
    value = _field(record, name, flag, where)
    if not isinstance(value, str):
        raise FileFormatError(
            f"{where}: field {name!r} holds {type(value).__name__} {value!r}; expected text"
        )
    return value
