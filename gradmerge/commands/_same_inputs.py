"""The same MODEL or DATA given twice under two spellings (``evaluate``'s arguments).

Two arguments name the same input when they resolve to the same file or folder (``d/a.jsonl``,
``d/./a.jsonl``, ``./d/../d/a.jsonl``, a symlink to it), the same entry point
(``path/to/file.py:f`` by its resolved file, ``module:f`` as written) or — DATA only — when two
files (or ``datasets`` folders) hold the same bytes: a test set copied under another name.
Scoring it twice would count its examples twice in every mean over DATA (and narrow the
intervals), and a model compared with itself has nothing to compare.

Contents are compared only between inputs of equal total size (SHA-256 of each file, a folder's
files by their paths inside it), so distinct test sets cost one ``stat`` each. MODELs are
compared by path only: hashing every model's weights would cost more than scoring it.

Example:
    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = (pathlib.Path(d) / "a.jsonl").write_text("{}")
    ...     same_inputs("DATA", [f"{d}/a.jsonl", f"{d}/./a.jsonl"], contents=True) is not None
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# gradmerge.io.sources (and so torch) is imported where used: evaluate's argument checks and
# --help load no torch (proofs_tests/unit/cli/test_cli_start.py)


def same_inputs(role: str, specs: Sequence[str], *, contents: bool = False) -> str | None:
    """The message refusing the first pair of ``specs`` that name the same input (module
    docstring), or ``None`` when all differ. ``contents``: also compare the bytes of files and
    folders (DATA)."""
    seen: dict[str, str] = {}
    for spec in specs:
        key = _identity(spec)
        if key in seen:
            return (
                f"{role} {seen[key]} and {spec} are the same {_what(spec)} ({key}): it would be "
                f"scored twice{_consequence(role)}; give each {role} once"
            )
        seen[key] = spec
    if not contents:
        return None
    by_size: dict[int, list[str]] = {}
    for spec in seen.values():
        size = _size(spec)
        if size is not None:
            by_size.setdefault(size, []).append(spec)
    for group in by_size.values():
        digests: dict[str, str] = {}
        for spec in group if len(group) > 1 else ():
            digest = _digest(Path(spec))
            if digest in digests:
                return (
                    f"{role} {digests[digest]} and {spec} hold the same bytes (SHA-256 "
                    f"{digest[:16]}...): one test set would be scored twice{_consequence(role)}; "
                    f"give each {role} once"
                )
            digests[digest] = spec
    return None


def _identity(spec: str) -> str:
    """A file or folder resolved (symlinks, ``.`` and ``..``); an entry point by its resolved
    file, or as written when it names a module."""
    if Path(spec).exists():
        return str(Path(spec).resolve())
    from gradmerge.io.sources import describe_source

    return describe_source(spec, "entry point") if ":" in spec else spec


def _what(spec: str) -> str:
    path = Path(spec)
    return "folder" if path.is_dir() else "file" if path.exists() else "entry point"


def _consequence(role: str) -> str:
    if role == "DATA":
        return " and counted twice in every mean over DATA (narrowing the intervals)"
    return " and compared with itself"


def _size(spec: str) -> int | None:
    """The bytes of a file, or of every file in a folder; ``None`` for an entry point."""
    path = Path(spec)
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return None


def _digest(path: Path) -> str:
    """SHA-256 of a file's bytes; of a folder, of its files' relative paths and digests."""
    from gradmerge.io.sources import file_sha256

    if path.is_file():
        return file_sha256(path)
    import hashlib

    digest = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        digest.update(f"{p.relative_to(path).as_posix()}\0{file_sha256(p)}\n".encode())
    return digest.hexdigest()
