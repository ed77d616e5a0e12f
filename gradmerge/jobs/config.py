"""Merge and removal configurations: strict YAML files in the style of mergekit's.

:class:`MergeConfig` reads ``gradmerge merge CONFIG OUT_DIR`` (Eq. 6 and its special cases),
:class:`RemoveConfig` ``gradmerge remove CONFIG OUT_DIR`` (Eq. 13, Koh & Liang); both share the
:class:`Options` (output dtype, compute dtype, device, passthrough, shard size, mixed dtypes,
curvature/weights pairing, and the K-FAC ``solver`` settings, a :class:`gradmerge.SolverSpec`).
Every key is declared once, as a field of these dataclasses with its :class:`~gradmerge.settings.
Setting` (meaning, checks, default and the default's source, its name in the ``gm.*`` rules):
the reader's checks and messages, the registry's method-specific keys (:data:`KEYS`) and the
tables of ``docs/config.md`` (:mod:`gradmerge.jobs.reference`) come from it. The page's
examples are parsed by this module in ``proofs_tests/docs/test_config_reference.py``.

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

import difflib
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from gradmerge._guard import Input
from gradmerge.errors import ArgumentError, ConfigError, InputWarning, MissingInputError
from gradmerge.jobs import methods
from gradmerge.merge import REGMEAN_OFF_DIAGONAL
from gradmerge.settings import REQUIRED, Setting, check, declared, default_of, setting, shown
from gradmerge.solvers.spec import SolverSpec, refuse_renamed
from gradmerge.solvers.spec import checked as checked_solver
from gradmerge.spectral import ISO_CTS_COMMON_SPACE_FRACTION

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
COMPUTE_DTYPES = ("float32", "float64")
CURVATURE_WEIGHTS = ("warn", "refuse", "ignore")
STEP_CHECKS = ("refuse", "warn", "ignore")
_ALIASES = {  # keys other tools use for the same thing
    "merge_method": "method",
    "weight": "alpha",
    "parameters": "alpha",
    "lambda": "scale",
    "out_dtype": "dtype",
    "out_shard_size": "max_shard_size",
}
_REQUIRED: Any = REQUIRED


@dataclass(frozen=True)
class ModelInput:
    """One fine-tuned model θ_t of a merge, its curvature H_t and its weight α_t (each field
    declared once: :mod:`gradmerge.settings`)."""

    model: Path = setting(
        REQUIRED,
        "θ_t: a `.safetensors` file, a shard folder, a Hugging Face folder or a PEFT LoRA "
        "adapter folder (applied over `base_model`).",
        kind="path",
        what="the fine-tuned model θ_t",
    )
    curvature: Path | None = setting(
        None,
        "H_t: a curvature file (`gradmerge curvature`, `C.save`).",
        kind="file",
        what="the curvature H_t",
        per_method=True,
    )
    alpha: float = setting(1.0, "α_t, the task's weight.", python="`alphas=[...]` (one per model)")
    scale: float = setting(
        1.0,
        "multiplies H_t (not α_t): a curvature summed over n of the task's N examples, or a "
        "mean Fisher, stands for the task's N_t·F_t at `scale: N/n` (or N).",
        what="the factor on the curvature H_t, e.g. N/n for a curvature summed over n of the "
        "task's N examples",
        above=0.0,
        python="`curvatures=[scale * C, ...]`",
        requires="curvature",
    )
    adapter_base: Path | None = setting(
        None,
        "when `model` is a LoRA adapter whose relative `base_model_name_or_path` cannot be "
        "told apart, the base it was trained on; it must hold `base_model`'s weights "
        "(`gradmerge.io.sources.adapter_base`).",
        kind="path",
        requires="model",
    )


@dataclass(frozen=True)
class CurvatureTerm:
    """A precision δ·I + scale·C: a prior H_0, or the remaining curvature H̄_\\t of a removal.

    ``curvature`` is one file, or several whose SUM is C (YAML: a list), e.g. the per-task
    curvatures of the tasks that stay in a merge when one is removed.
    """

    delta: float = setting(0.0, "δ ≥ 0.", minimum=0.0, python="`prior=δ` (a float)")
    curvature: Path | tuple[Path, ...] | None = setting(
        None,
        "C: one curvature file, or a list of files whose SUM is C (e.g. the per-task "
        "curvatures of the tasks that stay); a list must not be empty.",
        kind="file",
        python="`prior=δ + s * C` (a curvature)",
    )
    scale: float = setting(1.0, "s ≥ 0.", minimum=0.0)

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
    """Settings shared by merges and removals (each declared once: :mod:`gradmerge.settings`)."""

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
        5 * 10**9,
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
    solver: SolverSpec = field(
        default_factory=SolverSpec,
        metadata={
            "setting": Setting(
                "the K-FAC solves: a mapping with the keys of the `solver` table below, the "
                "fields of `gm.SolverSpec` one to one.",
                kind="mapping",
                default_doc="see below",
                python="`solver=gm.SolverSpec(...)`, its fields named as the keys",
            )
        },
    )
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


_METHOD = "the method: one of the registry's (`gradmerge.jobs.methods`), described below."


@dataclass(frozen=True, kw_only=True)
class MergeConfig(Options):
    """A merge: θ = θ_LLM + Σ_t α_t H̄⁻¹ (H_0 + H_t)(θ_t − θ_LLM) (Eq. 6) or a special case.

    ``method`` picks the rule (:mod:`gradmerge.jobs.methods`: which keys each method requires,
    allows or refuses); every key is declared once below, with its meaning, default and the
    default's source (docs/config.md's tables are generated from them). Every α_t is multiplied
    by ``scale``; each model's ``scale`` multiplies its H_t.

    Example:
        >>> cfg = MergeConfig.from_dict(
        ...     {"method": "task_arithmetic", "base_model": ".", "models": [{"model": "."}],
        ...      "scale": 0.5}, check_files=False)
        >>> cfg.alphas, cfg.max_shard_size
        ([0.5], 5000000000)
    """

    method: str = setting(REQUIRED, _METHOD, kind="choice")
    base_model: Path = setting(
        REQUIRED,
        "θ_LLM: a `.safetensors` file, a shard folder or a Hugging Face folder; the source of "
        "the config, tokenizer and integer buffers copied to the output. Where optional, the "
        "first model by default.",
        kind="path",
        what="the base model θ_LLM",
        per_method=True,
        python="`base` (first argument; `gm.fisher_average` has none)",
    )
    models: tuple[ModelInput, ...] = setting(
        REQUIRED,
        "a non-empty list of mappings (the `models[]` table). A checkpoint listed more than "
        "once warns, once, with the count.",
        kind="mapping",
        python="`finetuned`, `curvatures` and `alphas`, three lists in the models' order",
    )
    prior: CurvatureTerm | None = setting(
        None,
        "H_0, a [precision term](#precision-terms-prior-and-remaining).",
        kind="mapping",
        what="the prior H_0",
        per_method=True,
        python="`prior=`: a curvature, or a float δ for δ·I",
    )
    scale: float = setting(
        1.0,
        "multiplies every α_t; for the data-free merges, the papers' α (θ_LLM + α·M).",
        python="`alphas=[scale * α_t, ...]`",
    )
    damping: float = setting(
        0.0,
        "δ ≥ 0 added as δ·I to every H_t (RegMean: to every Gram). `gradient_matching` is "
        "damped by `prior: {delta}` instead.",
        minimum=0.0,
        what="δ·I added to each H_t",
        per_method=True,
        python="`curvatures=[C + δ, ...]`",
    )
    off_diagonal: float = setting(
        REGMEAN_OFF_DIAGONAL,
        "Jin et al.'s factor r on the Gram matrices' off-diagonal entries (their α), "
        "G̃ = r·G + (1 − r)·diag(G); 1 is the plain closed form. With r < 1 the Grams are "
        "non-singular wherever every input was seen, so a BERT or a GPT-2 merges without "
        "`damping`.",
        minimum=0.0,
        maximum=1.0,
        what="Jin et al.'s factor on the Grams' off-diagonal entries",
        per_method=True,
        source="Jin et al. (2023)'s reference implementation (`regmean_reduce_nondiag: 0.1` in "
        "its RoBERTa, DeBERTa and T5 configurations) and FusionBench "
        "(`reduce_non_diagonal_ratio: 0.1`); `gm.merge.REGMEAN_OFF_DIAGONAL`",
    )
    embeddings: str = setting(
        "average",
        "`average` or `gram`: solve the embeddings in K-FAC curvatures (layers with one-hot "
        "inputs: diagonal A, weight stored (vocab, hidden)) from their Grams too, i.e. each row "
        "weighted by how often each task looked it up. A row no task looked up makes that Gram "
        "singular: `gram` then needs `damping` (the dry run names it).",
        kind="choice",
        choices=("average", "gram"),
        what="whether RegMean averages the embeddings or solves them",
        per_method=True,
        source="Jin et al.'s code and FusionBench (both average the embeddings)",
    )
    common_space_fraction: float = setting(
        ISO_CTS_COMMON_SPACE_FRACTION,
        "f, the share of each matrix's r directions kept from the sum of the task matrices "
        "(the common subspace). A fraction so small that some matrix's task-specific "
        "directions would outnumber its rank (seen only below 0.5: none for 0.5 ≤ f ≤ 1, "
        "r ≤ 2048, T ≤ 64) is refused before any tensor is read, naming the matrix.",
        minimum=0.0,
        maximum=1.0,
        what="the share of each matrix's directions Iso-CTS keeps from the sum of the task "
        "matrices",
        per_method=True,
        source="Marczak et al. (2025): their code's `config/method/iso_cts.yaml` and "
        "fusion-bench's; `gm.spectral.ISO_CTS_COMMON_SPACE_FRACTION`",
    )
    average: tuple[str, ...] = setting(
        (),
        "a list of names or globs (`fnmatch`) of 2-D tensors merged by the mean of the "
        "α-weighted task vectors instead of the SVD (fusion-bench's `exclude_keys`; the "
        "authors' code so treats CLIP's `text_projection`); a glob "
        "that matches no tensor is an error.",
        kind="strings",
        what="2-D tensors merged by the mean of the task vectors",
        per_method=True,
    )

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
        spec = _method(r, "merge")
        values = _read_declared(r, cls, spec)
        models = tuple(
            ModelInput(**_read_declared(r.sub(m, f"models[{i}]"), ModelInput, spec))
            for i, m in enumerate(r.entries("models"))
        )
        _warn_repeated(models, r.check_files)
        if values["base_model"] is None:  # optional for this method: the first model
            values["base_model"] = models[0].model
        return cls(**values, models=models, source=source)


@dataclass(frozen=True, kw_only=True)
class RemoveConfig(Options):
    """A removal of data D_t from θ_LLM: Eq. 13 (``remove``) or Koh & Liang (``influence_remove``).

    - ``remove``: θ_\\t = θ_LLM − α H̄_\\t⁻¹ (H_0 + H_t)(θ_t − θ_LLM), with ``model`` θ_t,
      ``curvature`` H_t, ``prior`` H_0 and ``remaining`` H̄_\\t.
    - ``influence_remove``: θ_\\t = θ_LLM + α H̄_\\t⁻¹ ∇ℓ̄_t(θ_LLM), with ``gradient`` a
      safetensors file holding ∇ℓ̄_t(θ_LLM) under the parameters' names.

    Every key is declared once below (docs/config.md's table is generated from them). ``remove``
    with diagonal curvatures also bounds what the removal does to the inputs' rounding
    (:mod:`gradmerge.elementwise.removal`).
    """

    method: str = setting(REQUIRED, _METHOD, kind="choice")
    base_model: Path = setting(
        REQUIRED,
        "θ_LLM, trained on all data including D_t.",
        kind="path",
    )
    remaining: CurvatureTerm = setting(
        REQUIRED,
        "H̄_\\t: a [precision term](#precision-terms-prior-and-remaining), which must include "
        "the base model's own regulariser δ·I (`delta`) and be positive definite.",
        kind="mapping",
    )
    alpha: float = setting(1.0, "α_t, the weight D_t had in θ_LLM's loss.")
    model: Path | None = setting(
        None,
        "θ_t, fine-tuned from θ_LLM on D_t.",
        kind="path",
        what="the fine-tuned model θ_t",
        per_method=True,
        python="`finetuned` (second argument of `gm.remove`)",
    )
    curvature: Path | None = setting(
        None,
        "H_t, the curvature of D_t (a file).",
        kind="file",
        what="the curvature H_t",
        per_method=True,
    )
    prior: CurvatureTerm | None = setting(
        None,
        "H_0 used when fine-tuning θ_t, a precision term.",
        kind="mapping",
        what="the prior H_0",
        per_method=True,
    )
    gradient: Path | None = setting(
        None,
        "a safetensors file holding ∇ℓ̄_t(θ_LLM), a SUM over D_t, under the parameters' names "
        "(written by `gradmerge gradient`).",
        kind="path",
        what="the gradient ∇ℓ̄_t(θ_LLM)",
        per_method=True,
    )
    adapter_base: Path | None = setting(
        None,
        "when `model` is a LoRA adapter, its own base (as `models[].adapter_base` of a merge).",
        kind="path",
        requires="model",
    )
    step_check: str = setting(
        "refuse",
        "what to do when the step ‖θ_\\t − θ_LLM‖ is larger than `max_relative_step` times "
        "‖θ_t − θ_LLM‖ (`remove`) or ‖θ_LLM‖ (`influence_remove`), the sign of a near-zero "
        "direction of H̄_\\t that exploded.",
        kind="choice",
        choices=STEP_CHECKS,
    )
    max_relative_step: float = setting(
        100.0,
        "the largest step `step_check` lets through, relative to the task vector (`remove`) or "
        "the weights (`influence_remove`).",
        above=0.0,
        default_doc="100 (`remove`), 1 (`influence_remove`): the method's record",
    )
    rounding_check: str = setting(
        "refuse",
        "what to do when a `remove` with diagonal curvatures amplifies the rounding of its "
        "stored inputs beyond `max_rounding` × ‖θ_t − θ_LLM‖: the bound is "
        "(ε/2)·‖r·(\\|θ_t\\| + \\|θ_LLM\\|)‖ with r = α(H_0 + H_t)/H̄_\\t (ε of the coarser of "
        "the stored and compute dtypes), large where H̄_\\t is tiny next to H_0 + H_t. "
        "`--dry-run` computes the same bound.",
        kind="choice",
        choices=STEP_CHECKS,
    )
    max_rounding: float = setting(
        1e-2, "the rounding bound `rounding_check` lets through.", above=0.0
    )

    _WHAT: ClassVar[str] = "the remove config"

    @classmethod
    def _read(cls, r: _Reader, source: Path | None) -> RemoveConfig:
        spec = _method(r, "remove")
        assert spec.max_relative_step is not None  # every removal method has one
        values = _read_declared(
            r, cls, spec, defaults={"max_relative_step": spec.max_relative_step}
        )
        return cls(**values, source=source)


@dataclass(frozen=True)
class Remerge:
    """``method: remerge`` of ``gradmerge remove``: the keys of its YAML (read by
    :func:`remerge_config` into the :class:`MergeConfig` it runs)."""

    method: str = setting(REQUIRED, _METHOD, kind="choice")
    merge: Path = setting(
        REQUIRED,
        "the merge's YAML file; everything else (method, base, prior, alphas, options) is its own.",
        kind="file",
        what="the merge's YAML",
        per_method=True,
    )
    without: tuple[int | Path, ...] = setting(
        REQUIRED,
        "a non-empty list of the merge's models to leave out: 0-based indices into its "
        "`models` or their `model` paths (relative to this file).",
        kind="mapping",
        what="the merge's models to leave out",
        per_method=True,
    )


READS: dict[methods.JobKind, tuple[type, ...]] = {
    "merge": (MergeConfig, ModelInput),
    "remove": (RemoveConfig, Remerge),
}
"""The declarations each job's YAML files are read with (a merge's models are ModelInputs; a
removal's ``method: remerge`` reads :class:`Remerge`)."""

KEYS: dict[methods.JobKind, tuple[str, ...]] = {
    job: tuple(dict.fromkeys(k for c in classes for k, s in declared(c).items() if s.per_method))
    for job, classes in READS.items()
}
"""The method-specific keys of each job (declared ``per_method``; a merge's ``curvature`` is
each ``models[i]``'s): the registry's records say which of them each method needs."""

_WHAT_KEYS = {
    k: s.what for classes in READS.values() for c in classes for k, s in declared(c).items()
}


def help_keys(job: methods.JobKind) -> str:
    """The keys of a job's YAML for ``--help``, from the declarations: each mapping's own keys
    in parentheses, ``models[]`` last.

    Example:
        >>> help_keys("merge").split(", models[]")[0].split(", ")[:3]
        ['method', 'base_model', 'prior (delta']
    """
    nested = {"solver": SolverSpec, "prior": CurvatureTerm, "remaining": CurvatureTerm}
    top = READS[job][0]
    parts = []
    for key in _ordered(top):
        inner = nested.get(key)
        parts.append(f"{key} ({', '.join(declared(inner))})" if inner else key)
    if job == "merge":
        parts.append(f"models[] ({', '.join(declared(ModelInput))})")
    parts = [p for p in parts if p != "models"]
    return ", ".join(parts)


def _ordered(cls: Any) -> list[str]:
    """The declared keys of ``cls``, its own before the shared :class:`Options`."""
    shared = declared(Options)
    return sorted(declared(cls), key=lambda k: k in shared)


def _check_registry() -> None:
    """Every record names only method-specific keys of its job (on import: a wrong record
    fails at once, not in a user's run)."""
    for m in methods.REGISTRY:
        unknown = set(m.keys) - set(KEYS[m.job])
        if unknown:
            raise ArgumentError(f"{m.name}: keys {sorted(unknown)} are not keys of a {m.job}")


_check_registry()


def load(path: str | os.PathLike[str], job: methods.JobKind) -> MergeConfig | RemoveConfig:
    """The configuration of ``gradmerge JOB`` at ``path``: a :class:`MergeConfig` or
    :class:`RemoveConfig`, or, for a method that runs as another job (``remerge``: its record's
    ``runs``), the configuration it runs (:func:`remerge_config`).

    Example:
        >>> import tempfile, yaml
        >>> from pathlib import Path
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = (Path(d) / "a").mkdir(), (Path(d) / "b").mkdir()
        ...     merge = {"method": "task_arithmetic", "base_model": ".",
        ...              "models": [{"model": "a"}, {"model": "b"}]}
        ...     _ = (Path(d) / "merge.yaml").write_text(yaml.safe_dump(merge))
        ...     remerge = {"method": "remerge", "merge": "merge.yaml", "without": [0]}
        ...     _ = (Path(d) / "remerge.yaml").write_text(yaml.safe_dump(remerge))
        ...     cfg = load(Path(d) / "remerge.yaml", "remove")
        ...     type(cfg).__name__, cfg.method, [m.model.name for m in cfg.models]
        ('MergeConfig', 'task_arithmetic', ['b'])
    """
    data, root = _load_yaml(path)
    name = data.get("method") if isinstance(data, Mapping) else None
    if name in methods.names(job) and methods.get(name).runs != job:
        return remerge_config(data, root=root, source=Path(path))
    config = MergeConfig if job == "merge" else RemoveConfig
    return config.from_dict(data, root=root, source=Path(path))


def _method(r: _Reader, job: methods.JobKind) -> methods.MergeMethod:
    """The record of the ``method`` named in ``r``, one of ``job``'s that runs as ``job``."""
    spec = methods.get(r.choice("method", methods.names(job)))
    if spec.runs != job:
        raise ConfigError(
            f"method {spec.name} runs as a {spec.runs} of the tasks that stay: read it with "
            f"gradmerge.jobs.config.load(path, {job!r}) (`gradmerge {job}` does)"
        )
    return spec


def _read_declared(
    r: _Reader,
    cls: Any,
    spec: methods.MergeMethod,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every setting declared on ``cls`` (:mod:`gradmerge.settings`) read from ``r`` and
    checked by its declaration: a method-specific one (``per_method``) as ``spec`` needs it
    (refused, with the methods that use it, where ``spec`` does not), one that ``requires``
    another refused where that one is; ``defaults`` overrides a declared default (the
    method's own ``max_relative_step``). Unknown keys are refused first, naming the allowed
    ones. ``models`` is left to the caller."""
    own = declared(cls)
    siblings = [k for k in KEYS[spec.job] if k not in own and _top_level(cls, k, spec.job)]
    r.allow(*_ordered(cls), *siblings)
    values: dict[str, Any] = {}
    for key in siblings:
        r.forbid(key, spec.name, spec.refusal(key, _WHAT_KEYS[key]))
    for key, s in own.items():
        if key in ("method", "models"):
            continue  # read by the caller
        default = (defaults or {}).get(key, default_of(cls, key))
        refused = _refused(key, s, spec)
        if refused is not None:
            r.forbid(key, spec.name, refused)
            values[key] = None if default is REQUIRED else default
            continue
        if s.per_method and spec.need(key) == "required":
            default = REQUIRED
        elif s.per_method and default is REQUIRED:
            default = None  # optional for this method (its own default follows)
        values[key] = _read_one(r, key, s, default)
    if "method" in own:
        values["method"] = spec.name
    return values


def _top_level(cls: Any, key: str, job: methods.JobKind) -> bool:
    """Whether ``key`` (a method-specific key of ``job``) is read at ``cls``'s level: a key of
    a sibling top-level declaration (a removal's ``merge`` beside ``model``), not a nested one
    (a merge's ``models[i].curvature``)."""
    return cls is not ModelInput and any(
        key in declared(c) for c in READS[job] if c is not ModelInput
    )


def _refused(key: str, s: Setting, spec: methods.MergeMethod) -> str | None:
    """Why ``spec`` refuses setting ``key`` (None: it may be given)."""
    if s.per_method and spec.need(key) == "forbidden":
        return spec.refusal(key, s.what)
    if s.requires in KEYS[spec.job] and s.requires not in spec.uses:
        return f"it goes with `{s.requires}`, which {spec.name} does not use"
    return None


def _read_one(r: _Reader, key: str, s: Setting, default: Any) -> Any:
    """One setting's value (``default`` where it is absent), checked by its declaration."""
    if s.kind in ("path", "file"):
        return r.path(key, kind=s.kind if s.kind == "file" else "any", default=default)
    if s.kind == "size":
        return r.size(key, default=default)
    if s.kind == "device":
        return r.device(key)
    if s.kind == "mapping":
        return _NESTED[key](r, key, default)
    value = r._get(key, default)
    if value is None and default is None:
        return None
    return check(s, value, r._name(key), ConfigError)


def _term_or_default(r: _Reader, key: str, default: Any) -> CurvatureTerm | None:
    return _term(r, key, required=default is REQUIRED)


def _solver(r: _Reader, key: str, default: Any) -> SolverSpec:
    """``solver:``, the fields of :class:`gradmerge.SolverSpec` one to one, each checked by its
    declaration (:func:`gradmerge.solvers.spec.checked`, naming ``solver.KEY``)."""
    if r.data.get(key) is None:
        return SolverSpec()
    s = r.sub(r.data[key], key)
    refuse_renamed(s.data, key, ConfigError)
    s.allow(*declared(SolverSpec))
    given = {k: v for k, v in s.data.items() if v is not None}
    return SolverSpec(**checked_solver(given, key, ConfigError))


def _curvature_sum(r: _Reader, key: str, default: Any) -> Path | tuple[Path, ...] | None:
    """``curvature`` of a precision term: one file, or a non-empty list whose SUM is C."""
    listed = r.data.get(key)
    if not isinstance(listed, list):
        return r.path(key, kind="file", default=None)
    if not listed:
        raise ConfigError(
            f"`{r._name(key)}` is an empty list: give a curvature file, or a list of "
            "files whose sum is the curvature"
        )
    return tuple(r.sub({"": v}, f"{key}[{i}]").path("", kind="file") for i, v in enumerate(listed))


def _without(r: _Reader, key: str, default: Any) -> list[Any]:
    """``without`` of ``remerge``, as listed (:func:`remerge_config` resolves each entry)."""
    listed = r.data.get(key)
    if not isinstance(listed, list) or not listed:
        raise ConfigError(
            f"`{key}` must be a non-empty list of the merge's models to leave out: indices into "
            "its `models` (0-based) or their `model` paths, e.g. `without: [1]`"
        )
    return listed


_NESTED = {
    "prior": _term_or_default,
    "remaining": _term_or_default,
    "solver": _solver,
    "without": _without,
}
"""Readers of the settings that are mappings of their own."""


def remerge_config(
    data: Mapping[str, Any], *, root: str | os.PathLike[str], source: Path | None = None
) -> MergeConfig:
    """``method: remerge``: the merge ``merge`` (a merge YAML) without the models in
    ``without`` — Eq. 6 over the tasks that stay, the exact "remove task t from a merge"
    (Eq. 13 from the merged weights approximates it, up to H̄_\\t⁻¹ H_0 (θ_m − θ_LLM) and the
    rounding it amplifies). Its keys are declared in :class:`Remerge`.

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
    spec = methods.get(
        r.choice("method", tuple(m.name for m in methods.REGISTRY if m.runs != m.job))
    )
    values = _read_declared(r, Remerge, spec)
    merge_path = values["merge"]
    merged, merge_root = _load_yaml(merge_path)
    cfg = MergeConfig.from_dict(merged, root=merge_root, source=merge_path)
    listed = values["without"]
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
    """A precision term δ·I + s·C under ``key`` (:class:`CurvatureTerm`, read by its
    declarations); refused where it is zero."""
    if key not in r.data:
        if required:
            raise ConfigError(
                f"{r.where} needs `{key}`, e.g. `{key}: {{delta: 1.0e-6}}` (δ·I) or "
                f"`{key}: {{delta: 1.0e-6, curvature: path/to/file.curvature.safetensors}}`"
            )
        return None
    t = r.sub(r.data[key], key)
    settings = declared(CurvatureTerm)
    t.allow(*settings)
    term = CurvatureTerm(
        delta=_read_one(t, "delta", settings["delta"], default_of(CurvatureTerm, "delta")),
        curvature=_curvature_sum(t, "curvature", None),
        scale=_read_one(t, "scale", settings["scale"], default_of(CurvatureTerm, "scale")),
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
        return str(
            check(Setting("", "choice", choices=options), value, self._name(key), ConfigError)
        )

    def number(self, key: str, default: Any = _REQUIRED, *, minimum: float | None = None) -> float:
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


_shown = shown


def _unused(value: Any, name: str) -> bool:
    """An optional key left out of records when not given (records of runs without it stay as
    they were)."""
    if name == "embeddings":  # RegMean's alone
        return getattr(value, "method", None) != "regmean"
    return name == "adapter_base" and getattr(value, name) is None


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if is_dataclass(value) and not isinstance(value, type):  # ModelInput, CurvatureTerm, SolverSpec
        return {
            f.name: _plain(getattr(value, f.name))
            for f in fields(value)
            if not _unused(value, f.name)
        }
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
