"""``gradmerge curvature MODEL DATA OUT``: estimate a task's curvature H_t and save it.

H_t = Σ_i ∇²ℓ_i (or its Fisher/GGN), a SUM over the examples of DATA, at the weights of MODEL
(θ_t for a fine-tuned model's H_t, θ_LLM for a prior or for removal): a call of
:func:`gradmerge.estimate_curvature` written with ``C.save(OUT)`` (atomic), so that
``gradmerge merge`` / ``gm.load_curvature`` can read it. Where MODEL and DATA came from is kept in
the file's metadata (``C.meta["source.*"]`` after loading).

MODEL is either

- a Hugging Face model folder (``config.json`` naming the class in ``architectures``,
  safetensors weights), loaded offline with that transformers class; or
- a Python entry point ``module:function`` or ``path/to/file.py:function``: a function of no
  arguments returning the ``nn.Module`` (the current folder is importable, as with ``python -m``).

DATA is either

- an entry point returning an iterable of batches, as :func:`gradmerge.estimate_curvature`
  accepts: ``(inputs, targets)`` pairs or Hugging Face dicts with ``"labels"``; or
- a tensor file (``.safetensors``, or ``.pt``/``.pth`` read with ``torch.load(weights_only=True)``)
  holding ``inputs`` and ``targets``, or ``input_ids`` and ``labels`` (optionally
  ``attention_mask``, ``token_type_ids``), cut into batches of ``--batch-size`` rows. ``labels``
  are the targets of each position's logits; ``--shift-labels`` turns Hugging Face's causal-LM
  convention (labels = input_ids) into that. Positions whose ``attention_mask`` is 0 are ignored.

The model is put in evaluation mode (no dropout), so the estimate is that of the weights given.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from gradmerge.distributed.launch import (
    DISTRIBUTED_EPILOG,
    add_distributed_options,
    check_distributed,
)
from gradmerge.errors import ArgumentError, FileFormatError, StructureError
from gradmerge.estimate.kfac import MAX_FACTOR_SIDE

TENSOR_SUFFIXES = (".safetensors", ".pt", ".pth")
LM_KEYS = ("input_ids", "labels", "attention_mask", "token_type_ids")
EXAMPLES = """\
examples:
  # a Hugging Face folder and a token file (input_ids, labels[, attention_mask])
  gradmerge curvature runs/ft-task-a data/task_a.safetensors task_a.curvature.safetensors \\
      --structure kfac --fisher empirical --batch-size 8 --shift-labels
  # your own model and data loader, as Python entry points
  gradmerge curvature mypkg.models:finetuned_a mypkg.data:task_a_batches a.curvature.safetensors
  gradmerge curvature ./build.py:model ./build.py:batches a.curvature.safetensors --structure full \\
      --fisher hessian --loss mse
  # a prior H_0 = Fisher of the base model on pre-training-like data, with sampled labels
  gradmerge curvature gpt2-base text.pt base.curvature.safetensors --fisher mc --mc-samples 4
  # K-FAC of a LLaMA-style model whose untied lm_head (vocab × hidden) would need a vocab² G:
  # layers with a factor side above 8192 get a diagonal block instead (none: no limit)
  gradmerge curvature runs/ft-llama data/task_a.safetensors a.curvature.safetensors \\
      --structure kfac --kfac-max-side 8192 --shift-labels
"""


def max_side(text: str) -> int | None:
    """``--kfac-max-side``: a positive int, or ``none`` for no limit."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer (the largest side of a K-FAC factor) or 'none', "
            f"got {text!r}"
        )
    return value


# ----- command line ---------------------------------------------------------------------------
def add_parser(sub: Any) -> None:
    """Register ``gradmerge curvature``."""
    p = sub.add_parser(
        "curvature",
        help="estimate a model's curvature on data (a SUM over examples) and save it",
        description=_plain((__doc__ or "").split("\n\n", 1)[1]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES + "\n" + DISTRIBUTED_EPILOG,
    )
    p.add_argument("model", metavar="MODEL", help="Hugging Face folder or module:function")
    p.add_argument("data", metavar="DATA", help="tensor file (.safetensors/.pt) or module:function")
    p.add_argument("out", metavar="OUT", help="curvature file to write (.safetensors)")
    p.add_argument("--structure", choices=["diag", "kfac", "full"], default="diag")
    p.add_argument(
        "--fisher",
        choices=["empirical", "mc", "ggn", "hessian"],
        default="empirical",
        help="empirical (observed labels), mc (sampled labels), ggn (exact GGN), "
        "hessian (--structure full only); default: empirical",
    )
    p.add_argument("--loss", choices=["cross_entropy", "mse"], default="cross_entropy")
    p.add_argument("--mc-samples", type=int, default=1, help="labels drawn per example (mc)")
    p.add_argument("--seed", type=int, default=0, help="seed of the Monte-Carlo draws")
    p.add_argument(
        "--batch-size", type=int, default=None, help="rows per batch of a tensor file (16)"
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--kfac-approx", choices=["expand", "reduce"], default="expand")
    p.add_argument(
        "--kfac-max-side",
        type=max_side,
        default=MAX_FACTOR_SIDE,
        metavar="N",
        help="--structure kfac: a layer whose A or G factor would have a side above N (N² × 4 "
        "bytes in float32) gets a diagonal block instead, e.g. an untied vocabulary head; "
        f"'none': no limit; default: {MAX_FACTOR_SIDE}",
    )
    p.add_argument("--ignore-index", type=int, default=-100, help="label of ignored positions")
    p.add_argument(
        "--shift-labels",
        action="store_true",
        help="labels follow Hugging Face's causal-LM convention (labels = input_ids): shift "
        "them left by one and ignore the last position",
    )
    p.add_argument(
        "--max-params", type=int, default=20_000, help="largest model --structure full takes"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_distributed_options(p)  # --distributed, --timeout, --expected-examples, --backend
    p.set_defaults(run=run, check=check)


def estimate_options(args: argparse.Namespace) -> dict[str, Any]:
    """The estimator's keywords from the command-line options (also under --distributed)."""
    return {
        "structure": args.structure,
        "fisher": args.fisher,
        "loss": args.loss,
        "mc_samples": args.mc_samples,
        "seed": args.seed,
        "ignore_index": args.ignore_index,
        "kfac_approx": args.kfac_approx,
        "max_params": args.max_params,
        "kfac_max_factor_side": args.kfac_max_side,
    }


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject unusable arguments before any work (argparse error: exit 2 with usage)."""
    if args.fisher == "hessian" and args.structure != "full":
        parser.error(
            "--fisher hessian needs --structure full (diag and kfac estimate a Fisher/GGN)"
        )
    check_distributed(parser, args)
    if args.mc_samples < 1:
        parser.error(f"--mc-samples must be at least 1, got {args.mc_samples}")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no CUDA device is available; use --device cpu")
    try:
        model_kind, data_kind = _model_kind(args.model), _data_kind(args.data)
    except ArgumentError as err:
        parser.error(str(err))
    if data_kind == "entry point" and args.batch_size is not None:
        parser.error("--batch-size applies to tensor files; an entry point yields its own batches")
    if data_kind == "entry point" and args.shift_labels:
        parser.error("--shift-labels applies to tensor files; shift the labels in your data code")
    out = Path(args.out)
    if out.is_dir():
        parser.error(f"OUT {out} is a folder; give a file name such as task.curvature.safetensors")
    if out.exists() and not args.overwrite:
        parser.error(f"OUT {out} exists; pass --overwrite to replace it")
    args.model_kind, args.data_kind = model_kind, data_kind


def run(args: argparse.Namespace) -> int:
    """``gradmerge curvature``: 0 on success, 1 on bad input (a typed error of
    :mod:`gradmerge.errors` or an I/O error, reported on one line of stderr as ``gradmerge merge``
    does); other exceptions, e.g. from the user's own entry points, keep their traceback."""
    from gradmerge.errors import GradmergeError

    try:
        return execute(args)
    except (GradmergeError, OSError) as err:
        print(f"gradmerge curvature: error: {err}", file=sys.stderr)
        return 1


def execute(args: argparse.Namespace) -> int:
    """Load, estimate, save; print one summary line. Raises the typed errors of
    :mod:`gradmerge.errors` on bad input (see :func:`load_model`, :func:`load_data`)."""
    import gradmerge as gm

    if getattr(args, "distributed", False):  # under torchrun: gradmerge.distributed's path
        from gradmerge.distributed.launch import run_curvature

        return run_curvature(args)

    for name in ("model_kind", "data_kind"):  # set by check(); absent when called directly
        if not hasattr(args, name):
            args.model_kind, args.data_kind = _model_kind(args.model), _data_kind(args.data)
    start = time.perf_counter()
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    model = load_model(args.model).to(device).eval()
    data = load_data(
        args.data,
        batch_size=args.batch_size or 16,
        shift_labels=args.shift_labels,
        ignore_index=args.ignore_index,
    )
    warn_unshifted(model, data, shift_labels=args.shift_labels)
    batches = data if args.no_progress else progress(data, f"{args.structure} {args.fisher}")
    curvature = gm.estimate_curvature(model, batches, **estimate_options(args))
    curvature.meta.update(provenance(args, device))
    path = curvature.save(args.out)
    covered = sum(
        int(torch.Size(shape).numel()) for _, shape in curvature.layout or ()
    )  # parameters covered
    print(
        f"wrote {path}: {args.structure} {args.fisher} curvature of {covered:,} parameters, "
        f"a sum over {curvature.meta['num_examples']} examples ({time.perf_counter() - start:.1f} s)"
    )
    return 0


def provenance(args: argparse.Namespace, device: torch.device) -> dict[str, str]:
    """What the file's metadata records about how it was made (``source.*`` keys)."""
    import gradmerge

    meta = {
        "source.model": _describe_source(args.model, args.model_kind),
        "source.data": _describe_source(args.data, args.data_kind),
        "source.seed": str(args.seed),
        "source.mc_samples": str(args.mc_samples),
        "source.ignore_index": str(args.ignore_index),
        "source.device": str(device),
        "source.gradmerge": gradmerge.__version__,
        "source.torch": torch.__version__,
    }
    if args.data_kind == "tensor file":
        meta["source.data_sha256"] = _sha256(Path(args.data))
        meta["source.batch_size"] = str(args.batch_size or 16)
        meta["source.shift_labels"] = str(bool(args.shift_labels))
    return meta


# ----- MODEL ----------------------------------------------------------------------------------
def _model_kind(spec: str) -> str:
    if Path(spec).is_dir():
        return "hugging face folder"
    if ":" in spec:
        _split_entry_point(spec)
        return "entry point"
    raise ArgumentError(
        f"MODEL {spec!r} is neither a folder nor an entry point: expected a Hugging Face model "
        "folder (with config.json) or module:function / path/to/file.py:function"
    )


def load_model(spec: str) -> nn.Module:
    """The ``nn.Module`` MODEL names: a Hugging Face folder or an entry point (module docstring).

    Raises:
        ArgumentError: neither a folder nor ``module:function``; an entry point that cannot be
            imported or does not return an ``nn.Module``.
        FileFormatError: a folder without a usable ``config.json`` or safetensors weights.
    """
    if _model_kind(spec) == "hugging face folder":
        return hugging_face_model(Path(spec))
    model = entry_point(spec, "MODEL")()
    if not isinstance(model, nn.Module):
        raise ArgumentError(
            f"MODEL entry point {spec} returned {type(model).__name__}; expected a torch.nn.Module"
        )
    return model


def hugging_face_model(folder: Path) -> nn.Module:
    """The model of a Hugging Face folder, built offline by the class its config names."""
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
    model = cls.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    if not isinstance(model, nn.Module):  # pragma: no cover - transformers models are modules
        raise FileFormatError(f"{folder}: {architectures[0]} is not a torch model")
    return model


# ----- DATA -----------------------------------------------------------------------------------
def _data_kind(spec: str) -> str:
    if spec.endswith(TENSOR_SUFFIXES):
        if not Path(spec).is_file():
            raise ArgumentError(f"DATA file {spec} does not exist")
        return "tensor file"
    if ":" in spec:
        _split_entry_point(spec)
        return "entry point"
    raise ArgumentError(
        f"DATA {spec!r} is neither a tensor file nor an entry point: expected a .safetensors or "
        ".pt file, or module:function / path/to/file.py:function returning batches"
    )


def load_data(
    spec: str, *, batch_size: int = 16, shift_labels: bool = False, ignore_index: int = -100
) -> Iterable[Any]:
    """The batches DATA names: an entry point's iterable, or a tensor file cut into batches.

    Raises:
        ArgumentError: an entry point that cannot be imported or returns no iterable.
        FileFormatError: an unreadable tensor file or one with other tensor names.
        StructureError: tensors whose first (example) dimensions differ.
    """
    if _data_kind(spec) == "entry point":
        data = entry_point(spec, "DATA")()
        if not isinstance(data, Iterable) or isinstance(data, (Tensor, str, bytes, Mapping)):
            raise ArgumentError(
                f"DATA entry point {spec} returned {type(data).__name__}; expected an iterable "
                "of batches, e.g. a list of (inputs, targets) or a DataLoader"
            )
        return data
    return TensorBatches(
        read_tensors(Path(spec)),
        batch_size=batch_size,
        shift_labels=shift_labels,
        ignore_index=ignore_index,
        source=spec,
    )


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
            self.tensors = _lm_tensors(tensors, shift_labels, ignore_index, source)
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


def _lm_tensors(
    tensors: Mapping[str, Tensor], shift: bool, ignore_index: int, source: str
) -> dict[str, Tensor]:
    out = dict(tensors)
    labels, mask = tensors["labels"], tensors.get("attention_mask")
    if labels.is_floating_point():
        raise StructureError(
            f"{source}: labels must be integer token ids, got {labels.dtype}; for regression "
            "targets store 'inputs' and 'targets' and pass --loss mse"
        )
    if mask is not None and mask.shape != labels.shape:
        raise StructureError(
            f"{source}: attention_mask {tuple(mask.shape)} and labels {tuple(labels.shape)} "
            "must have the same shape"
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


def entry_point(spec: str, what: str) -> Callable[[], Any]:
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
            "function of no arguments"
        )
    return cast(Callable[[], Any], function)


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


# ----- helpers --------------------------------------------------------------------------------
def progress(data: Iterable[Any], label: str) -> Iterable[Any]:
    """``data`` with a progress bar (tqdm, on stderr) over each pass.

    A one-shot iterator stays one, so that estimators needing two passes can refuse it.
    """
    if isinstance(data, Iterator):
        return _bar(data, label, None)
    return _Passes(data, label)


class _Passes:
    def __init__(self, data: Iterable[Any], label: str) -> None:
        self.data, self.label, self.passes = data, label, 0

    def __iter__(self) -> Iterator[Any]:
        self.passes += 1
        label = self.label if self.passes == 1 else f"{self.label} (pass {self.passes})"
        total = len(self.data) if isinstance(self.data, Sized) else None
        return _bar(self.data, label, total)


def _bar(data: Iterable[Any], label: str, total: int | None) -> Iterator[Any]:
    from tqdm import tqdm

    with tqdm(data, desc=label, total=total, unit="batch", file=sys.stderr) as bar:
        yield from bar


def _plain(text: str) -> str:
    """Docstring text without reST markup, for --help."""
    return re.sub(r":\w+:`([^`]*)`", r"\1", text).replace("``", "")


def _describe_source(spec: str, kind: str) -> str:
    if kind == "entry point":
        module, attr = _split_entry_point(spec)
        if module.endswith(".py") or "/" in module:
            return f"{Path(module).resolve()}:{attr}"
        return spec
    return str(Path(spec).resolve())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
