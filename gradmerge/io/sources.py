"""Where models and data come from: Hugging Face folders, tensor files and Python entry points.

The library side of ``gradmerge curvature MODEL DATA OUT`` (and of its data-parallel form under
``torchrun``): the command-line modules parse flags, this module turns the MODEL and DATA
arguments into an ``nn.Module`` and batches that :func:`gradmerge.estimate_curvature` accepts, and
records where they came from (:func:`provenance`).

The forms MODEL and DATA take are :data:`FORMS` (a string, shown by ``gradmerge curvature
--help`` also under ``python -OO``): a Hugging Face folder or an entry point for MODEL; text
(:mod:`gradmerge.io.text_data`), a tensor file (:class:`TensorBatches`) or an entry point for DATA.

Example:
    >>> import torch
    >>> from gradmerge.io.sources import TensorBatches
    >>> batches = TensorBatches({"inputs": torch.zeros(5, 2), "targets": torch.zeros(5)}, batch_size=2)
    >>> [x.shape[0] for x, _ in batches]
    [2, 2, 1]
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from gradmerge._extras import require
from gradmerge._guard import Input
from gradmerge._version import __version__
from gradmerge.errors import AdapterBaseError, ArgumentError, FileFormatError, StructureError
from gradmerge.io.lora import is_adapter, merged_state_dict
from gradmerge.io.text_data import (
    TEXT_SUFFIXES,
    TextBatches,
    TextOptions,
    load_tokenizer,
    positions_of,
    read_records,
    token_labels,
    vocabulary_of,
)

FORMS = """\
MODEL is either

- a Hugging Face model folder (config.json naming the class in architectures,
  safetensors weights), loaded offline with that transformers class; or
- a Python entry point module:function or path/to/file.py:function: a function returning
  the nn.Module (the current folder is importable, as with python -m), called with the
  keyword arguments given as --model-arg KEY=VALUE (none by default).

DATA is one of

- text: .jsonl, .csv/.tsv, .txt or a datasets folder (save_to_disk),
  tokenised with the MODEL folder's tokenizer, for sequence classification (a label per example)
  or causal language modelling (gradmerge.io.text_data);
- a tensor file (.safetensors, or .pt/.pth read with torch.load(weights_only=True))
  holding inputs and targets, or input_ids and labels (optionally
  attention_mask, token_type_ids), cut into batches (TensorBatches); labels
  either one per position, or one class per sequence, shape (examples,);
- an entry point returning an iterable of batches, as gradmerge.estimate_curvature
  accepts: (inputs, targets) pairs or Hugging Face dicts with "labels", called with the
  keyword arguments given as --data-arg KEY=VALUE, so that one function serves several tasks
  (--data-arg task=sentiment); its first --max-examples examples, and at most 10,000,000
  without it (an iterator that does not end stops with an error).

An entry point RUNS CODE: its module is imported and its function called, with your
permissions, as python -c "import module" would. Name only code you trust, and trust a YAML
file that names one (gradmerge refine) as you would a script: gradmerge refuses entry points in
YAML files unless --allow-entry-points or GRADMERGE_ALLOW_ENTRY_POINTS=1 says so
(docs/trust.md). Folders and files are only read, never run: weights through safetensors (or
torch.load(weights_only=True)), models by the transformers class their config names (no remote
code), YAML with a safe loader.
"""
"""The forms of MODEL and DATA, as ``gradmerge curvature --help`` shows them."""

TENSOR_SUFFIXES = (".safetensors", ".pt", ".pth")
LM_KEYS = ("input_ids", "labels", "attention_mask", "token_type_ids")


# ----- MODEL ----------------------------------------------------------------------------------
def model_kind(spec: str) -> str:
    """``"hugging face folder"`` or ``"entry point"``; :class:`ArgumentError` for anything else."""
    if Path(spec).is_dir():
        return "hugging face folder"
    if ":" in spec:
        _split_entry_point(spec)
        return "entry point"
    raise ArgumentError(
        f"MODEL {spec!r} is neither a folder nor an entry point: expected a Hugging Face model "
        "folder (with config.json) or module:function / path/to/file.py:function"
    )


def load_model(
    spec: str,
    arguments: Mapping[str, Any] | None = None,
    *,
    allow_new_weights: bool = False,
    base: str | None = None,
) -> nn.Module:
    """The ``nn.Module`` MODEL names: a Hugging Face folder or an entry point (module docstring),
    the latter called with the keyword ``arguments`` (``--model-arg``).

    ``allow_new_weights``: let a folder's model have parameters its weights files lack (randomly
    initialised: an intentionally new head) or hold tensors it does not use
    (``--allow-new-weights``); see :func:`hugging_face_model`. ``base``: the base model
    folder of a LoRA adapter MODEL (``--adapter-base``; default: :func:`adapter_base`).

    Raises:
        ArgumentError: neither a folder nor ``module:function``; an entry point that cannot be
            imported, does not take ``arguments`` or does not return an ``nn.Module``; arguments
            for a folder.
        FileFormatError: a folder without a usable ``config.json`` or safetensors weights, or
            with weights that do not fit its model.
    """
    if model_kind(spec) == "hugging face folder":
        if arguments:
            raise ArgumentError(f"MODEL {spec} is a folder; arguments apply to entry points")
        if base is not None and not is_adapter(spec):
            raise ArgumentError(
                f"MODEL {spec} is not a LoRA adapter; --adapter-base applies to one"
            )
        if is_adapter(spec):  # a PEFT LoRA folder: its base with the adapter applied
            model = hugging_face_model(
                adapter_base(Path(spec), base), allow_new_weights=allow_new_weights
            )
            model.load_state_dict(merged_state_dict(Path(spec), model.state_dict()))
            return model
        return hugging_face_model(Path(spec), allow_new_weights=allow_new_weights)
    model = call_entry_point(spec, "MODEL", arguments)
    if not isinstance(model, nn.Module):
        raise ArgumentError(
            f"MODEL entry point {spec} returned {type(model).__name__}; expected a torch.nn.Module"
        )
    return model


def adapter_base(folder: Path, base: str | os.PathLike[str] | None = None) -> Path:
    """The base model of a PEFT adapter folder: ``base`` when given (``--adapter-base``, a YAML
    ``adapter_base:``), else its config's ``base_model_name_or_path``.

    An absolute ``base_model_name_or_path`` is taken as it is. A relative one (peft records the
    name the base was loaded by, e.g. ``base``) is read relative to the folder that holds the
    adapter folder; it is refused when it also names another existing path relative to the
    current directory, or names one only there: which model the adapter was trained on cannot
    be told then, and a wrong base gives a silently wrong model.

    Example:
        >>> import json, tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     (Path(d) / "base").mkdir(); (Path(d) / "ad").mkdir()
        ...     _ = (Path(d) / "ad/adapter_config.json").write_text(
        ...         json.dumps({"base_model_name_or_path": "base"}))
        ...     adapter_base(Path(d) / "ad") == Path(d) / "base"
        True

    Raises:
        AdapterBaseError: a relative base that exists relative to the current directory and is
            not the one beside the adapter (or is not there at all).
        ArgumentError: no such local path (a hub name: gradmerge loads offline); a given
            ``base`` that does not exist.
        FileFormatError: an unreadable ``adapter_config.json``.
    """
    if base is not None:
        if not Path(base).exists():
            raise ArgumentError(f"the adapter base {base} of {folder} does not exist")
        return Path(base)
    try:
        named = json.loads((folder / "adapter_config.json").read_text()).get(
            "base_model_name_or_path"
        )
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        raise FileFormatError(f"{folder}/adapter_config.json is not readable JSON ({err})") from err
    fix = (
        "name the base model with --adapter-base FOLDER (gradmerge curvature/gradient) or "
        "`adapter_base:` beside the adapter's `model:` in a merge or remove YAML"
    )
    if named and Path(str(named)).is_absolute() and Path(str(named)).exists():
        return Path(str(named))
    if named and not Path(str(named)).is_absolute():
        beside, here = folder.parent / str(named), Path.cwd() / str(named)
        same = beside.exists() and here.exists() and beside.resolve() == here.resolve()
        if here.exists() and not same:
            where = f"{beside} beside the adapter" if beside.exists() else "nothing beside it"
            raise AdapterBaseError(
                f"MODEL {folder} is a LoRA adapter over the relative base_model_name_or_path "
                f"{named!r}, which names {here.resolve()} relative to the current directory and "
                f"{where}: which model it was trained on cannot be told; {fix}"
            )
        if beside.exists():
            return beside
    raise ArgumentError(
        f"MODEL {folder} is a LoRA adapter over {named!r}, which is not a local model folder "
        f"(a relative name is read relative to {folder.parent}); {fix}, or set "
        "base_model_name_or_path in its adapter_config.json"
    )


def spec_inputs(
    role: str, spec: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None
) -> list[Input]:
    """The files and folders that reading MODEL or DATA ``spec`` reads, for the output guard
    (:mod:`gradmerge._guard`): the path itself; for an entry point ``path/to/file.py:function``
    its file (a dotted module is found by Python, not by a path); for a LoRA adapter folder also
    the base it applies to (``base`` when given, else the one its
    ``adapter_config.json`` names, :func:`adapter_base`; left out when that cannot be told, as
    loading refuses it then).

    Example:
        >>> [str(i.path) for i in spec_inputs("DATA", "scripts/data.py:batches")]
        ['scripts/data.py']
    """
    text = str(spec)
    if ":" in text and not Path(text).exists():  # an entry point
        module = text.rpartition(":")[0]
        if module.endswith(".py") or "/" in module or os.sep in module:
            return [Input(role, Path(module))]
        return []
    found = [Input(role, Path(text))]
    if is_adapter(text):
        # an adapter whose base cannot be told is refused by loading, which names the fix
        with contextlib.suppress(ArgumentError, FileFormatError):
            found.append(Input(f"the base of LoRA adapter {role}", adapter_base(Path(text), base)))
    return found


def base_fingerprint(path: Path) -> str:
    """:func:`gradmerge.curvature.provenance.sample_hash` of the floating-point weights of a model
    folder or checkpoint file (a few rows per tensor are read): which base an adapter was
    applied to, recorded in a curvature's metadata."""
    from gradmerge.curvature.provenance import sample_hash_from
    from gradmerge.io.reader import open_checkpoint

    with open_checkpoint(path) as checkpoint:
        keys = [k for k in checkpoint if checkpoint.dtype(k).is_floating_point]
        return sample_hash_from(keys, checkpoint.shape, checkpoint.rows)


def tokenizer_folder(spec: str, base: str | None = None) -> str:
    """Where text DATA's tokenizer is: MODEL's folder, or an adapter's base folder
    (:func:`adapter_base`, ``base`` if given) when the adapter folder holds no tokenizer files."""
    from gradmerge.io.text_data import TOKENIZER_FILES

    folder = Path(spec)
    if is_adapter(spec) and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return str(adapter_base(folder, base))
    return spec


def hugging_face_model(folder: Path, *, allow_new_weights: bool = False) -> nn.Module:
    """The model of a Hugging Face folder, built offline by the class its config names.

    Every parameter must come from the folder's weights and every stored tensor must be used
    (transformers' loading report): a model with randomly initialised parts would give a
    curvature of a random model, different at every run. ``allow_new_weights`` accepts them (a
    new head, on purpose) and names them on stderr.

    Raises:
        FileFormatError: no ``config.json``, no class, no safetensors weights; weights missing,
            unexpected or of another shape (named, with the fix).
        MissingExtraError: transformers is not installed (``pip install 'gradmerge[hf]'``).
    """
    require("hf", f"the Hugging Face model folder {folder}")
    import transformers

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileFormatError(
            f"{folder} has no config.json: expected a Hugging Face model folder "
            "(model.save_pretrained(folder)) or a module:function entry point"
        )
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (json.JSONDecodeError, AttributeError) as err:
        raise FileFormatError(f"{config_file} is not a JSON object ({err})") from err
    if not architectures:
        raise FileFormatError(
            f"{config_file} names no 'architectures': add the model class, e.g. "
            '"architectures": ["GPT2LMHeadModel"], or give a module:function entry point'
        )
    cls = getattr(transformers, architectures[0], None)
    if cls is None:
        raise FileFormatError(
            f"{config_file}: transformers {transformers.__version__} has no class "
            f"{architectures[0]!r}; load it yourself in a module:function entry point"
        )
    weights = [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json")]
    if not weights:
        raise FileFormatError(
            f"{folder} holds no safetensors weights (model.safetensors or shards with an index); "
            "save with model.save_pretrained(folder) (safetensors is its default)"
        )
    model, info = cls.from_pretrained(
        folder, local_files_only=True, use_safetensors=True, output_loading_info=True
    )
    if not isinstance(model, nn.Module):  # pragma: no cover - transformers models are modules
        raise FileFormatError(f"{folder}: {architectures[0]} is not a torch model")
    _check_loading(folder, architectures[0], info, allow_new_weights)
    return model


def _check_loading(folder: Path, name: str, info: Mapping[str, Any], allow: bool) -> None:
    """Refuse (or, with ``allow``, report) what transformers' loading report lists."""
    from gradmerge._text import key_list

    parts = []
    for key, what in (
        ("missing_keys", "missing from the weights (they would be initialised randomly)"),
        ("unexpected_keys", "stored but not used by the model"),
        ("mismatched_keys", "stored with another shape (they would be initialised randomly)"),
    ):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if names:
            parts.append(f"{len(names)} tensor(s) {what}: {key_list(names)}")
    if not parts:
        return
    text = f"MODEL {folder} ({name}): " + "; ".join(parts)
    if allow:
        print(f"warning: {text} (accepted: --allow-new-weights)", file=sys.stderr)
        return
    raise FileFormatError(
        f"{text}. The weights files do not fit the config's model: save the complete model "
        "with model.save_pretrained(folder), or pass --allow-new-weights if a new head is meant "
        "to start from random values"
    )


# ----- DATA -----------------------------------------------------------------------------------
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
        _split_entry_point(spec)
        return "entry point"
    raise ArgumentError(
        f"DATA {spec!r} is neither a data file nor an entry point: expected text (.jsonl, .csv, "
        ".tsv, .txt, a datasets folder), tensors (.safetensors, .pt) or module:function / "
        "path/to/file.py:function returning batches"
    )


def load_data(
    spec: str,
    *,
    batch_size: int = 16,
    shift_labels: bool = False,
    ignore_index: int = -100,
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
        ignore_index: int = -100,
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


# ----- entry points ---------------------------------------------------------------------------
def _split_entry_point(spec: str) -> tuple[str, str]:
    module, _, attr = spec.rpartition(":")
    if not module or not attr.isidentifier():
        raise ArgumentError(
            f"{spec!r} is not an entry point: expected module:function or path/to/file.py:function"
        )
    return module, attr


def parse_argument(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` (``--model-arg``/``--data-arg``) as ``(key, value)``: the value read as JSON
    when it is (``3``, ``0.5``, ``true``, ``[1, 2]``, ``"a b"``), else kept as text.

    Example:
        >>> parse_argument("task=b"), parse_argument("n=3"), parse_argument("ids=[1, 2]")
        (('task', 'b'), ('n', 3), ('ids', [1, 2]))
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise ArgumentError(
            f"expected KEY=VALUE with a Python identifier as KEY (e.g. task=sentiment), got {text!r}"
        )
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def call_entry_point(spec: str, what: str, arguments: Mapping[str, Any] | None = None) -> Any:
    """Call the function ``spec`` names (:func:`entry_point`) with the keyword ``arguments``.

    Raises:
        ArgumentError: what :func:`entry_point` raises; arguments the function does not take.
    """
    function = entry_point(spec, what)
    arguments = dict(arguments or {})
    try:
        inspect.signature(function).bind(**arguments)
    except TypeError as err:
        given = ", ".join(f"{k}={v!r}" for k, v in arguments.items()) or "no arguments"
        raise ArgumentError(
            f"{what} entry point {spec} cannot be called with {given} ({err}); its signature is "
            f"{spec.rpartition(':')[2]}{inspect.signature(function)}"
        ) from err
    except ValueError:  # no signature (some builtins): let the call decide
        pass
    return function(**arguments)


def entry_point(spec: str, what: str) -> Callable[..., Any]:
    """The function ``module:function`` or ``path/to/file.py:function`` names.

    The current folder is importable (as with ``python -m``); a file's own folder is importable
    while it is loaded, so it can import its neighbours.

    Raises:
        ArgumentError: a module or file that cannot be found, a missing or non-callable name.
    """
    module_name, attr = _split_entry_point(spec)
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        module = _module_from_file(Path(module_name), what)
    else:
        try:
            with _importable(os.getcwd()):
                module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is None or not module_name.startswith(err.name):
                raise  # the module exists but one of ITS imports is missing: show that
            raise ArgumentError(
                f"{what} entry point {spec}: no module named {err.name!r} (run from the folder "
                "that holds it, install it, or give path/to/file.py:function)"
            ) from err
    function = getattr(module, attr, None)
    if function is None:
        raise ArgumentError(f"{what} entry point {spec}: {module_name} has no {attr!r}")
    if not callable(function):
        raise ArgumentError(
            f"{what} entry point {spec}: {attr!r} is a {type(function).__name__}; expected a "
            "function"
        )
    return cast(Callable[..., Any], function)


def _module_from_file(path: Path, what: str) -> Any:
    if not path.is_file():
        raise ArgumentError(f"{what} entry point: no Python file at {path}")
    name = "_gradmerge_entry_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ArgumentError(f"{what} entry point: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with _importable(str(path.resolve().parent)):
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@contextlib.contextmanager
def _importable(folder: str) -> Iterator[None]:
    """``folder`` at the front of ``sys.path`` while the block runs."""
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)


def provenance(
    model: str,
    data: str,
    *,
    device: torch.device,
    ignore_index: int,
    batch_size: int,
    shift_labels: bool,
    model_arguments: Mapping[str, Any] | None = None,
    data_arguments: Mapping[str, Any] | None = None,
    max_examples: int | None = None,
    seed: int | None = None,
    mc_samples: int | None = None,
    base: str | None = None,
) -> dict[str, str]:
    """What a curvature (or gradient) file's metadata records about how it was made
    (``source.*`` keys).

    ``model`` and ``data`` are the MODEL and DATA arguments; a tensor file's SHA-256 and how it
    was batched are recorded too, so that the estimate can be traced to its exact inputs;
    ``seed`` and ``mc_samples`` (Monte-Carlo Fishers) when given. For a LoRA adapter MODEL, the
    base model it was applied to (:func:`adapter_base`, ``base`` if given) and a fingerprint of
    that base's weights (:func:`base_fingerprint`).
    """
    data_kind_ = data_kind(data)
    meta = {
        "source.model": describe_source(model, model_kind(model)),
        "source.data": describe_source(data, data_kind_),
        "source.ignore_index": str(ignore_index),
        "source.device": str(device),
        "source.gradmerge": __version__,
        "source.torch": torch.__version__,
    }
    for key, value in (("seed", seed), ("mc_samples", mc_samples)):
        if value is not None:
            meta[f"source.{key}"] = str(value)
    for key, arguments in (("model", model_arguments), ("data", data_arguments)):
        if arguments:
            meta[f"source.{key}_arguments"] = json.dumps(dict(arguments), sort_keys=True)
    if is_adapter(model) and model_kind(model) == "hugging face folder":
        resolved = adapter_base(Path(model), base)
        meta["source.adapter_base"] = str(resolved.resolve())
        meta["source.adapter_base_weights_sample_sha256"] = base_fingerprint(resolved)
    if data_kind_ in ("tensor file", "text file"):
        meta["source.data_sha256"] = file_sha256(Path(data))
    if data_kind_ != "entry point":
        meta["source.batch_size"] = str(batch_size)
    if max_examples is not None:
        meta["source.max_examples"] = str(max_examples)
    if data_kind_ == "tensor file":
        meta["source.shift_labels"] = str(bool(shift_labels))
    return meta


# ----- helpers --------------------------------------------------------------------------------
def describe_source(spec: str, kind: str) -> str:
    """``spec`` with its file or folder made absolute (a module entry point stays as given)."""
    if kind == "entry point":
        module, attr = _split_entry_point(spec)
        if module.endswith(".py") or "/" in module:
            return f"{Path(module).resolve()}:{attr}"
        return spec
    return str(Path(spec).resolve())


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
