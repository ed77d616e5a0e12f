"""Merge and removal configurations: strict YAML files in the style of mergekit's.

:class:`MergeConfig` reads ``gradmerge merge CONFIG OUT_DIR`` (Eq. 6 and its special cases),
:class:`RemoveConfig` ``gradmerge remove CONFIG OUT_DIR`` (Eq. 13, Koh & Liang); both share the
:class:`~gradmerge.jobs.options.Options` (output dtype, compute dtype, device, passthrough, shard
size, mixed dtypes, curvature/weights pairing, and the K-FAC ``solver`` settings, a
:class:`gradmerge.KroneckerCG`). Every key is declared once, as a field of these dataclasses with
its :class:`~gradmerge.foundation.settings.Setting` (meaning, checks, default and the default's
source, its name in the ``gm.*`` rules): the reader's checks and messages, the registry's
method-specific keys (:data:`KEYS`) and the tables of ``docs/config.md``
(:mod:`gradmerge.jobs.reference`) come from it. The page's examples are parsed by this module in
``proofs_tests/docs/test_config_reference.py``. :func:`load` is the one entry point of a job's
YAML (``method: remerge`` included: :func:`remerge_config`).

The reader is strict: relative paths are relative to the YAML file's folder; unknown keys,
missing keys, keys a method does not use, keys given twice, files that are not UTF-8 and missing
files raise :class:`ConfigError` / :class:`MissingInputError`, naming the key (values shown in
messages are shortened). A checkpoint listed as two models warns (:class:`InputWarning`).

This module holds each job's own declarations and reads them as its method needs them
(``per_method`` keys required, allowed or refused by the method's record); a key that one
method alone reads is declared in that method's module and bound here as a field
(``off_diagonal`` and ``embeddings``: :mod:`gradmerge.methods.regmean`;
``common_space_fraction``: :mod:`gradmerge.methods.iso_cts`). Its parts:
:mod:`gradmerge.jobs.options` (the shared :class:`~gradmerge.jobs.options.Options`, ``from_yaml``
and ``from_dict``, the record's values), :mod:`gradmerge.jobs.inputs` (a merge's models, precision
terms, the paths for the output guard), :mod:`gradmerge.jobs.setting_values` (one declared
setting's value) and :mod:`gradmerge.jobs.yaml_reader` (the YAML file and typed access to a
mapping).

Example:
    >>> cfg = MergeConfig.from_dict(
    ...     {"method": "gradient_matching", "base_model": ".", "prior": {"delta": 1e-6},
    ...      "models": [{"model": ".", "curvature": "a.curvature.safetensors", "alpha": 0.5}]},
    ...     check_files=False)
    >>> cfg.method, cfg.prior.delta, cfg.alphas
    ('gradient_matching', 1e-06, [0.5])
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from gradmerge.errors import ArgumentError, ConfigError
from gradmerge.foundation.settings import REQUIRED, Setting, declared, default_of, setting
from gradmerge.jobs.inputs import CurvatureTerm, ModelInput, path_inputs, warn_repeated
from gradmerge.jobs.options import Options, ordered
from gradmerge.jobs.setting_values import read_one
from gradmerge.jobs.yaml_reader import Reader, load_yaml
from gradmerge.methods import iso_cts, registry, regmean
from gradmerge.methods.base import Command, MergeMethod
from gradmerge.solvers.spec import KroneckerCG

STEP_CHECKS = ("refuse", "warn", "ignore")

_METHOD = "the method: one of the registry's (`gradmerge.methods.registry`), described below."


@dataclass(frozen=True, kw_only=True)
class MergeConfig(Options):
    """A merge: θ = θ_LLM + Σ_t α_t H̄⁻¹ (H_0 + H_t)(θ_t − θ_LLM) (Eq. 6) or a special case.

    ``method`` picks the rule (:mod:`gradmerge.methods`: which keys each method requires,
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
    off_diagonal: float = regmean.OFF_DIAGONAL
    embeddings: str = regmean.EMBEDDINGS
    common_space_fraction: float = iso_cts.COMMON_SPACE_FRACTION
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
    def _read(cls, r: Reader, source: Path | None) -> MergeConfig:
        spec = _method(r, "merge")
        values = _read_declared(r, cls, spec)
        models = tuple(
            ModelInput(**_read_declared(r.sub(m, f"models[{i}]"), ModelInput, spec))
            for i, m in enumerate(r.entries("models"))
        )
        warn_repeated(models, r.check_files)
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
    def _read(cls, r: Reader, source: Path | None) -> RemoveConfig:
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
        kind="selection",
        what="the merge's models to leave out",
        per_method=True,
    )


READS: dict[Command, tuple[type, ...]] = {
    "merge": (MergeConfig, ModelInput),
    "remove": (RemoveConfig, Remerge),
}
"""The declarations each job's YAML files are read with (a merge's models are ModelInputs; a
removal's ``method: remerge`` reads :class:`Remerge`)."""

KEYS: dict[Command, tuple[str, ...]] = {
    job: tuple(dict.fromkeys(k for c in classes for k, s in declared(c).items() if s.per_method))
    for job, classes in READS.items()
}
"""The method-specific keys of each job (declared ``per_method``; a merge's ``curvature`` is
each ``models[i]``'s): the registry's records say which of them each method needs."""

_WHAT_KEYS = {
    k: s.what for classes in READS.values() for c in classes for k, s in declared(c).items()
}


def help_keys(job: Command) -> str:
    """The keys of a job's YAML for ``--help``, from the declarations: each mapping's own keys
    in parentheses, ``models[]`` last.

    Example:
        >>> help_keys("merge").split(", models[]")[0].split(", ")[:3]
        ['method', 'base_model', 'prior (delta']
    """
    nested = {"solver": KroneckerCG, "prior": CurvatureTerm, "remaining": CurvatureTerm}
    top = READS[job][0]
    parts = []
    for key in ordered(top):
        inner = nested.get(key)
        parts.append(f"{key} ({', '.join(declared(inner))})" if inner else key)
    if job == "merge":
        parts.append(f"models[] ({', '.join(declared(ModelInput))})")
    parts = [p for p in parts if p != "models"]
    return ", ".join(parts)


def _check_registry() -> None:
    """Every record names only method-specific keys of its job (on import: a wrong record
    fails at once, not in a user's run)."""
    for m in registry.REGISTRY:
        unknown = set(m.keys) - set(KEYS[m.command])
        if unknown:
            raise ArgumentError(f"{m.name}: keys {sorted(unknown)} are not keys of a {m.command}")


_check_registry()


def load(path: str | os.PathLike[str], job: Command) -> MergeConfig | RemoveConfig:
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
    data, root = load_yaml(path)
    name = data.get("method") if isinstance(data, Mapping) else None
    if name in registry.names(job) and registry.get(name).runs != job:
        return remerge_config(data, root=root, source=Path(path))
    config = MergeConfig if job == "merge" else RemoveConfig
    return config.from_dict(data, root=root, source=Path(path))


def _method(r: Reader, job: Command) -> MergeMethod:
    """The record of the ``method`` named in ``r``, one of ``job``'s that runs as ``job``."""
    spec = registry.get(r.choice("method", registry.names(job)))
    if spec.runs != job:
        raise ConfigError(
            f"method {spec.name} runs as a {spec.runs} of the tasks that stay: read it with "
            f"gradmerge.jobs.config.load(path, {job!r}) (`gradmerge {job}` does)"
        )
    return spec


def _read_declared(
    r: Reader,
    cls: Any,
    spec: MergeMethod,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every setting declared on ``cls`` (:mod:`gradmerge.foundation.settings`) read from ``r`` and
    checked by its declaration: a method-specific one (``per_method``) as ``spec`` needs it
    (refused, with the methods that use it, where ``spec`` does not), one that ``requires``
    another refused where that one is; ``defaults`` overrides a declared default (the
    method's own ``max_relative_step``). Unknown keys are refused first, naming the allowed
    ones. ``models`` is left to the caller."""
    own = declared(cls)
    siblings = [k for k in KEYS[spec.command] if k not in own and _top_level(cls, k, spec.command)]
    r.allow(*ordered(cls), *siblings)
    values: dict[str, Any] = {}
    for key in siblings:
        r.forbid(key, spec.name, registry.refusal(spec, key, _WHAT_KEYS[key]))
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
        values[key] = read_one(r, key, s, default)
    if "method" in own:
        values["method"] = spec.name
    return values


def _top_level(cls: Any, key: str, job: Command) -> bool:
    """Whether ``key`` (a method-specific key of ``job``) is read at ``cls``'s level: a key of
    a sibling top-level declaration (a removal's ``merge`` beside ``model``), not a nested one
    (a merge's ``models[i].curvature``)."""
    return cls is not ModelInput and any(
        key in declared(c) for c in READS[job] if c is not ModelInput
    )


def _refused(key: str, s: Setting, spec: MergeMethod) -> str | None:
    """Why ``spec`` refuses setting ``key`` (None: it may be given)."""
    if s.per_method and spec.need(key) == "forbidden":
        return registry.refusal(spec, key, s.what)
    if s.requires in KEYS[spec.command] and s.requires not in spec.uses:
        return f"it goes with `{s.requires}`, which {spec.name} does not use"
    return None


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
    r = Reader(data, "the remove config", Path(root), True)
    spec = registry.get(
        r.choice("method", tuple(m.name for m in registry.REGISTRY if m.runs != m.command))
    )
    values = _read_declared(r, Remerge, spec)
    merge_path = values["merge"]
    merged, merge_root = load_yaml(merge_path)
    cfg = MergeConfig.from_dict(merged, root=merge_root, source=merge_path)
    listed = tuple(
        item
        if isinstance(item, int) and not isinstance(item, bool)
        else r.sub({"": item}, f"without[{i}]").path("", default=None)
        for i, item in enumerate(values["without"])
    )
    drop: set[int] = set()
    for i, item in enumerate(listed):
        if isinstance(item, int):
            if not 0 <= item < len(cfg.models):
                raise ConfigError(
                    f"`without[{i}]` = {item} is not an index of the merge's {len(cfg.models)} "
                    f"models (0 to {len(cfg.models) - 1})"
                )
            drop.add(item)
            continue
        matches = [j for j, m in enumerate(cfg.models) if m.model.resolve() == item.resolve()]
        if not matches:
            raise ConfigError(
                f"`without[{i}]` ({item}) is none of the merge's models: "
                + ", ".join(str(m.model) for m in cfg.models)
            )
        drop.update(matches)
    kept = tuple(m for j, m in enumerate(cfg.models) if j not in drop)
    if not kept:
        raise ConfigError("`without` leaves no model to merge: the result would be the base model")
    # what the run reads beyond the kept models: the paths of this file's declared keys (the
    # merge's YAML, the models of `without`) and every path of that merge, the dropped included
    read = Remerge(method=spec.name, merge=merge_path, without=listed)
    also = path_inputs(read, "") + path_inputs(cfg, "merge")
    return replace(cfg, models=kept, source=source, also_reads=tuple(also))
