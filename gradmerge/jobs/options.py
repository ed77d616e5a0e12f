"""The settings every merge and removal shares (:class:`Options`), and reading and recording any
configuration (:class:`FromYaml`: ``from_yaml``, ``from_dict``, ``inputs``).

:class:`Options` declares the output dtype, the compute dtype, the device, passthrough, the shard
size, mixed dtypes, the curvature/weights pairing and the K-FAC ``solver`` settings (a
:class:`gradmerge.KroneckerCG`), each once, as a field with its
:class:`~gradmerge.foundation.settings.Setting`; :class:`~gradmerge.jobs.config.MergeConfig` and
:class:`~gradmerge.jobs.config.RemoveConfig` add their own. :func:`plain` turns a configuration
into the JSON values of a run's record.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from gradmerge.foundation.guard import Input
from gradmerge.foundation.settings import Setting, declared, setting
from gradmerge.io.writer import DEFAULT_SHARD_SIZE
from gradmerge.jobs.inputs import NOT_KEYS, path_inputs
from gradmerge.jobs.yaml_reader import Reader, load_yaml
from gradmerge.methods import registry
from gradmerge.solvers.spec import KroneckerCG

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
COMPUTE_DTYPES = ("float32", "float64")
CURVATURE_WEIGHTS = ("warn", "refuse", "ignore")


_Config = TypeVar("_Config", bound="FromYaml")


class FromYaml:
    """``from_yaml`` and ``from_dict`` of every configuration type, written once: a subclass
    names what it reads (``_WHAT``, for messages) and implements ``_read``, the checks of its
    keys."""

    _WHAT: ClassVar[str]

    @classmethod
    def from_yaml(cls: type[_Config], path: str | os.PathLike[str]) -> _Config:
        """Read a configuration; relative paths are relative to the file's folder."""
        data, root = load_yaml(path)
        return cls.from_dict(data, root=root, source=Path(path))

    @classmethod
    def from_dict(
        cls: type[_Config],
        data: Mapping[str, Any],
        *,
        root: str | os.PathLike[str] | None = None,
        source: Path | None = None,
        check_files: bool = True,
    ) -> _Config:
        """Validate a configuration given as a dict (``root``: base of relative paths).

        Raises:
            ConfigError: an unknown, missing, repeated or unusable key (named).
            MissingInputError: an input file or folder that does not exist.
        """
        return cls._read(Reader(data, cls._WHAT, Path(root or "."), check_files), source)

    @classmethod
    def _read(cls: type[_Config], r: Reader, source: Path | None) -> _Config:
        raise NotImplementedError

    def inputs(self) -> list[Input]:
        """Every file and folder the run reads, for the output guard
        (:mod:`gradmerge.foundation.guard`): the YAML file (``CONFIG``), each path it names under
        its key (``base_model``, ``models[1].curvature``, ``prior.curvature[0]``, an entry point's
        ``.py`` file) and the base each LoRA adapter applies to.

        Example:
            >>> from gradmerge.jobs.config import MergeConfig
            >>> cfg = MergeConfig.from_dict(
            ...     {"method": "task_arithmetic", "base_model": "b", "models": [{"model": "a"}]},
            ...     check_files=False)
            >>> [(i.role, i.path.name) for i in cfg.inputs()]
            [('base_model', 'b'), ('models[0].model', 'a')]
        """
        source = getattr(self, "source", None)
        found = [Input("CONFIG", source)] if source is not None else []
        return found + list(getattr(self, "also_reads", ())) + path_inputs(self, "")


@dataclass(frozen=True, kw_only=True)
class Options(FromYaml):
    """Settings shared by merges and removals (each declared once:
    :mod:`gradmerge.foundation.settings`)."""

    dtype: str | None = setting(
        None,
        "output dtype of float tensors.",
        kind="choice",
        choices=tuple(DTYPES),
        default_doc="the base's dtype, per tensor",
    )
    compute_dtype: str = setting(
        "float32",
        "the precision of the arithmetic (bf16/fp16 inputs are merged in it).",
        kind="choice",
        choices=COMPUTE_DTYPES,
    )
    device: str = setting(
        "auto", "`auto` (CUDA when available), `cpu`, `cuda`, `cuda:N`.", kind="device"
    )
    passthrough: tuple[str, ...] = setting(
        (),
        "a list of names or globs (`fnmatch`) of float tensors copied from the base unmerged; "
        "a glob that matches no tensor is an error, globs that cover every float tensor warn "
        "(nothing would be merged). Integer tensors and buffers are always copied from the "
        "base.",
        kind="strings",
    )
    max_shard_size: int = setting(
        DEFAULT_SHARD_SIZE,
        "the output's shard size: bytes, or a string such as `5GB`, `500MB`, `2GiB` (decimal "
        "or binary units).",
        kind="size",
        default_doc="`5GB`",
    )
    allow_mixed_dtypes: bool = setting(
        False,
        "let the float tensors of one name differ in dtype between the inputs.",
        kind="flag",
    )
    curvature_weights: str = setting(
        "warn",
        "a curvature file estimated at other weights than both the model it is paired with "
        "and the base (judged by the sample hash of the weights recorded at estimation).",
        kind="choice",
        choices=CURVATURE_WEIGHTS,
    )
    solver: KroneckerCG = field(
        default_factory=KroneckerCG,
        metadata={
            "setting": Setting(
                "the K-FAC solves: a mapping with the keys of the `solver` table below, the "
                "fields of `gm.KroneckerCG` one to one.",
                kind="mapping",
                default_doc="see below",
                python="`solver=gm.KroneckerCG(...)`, its fields named as the keys",
            )
        },
    )
    source: Path | None = field(default=None, compare=False)
    also_reads: tuple[Input, ...] = field(default=(), compare=False, repr=False)
    """Inputs that this configuration's own keys do not name: those of the file it was made
    from (``method: remerge``: its ``merge`` YAML, every path in that, the models of
    ``without``; :func:`gradmerge.jobs.config.remerge_config`). Listed by :meth:`inputs`, not
    recorded."""

    @property
    def out_dtype(self) -> torch.dtype | None:
        """The output dtype of float tensors (``None``: each tensor's dtype in the base)."""
        return None if self.dtype is None else DTYPES[self.dtype]

    @property
    def math_dtype(self) -> torch.dtype:
        """The dtype the merge arithmetic runs in."""
        return DTYPES[self.compute_dtype]

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain JSON values (paths absolute), for the run's record."""
        return {
            f.name: plain(getattr(self, f.name))
            for f in fields(self)
            if f.name not in NOT_KEYS and not _unused(self, f.name)
        }


def ordered(cls: Any) -> list[str]:
    """The declared keys of ``cls``, its own before the shared :class:`Options`."""
    shared = declared(Options)
    return sorted(declared(cls), key=lambda k: k in shared)


def _unused(value: Any, name: str) -> bool:
    """An optional key left out of records when not given (records of runs without it stay as
    they were)."""
    if name == "embeddings":  # recorded for the methods that read it (RegMean) only
        method = getattr(value, "method", None)
        return method is None or name not in registry.get(method).uses
    return name == "adapter_base" and getattr(value, name) is None


def plain(value: Any) -> Any:
    """``value`` as plain JSON values, for a run's record: paths as strings, a dataclass as the
    mapping of its fields (optional keys not given left out), tuples as lists."""
    if isinstance(value, Path):
        return str(value)
    if is_dataclass(value) and not isinstance(
        value, type
    ):  # ModelInput, CurvatureTerm, KroneckerCG
        return {
            f.name: plain(getattr(value, f.name))
            for f in fields(value)
            if not _unused(value, f.name)
        }
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value
