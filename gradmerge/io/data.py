"""DATA of the commands: its kinds, loading, tensor files, and the bound on an entry point's
batches.

:func:`load_data` turns the DATA argument into batches that :func:`gradmerge.estimate_curvature`
accepts: text (:mod:`gradmerge.io.text_data`), a tensor file (:class:`TensorBatches`) or an entry
point's iterable, read at most :data:`MAX_ENTRY_POINT_EXAMPLES` examples far without
``max_examples`` (:func:`bounded`). :func:`check_tokens` and :func:`warn_unshifted` check token
data against the model before any forward pass.

Example:
    >>> import torch
    >>> batches = TensorBatches({"inputs": torch.zeros(5, 2), "targets": torch.zeros(5)}, batch_size=2)
    >>> [x.shape[0] for x, _ in batches]
    [2, 2, 1]
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gradmerge.errors import ArgumentError, FileFormatError, StructureError
from gradmerge.foundation.settings import IGNORE_INDEX
from gradmerge.io.entry_points import call_entry_point, split_entry_point
from gradmerge.io.forms import BATCH_SIZE
from gradmerge.io.text_data import (
    TextBatches,
    TextOptions,
    load_tokenizer,
    positions_of,
    token_labels,
    vocabulary_of,
)
from gradmerge.io.text_records import TEXT_SUFFIXES, read_records

TENSOR_SUFFIXES = (".safetensors", ".pt", ".pth")


LM_KEYS = ("input_ids", "labels", "attention_mask", "token_type_ids")


def data_kind(spec: str) -> str:
    """``"tensor file"``, ``"text file"``, ``"dataset folder"`` or ``"entry point"``;
    :class:`ArgumentError` for anything else."""
    for kind, suffixes in (("tensor file", TENSOR_SUFFIXES), ("text file", TEXT_SUFFIXES)):
        if spec.endswith(suffixes):
            if not Path(spec).is_file():
                raise ArgumentError(f"DATA file {spec} does not exist")
            return kind
    if Path(spec).is_dir():
        return "dataset folder"
    if ":" in spec:
        split_entry_point(spec)
        return "entry point"
    raise ArgumentError(
        f"DATA {spec!r} is neither a data file nor an entry point: expected text (.jsonl, .csv, "
        ".tsv, .txt, a datasets folder), tensors (.safetensors, .pt) or module:function / "
        "path/to/file.py:function returning batches"
    )


def load_data(
    spec: str,
    *,
    batch_size: int = BATCH_SIZE,
    shift_labels: bool = False,
    ignore_index: int = IGNORE_INDEX,
    arguments: Mapping[str, Any] | None = None,
    max_examples: int | None = None,
    model: nn.Module | None = None,
    tokenizer: str | None = None,
    text: TextOptions | None = None,
) -> Iterable[Any]:
    """The batches DATA names (module docstring).

    Args:
        spec: the DATA argument.
        batch_size: examples per batch of a tensor or text file.
        shift_labels: a tensor file's labels follow Hugging Face's causal-LM convention.
        ignore_index: the label of positions that count for nothing.
        arguments: keyword arguments of a DATA entry point (``--data-arg``).
        max_examples: keep the first examples only (of an entry point: at most
            :data:`MAX_ENTRY_POINT_EXAMPLES` without it, :func:`bounded`).
        model: the model the data are for; needed by text, whose task, labels, vocabulary and
            positions it gives (:class:`gradmerge.io.text_data.TextBatches`).
        tokenizer: the Hugging Face folder whose tokenizer tokenises text (MODEL's folder).
        text: the fields and limits of text data (:class:`gradmerge.io.text_data.TextOptions`).

    Raises:
        ArgumentError: an entry point that cannot be imported, does not take ``arguments`` or
            returns no iterable; options that do not apply to this kind of DATA.
        FileFormatError: an unreadable file, tensors of other names, bad records or labels.
        StructureError: tensors whose first (example) dimensions differ; tokens or lengths the
            model cannot take.
    """
    kind = data_kind(spec)
    if arguments and kind != "entry point":
        raise ArgumentError(f"DATA {spec} is a {kind}; arguments apply to entry points")
    if kind == "entry point":
        data = call_entry_point(spec, "DATA", arguments)
        if not isinstance(data, Iterable) or isinstance(data, (Tensor, str, bytes, Mapping)):
            raise ArgumentError(
                f"DATA entry point {spec} returned {type(data).__name__}; expected an iterable "
                "of batches, e.g. a list of (inputs, targets) or a DataLoader"
            )
        return bounded(data, spec, max_examples)
    if kind == "tensor file":
        tensors = read_tensors(Path(spec))
        if max_examples is not None:
            tensors = {k: v[:max_examples] if v.ndim else v for k, v in tensors.items()}
        batches = TensorBatches(
            tensors,
            batch_size=batch_size,
            shift_labels=shift_labels,
            ignore_index=ignore_index,
            source=spec,
        )
        if model is not None:
            check_tokens(batches.tensors, model, spec)
        return batches
    if model is None or tokenizer is None:
        raise ArgumentError(f"text DATA {spec} needs the model and its tokenizer folder")
    if shift_labels:
        raise ArgumentError(
            f"DATA {spec} is text: a causal LM's labels are its next tokens already; leave out "
            "--shift-labels"
        )
    text = text or TextOptions()
    return TextBatches(
        read_records(spec, max_examples),
        model=model,
        tokenizer=load_tokenizer(tokenizer),
        options=text,
        batch_size=batch_size,
        ignore_index=ignore_index,
        source=spec,
    )


MAX_ENTRY_POINT_EXAMPLES = 10_000_000
"""The most examples read from a DATA entry point without ``max_examples``: beyond it, an
iterator that never ends is stopped with an error instead of running forever."""


def bounded(data: Iterable[Any], spec: str, max_examples: int | None) -> Iterable[Any]:
    """``data`` (an entry point's batches) cut after ``max_examples`` examples (the last batch
    cut to fit), or, without it, an error after :data:`MAX_ENTRY_POINT_EXAMPLES`.

    A one-shot iterator stays one (estimators that need two passes refuse it); a re-iterable
    stays re-iterable. ``max_examples`` is also the progress bar's total (``.rows``).

    Example:
        >>> import torch
        >>> endless = ((torch.zeros(2, 3), torch.zeros(2)) for _ in iter(int, 1))
        >>> [x.shape[0] for x, _ in bounded(endless, "data:endless", 5)]
        [2, 2, 1]
    """
    if isinstance(data, Iterator):
        return _first(data, spec, max_examples)
    if hasattr(data, "__len__"):
        return _SizedBounded(data, spec, max_examples)
    return _Bounded(data, spec, max_examples)


class _Bounded:
    def __init__(self, data: Iterable[Any], spec: str, limit: int | None) -> None:
        self.data, self.spec, self.limit = data, spec, limit
        self.rows = limit  # the progress bar's total: at most this many

    def __iter__(self) -> Iterator[Any]:
        return _first(iter(self.data), self.spec, self.limit)


class _SizedBounded(_Bounded):
    def __len__(self) -> int:
        """The batches of the data (at most: a limit may end them sooner)."""
        return len(self.data)  # type: ignore[arg-type]  # bounded() checked it has one


def _first(batches: Iterator[Any], spec: str, limit: int | None) -> Iterator[Any]:
    seen = 0
    for batch in batches:
        rows = _rows(batch)
        if limit is not None and seen + rows >= limit:
            yield batch if seen + rows == limit else _cut(batch, limit - seen, rows)
            return
        seen += rows
        if limit is None and seen > MAX_ENTRY_POINT_EXAMPLES:
            raise ArgumentError(
                f"DATA entry point {spec} gave more than {MAX_ENTRY_POINT_EXAMPLES:,} examples "
                "and has not ended (an endless iterator?): pass --max-examples N (refine: "
                "`text: {max_examples: N}`) to use its first N examples"
            )
        yield batch


def _rows(batch: Any) -> int:
    """The examples in a batch: the first dimension of its targets (``(inputs, targets)``) or
    ``labels`` (a Hugging Face dict); the estimators check the batch itself."""
    if isinstance(batch, Mapping):
        targets = batch.get("labels")
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        targets = batch[1]
    else:
        targets = None
    if not isinstance(targets, Tensor):
        raise ArgumentError(
            f"a batch of {type(batch).__name__} has no targets to count examples by; expected "
            "(inputs, targets) or a dict with 'labels'"
        )
    return int(targets.shape[0]) if targets.ndim else 1


def _cut(batch: Any, keep: int, rows: int) -> Any:
    """The first ``keep`` examples of a batch of ``rows``: every tensor (of a pair, a tuple or a
    dict) whose first dimension is ``rows`` is cut."""

    def cut(value: Any) -> Any:
        if isinstance(value, Tensor) and value.ndim and value.shape[0] == rows:
            return value[:keep]
        return value

    if isinstance(batch, Mapping):
        return {k: cut(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(cut(v) for v in batch)
    raise ArgumentError(f"a batch of {type(batch).__name__} cannot be cut to --max-examples")


def read_tensors(path: Path) -> dict[str, Tensor]:
    """The named tensors of a ``.safetensors`` or ``.pt`` file (the latter: a dict of tensors)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            loaded: Any = load_file(str(path))
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors and pickle raise their own errors on damaged files
        raise FileFormatError(f"DATA {path} cannot be read as a tensor file ({err})") from err
    if not isinstance(loaded, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items()
    ):
        raise FileFormatError(
            f"DATA {path} holds a {type(loaded).__name__}; expected a dict of named tensors "
            "(torch.save({'inputs': X, 'targets': y}, path))"
        )
    return dict(loaded)


class TensorBatches:
    """Re-iterable batches of ``batch_size`` rows cut from the tensors of a DATA file.

    ``{"inputs", "targets"}`` gives ``(inputs, targets)`` pairs; ``{"input_ids", "labels"}``
    (optionally ``attention_mask``, ``token_type_ids``) gives Hugging Face dicts. Label positions
    whose ``attention_mask`` is 0 become ``ignore_index``; with ``shift_labels`` the labels are
    first shifted left by one (labels[:, s] ← labels[:, s + 1], the last position ignored), so
    that position s of the logits is scored against token s + 1.

    Example:
        >>> import torch
        >>> b = TensorBatches({"inputs": torch.zeros(5, 2), "targets": torch.zeros(5)}, batch_size=2)
        >>> len(b), [x.shape[0] for x, _ in b]
        (3, [2, 2, 1])
    """

    def __init__(
        self,
        tensors: Mapping[str, Tensor],
        *,
        batch_size: int,
        shift_labels: bool = False,
        ignore_index: int = IGNORE_INDEX,
        source: str = "DATA",
    ) -> None:
        names = set(tensors)
        self.labels_are_input_ids = False
        if names == {"inputs", "targets"}:
            self.tensors = dict(tensors)
            if shift_labels:
                raise ArgumentError(
                    f"{source}: --shift-labels applies to input_ids/labels files, not "
                    "inputs/targets"
                )
        elif {"input_ids", "labels"} <= names <= set(LM_KEYS):
            labels, ids = tensors["labels"], tensors["input_ids"]
            kept = labels != ignore_index
            self.labels_are_input_ids = (
                labels.shape == ids.shape
                and bool(kept.any())
                and torch.equal(labels[kept], ids[kept])
            )
            self.tensors = token_labels(tensors, shift_labels, ignore_index, source)
        else:
            raise FileFormatError(
                f"{source} holds tensors {sorted(names)}; expected 'inputs' and 'targets', or "
                f"'input_ids' and 'labels' (optionally 'attention_mask', 'token_type_ids')"
            )
        rows = {k: (int(v.shape[0]) if v.ndim else 0) for k, v in self.tensors.items()}
        if len(set(rows.values())) != 1 or 0 in rows.values():
            raise StructureError(
                f"{source}: every tensor needs the same number of examples (first dimension) "
                f"and at least one; got {rows}"
            )
        self.rows, self.batch_size = next(iter(rows.values())), batch_size

    def __len__(self) -> int:
        return -(-self.rows // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        for start in range(0, self.rows, self.batch_size):
            part = {k: v[start : start + self.batch_size] for k, v in self.tensors.items()}
            if "inputs" in part:
                yield part["inputs"], part["targets"]
            else:
                yield part


def check_tokens(tensors: Mapping[str, Tensor], model: nn.Module, source: str) -> None:
    """Check ``input_ids`` against the model's vocabulary and positions (before any forward
    pass, which would fail with a bare ``IndexError``).

    Raises:
        StructureError: a token id below 0 or at or above the vocabulary, or sequences longer
            than the model's positions (the first offending example is named).
    """
    ids = tensors.get("input_ids")
    if ids is None or ids.numel() == 0:
        return
    vocabulary, positions = vocabulary_of(model), positions_of(model)
    if ids.is_floating_point():
        raise StructureError(f"{source}: input_ids are {ids.dtype}; token ids must be integers")
    if vocabulary is not None:
        bad = (ids < 0) | (ids >= vocabulary)
        if bool(bad.any()):
            row = int(bad.reshape(ids.shape[0], -1).any(dim=1).nonzero()[0])
            value = int(ids[row][bad[row]].reshape(-1)[0])
            raise StructureError(
                f"{source}, example {row}: token id {value} is outside the model's vocabulary "
                f"of {vocabulary} (ids 0 to {vocabulary - 1}); the data were tokenised for "
                "another model: tokenise them with MODEL's own tokenizer"
            )
    if positions is not None and ids.ndim >= 2 and ids.shape[1] > positions:
        raise StructureError(
            f"{source}: sequences of {ids.shape[1]} tokens, but the model has {positions} "
            f"positions; cut input_ids, labels and attention_mask to at most {positions} tokens "
            "(or give text DATA with --max-length)"
        )


def warn_unshifted(model: nn.Module, data: Iterable[Any], *, shift_labels: bool) -> None:
    """Warn when a causal LM's labels equal its input ids where they count (HF's unshifted form)."""
    if shift_labels or not isinstance(data, TensorBatches):
        return
    causal = any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in _archs(model))
    if causal and data.labels_are_input_ids:
        print(
            "warning: labels equal input_ids, so every position is scored against its own "
            "token; if they follow Hugging Face's causal-LM convention, pass --shift-labels",
            file=sys.stderr,
        )


def _archs(model: nn.Module) -> list[str]:
    config = getattr(model, "config", None)
    return [type(model).__name__, *(getattr(config, "architectures", None) or [])]
