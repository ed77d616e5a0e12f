"""The demo's output directory: checked before any work, written all at once or not at all.

:func:`check_output` rejects, with an :class:`~gradmerge.errors.ArgumentError` that says what to
do: a path that is a file, a path below a file, an existing non-empty directory (unless
``overwrite``). :func:`staged_output` then makes a hidden temporary sibling directory
(``.NAME.XXXX.tmp``; a place where nothing can be written fails here, before the study runs),
yields it to be filled, and renames it to the final name only when everything was written. On
an error the temporary directory is removed, so a failed run leaves no half-written directory,
and an existing directory is replaced (with ``overwrite``) only by a complete one.

Example:
    >>> import tempfile, pathlib
    >>> from gradmerge.demo.output import staged_output
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> with staged_output(root / "demo", overwrite=False) as tmp:
    ...     _ = (tmp / "results.json").write_text("{}")
    >>> sorted(p.name for p in (root / "demo").iterdir())
    ['results.json']
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gradmerge.errors import ArgumentError


def check_output(out: str | os.PathLike[str], *, overwrite: bool) -> Path:
    """Check that ``out`` can become the demo's output directory; returns it as a Path.

    Raises:
        ArgumentError: ``out`` is a file, lies below a file, or is a non-empty directory and
            ``overwrite`` is False.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ArgumentError(
            f"--out {str(path)!r} is a file, expected a directory (new, empty, or replaced with "
            "--overwrite): choose another path"
        )
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ArgumentError(
            f"--out {str(path)!r} exists and is not empty: pass --overwrite to replace it, or "
            "choose another directory"
        )
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ArgumentError(
            f"--out {str(path)!r} lies below {str(ancestor)!r}, which is a file, not a "
            "directory: choose another path"
        )
    return path


@contextmanager
def staged_output(out: str | os.PathLike[str], *, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to write into; it becomes ``out`` on success.

    Raises:
        ArgumentError: as :func:`check_output`, or nothing can be written there (permissions,
            a read-only file system).
    """
    path = check_output(out, overwrite=overwrite)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private; give it mkdir's mode
    except OSError as error:
        raise ArgumentError(
            f"cannot write the demo's output to {str(path)!r}: {error.strerror or error}. "
            "Choose a directory you can write to (--out DIR)"
        ) from error
    try:
        yield staging
        _commit(staging, path, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _umask() -> int:
    """The process's file-mode creation mask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _commit(staging: Path, path: Path, *, overwrite: bool) -> None:
    """Rename ``staging`` to ``path``, replacing an existing directory there (checked again)."""
    check_output(path, overwrite=overwrite)  # it may have changed while the study ran
    if not path.exists():
        os.rename(staging, path)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
    os.rename(path, retired / path.name)
    try:
        os.rename(staging, path)
    except OSError:
        os.rename(retired / path.name, path)  # put the old directory back
        raise
    finally:
        shutil.rmtree(retired, ignore_errors=True)
