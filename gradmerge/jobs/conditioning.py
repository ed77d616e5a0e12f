r"""The systems a merge or removal will solve, checked before it runs (``--dry-run``).

Every merged unit (a tensor, a K-FAC layer, ...) solves one linear system:

- ``gradient_matching``: H̄ = H_0 + Σ_t α_t H_t (``prior`` is H_0 = δI + s·C);
- ``fisher_average``: Σ_t α_t (H_t + damping·I);
- ``remove`` / ``influence_remove``: H̄_\t (``remaining``).

:func:`check_systems` makes the same solvability decision for every unit as the real run:

- an elementwise system (diagonal, δ·I) is read from the curvature files only and judged by its
  smallest entry, exactly the rule of the run's division (> 0);
- any other (K-FAC, dense, a lazy sum) is COMPUTED as the run computes it — the same solve, on
  the unit's tensors read from the models — and judged by whether that succeeds; its λ_min
  (exact for dense and K-FAC with one or two terms per layer; a lower bound for lazy sums) is
  printed beside it. This costs what the run's solves cost, without writing.

A unit that fails is named with the damping that lifts it, to be set with the YAML key the method
uses (``prior: {delta: ...}``, ``damping:``, ``remaining: {delta: ...}``): for an elementwise
system δ = 2·(floor − λ_min), at least 10⁻⁶·‖C‖. A computed unit that fails — a singular
system, CG that does not converge within ``solver.maxiter``, a result that overflows the compute
or the output dtype — is computed again at other values of that key (:func:`least_delta`): up
starting at the δ the failure suggests (the error's own, :func:`_cg_delta` for CG, for an
overflow 10× the configured δ but at least the round-off scale ε·‖H̄‖), up by factors of
:data:`CLIMB` (squared at each failure) while it fails, down by factors of 4 (squared) from
the first that works until one fails, then bisected geometrically to a factor 2, so that the dry run
names the least δ it found finite and certified and the largest it found failing below it (or, when
none up to far above the curvature's scale works, why). This assumes that a larger δ does not break
a unit that a smaller one solved; every δ it names was computed. A method whose solves are not one
such system per unit brings its own check (``systems`` of its record: RegMean's Gram systems,
:func:`gradmerge.methods.regmean.dry_run`).

For ``gradient_matching`` with diagonal curvatures it also compares the prior H_0 (δ and its
curvature) with the curvature: where H_0 ≪ Σ_t α_t H_t, H̄⁻¹(H_0 + H_t) ≈ H̄⁻¹H_t and gradient
matching gives Fisher averaging's result (:func:`delta_note`). For a diagonal ``remove`` the dry
run computes the result (unwritten) and applies the run's step and rounding checks
(:func:`removal_checks`).

Example:
    >>> import tempfile, torch, gradmerge as gm
    >>> from pathlib import Path
    >>> from safetensors.torch import save_file
    >>> from gradmerge.jobs import MergeConfig
    >>> from gradmerge.jobs.conditioning import check_systems
    >>> with tempfile.TemporaryDirectory() as d:
    ...     for name, w in (("a", [1.0, 2.0]), ("b", [2.0, 0.0])):
    ...         save_file({"w": torch.tensor(w)}, f"{d}/{name}.safetensors")
    ...         _ = gm.Diagonal({"w": torch.tensor(w)}).save(f"{d}/{name}.c.safetensors")
    ...     cfg = MergeConfig.from_dict({"method": "fisher_average", "models": [
    ...         {"model": "a.safetensors", "curvature": "a.c.safetensors"},
    ...         {"model": "b.safetensors", "curvature": "b.c.safetensors"}]}, root=d)
    ...     [(c.keys, c.min_eigenvalue) for c in check_systems(cfg)]
    [(('w',), 2.0)]
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from gradmerge.curvature import Curvature, Diagonal, ScaledIdentity
from gradmerge.curvature.io import CurvatureFile
from gradmerge.errors import (
    InputWarning,
    NotConvergedError,
    NotPositiveDefiniteError,
    ResultOverflowError,
)
from gradmerge.jobs.config import MergeConfig, RemoveConfig
from gradmerge.jobs.inputs import CurvatureTerm
from gradmerge.jobs.job import Job
from gradmerge.jobs.opening import open_job
from gradmerge.jobs.plan import Unit
from gradmerge.jobs.removal_checks import Rounding, StepSize
from gradmerge.methods import registry
from gradmerge.methods.base import SystemInputs

CLIMB = 100.0
"""The first factor between the δ tried while none works (:func:`least_delta`), squared at each
further failure: from δ = 1e-12 to a pooler's 0.83 in 4 tries (1e-10, 1e-6, 1e2 works), then
bisections to a factor 2 (each try one solve of that unit)."""

SAMPLE = 4096
"""Values per unit kept for the δ comparison (a strided sample: memory stays bounded)."""


@dataclass(frozen=True)
class SystemCheck:
    """One unit's system: its smallest eigenvalue, the floor its solve needs, the damping that
    would lift it (0 when it is fine) and the YAML key that sets that damping."""

    keys: tuple[str, ...]
    min_eigenvalue: float
    floor: float
    needed: float
    key: str
    solved: bool | None = None
    """None: judged by λ_min alone (an elementwise system: exact); True/False: the unit was
    computed as the real run computes it, and succeeded or failed."""
    why: str = ""
    """What failed as configured (a computed unit): singular, not converged, an overflow."""
    below: float = 0.0
    """The largest δ found failing below ``needed`` (the configured one at least)."""

    @property
    def ok(self) -> bool:
        """Whether the solve will succeed as configured."""
        return self.needed == 0.0

    def describe(self) -> str:
        """One line naming the unit, what failed and the fix."""
        head = ", ".join(repr(k) for k in self.keys[:2]) + (" ..." if len(self.keys) > 2 else "")
        if self.solved is False:
            if math.isinf(self.needed):
                return (
                    f"[{head}]: {self.why} as configured, and at every `{self.key}` tried up to "
                    f"{self.below:.2g}: no δ makes it finite and certified"
                )
            return (
                f"[{head}]: {self.why} as configured; finite and certified from δ = "
                f"{self.needed:.2g} (δ = {self.below:.3g} fails): set `{self.key}` to at least "
                f"{self.needed:.2g}"
            )
        return (
            f"[{head}]: λ_min = {self.min_eigenvalue:.3g} ≤ {self.floor:.3g}, singular: set "
            f"`{self.key}` to at least {self.needed:.2g}"
        )


def check_systems(config: MergeConfig | RemoveConfig) -> list[SystemCheck]:
    """Every merged unit's system (module docstring), in the plan's order; empty for a method
    that solves none (task arithmetic)."""
    spec = registry.get(config.method)
    key = spec.damping_key or "damping"
    if spec.systems is not None:  # the method's own check (RegMean's Gram systems)
        with ExitStack() as stack:
            job = open_job(config, stack)
            units = [u.keys for u in job.plan.units if u.merged and not job.unchanged(u)]
            readings = spec.systems(config, job.curvatures, units)
        return [SystemCheck(r.keys, r.min_eigenvalue, r.floor, r.needed, key) for r in readings]
    if spec.system is None:
        return []
    out = []
    for job, unit in _merged_units(config):
        terms = _inputs(config, job.curvatures, unit.keys, config.math_dtype)
        system = spec.system(terms)
        check = _check(unit.keys, system, key, config.math_dtype)
        if system is not None and not isinstance(system, (Diagonal, ScaledIdentity)):
            check = _solved(job, unit, check, system, config)
        out.append(check)
    return out


def _merged_units(config: MergeConfig | RemoveConfig) -> Iterator[tuple[Job, Unit]]:
    """The opened job and every merged unit of its plan, in order (the inputs stay open while
    the iteration runs), but those every model leaves at the base (copied: nothing solved)."""
    with ExitStack() as stack:
        job = open_job(config, stack)
        for unit in job.plan.units:
            if unit.merged and not job.unchanged(unit):
                yield job, unit


def _solved(
    job: Job,
    unit: Unit,
    check: SystemCheck,
    system: Curvature,
    config: MergeConfig | RemoveConfig,
) -> SystemCheck:
    """A factorised or iterative unit (K-FAC, dense, a lazy sum) is judged by the real run's own
    computation of it — the same solve and the same checks of its result (finite, within the
    output dtype), reading the unit's tensors — so that the dry run and the run agree: λ_min
    against a round-off floor is only a sufficient condition (a K-FAC sum's λ_min is a lower
    bound), and neither CG's convergence nor an overflow is predicted by it. A failure is
    followed by the search of :func:`least_delta`."""
    err = _failure(job, unit)
    if err is None:
        return replace(check, needed=0.0, solved=True)
    current = _delta(config)
    if isinstance(err, NotPositiveDefiniteError):
        # the solver's own bound (a Rayleigh quotient met, the factors' round-off) is the
        # closest start; the λ_min check's generic 10⁻⁶·‖H̄‖ is often 100× above the answer
        guess = err.suggested_delta or (check.needed if not check.ok else 0.0)
        if not guess > 0:
            guess = max(2 * (check.floor - check.min_eigenvalue), 1e-6 * _magnitude(system))
    elif isinstance(err, NotConvergedError):
        guess = _cg_delta(system, config)
    else:  # an overflow: the search goes down too, so a high start costs a few solves only
        guess = max(10 * current, torch.finfo(config.math_dtype).eps * _magnitude(system))
    least, below = least_delta(config, unit, guess, _magnitude(system))
    return replace(check, needed=least, below=below, solved=False, why=_reason(err))


def least_delta(
    config: MergeConfig | RemoveConfig, unit: Unit, guess: float, magnitude: float
) -> tuple[float, float]:
    """(least, below): the least value of the method's damping key (``prior: {delta}``,
    ``damping``, ``remaining: {delta}``) found to compute ``unit`` finite and certified, and
    the largest found failing below it; ``(inf, last tried)`` when none up to 10¹²·``magnitude``
    (far above the curvature's scale, where H̄ ≈ δ·I and nothing changes any more) does.

    The search starts where a value can work — ``guess``, from the failure itself (the solver's
    suggested δ: the Rayleigh-quotient and round-off bound), at least twice the configured
    value — not at the configured value, which may be any distance below (δ = 1e-30): the
    solves it costs depend on how far ``guess`` is from the answer, not on where the
    configuration started. While a value fails, the next is :data:`CLIMB` times larger, the
    factor squared at each failure (100, 10⁴, 10⁸, ...: the answer at a distance R above
    ``guess`` costs about log₂ log₁₀₀ R solves); once one works, values below it are tried
    down by a factor 4, squared likewise, until one fails (the configured value, known to
    fail, ends this early). Then the bracket is bisected geometrically until within a factor
    2. Every value tried is rounded up to the two significant digits printed, so the least
    working one is named as computed. From a ``guess`` within 4× above the answer that is 4
    solves, within 250× 6-7, wherever the configured δ lies. Every value returned was computed
    as the real run computes the unit (but a configured 0's bracket may end below the
    smallest normal float64 uncomputed)."""
    lo = _delta(config)
    hi = _printed(max(guess, 2 * lo, torch.finfo(torch.float64).tiny))
    cap = max(1e12 * magnitude, CLIMB * hi)
    step, climbed = CLIMB, False
    while not _works(config, unit, hi):
        if hi >= cap:
            return math.inf, hi
        lo, hi, step, climbed = hi, _printed(min(step * hi, cap)), step * step, True
    step = 4.0
    while not climbed and hi > 2 * lo:  # find a failing value near the working one
        if hi / step < torch.finfo(torch.float64).tiny:
            lo = hi / step  # below every usable δ: taken as failing, uncomputed
            break
        lower = _printed(hi / step)
        if lower <= lo:
            break
        if not _works(config, unit, lower):
            lo = lower
            break
        hi, step = lower, step * step
    while hi > 2 * lo:
        mid = _printed(math.sqrt(lo * hi))  # within (lo, hi): at most 10% above the mean
        if _works(config, unit, mid):
            hi = mid
        else:
            lo = mid
    printed = float(f"{_round_up(hi):.2g}")
    if printed != hi and _works(config, unit, printed):
        hi = printed
    return hi, lo


def _printed(x: float) -> float:
    """x rounded up to the two significant digits the dry run prints: every value the search
    tries is one it can name without computing another."""
    return float(f"{_round_up(x):.2g}")


def _round_up(x: float) -> float:
    """x rounded up to two significant digits."""
    unit = 10.0 ** (math.floor(math.log10(x)) - 1)
    return math.ceil(x / unit * (1 - 1e-12)) * unit


def _works(config: MergeConfig | RemoveConfig, unit: Unit, delta: float) -> bool:
    """Whether ``unit`` computes, as the real run computes it, with the damping key at ``delta``
    (the inputs' warnings were shown once already)."""
    with ExitStack() as stack, warnings.catch_warnings():
        warnings.simplefilter("ignore", InputWarning)
        return _failure(open_job(_with_delta(config, delta), stack), unit) is None


def _failure(job: Job, unit: Unit) -> Exception | None:
    """The error that makes the real run refuse ``unit`` (None: it computes)."""
    try:
        job.compute_unit(unit)
    except (NotPositiveDefiniteError, NotConvergedError, ResultOverflowError) as err:
        return err
    return None


def _reason(err: Exception) -> str:
    """What failed, in a few words."""
    if isinstance(err, ResultOverflowError):
        what = str(err).split(" although")[0].split(" (largest")[0]
        return f"its result overflows ({what})"
    if isinstance(err, NotConvergedError):
        return "CG does not reach solver.tol within solver.maxiter"
    return "the system is singular or not positive definite"


def _delta(config: MergeConfig | RemoveConfig) -> float:
    """The configured value of the method's damping key (its record's ``damping_at``)."""
    value: object = config
    for name in _damping_at(config):
        value = getattr(value, name)
    assert isinstance(value, float | int)
    return float(value)


def _with_delta(config: MergeConfig | RemoveConfig, delta: float) -> MergeConfig | RemoveConfig:
    """``config`` with the method's damping key set to ``delta`` (nested blocks replaced)."""

    def put(obj: Any, path: tuple[str, ...]) -> Any:
        first, *rest = path
        return replace(obj, **{first: put(getattr(obj, first), tuple(rest)) if rest else delta})

    out: MergeConfig | RemoveConfig = put(config, _damping_at(config))
    return out


def _damping_at(config: MergeConfig | RemoveConfig) -> tuple[str, ...]:
    return registry.get(config.method).damping_at or ("damping",)


def _magnitude(system: Curvature) -> float:
    return max(float(system._scale()), 1e-30)


def _cg_delta(system: Curvature, config: MergeConfig | RemoveConfig) -> float:
    """The δ that makes CG's textbook iteration bound fit in ``solver.maxiter``: unpreconditioned
    CG reaches relative residual tol within ½·√κ·ln(2/tol) iterations (exact arithmetic), so
    κ = (λ_max + δ)/(λ_min + δ) ≤ κ_max = (2·maxiter/ln(2/tol))² needs
    δ ≥ (λ_max − κ_max·λ_min)/(κ_max − 1), with λ_max ≤ the operator's magnitude and λ_min ≥ the
    lower bound :meth:`Curvature.min_eigenvalue` gives. A suggestion, not a guarantee: finite
    precision slows CG down."""
    from gradmerge.solvers.cg import default_tol

    tol = config.solver.tol or default_tol(config.math_dtype)
    maxiter = config.solver.maxiter
    assert maxiter is not None  # KroneckerCG resolves its default
    kappa = (2 * maxiter / math.log(2 / tol)) ** 2
    high, low = _magnitude(system), max(float(system.min_eigenvalue()), 0.0)
    return max((high - kappa * low) / (kappa - 1), torch.finfo(torch.float64).tiny)


def removal_checks(config: RemoveConfig) -> tuple[StepSize, Rounding] | None:
    """A removal that bounds its rounding (``remove``, Eq. 13) with diagonal curvatures only:
    compute every unit as the real run does (no output) and return its step size and rounding bound,
    for the checks the real run applies before writing (``step_check``, ``rounding_check``). None
    for other removals or structures, where the dry run does not compute the result."""
    if not registry.get(config.method).bounds_rounding:
        return None
    with ExitStack() as stack:
        job = open_job(config, stack)
        if any(f.structure != "diag" for f in job.curvatures.values()):
            return None
        for unit in job.plan.units:
            if unit.merged:
                job.compute(unit)
        assert job.step is not None and job.rounding is not None
        return job.step, job.rounding


def delta_note(config: MergeConfig) -> str | None:
    """A warning when gradient matching's prior is so small next to diagonal curvatures that it
    equals Fisher averaging: the prior's share s_i = h_0,i / (h_0,i + H_i), with
    h_0 = δ + scale·C_0 (the prior curvature, when there is one) and H = Σ_t α_t H_t, is below
    10⁻³ on at least 90% of the coordinates where H > 0 (gradient matching weighs task t by
    s·α_t + (1 − s)·α_t h_t/H: :mod:`gradmerge.curvature.summary`). None otherwise (or with no
    diagonal curvature, or another method)."""
    if config.prior is None:
        return None
    totals: list[Tensor] = []
    priors: list[Tensor] = []
    for job, unit in _merged_units(config):
        parts = _models(config, job.curvatures, unit.keys, torch.float64)
        if not parts or not all(isinstance(p, Diagonal) for p in parts):
            continue
        prior = _term(config.prior, "prior", job.curvatures, unit.keys, torch.float64)
        if prior is not None and not isinstance(prior, (Diagonal, ScaledIdentity)):
            continue
        total = sum(parts[1:], parts[0])
        assert isinstance(total, Diagonal)
        for key, values in total.values.items():
            flat = values.flatten()
            step = max(1, flat.numel() // SAMPLE)
            totals.append(flat[::step])
            if isinstance(prior, Diagonal):
                priors.append(prior.values[key].flatten()[::step])
            else:
                delta = prior.delta if isinstance(prior, ScaledIdentity) else 0.0
                priors.append(torch.full_like(flat[::step], delta))
    if not totals:
        return None
    h, h0 = torch.cat(totals), torch.cat(priors)
    h0, h = h0[h > 0], h[h > 0]
    if h.numel() == 0:
        return None
    share = h0 / (h0 + h)
    p90 = float(torch.quantile(share, 0.9))
    if p90 >= 1e-3:
        return None
    prior_text = f"δ = {config.prior.delta:.3g}" + (
        f" + {config.prior.scale:g}·C_0 (prior curvature)" if config.prior.files else ""
    )
    return (
        f"the prior H_0 = {prior_text} is below 10⁻³ of H_0 + Σ α_t H_t on at least 90% of the "
        f"coordinates with curvature (90th percentile of the prior's share {p90:.2g}): there "
        "gradient matching gives Fisher averaging's result to three digits. If that is not "
        "meant, choose δ inside the window `gradmerge inspect` prints for these curvatures"
    )


def _models(
    config: MergeConfig | RemoveConfig,
    files: dict[str, CurvatureFile],
    keys: tuple[str, ...],
    dtype: torch.dtype,
) -> list[Curvature]:
    """α_t·H_t of the merge's models on ``keys`` (those with a curvature there)."""
    assert isinstance(config, MergeConfig)
    parts = []
    for t, (alpha, scale) in enumerate(zip(config.alphas, config.curvature_scales, strict=True)):
        f = files.get(f"models[{t}].curvature")
        c = f.restrict(keys, dtype=dtype) if f is not None else None
        if c is not None:
            parts.append(c.scaled(alpha * scale))
    return parts


def _term(
    term: CurvatureTerm | None,
    name: str,
    files: dict[str, CurvatureFile],
    keys: tuple[str, ...],
    dtype: torch.dtype,
) -> Curvature | None:
    if term is None:
        return None
    parts = [
        c
        for n, f in files.items()
        if n.startswith(f"{name}.curvature") and (c := f.restrict(keys, dtype=dtype)) is not None
    ]
    if not parts:
        return ScaledIdentity(term.delta) if term.delta > 0 else None
    total = sum(parts[1:], parts[0]).scaled(term.scale)
    return total + term.delta if term.delta > 0 else total


def _inputs(
    config: MergeConfig | RemoveConfig,
    files: dict[str, CurvatureFile],
    keys: tuple[str, ...],
    dtype: torch.dtype,
) -> SystemInputs:
    """The unit's curvature terms, which the method's ``system`` combines."""
    if isinstance(config, RemoveConfig):
        return SystemInputs(
            prior=_term(config.prior, "prior", files, keys, dtype),
            remaining=_term(config.remaining, "remaining", files, keys, dtype),
        )
    return SystemInputs(
        models=tuple(_models(config, files, keys, dtype)),
        alphas=tuple(config.alphas),
        prior=_term(config.prior, "prior", files, keys, dtype),
        damping=config.damping,
    )


def _check(
    keys: tuple[str, ...], system: Curvature | None, key: str, dtype: torch.dtype
) -> SystemCheck:
    if system is None:
        return SystemCheck(keys, 0.0, 0.0, math.inf, key)
    lowest = float(system.min_eigenvalue())
    scale = max(float(system._scale()), 1e-30)
    floor = (
        0.0
        if isinstance(system, (Diagonal, ScaledIdentity))
        else 100 * torch.finfo(dtype).eps * scale
    )
    if lowest > floor:
        return SystemCheck(keys, lowest, floor, 0.0, key)
    return SystemCheck(keys, lowest, floor, max(2 * (floor - lowest), 1e-6 * scale), key)
