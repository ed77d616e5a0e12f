"""Reading a job's YAML strictly: the file, and typed access to one mapping of it.

:func:`load_yaml` reads a configuration file: UTF-8 text, valid YAML, no key given twice in one
mapping (which YAML leaves to the reader and PyYAML resolves silently), nesting a few levels
deep. :class:`Reader` gives typed access to one mapping of it: every message names the key as
the file spells it (``models[1].curvature``), an unknown key is refused with the allowed ones and
a close match (or the key another tool uses for it), relative paths are relative to the file's
folder and must exist. :func:`parse_size` (:mod:`gradmerge.foundation.text`'s, shared with
``gradmerge materialize``) reads sizes such as ``5GB``. What each key means and allows is declared
elsewhere (:mod:`gradmerge.foundation.settings`;
:mod:`gradmerge.jobs.setting_values` reads a declared setting through a :class:`Reader`).

Example:
    >>> r = Reader({"device": "cuda:1", "out_shard_size": "2GB"}, "the merge config", Path("."), False)
    >>> r.device("device")
    'cuda:1'
    >>> r.allow("dtype", "device", "max_shard_size")
    Traceback (most recent call last):
    ...
    gradmerge.errors.ConfigError: unknown key 'out_shard_size' in the merge config (did you mean 'max_shard_size'?); allowed keys: dtype, device, max_shard_size
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gradmerge.errors import ConfigError, MissingInputError
from gradmerge.foundation.settings import REQUIRED, Setting, check, shown
from gradmerge.foundation.text import parse_size as parse_size  # gradmerge.jobs.parse_size

_ALIASES = {  # keys other tools use for the same thing
    "merge_method": "method",
    "weight": "alpha",
    "parameters": "alpha",
    "lambda": "scale",
    "out_dtype": "dtype",
    "out_shard_size": "max_shard_size",
}


class Reader:
    """Typed, strict access to one mapping of a configuration; every message names the key."""

    def __init__(self, data: Any, where: str, root: Path, check_files: bool) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"{where} must be a mapping of keys to values, got {type(data).__name__}"
            )
        self.data, self.where, self.root, self.check_files = dict(data), where, root, check_files

    def sub(self, data: Any, where: str) -> Reader:
        prefix = "" if self.where.startswith("the ") else f"{self.where}."
        return Reader(data, f"{prefix}{where}", self.root, self.check_files)

    def _name(self, key: str) -> str:
        """The key as the YAML file spells it (``remaining.delta``); "" names ``where`` itself."""
        if not key:
            return self.where
        return key if self.where.startswith("the ") else f"{self.where}.{key}"

    def allow(self, *keys: str) -> None:
        unknown = [k for k in self.data if k not in keys]
        if unknown:
            key = shown(unknown[0], quoted=False)
            hint = _ALIASES.get(key) if _ALIASES.get(key) in keys else None
            close = difflib.get_close_matches(key, keys, n=1)
            guess = hint or (close[0] if close else None)
            raise ConfigError(
                f"unknown key {key!r} in {self.where}"
                + (f" (did you mean {guess!r}?)" if guess else "")
                + f"; allowed keys: {', '.join(keys)}"
            )

    def forbid(self, key: str, method: str, why: str) -> None:
        if key in self.data:
            raise ConfigError(
                f"`{self._name(key)}` is not used by method {method}: {why}; remove it"
            )

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data and self.data[key] is not None:
            return self.data[key]
        if default is REQUIRED:
            raise ConfigError(f"{self.where} needs `{key}`")
        return default

    def choice(self, key: str, options: tuple[str, ...], default: Any = REQUIRED) -> str:
        value = self._get(key, default)
        return str(
            check(Setting("", "choice", choices=options), value, self._name(key), ConfigError)
        )

    def number(self, key: str, default: Any = REQUIRED, *, minimum: float | None = None) -> float:
        declared = Setting("", minimum=minimum)
        return float(check(declared, self._get(key, default), self._name(key), ConfigError))

    def flag(self, key: str, default: bool) -> bool:
        return bool(
            check(Setting("", "flag"), self._get(key, default), self._name(key), ConfigError)
        )

    def strings(self, key: str) -> tuple[str, ...]:
        value = self._get(key, [])
        return tuple(check(Setting("", "strings"), value, self._name(key), ConfigError))

    def entries(self, key: str) -> list[Any]:
        value = self._get(key, REQUIRED)
        if not isinstance(value, list) or not value:
            raise ConfigError(
                f"`{self._name(key)}` must be a non-empty list, e.g. "
                "[{model: path/to/finetuned, curvature: path/to/curvature.safetensors}]"
            )
        return value

    def path(self, key: str, *, kind: str = "any", default: Any = REQUIRED) -> Any:
        value = self._get(key, default)
        if value is None:
            return None
        if not isinstance(value, (str, os.PathLike)) or str(value) == "":
            raise ConfigError(f"`{self._name(key)}` must be a path, got {shown(value)}")
        path = (self.root / Path(value).expanduser()).absolute()
        if self.check_files:
            exists = path.is_file() if kind == "file" else path.exists()
            if not exists:
                what = "file" if kind == "file" else "file or folder"
                raise MissingInputError(f"`{self._name(key)}`: no {what} at {path}")
        return path

    def device(self, key: str) -> str:
        value = self._get(key, "auto")
        if not isinstance(value, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ConfigError(
                f"`{self._name(key)}` must be auto, cpu, cuda or cuda:N; got {shown(value)}"
            )
        return value

    def size(self, key: str, default: int) -> int:
        value = self._get(key, default)
        try:
            size = parse_size(value)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"`{self._name(key)}`: {err}") from None
        return size


def load_yaml(path: str | os.PathLike[str]) -> tuple[Any, Path]:
    """The data of the configuration file at ``path``, and its folder (the base of its relative
    paths).

    Raises:
        MissingInputError: no file at ``path``.
        ConfigError: a file that is not UTF-8 text or not valid YAML, gives a key twice in one
            mapping, or nests hundreds of levels deep.
    """
    import yaml

    source = Path(path)
    if not source.is_file():
        raise MissingInputError(f"no configuration file at {source}")
    raw = source.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{source} is not UTF-8 text: byte 0x{raw[err.start]:02x} at offset {err.start} "
            "cannot be decoded; save the configuration as UTF-8"
        ) from None
    try:
        data = yaml.load(text, Loader=_strict_loader())  # a yaml.SafeLoader subclass
    except yaml.YAMLError as err:
        raise ConfigError(f"{source} is not valid YAML: {err}") from err
    except RecursionError:  # PyYAML reads nested lists and mappings recursively
        raise ConfigError(
            f"{source} nests deeper than gradmerge reads (lists or mappings inside one another, "
            "hundreds of levels deep); a configuration needs a few levels: check the file"
        ) from None
    return data, source.absolute().parent


def _strict_loader() -> type:
    """``yaml.SafeLoader`` refusing a key given twice in one mapping (which YAML leaves to the
    reader and PyYAML resolves silently: the last one wins)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *defaults` may be overridden by explicit keys
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = seen.get(key)
                except TypeError:  # an unhashable key: PyYAML's own error follows
                    continue
                line = key_node.start_mark.line + 1
                if earlier is not None:
                    raise ConfigError(
                        f"key {shown(key)} is given twice in one mapping (lines {earlier} and "
                        f"{line} of {key_node.start_mark.name}); YAML keeps only one: remove "
                        "one of them"
                    )
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return StrictLoader
