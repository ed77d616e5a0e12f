"""Temporary files and folders for atomic writes, with the permissions of ordinary new files.

``tempfile.mkstemp``/``mkdtemp`` create 0600 files and 0700 folders; an output renamed from them
would stay unreadable to other users. These helpers give them the modes ``open``/``mkdir`` would
(0666/0777 less the umask).
"""

from __future__ import annotations

import os
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
    """An empty hidden folder in ``target``'s folder, to be renamed onto ``target``."""
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.{tag}-", dir=target.parent))
    os.chmod(stage, 0o777 & ~_umask())
    return stage
