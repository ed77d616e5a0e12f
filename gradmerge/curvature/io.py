"""Save and load curvatures as safetensors files, with metadata and a parameter fingerprint.

A file holds the tensors of one curvature (any structure, nested ``Blocks`` and lazy ``Sum``s of
structured terms included) and string metadata: the format version, the structure, what the
estimator recorded (fisher type, loss, number of examples, ...), the dtype, the layout, and a
fingerprint (SHA-256 of the covered parameter names and shapes); the tensors are named and the
structure described by :mod:`gradmerge.curvature.codec`. ``load_curvature(path, like=m)``
refuses a file whose fingerprint does not match the model or parameter dict ``m``. Writes are
atomic: a temporary file in the same folder, renamed when complete.

``open_curvature(path)`` opens a file lazily (:class:`CurvatureFile`): its structure at once, its
tensors only for the parameters asked for (``restrict``), so a streaming merge reads one K-FAC
layer's factors or one tensor's diagonal at a time instead of the whole file; what it asks of
the file's structure tree before reading a tensor is :mod:`gradmerge.curvature.spec`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gradmerge.curvature.base import Curvature
from gradmerge.curvature.blocks import Blocks
from gradmerge.curvature.codec import decode, encode
from gradmerge.curvature.spec import (
    MAX_SPEC_DEPTH,
    coupling_groups,
    is_elementwise,
    kfac_layer_keys,
    parse_spec,
    restricted_spec,
    spec_depth,
    tensor_names,
)
from gradmerge.errors import ArgumentError, FileFormatError, GradmergeError, StructureError
from gradmerge.foundation.guard import staged_file
from gradmerge.foundation.readahead import Readahead, data_offsets, row_range
from gradmerge.params import Layout, Params

FORMAT = "gradmerge-curvature/1"


def fingerprint(layout: Layout) -> str:
    """SHA-256 of the sorted ``name:shape`` lines of the covered parameters."""
    lines = sorted(f"{k}:{','.join(map(str, s))}" for k, s in layout)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def save_curvature(curvature: Curvature, path: str | os.PathLike[str]) -> Path:
    """Write ``curvature`` to ``path`` (a ``.safetensors`` file), atomically.

    Raises:
        ArgumentError: δ·I alone, or Blocks/Sums nested too deep for a file.
        OutputWriteError: ``path`` could not be written (a full disk, a read-only folder, a
            parent that is a file, a folder at ``path``); nothing is left of it
            (:func:`gradmerge.foundation.guard.staged_file`).
    """
    from safetensors.torch import save_file

    if curvature.layout is None:
        raise ArgumentError("δ·I covers no particular parameters; there is nothing to save")
    tensors: dict[str, Tensor] = {}
    spec = encode(curvature, "", tensors)
    if spec_depth(spec) > MAX_SPEC_DEPTH:
        raise ArgumentError(
            f"this curvature nests Blocks/Sums more than {MAX_SPEC_DEPTH} levels deep, more than "
            "a curvature file may hold: flatten it (gm.Blocks of the innermost blocks)"
        )
    seen: set[tuple[int, int]] = set()
    for key, value in tensors.items():  # safetensors refuses tensors that share memory
        ident = (value.untyped_storage().data_ptr(), int(value.storage_offset()))
        if (
            ident in seen
            or value.untyped_storage().nbytes() != value.numel() * value.element_size()
        ):
            tensors[key] = value.clone()
        seen.add(ident)
    dtype, _ = curvature._dtype_device()
    meta = {
        "format": FORMAT,
        "structure": spec["type"],
        "spec": json.dumps(spec),
        "layout": json.dumps([[k, list(s)] for k, s in curvature.layout]),
        "fingerprint": fingerprint(curvature.layout),
        "dtype": str(dtype).removeprefix("torch."),
        "precision": str(curvature.coarsest_dtype).removeprefix("torch."),
        **{f"info.{k}": str(v) for k, v in curvature.meta.items()},
    }
    target = Path(path)
    with staged_file(target, "the curvature file") as tmp:
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=meta
        )
    return target


def recorded_examples(info: Mapping[str, str], *, where: str) -> int | None:
    """The ``num_examples`` a curvature file records (``info``: its ``info.*`` metadata), or
    ``None`` when it records none (files made by hand, or before it was recorded).

    Checked where every reader opens a file (:class:`CurvatureFile`: ``merge``, ``remove``,
    ``tune``, ``gm.load_curvature``, ``inspect``), so that all treat it alike.

    Example:
        >>> recorded_examples({"num_examples": "12"}, where="a.safetensors")
        12

    Raises:
        FileFormatError: a value that is not a whole number ≥ 1 (zero, negative, ``"abc"``,
            ``"1.5"``), naming the file (``where``): a curvature is a SUM over its examples, and
            a count that is not one says the file is not what it claims to be.
    """
    value = info.get("num_examples")
    if value is None:
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1 or str(count) != value.strip():
        raise FileFormatError(
            f"{where}: num_examples is {value!r}, expected a whole number ≥ 1 (a curvature is a "
            "SUM over its examples): the file is damaged or was edited; estimate it again, or "
            "record the right count (gradmerge convert-curvature --num-examples N)"
        )
    return count


def load_curvature(
    path: str | os.PathLike[str],
    *,
    like: nn.Module | Params | None = None,
    device: torch.device | str | None = None,
) -> Curvature:
    """Read a curvature written by :func:`save_curvature` (``C.save``).

    Args:
        path: the file.
        like: a model or parameter dict the curvature must fit: every covered parameter must
            exist there with the same shape, else :class:`StructureError` names the differences.
        device: where to put the tensors (default: CPU).

    Raises:
        FileNotFoundError: no such file.
        FileFormatError: not a gradmerge curvature file, or a corrupt/truncated one.
        StructureError: the fingerprint does not match ``like``.
    """
    from safetensors import safe_open

    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"no curvature file at {source}")
    try:
        with safe_open(str(source), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open API
    except Exception as err:  # safetensors raises its own errors for damaged files
        raise FileFormatError(f"{source} is not a readable safetensors file ({err})") from err
    if meta.get("format") != FORMAT:
        raise FileFormatError(
            f"{source} is not a gradmerge curvature file (format {meta.get('format')!r}, "
            f"expected {FORMAT!r}); write curvatures with C.save(path)"
        )
    if device is not None:
        tensors = {k: v.to(device) for k, v in tensors.items()}
    try:
        spec = parse_spec(meta["spec"], source)
    except (KeyError, ValueError) as err:
        if isinstance(err, FileFormatError):
            raise
        raise FileFormatError(f"{source}: damaged curvature metadata ({err})") from err
    try:
        curvature = decode(spec, tensors)
        stored = meta["fingerprint"]
    except GradmergeError as err:  # e.g. NaN/Inf values: the tensors are wrong, not the metadata
        raise type(err)(f"{source}: {err}") from err
    except (KeyError, ValueError) as err:
        raise FileFormatError(f"{source}: damaged curvature metadata ({err})") from err
    if fingerprint(curvature.layout or ()) != stored:
        raise FileFormatError(f"{source}: the stored fingerprint does not match its tensors")
    curvature.meta.update({k[5:]: v for k, v in meta.items() if k.startswith("info.")})
    curvature._remember_precision(_precision(meta))
    if like is not None:
        _check_fits(curvature, like, source)
    return curvature


def _check_fits(curvature: Curvature, like: nn.Module | Params, source: Path) -> None:
    shapes = (
        {k: tuple(v.shape) for k, v in like.named_parameters()}
        if isinstance(like, nn.Module)
        else {k: tuple(v.shape) for k, v in like.items()}
    )
    layout = curvature.layout or ()
    missing = [k for k, _ in layout if k not in shapes]
    wrong = [
        f"{k}: file {tuple(s)}, model {shapes[k]}"
        for k, s in layout
        if k in shapes and tuple(s) != shapes[k]
    ]
    if missing or wrong:
        raise StructureError(
            f"{source} was estimated for other parameters (fingerprint mismatch): "
            + (f"{len(missing)} not in the model, e.g. {missing[:3]}; " if missing else "")
            + (f"{len(wrong)} of another shape, e.g. {wrong[:3]}" if wrong else "")
            + ". Estimate the curvature for this model."
        )


# ----- lazy, partial reading ----------------------------------------------------------------------
class CurvatureFile:
    """A curvature file opened lazily: its structure at once, its tensors only when asked for.

    ``couplings()`` lists the smallest groups of parameters the curvature couples (one tensor of a
    diagonal, a K-FAC layer's weight and bias, all parameters of a dense block; a lazy sum joins
    the groups of its terms). ``restrict(keys)`` builds the curvature over a union of such groups,
    reading only the tensors it needs (a diagonal's entries for ``keys``, the factors of the K-FAC
    layers in ``keys``); its ``mv``/``solve`` equal those of the whole curvature restricted to
    ``keys`` exactly, because a structure never couples parameters of different groups.

    Args:
        path: a file written by :func:`save_curvature` (``C.save``).

    Raises:
        FileNotFoundError: no such file.
        FileFormatError: not a gradmerge curvature file, damaged metadata, a corrupt or truncated
            file, or a tensor the structure needs that the file does not hold.

    Example:
        >>> import tempfile, torch, gradmerge as gm
        >>> from gradmerge.curvature.io import open_curvature
        >>> C = gm.Blocks([gm.KFAC({"fc": (torch.eye(3), torch.eye(2))}, bias=["fc"]),
        ...                gm.Diagonal({"norm.weight": torch.ones(2)})])
        >>> with tempfile.TemporaryDirectory() as d:
        ...     with open_curvature(C.save(f"{d}/c.safetensors")) as f:
        ...         print(f.couplings())
        ...         print(f.restrict(["norm.weight"]), f.bytes_read)
        [('fc.weight', 'fc.bias'), ('norm.weight',)]
        Diagonal(1 tensors, 2 values) 8
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no curvature file at {self.path}")
        try:
            self._file = safe_open(str(self.path), framework="pt", device="cpu")
            meta = self._file.metadata() or {}
            self._names = set(self._file.keys())
        except Exception as err:  # safetensors raises its own errors for damaged files
            raise FileFormatError(
                f"{self.path} is not a readable safetensors file ({err}); it may be truncated or "
                "corrupt: write it again with C.save(path) or `gradmerge curvature`"
            ) from err
        if meta.get("format") != FORMAT:
            raise FileFormatError(
                f"{self.path} is not a gradmerge curvature file (format {meta.get('format')!r}, "
                f"expected {FORMAT!r}); write curvatures with C.save(path)"
            )
        try:
            self.spec: dict[str, Any] = parse_spec(meta["spec"], self.path)
            self.layout: Layout = tuple(
                (str(k), torch.Size(s)) for k, s in json.loads(meta["layout"])
            )
            self.fingerprint = meta["fingerprint"]
            self.structure = meta["structure"]
            groups = coupling_groups(self.spec)
        except FileFormatError:
            raise
        except (KeyError, ValueError, TypeError) as err:
            raise FileFormatError(f"{self.path}: damaged curvature metadata ({err!r})") from err
        if fingerprint(self.layout) != self.fingerprint:
            raise FileFormatError(f"{self.path}: the stored fingerprint does not match its layout")
        covered = [k for group in groups for k in group]
        if sorted(covered) != sorted(k for k, _ in self.layout):
            raise FileFormatError(f"{self.path}: the structure does not cover its stated layout")
        missing = sorted(set(tensor_names(self.spec)) - self._names)
        if missing:
            raise FileFormatError(
                f"{self.path} lacks {len(missing)} tensor(s) its structure needs, e.g. "
                f"{missing[:3]}; the file is damaged: write it again with C.save(path)"
            )
        self._groups = groups
        self.metadata: dict[str, str] = dict(meta)
        self.info: dict[str, str] = {k[5:]: v for k, v in meta.items() if k.startswith("info.")}
        self.num_examples = recorded_examples(self.info, where=str(self.path))
        self.bytes_read = 0
        self._starts = data_offsets(self.path)
        self._readahead = Readahead([self.path])

    def __repr__(self) -> str:
        return f"CurvatureFile({str(self.path)!r}, {self.structure}, {len(self.layout)} tensors)"

    def __enter__(self) -> CurvatureFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the file (the curvatures already built stay valid: they hold copies)."""
        self._file.__exit__(None, None, None)
        self._readahead.close()

    def couplings(self) -> list[tuple[str, ...]]:
        """The smallest groups of parameters this curvature couples, in file order."""
        return list(self._groups)

    def kfac_layers(self) -> dict[str, tuple[str, ...]]:
        """K-FAC layers stored as such (not inside a lazy sum): module name → its parameters."""
        return kfac_layer_keys(self.spec)

    def restrict(
        self,
        keys: Iterable[str],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        check_finite: bool = True,
        rows: slice | None = None,
    ) -> Curvature | None:
        """The curvature over the covered parameters among ``keys``; ``None`` if it covers none.

        ``keys`` must hold whole coupling groups (see :meth:`couplings`): a K-FAC layer's weight
        with its bias, every parameter of a dense block. Only the needed tensors are read; they
        are moved to ``device`` and cast to ``dtype`` when given. ``check_finite=False`` leaves
        the NaN/Inf check of diagonal values to whoever uses them
        (:func:`gradmerge.curvature.diagonal.unchecked`: the streaming engine names a non-finite
        value when a unit's merge fails), sparing a diagonal merge one read of each value.
        ``rows``: only these rows (along the first dimension) of every parameter, read alone,
        for a curvature that is elementwise over ``keys`` (:meth:`elementwise`): the diagonal
        of those rows, which is how the streaming engine merges a tensor larger than memory.

        Raises:
            ArgumentError: ``keys`` splits a coupling group; ``rows`` of a curvature that is
                not elementwise over ``keys``.
            FileFormatError: a tensor cannot be read.
        """
        wanted = set(keys)
        spec = restricted_spec(self.spec, wanted)
        if spec is None:
            return None
        if rows is not None and not is_elementwise(spec):
            raise ArgumentError(
                f"{self.path}: rows of {sorted(wanted)[:3]} were asked for, but its "
                f"{spec['type']} curvature couples their entries: read the whole parameters"
            )
        tensors = _LazyTensors(self, rows)
        try:
            curvature = _simplify(decode(spec, tensors, defer=not check_finite))
        except Exception as err:
            if isinstance(err, (FileFormatError, StructureError)) or not _is_safetensors(err):
                raise
            raise FileFormatError(f"{self.path}: cannot read a tensor ({err})") from err
        curvature.meta.update(self.info)
        curvature._remember_precision(_precision(self.metadata))
        now_dtype, now_device = curvature._dtype_device()
        if (dtype is not None and dtype != now_dtype) or (
            device is not None and torch.device(device) != now_device
        ):
            moved = curvature.to(device=device, dtype=dtype)
            moved.meta.update(self.info)
            curvature = moved
        return curvature

    def prefetch(self, keys: Iterable[str], rows: slice | None = None) -> None:
        """Start reading the tensors ``restrict(keys, rows=rows)`` would read into the page cache
        in the background (:mod:`gradmerge.foundation.readahead`; a hint only, nothing is
        checked)."""
        spec = restricted_spec(self.spec, set(keys))
        if spec is None:
            return
        sliced = rows is not None and is_elementwise(spec)
        for name in tensor_names(spec):
            if name in self._starts:
                start, end = self._starts[name]
                shape = self._file.get_slice(name).get_shape() if sliced else ()
                self._readahead.advise(0, *row_range(start, end, shape, rows if sliced else None))

    def elementwise(self, keys: Iterable[str]) -> bool:
        """Whether the curvature over ``keys`` is diagonal or δ·I (or blocks and sums of these),
        so that each entry couples with itself only (``restrict(keys, rows=...)`` applies).

        Raises:
            ArgumentError: ``keys`` splits a coupling group.
        """
        spec = restricted_spec(self.spec, set(keys))
        return spec is None or is_elementwise(spec)

    def load(
        self, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Curvature:
        """The whole curvature (as :func:`load_curvature`, without the ``like`` check)."""
        curvature = self.restrict([k for k, _ in self.layout], device=device, dtype=dtype)
        if curvature is None:
            raise FileFormatError(f"{self.path} covers no parameters")
        return curvature


def _precision(meta: Mapping[str, str]) -> torch.dtype | None:
    """The coarsest dtype the saved values had passed through (files from before: none known)."""
    dtype = getattr(torch, meta.get("precision", ""), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def open_curvature(path: str | os.PathLike[str]) -> CurvatureFile:
    """Open a curvature file lazily (see :class:`CurvatureFile`)."""
    return CurvatureFile(path)


class _LazyTensors(Mapping[str, Tensor]):
    """The file's tensors as a mapping that reads each one when it is looked up."""

    def __init__(self, file: CurvatureFile, rows: slice | None = None) -> None:
        self._file, self._rows = file, rows

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._file._names:
            raise KeyError(name)
        tensor = self._file._file.get_tensor(name)  # a view of the mapped file: nothing read yet
        if self._rows is not None:
            tensor = tensor[self._rows]
        self._file.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._file._names)

    def __len__(self) -> int:
        return len(self._file._names)


def _is_safetensors(err: BaseException) -> bool:
    return type(err).__module__.startswith("safetensors")


def _simplify(curvature: Curvature) -> Curvature:
    """A ``Blocks`` of one block is that block."""
    if isinstance(curvature, Blocks) and len(curvature.blocks) == 1:
        return _simplify(curvature.blocks[0])
    return curvature
