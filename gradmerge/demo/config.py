"""The demo's settings: one frozen dataclass, with the full and the quick preset.

Example:
    >>> from gradmerge.demo.config import DemoConfig
    >>> DemoConfig.full().tasks
    ('rotated', 'mirrored', 'shifted')
    >>> DemoConfig.quick(seed=3).seed
    3
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gradmerge.demo.data import TRANSFORMS
from gradmerge.errors import ArgumentError


@dataclass(frozen=True)
class DemoConfig:
    """Everything that decides the demo's numbers (with the device).

    Attributes:
        tasks: the domain shifts, one task each (:data:`gradmerge.demo.data.TRANSFORMS`).
        hidden: hidden units of the MLP 64 → hidden → 10.
        n_base, n_base_test: original images to train θ_LLM on, and to test it on.
        n_train, n_test: images per task for D_t and for its held-out set.
        delta: δ, the prior precision H_0 = δI of every fine-tune and of the target.
        base_delta: the base model's weight decay (its prior (δ/2)‖θ‖²).
        alphas: the task weights α (the same for every task) of the α sweep; the table is at
            the largest.
        refine_steps: k, the steps of ``gm.refine`` from the full-curvature merge (≥ 1).
        remove: the task removed in the removal study.
        seed: the data split, the noise and the initialisation.
    """

    tasks: tuple[str, ...] = ("rotated", "mirrored", "shifted")
    hidden: int = 16
    n_base: int = 500
    n_base_test: int = 150
    n_train: int = 200
    n_test: int = 150
    delta: float = 5.0
    base_delta: float = 2.0
    alphas: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    refine_steps: int = 3
    remove: str = "shifted"
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.tasks) < 2 or any(t not in TRANSFORMS for t in self.tasks):
            raise ArgumentError(
                f"tasks must be at least two names from {sorted(TRANSFORMS)}, got {self.tasks}"
            )
        if self.remove not in self.tasks:
            raise ArgumentError(
                f"remove must be one of the tasks {self.tasks}, got {self.remove!r}"
            )
        if not self.alphas or any(not 0.0 < a <= 1.0 for a in self.alphas):
            raise ArgumentError(f"alphas must be in (0, 1], got {self.alphas}")
        if self.delta <= 0.0 or self.base_delta <= 0.0:
            raise ArgumentError(
                f"delta and base_delta must be > 0, got {self.delta} and {self.base_delta}"
            )
        if self.refine_steps < 1:
            raise ArgumentError(
                f"refine_steps must be at least 1 (gm.refine steps), got {self.refine_steps}"
            )
        if self.hidden < 1:
            raise ArgumentError(f"hidden must be at least 1, got {self.hidden}")

    @classmethod
    def full(cls, seed: int = 0) -> DemoConfig:
        """The default study (about a minute on two CPU cores)."""
        return cls(seed=seed)

    @classmethod
    def quick(cls, seed: int = 0) -> DemoConfig:
        """A small version for tests and smoke runs (a few seconds)."""
        return cls(
            hidden=6,
            n_base=150,
            n_base_test=60,
            n_train=60,
            n_test=60,
            alphas=(0.5, 1.0),
            seed=seed,
        )

    @property
    def alpha(self) -> float:
        """The α of the main table: the largest of the sweep."""
        return max(self.alphas)

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }
