"""Text examples as batches: JSONL, CSV/TSV, plain text and ``datasets`` folders, tokenised.

The text path of ``gradmerge curvature MODEL DATA OUT`` (:mod:`gradmerge.io.sources`): records are
read from DATA (JSONL, CSV/TSV, plain text, ``datasets`` folders: :mod:`gradmerge.io.text_records`,
whose names are re-exported here), tokenised with the MODEL folder's own tokenizer
(``AutoTokenizer``, offline) and cut into padded batches that :func:`gradmerge.estimate_curvature`
accepts.

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

import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gradmerge.errors import ArgumentError, FileFormatError, StructureError
from gradmerge.foundation.extras import require
from gradmerge.foundation.settings import IGNORE_INDEX
from gradmerge.foundation.text import key_list
from gradmerge.io.forms import BATCH_SIZE
from gradmerge.io.text_records import TEXT_SUFFIXES as TEXT_SUFFIXES  # re-exported: public path
from gradmerge.io.text_records import Records as Records
from gradmerge.io.text_records import TextOptions as TextOptions  # re-exported: public path
from gradmerge.io.text_records import is_text_data as is_text_data
from gradmerge.io.text_records import read_records as read_records

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
)
CLASSIFICATION, CAUSAL_LM = "sequence classification", "causal language modelling"


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
    """A record's label as a class id: a name of ``label2id``, or an id (an int, or ASCII digits
    with an optional minus sign) below ``num_labels``.

    Example:
        >>> label_id(" 2 ", {}, 3, "row 0"), label_id("pos", {"pos": 1}, 3, "row 1")
        (2, 1)

    Raises:
        FileFormatError: an unknown name, an id out of range, or a value of another type
            (``"--1"``, ``"²"``, ``"١"`` are not ids); the message lists the known labels.
    """
    known = f"known labels: {key_list(list(label2id), limit=10)} or ids 0..{num_labels - 1}"
    if isinstance(value, str) and value in label2id:
        return int(label2id[value])
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        digits = value.strip().lstrip("-")
        if len(digits) > _MAX_DIGITS:  # beyond any label, and beyond what int() may parse
            raise FileFormatError(
                f"{where}: label id of {len(digits)} digits is out of range ({known})"
            )
        number = int(value)
    if number is None:
        raise FileFormatError(
            f"{where}: label {_short(value)} is not a label of the model's config.json ({known})"
        )
    if not 0 <= number < num_labels:
        shown = str(number) if number.bit_length() < 64 else f"of {number.bit_length()} bits"
        raise FileFormatError(f"{where}: label id {shown} is out of range ({known})")
    return number


_INTEGER = re.compile(r"-?[0-9]+", re.ASCII)
"""An integer label written as text: ASCII digits only (``str.isdigit`` also takes ``"²"`` and
Arabic-Indic digits, which ``int`` then rejects or reads as other numbers)."""
_MAX_DIGITS = 18


def _short(value: Any) -> str:
    """``repr(value)``, at most 80 characters."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 64 else "a huge int"
    return text if len(text) <= 80 else text[:77] + "..."


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
            (``pip install '.[hf]'`` in a clone).
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
    """Re-iterable, padded batches of tokenised text examples (module docstring), streamed.

    Records are read and tokenised one batch at a time, on every pass, so that memory is
    bounded by a batch, not by the file. The constructor makes one pass that checks every
    example and counts them (tokens, truncation: what :meth:`summary` reports), so that bad
    input fails before any estimate.

    Tokenisation is one tokenizer call per batch, truncating to ``max_length`` (or, without it,
    to one past the model's positions, to find a too-long sequence without tokenising all of
    it); a text far longer than the limit is first cut at a whitespace after enough characters
    for the limit (:data:`CHARS_PER_TOKEN` per token), and tokenised whole only when that cut
    gives fewer tokens than the limit.

    Args:
        records: the examples (mappings from field names to values), re-iterable, e.g.
            :func:`read_records` or a list.
        model: the model the batches are for: its class names the task; its config gives the
            labels, the vocabulary and the positions the sequences are checked against.
        tokenizer: a Hugging Face tokenizer (``__call__`` returning ``input_ids``).
        options: fields and limits (:class:`TextOptions`).
        batch_size: examples per batch.
        ignore_index: the label of positions that count for nothing (causal LM).
        source: DATA's name, for messages.

    Attributes:
        task: :data:`CLASSIFICATION` or :data:`CAUSAL_LM`.
        examples, tokens, truncated: how many examples there are, their tokens (special tokens
            included, padding not), and how many examples ``max_length`` cut.

    Raises:
        ArgumentError: a missing field (the fields found are named), a task the model has not;
            a ``max_length`` above the model's positions, or one that leaves no room for a
            token of the text beside the tokenizer's special tokens.
        FileFormatError: a text that is not a string, a bad label (:func:`label_id`), no
            examples; what :class:`Records` raises.
        StructureError: a token id at or above the model's vocabulary; a sequence longer than the
            model's positions (without ``max_length``); an example without tokens.
    """

    def __init__(
        self,
        records: Iterable[Mapping[str, Any]],
        *,
        model: nn.Module,
        tokenizer: Any,
        options: TextOptions = TextOptions(),
        batch_size: int = BATCH_SIZE,
        ignore_index: int = IGNORE_INDEX,
        source: str = "DATA",
    ) -> None:
        self.task, self.batch_size, self.ignore_index = task_of(model), batch_size, ignore_index
        self.source, self.records, self.tokenizer = source, records, tokenizer
        self.options, config = options, getattr(model, "config", None)
        self.positions, self.vocabulary = positions_of(model), vocabulary_of(model)
        self.label2id = dict(getattr(config, "label2id", None) or {})
        self.num_labels = int(getattr(config, "num_labels", len(self.label2id)))
        limit = options.max_length
        if limit is not None and self.positions is not None and limit > self.positions:
            raise ArgumentError(
                f"--max-length {limit} exceeds the model's {self.positions} positions; "
                f"give at most {self.positions}"
            )
        if limit is not None:
            special = _special_tokens(tokenizer, options.text_pair_field is not None)
            if limit <= special:
                raise ArgumentError(
                    f"--max-length {limit} leaves no token of the text: the tokenizer adds "
                    f"{special} special token(s) to every {'pair' if special > 2 else 'example'}"
                    f"; give at least {special + 1}"
                )
        self.examples = self.tokens = self.truncated = 0
        lengths: set[int] = set()
        for chunk, truncated in self._chunks():
            self.truncated += truncated
            for encoded in chunk:
                self.examples += 1
                self.tokens += len(encoded["input_ids"])
                lengths.add(len(encoded["input_ids"]))
        self.labels_ignored = self._labels_ignored  # records whose label a causal LM ignores
        if self.examples == 0:
            raise FileFormatError(f"DATA {source} holds no examples")
        self.pad_id = self._pad_id(tokenizer, config, len(lengths) > 1)

    def _chunks(self) -> Iterator[tuple[list[dict[str, Any]], int]]:
        """The examples, tokenised and checked, ``batch_size`` at a time, and how many of them
        ``max_length`` cut."""
        self._labels_ignored = 0
        chunk: list[Mapping[str, Any]] = []
        start = 0
        for record in self.records:
            chunk.append(record)
            if len(chunk) == self.batch_size:
                yield self._encode(chunk, start)
                start, chunk = start + len(chunk), []
        if chunk:
            yield self._encode(chunk, start)

    def _encode(
        self, records: list[Mapping[str, Any]], start: int
    ) -> tuple[list[dict[str, Any]], int]:
        """``records`` (examples ``start``, ``start`` + 1, ...) tokenised, checked, labelled;
        and how many of them ``max_length`` cut."""
        options, tokenizer = self.options, self.tokenizer
        wheres = [f"{self.source}, example {start + i}" for i in range(len(records))]
        fields = [(options.text_field, "--text-field")]
        if options.text_pair_field is not None:
            fields.append((options.text_pair_field, "--text-pair-field"))
        columns = [
            [_text(r, name, flag, where) for r, where in zip(records, wheres, strict=True)]
            for name, flag in fields
        ]
        limit = options.max_length
        cap = limit if limit is not None else self.positions  # the longest sequence kept
        rows = [[column[i] for column in columns] for i in range(len(records))]
        cut = [False] * len(rows)
        if cap is not None:  # cut texts far longer than the limit (class docstring)
            for i, texts in enumerate(rows):
                shorter = [_cut(t, cap) for t in texts]
                if any(len(a) < len(b) for a, b in zip(shorter, texts, strict=True)) and all(
                    len(a) == len(b) or self._at_least(a, cap + 1)
                    for a, b in zip(shorter, texts, strict=True)
                ):
                    rows[i], cut[i] = shorter, True
        used = [list(column) for column in zip(*rows, strict=True)]
        bound = {} if cap is None else {"truncation": True, "max_length": cap + 1}
        encoded = tokenizer(*used, verbose=False, **bound)
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in encoded]
        out, truncated = [], 0
        for i, (record, where) in enumerate(zip(records, wheres, strict=True)):
            example = {k: list(encoded[k][i]) for k in keys}
            if cap is not None and len(example["input_ids"]) > cap:
                if limit is None:
                    self._too_long(rows[i], cut[i], where)
                short = tokenizer(*rows[i], truncation=True, max_length=limit, verbose=False)
                example = {k: list(short[k]) for k in keys}
                truncated += 1
            out.append(self._checked(example, record, where))
        return out, truncated

    def _at_least(self, text: str, count: int) -> bool:
        """Whether ``text`` alone gives at least ``count`` tokens (special tokens left out)."""
        ids = self.tokenizer(
            text, add_special_tokens=False, truncation=True, max_length=count, verbose=False
        )["input_ids"]
        return len(ids) >= count

    def _too_long(self, texts: list[str], cut: bool, where: str) -> None:
        """Raise the error for an example longer than the model's positions."""
        positions = self.positions or 0
        count = f"more than {positions}"
        if not cut and sum(map(len, texts)) <= 2 * CHARS_PER_TOKEN * (positions + 1):
            count = str(len(self.tokenizer(*texts, verbose=False)["input_ids"]))  # exact
        raise StructureError(
            f"{where}: {count} tokens, but the model has {positions} positions; "
            f"pass --max-length {positions} (or less) to truncate"
        )

    def _checked(
        self, example: dict[str, list[int]], record: Mapping[str, Any], where: str
    ) -> dict[str, Any]:
        """``example`` (token lists) checked against the model, with its class label."""
        ids = example["input_ids"]
        if not ids:
            raise StructureError(f"{where}: the tokenizer gave no tokens for {record!r}")
        if self.vocabulary is not None and max(ids) >= self.vocabulary:
            raise StructureError(
                f"{where}: token id {max(ids)} is outside the model's vocabulary of "
                f"{self.vocabulary}; the tokenizer does not belong to MODEL (give the model's "
                "own tokenizer with --tokenizer)"
            )
        out: dict[str, Any] = dict(example)
        if self.task == CLASSIFICATION:
            label = _field(record, self.options.label_field, "--label-field", where)
            out["labels"] = label_id(label, self.label2id, self.num_labels, where)
        elif self.options.label_field in record:  # a causal LM predicts the text's next tokens
            self._labels_ignored += 1
        return out

    def _pad_id(self, tokenizer: Any, config: Any, ragged: bool) -> int:
        for candidate in (
            getattr(config, "pad_token_id", None),
            getattr(tokenizer, "pad_token_id", None),
        ):
            if isinstance(candidate, int):
                return candidate
        if self.task == CLASSIFICATION and ragged:
            raise ArgumentError(
                f"{self.source}: sequences of different lengths need padding, but neither the "
                "model's config nor its tokenizer has a pad_token_id; set pad_token_id in "
                "config.json (a sequence classifier finds each sequence's end by it)"
            )
        return 0  # padding is masked out: causal LMs never attend to it, its labels are ignored

    def __len__(self) -> int:
        return -(-self.examples // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        for chunk, _ in self._chunks():
            yield self.batch(chunk)

    def by_length(self) -> tuple[list[dict[str, Tensor]], list[int]]:
        """The examples in batches of similar length (shortest first), and their order.

        Each batch is padded to its longest sequence, so grouping by length saves the compute
        spent on padding; what a model gives an example does not depend on its batch (padding
        is masked), up to rounding. ``order[j]`` is the index of the j-th example of the batches
        (``gm.Evaluation.in_order`` puts per-example results back into the data's order).
        Sorting needs every example at once: this holds all of them (as token lists), unlike
        iterating, whose memory is one batch.
        """
        examples = [e for chunk, _ in self._chunks() for e in chunk]
        order = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))
        size = self.batch_size
        batches = [
            self.batch([examples[i] for i in order[s : s + size]])
            for s in range(0, len(order), size)
        ]
        return batches, order

    def batch(self, chosen: list[dict[str, Any]]) -> dict[str, Tensor]:
        """Tokenised examples (token lists) padded on the right into one Hugging Face batch
        with ``labels``."""
        width = max(len(e["input_ids"]) for e in chosen)
        out: dict[str, Tensor] = {}
        for key in chosen[0]:
            if key == "labels":
                continue
            fill = self.pad_id if key == "input_ids" else 0
            rows = [e[key] + [fill] * (width - len(e[key])) for e in chosen]
            out[key] = torch.tensor(rows, dtype=torch.long)
        if "attention_mask" not in out:
            rows = [[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"])) for e in chosen]
            out["attention_mask"] = torch.tensor(rows, dtype=torch.long)
        if self.task == CLASSIFICATION:
            out["labels"] = torch.tensor([e["labels"] for e in chosen], dtype=torch.long)
            return out
        out["labels"] = out["input_ids"].clone()
        return token_labels(out, True, self.ignore_index, self.source)

    def summary(self) -> str:
        """One line: examples, tokens, truncation; and, for a causal LM reading records that
        carry a label field, that it ignores them."""
        cut = f", {self.truncated} truncated" if self.truncated else ""
        line = f"{self.examples} examples, {self.tokens} tokens{cut} ({self.task})"
        if self.labels_ignored:
            line += (
                f"; {self.labels_ignored} of {self.examples} records have a "
                f"`{self.options.label_field}` field, and a causal LM ignores it (it is scored on "
                "next-token prediction of the text)"
            )
        return line

    def metadata(self) -> dict[str, str]:
        """What a curvature's metadata records about the examples (``source.*`` keys)."""
        return {
            "source.task": self.task,
            "source.examples": str(self.examples),
            "source.tokens": str(self.tokens),
            "source.truncated": str(self.truncated),
        }


CHARS_PER_TOKEN = 64
"""Characters kept per token of the limit when a long text is cut before tokenising (a token
is rarely longer; a cut that gives too few tokens falls back to the whole text)."""


def _cut(text: str, limit: int) -> str:
    """``text`` cut at the start of a whitespace run after at least ``CHARS_PER_TOKEN`` ×
    (``limit`` + 1) characters (tokens do not span whitespace, so the tokens before the cut are
    the whole text's); the whole text when it is shorter or has no whitespace there."""
    size = CHARS_PER_TOKEN * (limit + 1)
    if len(text) <= 2 * size:
        return text
    match = _SPACE.search(text, size)
    return text if match is None or match.start() > 2 * size else text[: match.start()]


_SPACE = re.compile(r"\s")


def _special_tokens(tokenizer: Any, pair: bool) -> int:
    """The special tokens the tokenizer adds to an example (a pair with ``pair``)."""
    count = getattr(tokenizer, "num_special_tokens_to_add", None)
    return int(count(pair=pair)) if callable(count) else 0


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
