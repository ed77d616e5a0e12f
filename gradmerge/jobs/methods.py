r"""The merge and removal methods of the YAML jobs: one :class:`MergeMethod` record each.

A record says everything the jobs know about a method, so that adding a method means adding one
record here and its rule in :mod:`gradmerge.jobs.rules`:

- ``name`` and ``command``: the YAML ``method:`` value and the command that runs it (``merge``,
  ``remove``);
- ``keys``: which of the method-specific YAML keys it requires, allows or refuses (the settings
  declared ``per_method`` in :mod:`gradmerge.jobs.config`, :data:`~gradmerge.jobs.config.KEYS`,
  which reads them from here and checks every record against them on import);
- ``runs``: the command its configuration runs as, when not its own (``remerge``, a removal that
  is a merge of the tasks that stay: :func:`gradmerge.jobs.config.load` reads it);
- ``coverage``: which tensors need a curvature (the plan, :data:`gradmerge.jobs.plan.Coverage`);
- ``rule``: the function of :mod:`gradmerge.jobs.rules` the engine calls on every unit (none
  for a method that runs as another command's method);
- ``system`` and ``damping_key``: the linear system the dry run checks on a unit
  (:mod:`gradmerge.jobs.conditioning`), built from that unit's curvature terms
  (:class:`SystemInputs`), and the YAML key that damps it; ``None`` for a method whose system
  is not checked;
- ``hint``: what to change when the run meets a singular system (the engine adds it to the
  error);
- ``summary``: its lines in ``gradmerge merge --help``;
- ``rowwise``: the rule is elementwise where every curvature of a tensor is (diagonal or δ·I),
  so that the engine may merge a large tensor a block of rows at a time
  (:data:`gradmerge.jobs.job.ROW_BLOCK_BYTES`): rows of the result depend only on the same
  rows of every input.

Example:
    >>> [m.name for m in methods("merge")]
    ['task_arithmetic', 'fisher_average', 'gradient_matching', 'regmean', 'tsv_merge', 'iso_c', 'iso_cts']
    >>> names("remove")
    ('remove', 'influence_remove', 'remerge')
    >>> get("fisher_average").need("damping"), get("fisher_average").need("prior")
    ('optional', 'forbidden')
    >>> import gradmerge as gm
    >>> system = get("gradient_matching").system
    >>> system(SystemInputs(models=(gm.ScaledIdentity(2.0),), alphas=(1.0,),
    ...                     prior=gm.ScaledIdentity(0.5))).min_eigenvalue()
    2.5
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gradmerge.curvature import Curvature
from gradmerge.errors import ArgumentError
from gradmerge.jobs import rules
from gradmerge.jobs.plan import Coverage
from gradmerge.merge import REGMEAN_OFF_DIAGONAL
from gradmerge.spectral import ISO_CTS_COMMON_SPACE_FRACTION

Need = Literal["required", "optional", "forbidden"]
Command = Literal["merge", "remove"]
"""Which command a method serves: ``gradmerge merge`` or ``gradmerge remove`` (the running job
itself is :class:`gradmerge.jobs.job.Job`)."""


@dataclass(frozen=True)
class SystemInputs:
    """One unit's curvature terms, as the dry run reads them (in the compute dtype).

    ``models``: α_t·H_t of the models that have a curvature on the unit; ``alphas``: every
    α_t (scale included); ``prior``: H_0 = δI + s·C; ``remaining``: H̄_\t of a removal;
    ``damping``: the merge's ``damping``.
    """

    models: tuple[Curvature, ...] = ()
    alphas: tuple[float, ...] = ()
    prior: Curvature | None = None
    remaining: Curvature | None = None
    damping: float = 0.0


SystemFn = Callable[[SystemInputs], Curvature | None]
"""The system a method solves on one unit, from that unit's terms (``None``: there is none)."""


@dataclass(frozen=True)
class MergeMethod:
    """One merge or removal method of the YAML jobs (module docstring)."""

    name: str
    command: Command
    summary: str
    keys: Mapping[str, Need]
    rule: rules.MergeRule | rules.RemoveRule | None
    coverage: Coverage = "all"
    system: SystemFn | None = None
    damping_key: str | None = None
    hint: str = ""
    max_relative_step: float | None = None
    runs: Command | None = None
    rowwise: bool = False
    uses: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        uses = frozenset(k for k, need in self.keys.items() if need != "forbidden")
        object.__setattr__(self, "uses", uses)
        object.__setattr__(self, "runs", self.runs or self.command)

    def need(self, key: str) -> Need:
        """Whether the method requires, allows or refuses the method-specific ``key``."""
        return self.keys.get(key, "forbidden")

    def refusal(self, key: str, what: str = "") -> str:
        """Why ``key`` (``what`` it holds, for the message) is refused by this method: which
        methods of its command use it instead."""
        users = [m.name for m in methods(self.command) if key in m.uses]
        listed = " and ".join(filter(None, [", ".join(users[:-1]), *users[-1:]]))
        why = f"{what or f'`{key}`'} is for {listed or 'no method'}"
        if key == "damping" and self.damping_key is not None:
            why += f" (damp {self.name} with `{self.damping_key}`)"
        return why


def _sum(terms: Sequence[Curvature]) -> Curvature | None:
    return sum(terms[1:], terms[0]) if terms else None


def _gradient_matching_system(x: SystemInputs) -> Curvature | None:
    """H̄ = H_0 + Σ_t α_t H_t."""
    return _sum([*x.models, *([x.prior] if x.prior is not None else [])])


def _fisher_average_system(x: SystemInputs) -> Curvature | None:
    """Σ_t α_t (H_t + damping·I)."""
    total = _sum(x.models)
    damping = x.damping * sum(x.alphas)
    return total + damping if total is not None and damping else total


def _removal_system(x: SystemInputs) -> Curvature | None:
    """H̄_\\t, the remaining curvature."""
    return x.remaining


def _removal(
    name: str, summary: str, keys: Mapping[str, Need], rule: rules.RemoveRule, step: float
) -> MergeMethod:
    """A removal method: every one solves H̄_\\t, damped by ``remaining: {delta: ...}``."""
    return MergeMethod(
        name,
        "remove",
        summary,
        keys,
        rule,
        system=_removal_system,
        damping_key="remaining: {delta: ...}",
        hint="the remaining curvature H̄_\\t must be positive definite: set `remaining: {{delta: "
        "...}}` to the base model's prior precision δ ({example}), or add the curvature of the "
        "data that stays",
        max_relative_step=step,
    )


REGISTRY: tuple[MergeMethod, ...] = (
    MergeMethod(
        "task_arithmetic",
        "merge",
        "θ_LLM + Σ α_t (θ_t − θ_LLM); no curvature, no prior",
        {"base_model": "required"},
        rules.task_arithmetic,
        coverage="none",
        rowwise=True,
    ),
    MergeMethod(
        "fisher_average",
        "merge",
        "(Σ α_t H_t)⁻¹ Σ α_t H_t θ_t; optional `damping: δ` adds δI to each H_t;\n"
        "base_model optional (default: the first model)",
        {"base_model": "optional", "curvature": "required", "damping": "optional"},
        rules.fisher_average,
        system=_fisher_average_system,
        damping_key="damping",
        hint="set `damping:` ({example}) so that Σ α_t H_t is positive definite",
        rowwise=True,
    ),
    MergeMethod(
        "gradient_matching",
        "merge",
        "Eq. 6: θ_LLM + H̄⁻¹ Σ α_t (H_0 + H_t)(θ_t − θ_LLM), H̄ = H_0 + Σ α_t H_t;\n`prior` required",
        {"base_model": "required", "curvature": "required", "prior": "required"},
        rules.gradient_matching,
        system=_gradient_matching_system,
        damping_key="prior: {delta: ...}",
        hint="raise `prior: {{delta: ...}}` ({example}) so that H̄ is positive definite",
        rowwise=True,
    ),
    MergeMethod(
        "regmean",
        "merge",
        "RegMean (Jin et al.): each linear layer's weight from Gram_t = M_t·A_t = Σ x xᵀ\n"
        "(A_t: each curvature's K-FAC input factor, a mean over M_t rows), off-diagonal\n"
        f"entries times `off_diagonal: r` (Jin et al.'s α, in [0, 1], default "
        f"{REGMEAN_OFF_DIAGONAL:g}; 1: the\n"
        "plain closed form); biases, embeddings (`embeddings: gram` solves them too) and\n"
        "other tensors are averaged; optional `damping`",
        {
            "base_model": "optional",
            "curvature": "required",
            "damping": "optional",
            "off_diagonal": "optional",
            "embeddings": "optional",
        },
        rules.regmean,
        coverage="kfac",
        damping_key="damping",
        hint="set `damping:` ({example}) so that the summed Gram matrices are invertible",
    ),
    MergeMethod(
        "tsv_merge",
        "merge",
        "TSV-M (Gargiulo et al., CVPR 2025): per matrix, each task's top ⌊r/T⌋\n"
        "singular directions, whitened (U ↦ PQᵀ), θ_LLM + polar(U) S polar(V)ᵀ;\n"
        "other tensors and `average`: the mean of the α_t τ_t; no curvature",
        {"base_model": "required", "average": "optional"},
        rules.tsv_merge,
        coverage="none",
    ),
    MergeMethod(
        "iso_c",
        "merge",
        "Iso-C (Marczak et al., ICML 2025): per matrix, Σ α_t τ_t = U S Vᵀ with a flat\n"
        "spectrum, θ_LLM + mean(S)·U Vᵀ; other tensors and `average`: the mean",
        {"base_model": "required", "average": "optional"},
        rules.iso_c,
        coverage="none",
    ),
    MergeMethod(
        "iso_cts",
        "merge",
        "Iso-CTS (Marczak et al.): Iso-C's common subspace (`common_space_fraction`,\n"
        f"default {ISO_CTS_COMMON_SPACE_FRACTION:g}, of the directions) plus each task's own directions outside it,\n"
        "whitened, flat spectrum; other tensors and `average`: the mean",
        {"base_model": "required", "common_space_fraction": "optional", "average": "optional"},
        rules.iso_cts,
        coverage="none",
    ),
    _removal(
        "remove",
        "Eq. 13: θ_LLM − α H̄_\\t⁻¹ (H_0 + H_t)(θ_t − θ_LLM)",
        {"model": "required", "curvature": "required", "prior": "required"},
        rules.remove,
        step=100.0,
    ),
    _removal(
        "influence_remove",
        "Koh & Liang (2017): θ_LLM + α H̄_\\t⁻¹ ∇ℓ̄_t(θ_LLM)",
        {"gradient": "required"},
        rules.influence_remove,
        step=1.0,
    ),
    MergeMethod(
        "remerge",
        "remove",
        "the exact removal of tasks from a merge: the merge `merge` (its YAML) again\n"
        "without the models listed in `without`; runs as that merge",
        {"merge": "required", "without": "required"},
        None,
        runs="merge",
    ),
)
"""Every method, in the order the help and the error messages list them."""

_BY_NAME = {m.name: m for m in REGISTRY}


def methods(command: Command) -> tuple[MergeMethod, ...]:
    """The methods of one command, in registry order."""
    return tuple(m for m in REGISTRY if m.command == command)


def names(command: Command) -> tuple[str, ...]:
    """The ``method:`` values one command accepts."""
    return tuple(m.name for m in methods(command))


def get(name: str) -> MergeMethod:
    """The record of ``name``.

    Raises:
        ArgumentError: no method has that name (the message lists those that exist).
    """
    method = _BY_NAME.get(name)
    if method is None:
        raise ArgumentError(
            f"unknown method {name!r}: expected one of {', '.join(_BY_NAME)} "
            "(gradmerge.jobs.methods.REGISTRY)"
        )
    return method


def help_table(command: Command, indent: int = 2, width: int = 19) -> str:
    """The ``methods:`` lines of a command's help: each name and its summary."""
    lines = []
    for m in methods(command):
        first, *rest = m.summary.splitlines()
        lines.append(f"{' ' * indent}{m.name:<{width}}{first}")
        lines += [f"{' ' * (indent + width)}{line}" for line in rest]
    return "\n".join(lines)
