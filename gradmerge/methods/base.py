r"""What every method module shares: its record (:class:`MergeMethod`), one unit's inputs
(:class:`MergeUnit`, :class:`RemoveUnit`), the terms of the system the dry run checks
(:class:`SystemInputs`) and the helpers several rules use.

A method is one module of :mod:`gradmerge.methods` holding its streamed rule and its record
``METHOD``; :mod:`gradmerge.methods.registry` lists them. The record says everything the jobs
know about a method:

- ``name`` and ``command``: the YAML ``method:`` value and the command that runs it (``merge``,
  ``remove``);
- ``keys``: which of the method-specific YAML keys it requires, allows or refuses (the settings
  declared ``per_method`` in :mod:`gradmerge.jobs.config`, :data:`~gradmerge.jobs.config.KEYS`,
  which checks every record against them on import);
- ``runs``: the job its configuration becomes, when not its own (``remerge``, a removal that
  is a merge of the tasks that stay: :func:`gradmerge.jobs.config.load` reads it);
- ``coverage``: which tensors need a curvature (the plan, :data:`Coverage`);
- ``rule``: the function the engine calls on every unit (none for a method that runs as another
  job's method);
- ``system`` and ``damping_at``: the linear system the dry run checks on a unit
  (:mod:`gradmerge.jobs.conditioning`), built from that unit's curvature terms
  (:class:`SystemInputs`), and the configuration field that damps it (``("prior", "delta")``
  is the YAML's ``prior: {delta: ...}``, :attr:`MergeMethod.damping_key`); ``None`` for a
  method whose system is not checked;
- ``systems``: for a method whose solves are not one such system per unit (RegMean's Gram
  systems), the dry run's check itself (:data:`SystemsFn`), run on the units it merges;
- ``bounds_rounding``: a removal whose result amplifies the rounding of its stored inputs
  (Eq. 13's (H_0 + H_t)/H̄_\t), bounded per unit with diagonal curvatures and checked by
  ``rounding_check`` (:class:`gradmerge.jobs.removal_checks.Rounding`);
- ``precheck``: a check of the method's own settings against the shapes of the merged tensors,
  run when the job opens, before a tensor is read (:data:`PrecheckFn`: Iso-CTS's split);
- ``hint``: what to change when the run meets a singular system (the engine adds it to the
  error);
- ``summary``: its lines in ``gradmerge merge --help``; ``docs``: its line in docs/config.md
  (Markdown, one sentence or two);
- ``rowwise``: the rule is elementwise where every curvature of a tensor is (diagonal or δ·I),
  so that the engine may merge a large tensor a block of rows at a time
  (:data:`gradmerge.jobs.job.ROW_BLOCK_BYTES`): rows of the result depend only on the same
  rows of every input.

No formula lives in a rule: each calls one function of :mod:`gradmerge.merge` with the unit's
tensors and the unit's restriction of each curvature, so a streamed merge computes, unit by
unit, exactly what the in-memory call computes on whole state dicts (the curvature structures
never couple two units). A merge rule takes a :class:`MergeUnit`, a removal rule a
:class:`RemoveUnit`. Each unit carries the job's solver settings (``solver``, a
:class:`gradmerge.KroneckerCG` from its ``solver:`` block), passed to the solve; each rule
returns the unit's tensors with the report of its solve (``None`` where nothing is solved).

Example:
    >>> import gradmerge as gm
    >>> precision(0.5, 1.0, None), precision(0.5, 2.0, gm.ScaledIdentity(1.0)).min_eigenvalue()
    (0.5, 2.5)
    >>> gradient_matching_system = lambda x: total([*x.models, x.prior])
    >>> gradient_matching_system(SystemInputs(models=(gm.ScaledIdentity(2.0),), alphas=(1.0,),
    ...                          prior=gm.ScaledIdentity(0.5))).min_eigenvalue()
    2.5
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from gradmerge import merge
from gradmerge.curvature import Curvature, Diagonal
from gradmerge.curvature.io import CurvatureFile
from gradmerge.elementwise.matching import Kernel
from gradmerge.errors import StructureError
from gradmerge.merge import spectral
from gradmerge.merge.inputs import CurvatureLike
from gradmerge.params import Params
from gradmerge.solvers.solution import Solution
from gradmerge.solvers.spec import KroneckerCG

Need = Literal["required", "optional", "forbidden"]
Command = Literal["merge", "remove"]
"""Which command a method serves: ``gradmerge merge`` or ``gradmerge remove`` (the running job
itself is :class:`gradmerge.jobs.job.Job`)."""

Coverage = Literal["all", "kfac", "none"]
"""Which merged tensors a method needs a curvature for: ``all`` of them, those in a K-FAC
structure (``kfac``: RegMean, the rest averaged), or ``none`` (the plan,
:func:`gradmerge.jobs.plan.build_plan`, checks it before any tensor is read)."""

Solved = tuple[dict[str, Tensor], Solution | None]
"""A rule's result: the unit's tensors, and the report of its solve (``None``: none ran)."""


def precision(delta: float, scale: float, curvature: Curvature | None) -> CurvatureLike:
    """δ·I + scale·C (a prior H_0 or a remaining curvature H̄_\\t); δ alone without a curvature.

    A diagonal C gives :meth:`Diagonal.shifted` (the same values, formed only where used: the
    diagonal merge forms them inside its loop)."""
    if curvature is None:
        return delta
    if isinstance(curvature, Diagonal):
        return curvature.shifted(scale, delta)
    return curvature.scaled(scale) + delta


@dataclass(frozen=True)
class MergeUnit:
    """One unit of a merge, as the engine reads it: θ_LLM, the θ_t and their H_t on the unit's
    tensors, the α_t, the prior H_0, the merge's ``damping``, ``kernel``, the fast elementwise
    evaluator the engine chose (:func:`gradmerge.kernels.select`) for the diagonal merges,
    RegMean's ``off_diagonal`` factor and ``embeddings`` choice (``average``, or ``gram``: solve
    the embeddings from their Grams too), the models' ``scale`` (``curvature_scales``, the
    factor on each H_t; RegMean: on each Gram), the job's ``solver`` settings, and for the
    spectral merges Iso-CTS's ``common_space_fraction`` and the names of the matrices to
    ``average``."""

    base: Params
    finetuned: Sequence[Params]
    curvatures: Sequence[Curvature | None]
    alphas: Sequence[float]
    prior: CurvatureLike | None = None
    damping: float = 0.0
    kernel: Kernel | None = None
    off_diagonal: float = merge.REGMEAN_OFF_DIAGONAL
    curvature_scales: Sequence[float] | None = None
    solver: KroneckerCG | None = None
    embeddings: str = "average"
    common_space_fraction: float = spectral.ISO_CTS_COMMON_SPACE_FRACTION
    average: frozenset[str] = frozenset()

    def averaged(self) -> list[str]:
        """The unit's tensors among those to ``average`` (the job's names: every unit's)."""
        return [k for k in self.base if k in self.average]

    def scales(self) -> list[float]:
        """Each model's ``scale``, the factor on its H_t (1 when none is given)."""
        return list(self.curvature_scales or [1.0] * len(self.curvatures))

    def hs(self) -> list[Curvature]:
        """The H_t, every one required, each times its model's ``scale``."""
        return [
            h if s == 1.0 else h.scaled(s)
            for h, s in zip(
                (required(c, t) for t, c in enumerate(self.curvatures)), self.scales(), strict=True
            )
        ]


@dataclass(frozen=True)
class RemoveUnit:
    """One unit of a removal: θ_LLM, H̄_\\t (``remaining``), α and, as the method needs them, θ_t,
    H_t, the prior H_0 and the gradient ∇ℓ̄_t(θ_LLM)."""

    base: Params
    remaining: CurvatureLike
    alpha: float
    finetuned: Params | None = None
    curvature: Curvature | None = None
    prior: CurvatureLike | None = None
    gradient: Params | None = None
    solver: KroneckerCG | None = None


MergeRule = Callable[[MergeUnit], Solved]
"""The signature of a merge rule."""

RemoveRule = Callable[[RemoveUnit], Solved]
"""The signature of a removal rule."""


def required(curvature: Curvature | None, t: int) -> Curvature:
    """Model ``t``'s curvature on the unit, which the rule needs.

    Raises:
        StructureError: there is none (the plan checks coverage; this guards direct callers).
    """
    if curvature is None:  # the plan checks coverage; this guards direct callers
        raise StructureError(f"no curvature for model {t} on these parameters")
    return curvature


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
class SystemReading:
    """A method's own dry-run verdict on one unit's system (:data:`SystemsFn`): its smallest
    eigenvalue, the floor its solve needs and the damping that lifts it (0 when it is fine)."""

    keys: tuple[str, ...]
    min_eigenvalue: float
    floor: float
    needed: float


SystemsFn = Callable[
    [Any, Mapping[str, CurvatureFile], Sequence[tuple[str, ...]]], list[SystemReading]
]
"""A method's own dry-run check: (the job's configuration, its open curvature files by YAML
name — ``models[t].curvature``, …, the merged units' keys) → a reading per unit that solves."""

PrecheckFn = Callable[[Any, Mapping[str, tuple[int, ...]]], None]
"""A check of the method's settings against the job (its configuration, and the shapes of the
merged tensors not named in ``average``), before a tensor is read; raises
:class:`gradmerge.errors.ConfigError` naming the tensor."""


def total(terms: Sequence[Curvature | None]) -> Curvature | None:
    """The sum of the ``terms`` given (``None`` ones left out); ``None`` when there is none."""
    given = [t for t in terms if t is not None]
    return sum(given[1:], given[0]) if given else None


@dataclass(frozen=True)
class MergeMethod:
    """One merge or removal method of the YAML jobs (module docstring)."""

    name: str
    command: Command
    summary: str
    keys: Mapping[str, Need]
    rule: MergeRule | RemoveRule | None
    docs: str = ""
    coverage: Coverage = "all"
    system: SystemFn | None = None
    damping_at: tuple[str, ...] | None = None
    systems: SystemsFn | None = None
    precheck: PrecheckFn | None = None
    hint: str = ""
    max_relative_step: float | None = None
    bounds_rounding: bool = False
    runs: Command | None = None
    rowwise: bool = False
    uses: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        uses = frozenset(k for k, need in self.keys.items() if need != "forbidden")
        object.__setattr__(self, "uses", uses)
        object.__setattr__(self, "runs", self.runs or self.command)

    @property
    def damping_key(self) -> str | None:
        """The YAML spelling of ``damping_at``: ``damping``, ``prior: {delta: ...}``."""
        if self.damping_at is None:
            return None
        *outer, last = self.damping_at
        return (
            "".join(f"{k}: {{" for k in outer)
            + (f"{last}: ..." if outer else last)
            + "}" * len(outer)
        )

    def need(self, key: str) -> Need:
        """Whether the method requires, allows or refuses the method-specific ``key``."""
        return self.keys.get(key, "forbidden")


def removal_system(x: SystemInputs) -> Curvature | None:
    """H̄_\\t, the remaining curvature: the system of every removal."""
    return x.remaining


def removal(
    name: str,
    summary: str,
    keys: Mapping[str, Need],
    rule: RemoveRule,
    step: float,
    docs: str,
    bounds_rounding: bool = False,
) -> MergeMethod:
    """A removal method: every one solves H̄_\\t, damped by ``remaining: {delta: ...}``;
    ``step`` is its default ``max_relative_step``; ``bounds_rounding`` as the record's."""
    return MergeMethod(
        name,
        "remove",
        summary,
        keys,
        rule,
        docs=docs,
        system=removal_system,
        damping_at=("remaining", "delta"),
        hint="the remaining curvature H̄_\\t must be positive definite: set `remaining: {{delta: "
        "...}}` to the base model's prior precision δ ({example}), or add the curvature of the "
        "data that stays",
        max_relative_step=step,
        bounds_rounding=bounds_rounding,
    )
