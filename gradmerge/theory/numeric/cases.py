"""The random problems numeric checks run on, as explicit, hashable specifications.

A spec lists every knob of a problem (dimensions, task count, conditioning, α, ...). ``from_seed``
draws one at random (``gradmerge verify``); the tests draw them with hypothesis strategies over the
same ranges (``proofs_tests/strategies.py``), so failures shrink to small readable cases.
``build()`` makes the exact problem; it is cached, so checks that share a case share the solves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from gradmerge.theory import linear, logistic


def _log_uniform(r: np.random.Generator, low: float, high: float) -> float:
    return float(10 ** r.uniform(np.log10(low), np.log10(high)))


@dataclass(frozen=True)
class LinearMergeSpec:
    """Linear regression, T tasks (ranges: those of ``from_seed``)."""

    seed: int
    d: int  # 1–8 parameters
    tasks: int  # 1–4
    n_per_task: int  # 1–12 (fewer than d: singular H_t)
    condition: float  # feature covariance condition number, 1–1e6
    delta: float  # pretraining prior δ, 1e-2–10
    prior_condition: float  # condition number of H_0, 1–1e3
    prior_scale: float  # ‖H_0‖₂, 1e-2–1e2
    shift: float  # task shift of the true parameters, 0.1–2
    covariate_shift: float  # 0–1
    alphas: tuple[float, ...]  # one α_t in 0.1–2 per task

    @classmethod
    def from_seed(cls, seed: int) -> LinearMergeSpec:
        r = np.random.default_rng(seed)
        tasks = int(r.integers(1, 5))
        return cls(
            seed=seed,
            d=int(r.integers(1, 9)),
            tasks=tasks,
            n_per_task=int(r.integers(1, 13)),
            condition=_log_uniform(r, 1.0, 1e6),
            delta=_log_uniform(r, 1e-2, 10.0),
            prior_condition=_log_uniform(r, 1.0, 1e3),
            prior_scale=_log_uniform(r, 1e-2, 1e2),
            shift=float(r.uniform(0.1, 2.0)),
            covariate_shift=float(r.uniform(0.0, 1.0)),
            alphas=tuple(float(a) for a in r.uniform(0.1, 2.0, tasks)),
        )

    @functools.cache  # noqa: B019 - specs are frozen and few; sharing the solves is the point
    def build(self) -> linear.LinearMergeProblem:
        return linear.make_linear_merge_problem(
            self.seed,
            d=self.d,
            tasks=self.tasks,
            n_per_task=self.n_per_task,
            condition=self.condition,
            delta=self.delta,
            prior_condition=self.prior_condition,
            prior_scale=self.prior_scale,
            task_shift=self.shift,
            covariate_shift=self.covariate_shift,
        )


@dataclass(frozen=True)
class LinearRemovalSpec:
    """Linear regression trained on D_\\t ∪ D_t, then D_t removed."""

    seed: int
    d: int  # 1–8
    n_keep: int  # 1–19 (with δ > 0 a small D_\t is fine)
    n_remove: int  # 1–7
    delta: float  # 1e-2–10
    alpha: float  # α_t, 0.1–2
    condition: float  # 1–1e6
    prior_condition: float  # 1–1e3
    prior_scale: float  # 1e-2–1e2
    shift: float  # 0.1–2

    @classmethod
    def from_seed(cls, seed: int) -> LinearRemovalSpec:
        r = np.random.default_rng(seed)
        return cls(
            seed=seed,
            d=int(r.integers(1, 9)),
            n_keep=int(r.integers(1, 20)),
            n_remove=int(r.integers(1, 8)),
            delta=_log_uniform(r, 1e-2, 10.0),
            alpha=float(r.uniform(0.1, 2.0)),
            condition=_log_uniform(r, 1.0, 1e6),
            prior_condition=_log_uniform(r, 1.0, 1e3),
            prior_scale=_log_uniform(r, 1e-2, 1e2),
            shift=float(r.uniform(0.1, 2.0)),
        )

    @functools.cache  # noqa: B019
    def build(self) -> linear.LinearRemovalProblem:
        return linear.make_linear_removal_problem(
            self.seed,
            d=self.d,
            n_keep=self.n_keep,
            n_remove=self.n_remove,
            delta=self.delta,
            alpha=self.alpha,
            condition=self.condition,
            prior_condition=self.prior_condition,
            prior_scale=self.prior_scale,
            shift=self.shift,
        )


@dataclass(frozen=True)
class LogisticMergeSpec:
    """Binary or softmax logistic regression, T tasks."""

    seed: int
    d: int  # 1–5 features
    classes: int  # 2–4
    tasks: int  # 1–3
    n_per_task: int  # 5–40
    shift: float  # 0–1.5
    covariate_shift: float  # 0–1
    delta: float  # 0.1–10
    prior: str  # "isotropic" | "fisher"
    prior_scale: float  # 1e-2–1
    alphas: tuple[float, ...]  # 0.1–2

    @classmethod
    def from_seed(cls, seed: int) -> LogisticMergeSpec:
        r = np.random.default_rng(seed)
        tasks = int(r.integers(1, 4))
        return cls(
            seed=seed,
            d=int(r.integers(1, 6)),
            classes=int(r.choice([2, 2, 3, 4])),
            tasks=tasks,
            n_per_task=int(r.integers(5, 41)),
            shift=float(r.uniform(0.0, 1.5)),
            covariate_shift=float(r.uniform(0.0, 1.0)),
            delta=_log_uniform(r, 0.1, 10.0),
            prior=str(r.choice(["isotropic", "fisher"])),
            prior_scale=_log_uniform(r, 0.01, 1.0),
            alphas=tuple(float(a) for a in r.uniform(0.1, 2.0, tasks)),
        )

    @functools.cache  # noqa: B019
    def build(self) -> logistic.LogisticMergeProblem:
        return logistic.make_logistic_merge_problem(
            self.seed,
            d=self.d,
            tasks=self.tasks,
            n_per_task=self.n_per_task,
            classes=self.classes,
            shift=self.shift,
            covariate_shift=self.covariate_shift,
            delta=self.delta,
            prior=self.prior,  # type: ignore[arg-type]
            prior_scale=self.prior_scale,
        )


@dataclass(frozen=True)
class LogisticRemovalSpec:
    """Logistic regression trained on D_\\t ∪ D_t, then D_t removed."""

    seed: int
    d: int  # 1–5
    classes: int  # 2–3
    n_keep: int  # 40–119
    n_remove: int  # 1–29
    delta: float  # 0.1–10
    alpha: float  # 0.2–2
    shift: float  # 0–1.5
    prior: str  # "isotropic" | "fisher"
    prior_scale: float  # 1e-2–1

    @classmethod
    def from_seed(cls, seed: int) -> LogisticRemovalSpec:
        r = np.random.default_rng(seed)
        return cls(
            seed=seed,
            d=int(r.integers(1, 6)),
            classes=int(r.choice([2, 2, 3])),
            n_keep=int(r.integers(40, 120)),
            n_remove=int(r.integers(1, 30)),
            delta=_log_uniform(r, 0.1, 10.0),
            alpha=float(r.uniform(0.2, 2.0)),
            shift=float(r.uniform(0.0, 1.5)),
            prior=str(r.choice(["isotropic", "fisher"])),
            prior_scale=_log_uniform(r, 0.01, 1.0),
        )

    @functools.cache  # noqa: B019
    def build(self) -> logistic.LogisticRemovalProblem:
        return logistic.make_logistic_removal_problem(
            self.seed,
            d=self.d,
            n_keep=self.n_keep,
            n_remove=self.n_remove,
            classes=self.classes,
            delta=self.delta,
            alpha=self.alpha,
            shift=self.shift,
            prior=self.prior,  # type: ignore[arg-type]
            prior_scale=self.prior_scale,
        )


Spec = LinearMergeSpec | LinearRemovalSpec | LogisticMergeSpec | LogisticRemovalSpec
