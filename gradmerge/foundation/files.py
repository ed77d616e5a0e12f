"""Temporary files and folders for atomic writes, with the permissions of ordinary new files.

In the foundation because the output guard, io's writer and the distributed merge all stage
their outputs with it (no one package is its main user).

``tempfile.mkstemp``/``mkdtemp`` create 0600 files and 0700 folders; an output renamed from them
would stay unreadable to other users. These helpers give them the modes ``open``/``mkdir`` would
(0666/0777 less the umask).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def temp_file_beside(target: Path, suffix: str = ".tmp") -> Path:
    """An empty hidden file in ``target``'s folder, to be moved onto it by :func:`publish`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(fd)
    return Path(tmp)


def publish(tmp: Path, target: Path) -> None:
    """Give ``tmp`` an ordinary file's mode and rename it onto ``target`` (atomic on POSIX).

    Writers such as ``safetensors.torch.save_file`` create 0600 files whatever the umask.
    """
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, target)


def temp_dir_beside(target: Path, tag: str) -> Path:
    """An empty hidden folder in ``target``'s folder, to be renamed onto ``target``.

    Its name, ``.NAME.TAG-HOST-PID-START-xxxx``, records the owning process (host, pid and the
    process's start time, which tells a reused pid apart), so that a folder left behind by a
    killed process can be recognised and removed later (:func:`remove_stale_dirs_beside`).
    """
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.{tag}-{_owner()}-", dir=target.parent))
    os.chmod(stage, 0o777 & ~_umask())
    return stage


def remove_stale_dirs_beside(target: Path, tag: str) -> tuple[list[Path], list[Path]]:
    """Remove the folders :func:`temp_dir_beside` made for ``target`` whose owning process is
    gone (same host, pid no longer running, or running but started at another time).

    Returns:
        (removed, left): the folders removed, and those of the same pattern left alone because
        their owner cannot be known (another host, or a name without an owner, from an older
        gradmerge). Folders of live processes (a concurrent run) are neither.
    """
    removed: list[Path] = []
    left: list[Path] = []
    prefix = f".{target.name}.{tag}-"
    if not target.parent.is_dir():
        return removed, left
    host = _host()
    for path in sorted(target.parent.iterdir()):
        if not path.name.startswith(prefix) or not path.is_dir() or path.is_symlink():
            continue
        match = _OWNER.match(path.name[len(prefix) :])
        if match is None or match["host"] != host:
            left.append(path)
            continue
        if _running(int(match["pid"]), int(match["start"])):
            continue
        shutil.rmtree(path, ignore_errors=True)
        (left if path.exists() else removed).append(path)
    return removed, left


_OWNER = re.compile(r"(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)-(?P<start>\d+)-[^-]*$")


def _host() -> str:
    """This machine's name, letters and digits only (at most 24)."""
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:24] or "host"


def _owner() -> str:
    return f"{_host()}-{os.getpid()}-{_start_time(os.getpid())}"


def _start_time(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since boot (Linux ``/proc``); 0 elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name may hold spaces


def _running(pid: int, start: int) -> bool:
    """Whether process ``pid`` runs and is the one that started at ``start`` (when known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    return start == 0 or _start_time(pid) in (0, start)
