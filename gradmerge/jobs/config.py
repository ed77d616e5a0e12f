"""Merge and removal configurations: strict YAML files in the style of mergekit's.

:class:`MergeConfig` reads ``gradmerge merge CONFIG OUT_DIR`` (Eq. 6 and its special cases),
:class:`RemoveConfig` ``gradmerge remove CONFIG OUT_DIR`` (Eq. 13, Koh & Liang); both share the
:class:`Options` (output dtype, compute dtype, device, passthrough, shard size, mixed dtypes,
curvature/weights pairing, and the K-FAC ``solver`` settings). Every key, its default and an
example of each method are in ``docs/config.md``, the one reference of the YAML files (its
examples are parsed by this module in ``proofs_tests/docs/test_config_reference.py``); this
docstring does not repeat them.

The reader is strict: relative paths are relative to the YAML file's folder; unknown keys,
missing keys, keys a method does not use, keys given twice, files that are not UTF-8 and missing
files raise :class:`ConfigError` / :class:`MissingInputError`, naming the key (values shown in
messages are shortened). A checkpoint listed as two models warns (:class:`InputWarning`).

Example:
    >>> cfg = MergeConfig.from_dict(
    ...     {"method": "gradient_matching", "base_model": ".", "prior": {"delta": 1e-6},
    ...      "models": [{"model": ".", "curvature": "a.curvature.safetensors", "alpha": 0.5}]},
    ...     check_files=False)
    >>> cfg.method, cfg.prior.delta, cfg.alphas
    ('gradient_matching', 1e-06, [0.5])
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from gradmerge._guard import Input
from gradmerge.errors import ConfigError, InputWarning, MissingInputError
from gradmerge.jobs import methods
from gradmerge.merge import REGMEAN_OFF_DIAGONAL
from gradmerge.solvers.spec import ARITHMETIC_MODES as PRECISIONS
from gradmerge.solvers.spec import ArithmeticMode as Precision
from gradmerge.spectral import ISO_CTS_COMMON_SPACE_FRACTION

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
COMPUTE_DTYPES = ("float32", "float64")
_ALIASES = {  # keys other tools use for the same thing
    "merge_method": "method",
    "weight": "alpha",
    "parameters": "alpha",
    "lambda": "scale",
    "out_dtype": "dtype",
    "out_shard_size": "max_shard_size",
}
_REQUIRED: Any = object()


@dataclass(frozen=True)
class ModelInput:
    """One fine-tuned model θ_t of a merge, its curvature H_t and its weight α_t.

    ``adapter_base``: when ``model`` is a LoRA adapter, the base it was trained on, if its
    ``base_model_name_or_path`` cannot be told (:func:`gradmerge.io.sources.adapter_base`); it
    must hold the merge's ``base_model`` weights.
    """

    model: Path
    curvature: Path | None = None
    alpha: float = 1.0
    scale: float = 1.0
    """Multiplies H_t (not α_t): a curvature summed over n of the task's N examples, or a mean
    Fisher, stands for the task's N_t·F_t at ``scale: N/n`` (or N)."""
    adapter_base: Path | None = None


@dataclass(frozen=True)
class CurvatureTerm:
    """A precision δ·I + scale·C: a prior H_0, or the remaining curvature H̄_\\t of a removal.

    ``curvature`` is one file, or several whose SUM is C (YAML: a list), e.g. the per-task
    curvatures of the tasks that stay in a merge when one is removed.
    """

    delta: float = 0.0
    curvature: Path | tuple[Path, ...] | None = None
    scale: float = 1.0

    @property
    def files(self) -> tuple[Path, ...]:
        """The curvature files whose sum is C (none, one or several)."""
        if self.curvature is None:
            return ()
        return self.curvature if isinstance(self.curvature, tuple) else (self.curvature,)


_Config = TypeVar("_Config", bound="FromYaml")


class FromYaml:
    """``from_yaml`` and ``from_dict`` of every configuration type, written once: a subclass
    names what it reads (``_WHAT``, for messages) and implements ``_read``, the checks of its
    keys."""

    _WHAT: ClassVar[str]

    @classmethod
    def from_yaml(cls: type[_Config], path: str | os.PathLike[str]) -> _Config:
        """Read a configuration; relative paths are relative to the file's folder."""
        data, root = _load_yaml(path)
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
        return cls._read(_Reader(data, cls._WHAT, Path(root or "."), check_files), source)

    @classmethod
    def _read(cls: type[_Config], r: _Reader, source: Path | None) -> _Config:
        raise NotImplementedError

    def inputs(self) -> list[Input]:
        """Every file and folder the run reads, for the output guard (:mod:`gradmerge._guard`):
        the YAML file (``CONFIG``), each path it names under its key (``base_model``,
        ``models[1].curvature``, ``prior.curvature[0]``, an entry point's ``.py`` file) and the
        base each LoRA adapter applies to.

        Example:
            >>> cfg = MergeConfig.from_dict(
            ...     {"method": "task_arithmetic", "base_model": "b", "models": [{"model": "a"}]},
            ...     check_files=False)
            >>> [(i.role, i.path.name) for i in cfg.inputs()]
            [('base_model', 'b'), ('models[0].model', 'a')]
        """
        source = getattr(self, "source", None)
        found = [Input("CONFIG", source)] if source is not None else []
        return found + _path_inputs(self, "")


@dataclass(frozen=True, kw_only=True)
class Options(FromYaml):
    """Settings shared by merges and removals (see the module docstring)."""

    dtype: str | None = None
    compute_dtype: str = "float32"
    device: str = "auto"
    passthrough: tuple[str, ...] = ()
    max_shard_size: int = 5 * 10**9
    allow_mixed_dtypes: bool = False
    curvature_weights: str = "warn"
    solver_tol: float | None = None
    solver_maxiter: int = 1000
    solver_approximate: bool = False
    solver_precision: Precision = "auto"
    solver_warm_start: bool = False
    source: Path | None = field(default=None, compare=False)

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
            f.name: _plain(getattr(self, f.name))
            for f in fields(self)
            if f.name != "source" and not _unused(self, f.name)
        }


@dataclass(frozen=True, kw_only=True)
class MergeConfig(Options):
    """A merge: θ = θ_LLM + Σ_t α_t H̄⁻¹ (H_0 + H_t)(θ_t − θ_LLM) (Eq. 6) or a special case.

    ``method`` picks the rule: ``task_arithmetic`` (no curvature), ``fisher_average``
    (H_0 = 0; ``damping`` adds δ·I to every H_t), ``gradient_matching`` (``prior`` H_0 required),
    ``regmean`` (the K-FAC input factors of each model's curvature, bias column left out, as
    RegMean's Gram matrices of the linear layers' weights, their off-diagonal entries times
    ``off_diagonal``, Jin et al.'s r, default :data:`gradmerge.merge.REGMEAN_OFF_DIAGONAL`, and
    ``damping`` added to each; biases and, unless ``embeddings: gram``, embeddings averaged).
    Every α_t is multiplied by ``scale``; each model's ``scale``
    multiplies its H_t. The data-free ``tsv_merge``, ``iso_c`` and ``iso_cts``
    (:mod:`gradmerge.spectral`; ``average``: globs of 2-D tensors merged by the mean of the task
    vectors; Iso-CTS's ``common_space_fraction``, default 0.8).

    Example:
        >>> cfg = MergeConfig.from_dict(
        ...     {"method": "task_arithmetic", "base_model": ".", "models": [{"model": "."}],
        ...      "scale": 0.5}, check_files=False)
        >>> cfg.alphas, cfg.max_shard_size
        ([0.5], 5000000000)
    """

    method: str
    base_model: Path
    models: tuple[ModelInput, ...]
    prior: CurvatureTerm | None = None
    scale: float = 1.0
    damping: float = 0.0
    off_diagonal: float = REGMEAN_OFF_DIAGONAL
    embeddings: str = "average"
    common_space_fraction: float = ISO_CTS_COMMON_SPACE_FRACTION
    average: tuple[str, ...] = ()

    @property
    def alphas(self) -> list[float]:
        """The effective weights scale·α_t."""
        return [self.scale * m.alpha for m in self.models]

    @property
    def curvature_scales(self) -> list[float]:
        """Each model's ``scale``, the factor on its curvature H_t."""
        return [m.scale for m in self.models]

    _WHAT: ClassVar[str] = "the merge config"

    @classmethod
    def _read(cls, r: _Reader, source: Path | None) -> MergeConfig:
        method = r.choice("method", methods.names("merge"))
        spec = methods.get(method)
        r.allow(
            "method",
            "base_model",
            "models",
            "prior",
            "scale",
            "damping",
            "off_diagonal",
            "common_space_fraction",
            "average",
            "embeddings",
            *_OPTION_KEYS,
        )
        models = tuple(_model(r, i, m, spec) for i, m in enumerate(r.entries("models")))
        _warn_repeated(models, r.check_files)
        needs_base = spec.need("base_model") == "required"
        base = r.path("base_model", default=_REQUIRED if needs_base else None)
        prior = None
        if spec.need("prior") != "forbidden":
            prior = _term(r, "prior", required=spec.need("prior") == "required")
        else:
            r.forbid("prior", method, spec.refusal("prior"))
        if spec.need("damping") != "forbidden":
            damping = r.number("damping", default=0.0, minimum=0.0)
        else:
            damping = 0.0
            r.forbid("damping", method, spec.refusal("damping"))
        off_diagonal, embeddings = REGMEAN_OFF_DIAGONAL, "average"
        if spec.need("embeddings") != "forbidden":
            embeddings = r.choice("embeddings", ("average", "gram"), default="average")
        else:
            r.forbid("embeddings", method, spec.refusal("embeddings"))
        if spec.need("off_diagonal") != "forbidden":
            off_diagonal = r.number("off_diagonal", default=REGMEAN_OFF_DIAGONAL, minimum=0.0)
            if off_diagonal > 1.0:
                raise ConfigError(
                    f"`off_diagonal` (Jin et al.'s factor on the Grams' off-diagonal entries) must "
                    f"be in [0, 1], got {_shown(off_diagonal)}"
                )
        else:
            r.forbid("off_diagonal", method, spec.refusal("off_diagonal"))
        fraction = ISO_CTS_COMMON_SPACE_FRACTION
        if spec.need("common_space_fraction") != "forbidden":
            fraction = r.number("common_space_fraction", default=fraction, minimum=0.0)
            if fraction > 1.0:
                raise ConfigError(
                    "`common_space_fraction` (the share of each matrix's directions Iso-CTS keeps "
                    f"from the sum of the task matrices) must be in [0, 1], got {_shown(fraction)}"
                )
        else:
            r.forbid("common_space_fraction", method, spec.refusal("common_space_fraction"))
        average: tuple[str, ...] = ()
        if spec.need("average") != "forbidden":
            average = r.strings("average")
        else:
            r.forbid("average", method, spec.refusal("average"))
        return cls(
            method=method,
            base_model=base if base is not None else models[0].model,
            models=models,
            prior=prior,
            scale=r.number("scale", default=1.0),
            damping=damping,
            off_diagonal=off_diagonal,
            common_space_fraction=fraction,
            average=average,
            embeddings=embeddings,
            source=source,
            **_options(r),
        )


@dataclass(frozen=True, kw_only=True)
class RemoveConfig(Options):
    """A removal of data D_t from θ_LLM: Eq. 13 (``remove``) or Koh & Liang (``influence_remove``).

    - ``remove``: θ_\\t = θ_LLM − α H̄_\\t⁻¹ (H_0 + H_t)(θ_t − θ_LLM), with ``model`` θ_t,
      ``curvature`` H_t, ``prior`` H_0 and ``remaining`` H̄_\\t.
    - ``influence_remove``: θ_\\t = θ_LLM + α H̄_\\t⁻¹ ∇ℓ̄_t(θ_LLM), with ``gradient`` a
      safetensors file holding ∇ℓ̄_t(θ_LLM) under the parameters' names.

    ``remaining`` must include the base model's own regulariser δ·I (``delta``) and be positive
    definite. The step's size ‖θ_\\t − θ_LLM‖ is measured against ‖θ_t − θ_LLM‖ (``remove``) or
    ‖θ_LLM‖ (``influence_remove``); above ``max_relative_step`` (default 100 and 1), where a
    near-zero curvature direction has exploded, ``step_check`` refuses (default), warns or
    ignores it. ``remove`` with diagonal curvatures also bounds what the removal does to the
    inputs' rounding (:mod:`gradmerge._removal`: entries where (H_0 + H_t)/H̄_\\t is large
    multiply it); above ``max_rounding`` (default 1e-2) × ‖θ_t − θ_LLM‖, ``rounding_check``
    refuses (default), warns or ignores it.
    """

    method: str
    base_model: Path
    remaining: CurvatureTerm
    alpha: float = 1.0
    model: Path | None = None
    curvature: Path | None = None
    prior: CurvatureTerm | None = None
    gradient: Path | None = None
    adapter_base: Path | None = None
    step_check: str = "refuse"
    max_relative_step: float = 100.0
    rounding_check: str = "refuse"
    max_rounding: float = 1e-2

    _WHAT: ClassVar[str] = "the remove config"

    @classmethod
    def _read(cls, r: _Reader, source: Path | None) -> RemoveConfig:
        if r.data.get("method") == "remerge":
            raise ConfigError(
                "method remerge is a merge of the tasks that stay: read it with "
                "gradmerge.jobs.config.remerge_config (`gradmerge remove` does)"
            )
        method = r.choice("method", methods.names("remove"))
        spec = methods.get(method)
        r.allow(
            "method",
            "base_model",
            "model",
            "adapter_base",
            "curvature",
            "prior",
            "gradient",
            "remaining",
            "alpha",
            "step_check",
            "max_relative_step",
            "rounding_check",
            "max_rounding",
            *_OPTION_KEYS,
        )
        uses = spec.uses
        model = r.path("model", default=_wanted(spec, "model")) if "model" in uses else None
        adapter_base = r.path("adapter_base", default=None) if "model" in uses else None
        curvature = None
        if "curvature" in uses:
            curvature = r.path("curvature", kind="file", default=_wanted(spec, "curvature"))
        prior = None
        if "prior" in uses:
            prior = _term(r, "prior", required=spec.need("prior") == "required")
        gradient = None
        if "gradient" in uses:
            gradient = r.path("gradient", default=_wanted(spec, "gradient"))
        for key in methods.KEYS["remove"]:
            if key not in spec.uses:
                r.forbid(key, method, spec.refusal(key))
        if "model" not in uses:
            r.forbid("adapter_base", method, spec.refusal("model"))
        assert spec.max_relative_step is not None  # every removal method has one
        remaining = _term(r, "remaining", required=True)
        assert remaining is not None  # required=True
        return cls(
            method=method,
            base_model=r.path("base_model"),
            model=model,
            curvature=curvature,
            gradient=gradient,
            adapter_base=adapter_base,
            prior=prior,
            remaining=remaining,
            alpha=r.number("alpha", default=1.0),
            step_check=r.choice("step_check", STEP_CHECKS, default="refuse"),
            max_relative_step=_positive(r, "max_relative_step", spec.max_relative_step),
            rounding_check=r.choice("rounding_check", STEP_CHECKS, default="refuse"),
            max_rounding=_positive(r, "max_rounding", 1e-2),
            source=source,
            **_options(r),
        )


def remerge_config(
    data: Mapping[str, Any], *, root: str | os.PathLike[str], source: Path | None = None
) -> MergeConfig:
    """``method: remerge``: the merge ``merge`` (a merge YAML) without the models in
    ``without`` — Eq. 6 over the tasks that stay, the exact "remove task t from a merge"
    (Eq. 13 from the merged weights approximates it, up to H̄_\\t⁻¹ H_0 (θ_m − θ_LLM) and the
    rounding it amplifies).

    ``without`` lists indices into the merge's ``models`` (0-based) or their ``model`` paths
    (relative to this file). Everything else — method, base, prior, alphas, options — is the
    merge's own.

    Example:
        >>> import tempfile, yaml
        >>> from pathlib import Path
        >>> with tempfile.TemporaryDirectory() as d:
        ...     merge = {"method": "task_arithmetic", "base_model": ".",
        ...              "models": [{"model": "a"}, {"model": "b"}, {"model": "c"}]}
        ...     for name in "abc":
        ...         (Path(d) / name).mkdir()
        ...     _ = (Path(d) / "merge.yaml").write_text(yaml.safe_dump(merge))
        ...     cfg = remerge_config({"method": "remerge", "merge": "merge.yaml",
        ...                           "without": [1, "c"]}, root=d)
        ...     [m.model.name for m in cfg.models]
        ['a']
    """
    r = _Reader(data, "the remove config", Path(root), True)
    r.choice("method", ("remerge",))
    r.allow("method", "merge", "without")
    merge_path = r.path("merge", kind="file")
    merged, merge_root = _load_yaml(merge_path)
    cfg = MergeConfig.from_dict(merged, root=merge_root, source=merge_path)
    listed = r.data.get("without")
    if not isinstance(listed, list) or not listed:
        raise ConfigError(
            "`without` must be a non-empty list of the merge's models to leave out: indices into "
            "its `models` (0-based) or their `model` paths, e.g. `without: [1]`"
        )
    drop: set[int] = set()
    for i, item in enumerate(listed):
        if isinstance(item, int) and not isinstance(item, bool):
            if not 0 <= item < len(cfg.models):
                raise ConfigError(
                    f"`without[{i}]` = {item} is not an index of the merge's {len(cfg.models)} "
                    f"models (0 to {len(cfg.models) - 1})"
                )
            drop.add(item)
            continue
        path = r.sub({"": item}, f"without[{i}]").path("", default=None)
        matches = [j for j, m in enumerate(cfg.models) if m.model.resolve() == path.resolve()]
        if not matches:
            raise ConfigError(
                f"`without[{i}]` ({path}) is none of the merge's models: "
                + ", ".join(str(m.model) for m in cfg.models)
            )
        drop.update(matches)
    kept = tuple(m for j, m in enumerate(cfg.models) if j not in drop)
    if not kept:
        raise ConfigError("`without` leaves no model to merge: the result would be the base model")
    return replace(cfg, models=kept, source=source)


_OPTION_KEYS = (
    "dtype",
    "compute_dtype",
    "device",
    "passthrough",
    "max_shard_size",
    "allow_mixed_dtypes",
    "curvature_weights",
    "solver",
)
CURVATURE_WEIGHTS = ("warn", "refuse", "ignore")
STEP_CHECKS = ("refuse", "warn", "ignore")


def _wanted(spec: methods.MergeMethod, key: str) -> Any:
    """The default of a path key ``spec`` uses: none if it requires the key."""
    return _REQUIRED if spec.need(key) == "required" else None


def _positive(r: _Reader, key: str, default: float) -> float:
    value = r.number(key, default=default)
    if value <= 0:
        raise ConfigError(f"`{r._name(key)}` must be > 0, got {_shown(value)}")
    return value


def _options(r: _Reader) -> dict[str, Any]:
    dtype = r.data.get("dtype")
    return {
        "dtype": None if dtype is None else r.choice("dtype", tuple(DTYPES)),
        "compute_dtype": r.choice("compute_dtype", COMPUTE_DTYPES, default="float32"),
        "device": r.device("device"),
        "passthrough": r.strings("passthrough"),
        "max_shard_size": r.size("max_shard_size", default=5 * 10**9),
        "allow_mixed_dtypes": r.flag("allow_mixed_dtypes", default=False),
        "curvature_weights": r.choice("curvature_weights", CURVATURE_WEIGHTS, default="warn"),
        **_solver(r),
    }


def _solver(r: _Reader) -> dict[str, Any]:
    """``solver: {tol, maxiter, approximate, precision, warm_start}``, the fields of
    :class:`gradmerge.SolverSpec` one to one: the certified relative residual of every K-FAC
    layer's solve (default 1e-5 in float32, 1e-10 in float64), CG iterations per round (default
    1000), with ``approximate: true`` (never the default) accepting each layer after at
    most ``maxiter`` CG iterations (default then 0: the eigenbasis preconditioner alone) with its
    measured residual instead of an error, ``precision`` (auto | working | bfloat16: the dtype of the
    CG's inner Kronecker products, auto = bfloat16 where it is measurably faster; the
    certificate is the same) and ``warm_start`` (default
    false)."""
    if r.data.get("solver") is None:
        return {}
    s = r.sub(r.data["solver"], "solver")
    s.allow("tol", "maxiter", "approximate", "precision", "warm_start")
    out: dict[str, Any] = {}
    if s.data.get("tol") is not None:
        tol = s.number("tol")
        if not 0 < tol < 1:
            raise ConfigError(
                f"`solver.tol` is a relative residual: it must be > 0 and < 1, got {_shown(tol)} "
                "(e.g. 1.0e-6)"
            )
        out["solver_tol"] = tol
    approximate = s.flag("approximate", default=False)
    if isinstance(s.data.get("maxiter"), str):
        raise ConfigError(
            f"`solver.maxiter` must be a whole number, got the text {_shown(s.data['maxiter'])}: "
            "write it without quotes (maxiter: 10)"
        )
    maxiter = s.number("maxiter", default=0 if approximate else 1000, minimum=0)
    if maxiter != int(maxiter) or (maxiter == 0 and not approximate):
        raise ConfigError(
            f"`solver.maxiter` must be a whole number ≥ 1 (≥ 0 with `approximate: true`), got "
            f"{_shown(maxiter)}"
        )
    out["solver_maxiter"] = int(maxiter)
    out["solver_approximate"] = approximate
    out["solver_precision"] = s.choice("precision", PRECISIONS, default="auto")
    out["solver_warm_start"] = s.flag("warm_start", default=False)
    return out


def _model(r: _Reader, i: int, data: Any, spec: methods.MergeMethod) -> ModelInput:
    where = f"models[{i}]"
    m = r.sub(data, where)
    m.allow("model", "curvature", "alpha", "scale", "adapter_base")
    if spec.need("curvature") == "forbidden":
        m.forbid("curvature", spec.name, spec.refusal("curvature"))
        m.forbid("scale", spec.name, "it multiplies the model's curvature, and there is none")
        curvature = None
    else:
        curvature = m.path("curvature", kind="file", default=_wanted(spec, "curvature"))
    scale = m.number("scale", 1.0)
    if not scale > 0:
        raise ConfigError(
            f"`{m._name('scale')}` multiplies the curvature H_t (e.g. N/n for a curvature summed "
            f"over n of the task's N examples): it must be > 0, got {_shown(scale)}"
        )
    return ModelInput(
        model=m.path("model"),
        curvature=curvature,
        alpha=m.number("alpha", 1.0),
        scale=scale,
        adapter_base=m.path("adapter_base", default=None),
    )


def _warn_repeated(models: tuple[ModelInput, ...], check_files: bool) -> None:
    """Warn, once, when a checkpoint is listed as several models: it is then merged as many
    times, as one model with the sum of their weights — rarely what was meant. One warning
    names every repeated checkpoint with its count (not one per repetition)."""
    listed: dict[Path, list[int]] = {}
    for i, m in enumerate(models):
        listed.setdefault(m.model.resolve() if check_files else m.model, []).append(i)
    repeated = [indices for indices in listed.values() if len(indices) > 1]
    if not repeated:
        return
    parts = []
    for indices in repeated[:3]:
        names = [f"models[{i}].model" for i in indices]
        shown = " and ".join(names) if len(names) == 2 else ", ".join(names[:3])
        if len(names) > 3:
            shown += f", ... ({len(names) - 3} more)"
        alpha = sum(models[i].alpha for i in indices)
        parts.append(
            f"{shown} are the same checkpoint ({models[indices[0]].model}), "
            f"listed {len(indices)} times: it is merged {len(indices)} times, as if listed once "
            f"with alpha {alpha:g}"
        )
    more = f"; and {len(repeated) - 3} more repeated checkpoint(s)" if len(repeated) > 3 else ""
    warnings.warn(
        "; ".join(parts) + more + ". List each checkpoint once (with the summed `alpha` if that "
        "is meant)",
        InputWarning,
        stacklevel=4,
    )


def _term(r: _Reader, key: str, *, required: bool) -> CurvatureTerm | None:
    if key not in r.data:
        if required:
            raise ConfigError(
                f"{r.where} needs `{key}`, e.g. `{key}: {{delta: 1.0e-6}}` (δ·I) or "
                f"`{key}: {{delta: 1.0e-6, curvature: path/to/file.curvature.safetensors}}`"
            )
        return None
    t = r.sub(r.data[key], key)
    t.allow("delta", "curvature", "scale")
    listed = t.data.get("curvature")
    curvature: Path | tuple[Path, ...] | None
    if isinstance(listed, list):
        if not listed:
            raise ConfigError(
                f"`{t._name('curvature')}` is an empty list: give a curvature file, or a list of "
                "files whose sum is the curvature"
            )
        curvature = tuple(
            t.sub({"": v}, f"curvature[{i}]").path("", kind="file") for i, v in enumerate(listed)
        )
    else:
        curvature = t.path("curvature", kind="file", default=None)
    term = CurvatureTerm(
        delta=t.number("delta", 0.0, minimum=0.0),
        curvature=curvature,
        scale=t.number("scale", 1.0, minimum=0.0),
    )
    if term.delta == 0.0 and (term.curvature is None or term.scale == 0.0):
        raise ConfigError(
            f"{t.where} is zero: give `delta` > 0 (δ·I) and/or a `curvature` with scale > 0"
        )
    return term


class _Reader:
    """Typed, strict access to one mapping of a configuration; every message names the key."""

    def __init__(self, data: Any, where: str, root: Path, check_files: bool) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"{where} must be a mapping of keys to values, got {type(data).__name__}"
            )
        self.data, self.where, self.root, self.check_files = dict(data), where, root, check_files

    def sub(self, data: Any, where: str) -> _Reader:
        prefix = "" if self.where.startswith("the ") else f"{self.where}."
        return _Reader(data, f"{prefix}{where}", self.root, self.check_files)

    def _name(self, key: str) -> str:
        """The key as the YAML file spells it (``remaining.delta``); "" names ``where`` itself."""
        if not key:
            return self.where
        return key if self.where.startswith("the ") else f"{self.where}.{key}"

    def allow(self, *keys: str) -> None:
        unknown = [k for k in self.data if k not in keys]
        if unknown:
            key = _shown(unknown[0], quoted=False)
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
        if default is _REQUIRED:
            raise ConfigError(f"{self.where} needs `{key}`")
        return default

    def choice(self, key: str, options: tuple[str, ...], default: Any = _REQUIRED) -> str:
        value = self._get(key, default)
        if value not in options:
            raise ConfigError(
                f"`{self._name(key)}` must be one of {', '.join(options)}; got {_shown(value)}"
            )
        return str(value)

    def number(self, key: str, default: Any = _REQUIRED, *, minimum: float | None = None) -> float:
        value = self._get(key, default)
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ConfigError(f"`{self._name(key)}` must be a finite number, got {_shown(value)}")
        if minimum is not None and value < minimum:
            raise ConfigError(f"`{self._name(key)}` must be ≥ {minimum:g}, got {_shown(value)}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"`{self._name(key)}` must be true or false, got {_shown(value)}")
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        value = self._get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(
                f"`{self._name(key)}` must be a list of names or globs, e.g. "
                f"[lm_head.weight, '*.rotary_emb.*'], got {_shown(value)}"
            )
        return tuple(value)

    def entries(self, key: str) -> list[Any]:
        value = self._get(key, _REQUIRED)
        if not isinstance(value, list) or not value:
            raise ConfigError(
                f"`{self._name(key)}` must be a non-empty list, e.g. "
                "[{model: path/to/finetuned, curvature: path/to/curvature.safetensors}]"
            )
        return value

    def path(self, key: str, *, kind: str = "any", default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if value is None:
            return None
        if not isinstance(value, (str, os.PathLike)) or str(value) == "":
            raise ConfigError(f"`{self._name(key)}` must be a path, got {_shown(value)}")
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
                f"`{self._name(key)}` must be auto, cpu, cuda or cuda:N; got {_shown(value)}"
            )
        return value

    def size(self, key: str, default: int) -> int:
        value = self._get(key, default)
        try:
            size = parse_size(value)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"`{self._name(key)}`: {err}") from None
        return size


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


_SPEC_KEYS = ("start", "base_model", "model", "data")
"""Keys whose string values are MODEL/DATA specs (a path or an entry point; refine's YAML)."""


def _path_inputs(value: Any, key: str) -> list[Input]:
    """The inputs named by ``value`` (a path, a spec under a key of :data:`_SPEC_KEYS`, or a
    tuple or dataclass of them), each under its YAML key; a ``model`` with the LoRA adapter base
    given beside it (``adapter_base``)."""
    from gradmerge.io.sources import spec_inputs

    if isinstance(value, Path) or (isinstance(value, str) and key.rpartition(".")[2] in _SPEC_KEYS):
        return spec_inputs(key, value)
    if isinstance(value, (tuple, list)):
        return [i for n, item in enumerate(value) for i in _path_inputs(item, f"{key}[{n}]")]
    if not is_dataclass(value):
        return []
    found: list[Input] = []
    for f in fields(value):
        item, sub = getattr(value, f.name), f"{key}.{f.name}" if key else f.name
        if f.name == "model" and item is not None:
            found += spec_inputs(sub, item, base=getattr(value, "adapter_base", None))
        elif f.name != "source":
            found += _path_inputs(item, sub)
    return found


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``"5GB"``, ``"500MB"``, ``"2GiB"`` (decimal/binary).

    Example:
        >>> parse_size("1.5GB"), parse_size("2KiB"), parse_size(100)
        (1500000000, 2048, 100)
    """
    if isinstance(value, bool):
        raise TypeError(f"expected a size in bytes or a string such as '5GB', got {_shown(value)}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError(
                f"expected a size such as '5GB', '500MB' or '2GiB', got {_shown(value)}"
            )
        size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    else:
        raise TypeError(f"expected a size in bytes or a string such as '5GB', got {_shown(value)}")
    if size <= 0:
        raise ValueError(f"a size must be positive, got {_shown(value)}")
    return size


def _load_yaml(path: str | os.PathLike[str]) -> tuple[Any, Path]:
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
                        f"key {_shown(key)} is given twice in one mapping (lines {earlier} and "
                        f"{line} of {key_node.start_mark.name}); YAML keeps only one: remove "
                        "one of them"
                    )
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _shown(value: Any, *, quoted: bool = True) -> str:
    """``repr(value)`` shortened for an error message: at most a few levels, items and
    characters, without expanding the value (a YAML alias bomb shares one list a billion times:
    its full repr would never finish)."""
    import reprlib

    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxtuple = 2, 4, 4, 4
    short.maxstring = short.maxother = 80
    if isinstance(value, str) and not quoted:
        return value if len(value) <= 80 else value[:77] + "..."
    return short.repr(value)


def _unused(value: Any, name: str) -> bool:
    """An optional key left out of records when not given (records of runs without it stay as
    they were)."""
    if name == "embeddings":  # RegMean's alone
        return getattr(value, "method", None) != "regmean"
    return name == "adapter_base" and getattr(value, name) is None


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (ModelInput, CurvatureTerm)):
        return {
            f.name: _plain(getattr(value, f.name))
            for f in fields(value)
            if not _unused(value, f.name)
        }
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
