"""The output guard: the one place that says where a run may write, and how it writes.

In the foundation because every part that writes goes through it: curvature files, io, jobs,
the distributed merge, the demo and the commands.

Every command that writes declares its outputs (:class:`Output`) and everything it reads
(:class:`Input`: the models, an adapter's base, tokenizer folders, curvature and data files,
the configuration file and every path in it); :func:`check` applies the rules before any work,
and the writers below apply the rest while writing. The rules (docs/reliability.md states them
as this module applies them):

1. **No output overlaps an input, nor another output.** An output may not *be* an input, *lie
   inside* one (a folder the run reads) or *contain* one (a folder that holds something the
   run reads); nor may two outputs of one run be, lie inside or contain each other (``tune
   --out X --out-dir X`` would write one over the other at the end of its work). Paths are
   compared after resolving symlinks, ``..`` and relative parts, so a symlink to an input is
   that input. Refused with and without ``--overwrite``: :class:`~gradmerge.errors.
   OutputOverlapError`, ``"ROLE OUT is|lies inside|contains WHAT PATH: ..."``.
2. **An existing output is replaced only with ``--overwrite``** (:class:`~gradmerge.errors.
   OutputExistsError`), and only by one of its kind: a file output may not be an existing
   folder, a folder output not an existing file.
3. **Its folder must be writable**: the nearest existing ancestor must be a folder (not a file)
   in which a file can be created (probed): else :class:`~gradmerge.errors.OutputWriteError`.
   Missing parent folders are created when the output is written, and removed again if the
   write fails.
4. **Writes are staged and renamed**: a file is written to a hidden temporary file beside it
   (:func:`staged_file`), a folder is built in a hidden sibling folder (:func:`staged_folder`),
   and renamed onto the target only when complete. On any failure the temporary file or folder
   is removed (and the parents the write made): nothing partial is left, and an existing
   output is kept as it was.
5. **Failures are one line**: a full disk, a read-only or unwritable folder, a parent that is a
   file and a folder in the way become :class:`~gradmerge.errors.OutputWriteError`, naming the
   output, the cause and the fix.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> with tempfile.TemporaryDirectory() as d:
    ...     model = Path(d, "model"); model.mkdir()
    ...     try:
    ...         check([Output("OUT", Path(d))], [Input("MODEL", model)], overwrite=True)
    ...     except OutputOverlapError as err:
    ...         print(str(err).split(":")[0].replace(d, "D"))
    OUT D contains MODEL D/model
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gradmerge.errors import (
    InputChangedError,
    OutputExistsError,
    OutputOverlapError,
    OutputWriteError,
)
from gradmerge.foundation.files import publish, temp_dir_beside, temp_file_beside


@dataclass(frozen=True)
class Input:
    """A file or folder a run reads. ``role`` names it as the user gave it (``MODEL``,
    ``CONFIG``, ``models[1].curvature``, ``the base of LoRA adapter MODEL``)."""

    role: str
    path: Path


@dataclass(frozen=True)
class Output:
    """A file or folder a run writes. ``role`` names it as the user gave it (``OUT``,
    ``--json``); ``kind`` says whether it is one file or a folder."""

    role: str
    path: Path
    kind: Literal["file", "folder"] = "file"


def check(
    outputs: Sequence[Output],
    inputs: Sequence[Input],
    *,
    overwrite: bool,
    how: str = "overwrite=True",
) -> None:
    """Apply rules 1-3 of the module docstring to every output, before any work.

    ``how``: how the caller asks to replace an output, for the messages: ``overwrite=True`` in
    Python, ``--overwrite`` on the command line (:func:`gradmerge.commands._writes.guard`).

    Raises:
        OutputOverlapError: an output is, lies inside or contains an input or another output
            (even with ``overwrite``).
        OutputExistsError: an output exists and not ``overwrite``.
        OutputWriteError: an output of the other kind is in the way, a parent is a file, or
            its folder cannot be written to.

    Example:
        >>> try:
        ...     check([Output("--out", Path("x")), Output("--out-dir", Path("x"), "folder")], [],
        ...           overwrite=True)
        ... except OutputOverlapError as err:
        ...     print(str(err).split(":")[0])
        --out-dir x is --out x
    """
    for i, output in enumerate(outputs):
        refuse_overlap(output, [Input(o.role, o.path) for o in outputs[:i]], outputs=True)
    for output in outputs:
        refuse_overlap(output, inputs)
        refuse_existing(output, overwrite, how)
        refuse_unwritable(output)


def refuse_overlap(output: Output, inputs: Sequence[Input], *, outputs: bool = False) -> None:
    """Rule 1: :class:`OutputOverlapError` if ``output`` is, lies inside or contains an input
    (``outputs``: another output of the run, given as an :class:`Input`)."""
    out = output.path.resolve()
    for item in inputs:
        source = item.path.resolve()
        if out == source:
            relation = "is"
        elif source in out.parents:
            relation = "lies inside"
        elif out in source.parents:
            relation = "contains"
        else:
            continue
        shown = str(item.path)
        if source != item.path.absolute():
            shown += f" (= {source})"
        if outputs:
            raise OutputOverlapError(
                f"{output.role} {output.path} {relation} {item.role} {shown}: the run writes "
                "both, so one would replace or land inside the other; give each output its own "
                "path, outside the others"
            )
        raise OutputOverlapError(
            f"{output.role} {output.path} {relation} {item.role} {shown}: writing it would "
            "replace, delete or add to an input of this run; choose a path outside every input"
        )


def refuse_existing(output: Output, overwrite: bool, how: str = "overwrite=True") -> None:
    """Rule 2: an existing output of the other kind, or any without ``overwrite`` (``how``: how
    the caller asks for it, named in the message)."""
    path = output.path
    if not path.exists():
        return
    if output.kind == "file" and path.is_dir():
        raise OutputWriteError(
            f"{output.role} {path} is a folder; give a file name (a new file, or one to replace "
            f"with {how})"
        )
    if output.kind == "folder" and not path.is_dir():
        raise OutputWriteError(
            f"{output.role} {path} is a file; give a folder name (a new folder, or one to "
            f"replace with {how})"
        )
    if not overwrite:
        raise OutputExistsError(
            f"{output.role} {path} exists; pass {how} to replace it, or choose another path"
        )


def refuse_unwritable(output: Output) -> None:
    """Rule 3: the nearest existing ancestor of ``output`` must be a folder one can write in."""
    folder = output.path.absolute().parent
    while not folder.exists() and not folder.is_symlink():
        folder = folder.parent
    if not folder.is_dir():
        raise _parent_is_a_file(output.role, output.path, folder)
    try:
        fd, probe = tempfile.mkstemp(prefix=".gradmerge-probe-", dir=folder)
    except OSError as err:
        raise write_error(output.role, output.path, err, folder) from err
    os.close(fd)
    os.unlink(probe)


@dataclass(frozen=True)
class Snapshot:
    """The size and modification time of every file of the inputs, taken before a run reads
    them, to find those that changed while it read (:meth:`check`, before the output is
    renamed into place): a checkpoint rewritten or appended to mid-merge would give an output
    that mixes two versions. A file truncated while it is memory-mapped cannot be caught this
    way: reading past its new end kills the process (SIGBUS) before the check; the output is
    not created either way (rule 4), docs/reliability.md.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = Path(d, "a.bin"); _ = path.write_bytes(b"12")
        ...     snapshot = Snapshot.of([Input("MODEL", path)])
        ...     _ = path.write_bytes(b"123")
        ...     try:
        ...         snapshot.check()
        ...     except InputChangedError as err:
        ...         print(str(err).split(" (")[0].replace(d, "D"))
        MODEL D/a.bin changed while the run read it
    """

    files: tuple[tuple[str, Path, int, int], ...]
    """(role, file, size, modification time in ns) of every file of every input."""

    @classmethod
    def of(cls, inputs: Sequence[Input]) -> Snapshot:
        """The inputs' files as they are now (a folder: every file under it; missing: none)."""
        found = []
        for item in inputs:
            paths = [item.path] if item.path.is_file() else []
            if item.path.is_dir():
                paths = sorted(p for p in item.path.rglob("*") if p.is_file())
            for path in paths:
                stat = path.stat()
                found.append((item.role, path, stat.st_size, stat.st_mtime_ns))
        return cls(tuple(found))

    def check(self) -> None:
        """Raise :class:`InputChangedError` naming the first file whose size or modification
        time differs from the snapshot's (or that is gone)."""
        for role, path, size, mtime in self.files:
            try:
                stat = path.stat()
                now: tuple[int, int] | None = (stat.st_size, stat.st_mtime_ns)
            except OSError:
                now = None
            if now != (size, mtime):
                what = "is gone" if now is None else f"{size:,} -> {now[0]:,} bytes"
                raise InputChangedError(
                    f"{role} {path} changed while the run read it ({what}): the output could mix "
                    "two versions of it, so nothing was written; run again once it no longer "
                    "changes"
                )


# ----- writing: staged beside the target, renamed when complete ----------------------------------
@contextmanager
def staged_file(target: str | os.PathLike[str], role: str = "OUT") -> Iterator[Path]:
    """A hidden temporary file beside ``target`` to write; renamed onto ``target`` when the block
    succeeds (rule 4), removed with the parent folders it made when it fails.

    Raises:
        OutputWriteError: the file could not be written (rule 5: full disk, read-only folder,
            a parent that is a file, ``target`` a folder).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     with staged_file(Path(d, "sub", "a.txt")) as tmp:
        ...         _ = tmp.write_text("done")
        ...     print(Path(d, "sub", "a.txt").read_text())
        done
    """
    target = Path(target)
    refuse_existing(Output(role, target, "file"), overwrite=True)  # a folder in the way
    made = _make_parents(target, role)
    try:
        tmp = temp_file_beside(target)
    except OSError as err:
        _remove_empty(made)
        raise write_error(role, target, err) from err
    try:
        yield tmp
        publish(tmp, target)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        _remove_empty(made)
        typed = _typed(role, target, err, any_errno=True)
        if typed is None:
            raise
        raise typed from err


def write_text(text: str, target: str | os.PathLike[str], role: str = "OUT") -> Path:
    """Write ``text`` to ``target`` through :func:`staged_file`; returns ``target``."""
    with staged_file(target, role) as tmp, open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())  # a full disk reports here, not after the rename
    return Path(target)


def write_json(value: object, target: str | os.PathLike[str], role: str = "OUT") -> Path:
    """Write ``value`` as indented JSON to ``target`` through :func:`staged_file`; NaN/Inf are
    refused (``ValueError``), so a report never holds them."""
    import json

    return write_text(json.dumps(value, indent=1, allow_nan=False) + "\n", target, role)


@contextmanager
def staged_folder(
    target: str | os.PathLike[str], *, overwrite: bool = False, role: str = "OUT_DIR"
) -> Iterator[Path]:
    """A hidden sibling folder of ``target`` to fill; it becomes ``target`` if the block
    succeeds (an existing ``target`` is replaced only then, and only with ``overwrite``).

    On an exception (or ``KeyboardInterrupt``) the sibling is removed, with the parent folders
    this call made, and ``target`` is left as it was. The sibling's name records its owner
    (:func:`gradmerge.foundation.files.temp_dir_beside`), so that one left by a killed process can
    be removed by the next run.

    Raises:
        OutputExistsError: ``target`` exists and not ``overwrite`` (checked before the block
            and again before the rename).
        OutputWriteError: ``target`` is a file, or writing failed for a full disk, a read-only
            folder, a parent that is a file (rule 5).
    """
    target = Path(target).absolute()
    output = Output(role, target, "folder")
    refuse_existing(output, overwrite)
    made = _make_parents(target, role)
    try:
        stage = temp_dir_beside(target, "gradmerge")
    except OSError as err:
        _remove_empty(made)
        raise write_error(role, target, err) from err
    try:
        yield stage
        publish_folder(stage, target, overwrite, role)
    except BaseException as err:
        shutil.rmtree(stage, ignore_errors=True)
        _remove_empty(made)
        typed = _typed(role, target, err, any_errno=False, inside=stage)
        if typed is None:
            raise
        raise typed from err


def publish_folder(stage: Path, target: Path, overwrite: bool, role: str = "OUT_DIR") -> None:
    """Rename the finished ``stage`` folder to ``target``, replacing an existing ``target`` only
    with ``overwrite`` (moved aside first, put back if the rename fails, removed after it)."""
    refuse_existing(Output(role, target, "folder"), overwrite)
    if not target.exists():
        os.replace(stage, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, old / target.name)
    try:
        os.replace(stage, target)
    except OSError:
        os.replace(old / target.name, target)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


# ----- one-line errors ------------------------------------------------------------------------
_FIXES = {
    errno.ENOSPC: "free space, or write to another disk",
    errno.EDQUOT: "free space under your quota, or write to another disk",
    errno.EFBIG: "write to a file system that takes larger files",
    errno.EROFS: "write to a folder on a writable file system",
    errno.EACCES: "write to a folder you may write to",
    errno.EPERM: "write to a folder you may write to",
    errno.ENOTDIR: "a parent of it is a file, not a folder: choose another path",
    errno.EISDIR: "it is a folder: give a file name",
    errno.ENOENT: "its folder was removed while the run wrote: run it again",
}
_WRITE_ONLY = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
"""Errors only a write can cause: mapped wherever they come from inside a staged block."""


def _errno(err: BaseException) -> int | None:
    """The errno of an ``OSError``, or of a safetensors error that wraps one (its Rust message
    ends in ``(os error N)``)."""
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno
    if type(err).__name__ == "SafetensorError":
        found = re.search(r"\(os error (\d+)\)", str(err))
        return int(found.group(1)) if found else None
    return None


def _typed(
    role: str, target: Path, err: BaseException, *, any_errno: bool, inside: Path | None = None
) -> OutputWriteError | None:
    """``err`` as an :class:`OutputWriteError`, or ``None`` when it is not a write failure
    (``any_errno``: every OS error of the block is; else only those only writes cause, or those
    naming a file in ``inside``)."""
    if isinstance(err, (OutputWriteError, OutputExistsError)):
        return None
    code = _errno(err)
    if code is None or code not in _FIXES:
        return None
    named = getattr(err, "filename", None)
    ours = inside is not None and named is not None and Path(named).is_relative_to(inside)
    if not (any_errno or code in _WRITE_ONLY or ours):
        return None
    return write_error(role, target, err)


def write_error(
    role: str, target: Path, err: BaseException, folder: Path | None = None
) -> OutputWriteError:
    """The one-line :class:`OutputWriteError` for ``err`` (an ``OSError``, or a safetensors error
    wrapping one) met while writing ``role`` ``target`` (``folder``: where, if not beside it)."""
    code = _errno(err)
    cause = os.strerror(code).lower() if code is not None else str(err)
    where = f" ({folder})" if folder is not None else ""
    fix = _FIXES.get(code or 0, "choose another path")
    made = OutputWriteError(
        f"{role} {target} could not be written: {cause}{where}; nothing was written: {fix}"
    )
    made.errno = code
    return made


def _make_parents(target: Path, role: str) -> list[Path]:
    """Create ``target``'s missing parent folders; the ones made, outermost first."""
    made = [p for p in reversed(target.absolute().parents) if not p.exists()]
    try:
        target.absolute().parent.mkdir(parents=True, exist_ok=True)
    except (OSError, FileExistsError) as err:
        _remove_empty(made)
        folder = next((p for p in target.absolute().parents if p.exists()), None)
        if folder is not None and not folder.is_dir():
            raise _parent_is_a_file(role, target, folder) from err
        raise write_error(role, target, err) from err
    return made


def _parent_is_a_file(role: str, target: Path, folder: Path) -> OutputWriteError:
    return OutputWriteError(
        f"{role} {target} cannot be written: {folder} is a file, not a folder; choose another path"
    )


def _remove_empty(made: list[Path]) -> None:
    """Remove the folders ``made`` (outermost first) where they are still empty."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            break
