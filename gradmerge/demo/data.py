r"""The demo's data: scikit-learn's handwritten digits, split into a base set and shifted tasks.

``sklearn.datasets.load_digits`` ships 1797 8×8 grey-level images of the digits 0–9 with the
library (no download). The demo mirrors the paper's setting — one pretrained model θ_LLM,
fine-tuned on T data sets of the SAME classes from different domains (the paper's sentiment data
from different sources) — with domain shifts of the images:

==============  =======================================================================
task            transform of an image x ∈ [0, 1]^{8×8}
==============  =======================================================================
``rotated``     rotated by 90° counter-clockwise
``mirrored``    flipped left ↔ right
``shifted``     moved 2 pixels right and 1 down (zeros enter at the edges)
``noisy``       x + 0.35·ε, ε ~ N(0, 1) drawn once per image from the split's seed
==============  =======================================================================

The images are shuffled once (seeded) and cut into DISJOINT parts: the base model's training
and held-out sets (original images), then, per task, a training set D_t and a held-out set,
both transformed. Pixels are scaled to [0, 1] and flattened to 64 features.

Example:
    >>> from gradmerge.demo.data import make_splits
    >>> splits = make_splits(("rotated", "mirrored"), n_base=100, n_train=50, n_test=40, seed=0)
    >>> [t.name for t in splits.tasks], tuple(splits.tasks[0].train.x.shape)
    (['rotated', 'mirrored'], (50, 64))
    >>> float(splits.tasks[1].train.x.max()) <= 1.0
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gradmerge.errors import ArgumentError

NUM_CLASSES = 10
IMAGE_SIDE = 8


def _rotated(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.rot90(images, k=1, axes=(1, 2))


def _mirrored(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return images[:, :, ::-1]


def _shifted(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    out = np.zeros_like(images)
    out[:, 1:, 2:] = images[:, :-1, :-2]
    return out


def _noisy(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return images + 0.35 * rng.standard_normal(images.shape)


TRANSFORMS: dict[str, Callable[[np.ndarray, np.random.Generator], np.ndarray]] = {
    "rotated": _rotated,
    "mirrored": _mirrored,
    "shifted": _shifted,
    "noisy": _noisy,
}
"""Domain shifts by name: images (n, 8, 8) in [0, 1] and a generator → transformed images."""


@dataclass(frozen=True)
class Split:
    """One data set: ``x`` (n, 64) float features, ``y`` (n,) integer labels in 0..9."""

    x: Tensor
    y: Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def to(self, device: torch.device | str) -> Split:
        """The same data on ``device``."""
        return Split(self.x.to(device), self.y.to(device))

    @staticmethod
    def concat(splits: Sequence[Split]) -> Split:
        """The union of ``splits`` (in order)."""
        return Split(torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]))

    def batches(self, size: int) -> list[tuple[Tensor, Tensor]]:
        """``(inputs, targets)`` batches of at most ``size`` rows, in order (for estimators)."""
        return [(self.x[i : i + size], self.y[i : i + size]) for i in range(0, len(self), size)]


@dataclass(frozen=True)
class Task:
    """A domain: its name, its training set D_t and its held-out set."""

    name: str
    train: Split
    test: Split


@dataclass(frozen=True)
class Splits:
    """The base model's data (original images) and the T shifted tasks, all disjoint."""

    base: Task
    tasks: list[Task]

    def to(self, device: torch.device | str) -> Splits:
        """Every split on ``device``."""
        move = lambda t: Task(t.name, t.train.to(device), t.test.to(device))  # noqa: E731
        return Splits(move(self.base), [move(t) for t in self.tasks])


def make_splits(
    tasks: Sequence[str],
    *,
    n_base: int,
    n_train: int,
    n_test: int,
    n_base_test: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> Splits:
    """Shuffle the digits (seeded) and cut them into the base set and one set per task.

    Args:
        tasks: names from :data:`TRANSFORMS`, each at most once.
        n_base: training images of the base model (original domain).
        n_train: training images per task (D_t).
        n_test: held-out images per task (and for the original domain, unless ``n_base_test``).
        n_base_test: held-out original images (default ``n_test``).
        seed: the shuffle and the noise.
        dtype: the features' dtype.

    Raises:
        ArgumentError: an unknown or repeated task, or more images asked for than the 1797 there.
    """
    from sklearn.datasets import load_digits  # imported here: only the demo needs scikit-learn

    unknown = [t for t in tasks if t not in TRANSFORMS]
    if unknown or len(set(tasks)) != len(tasks) or not tasks:
        raise ArgumentError(
            f"tasks must be distinct names from {sorted(TRANSFORMS)}, got {list(tasks)}"
        )
    n_base_test = n_test if n_base_test is None else n_base_test
    sizes = [n_base, n_base_test, n_train, n_test]
    if min(sizes) < 1:
        raise ArgumentError(f"every split needs at least one image, got sizes {sizes}")
    digits = load_digits()
    images = digits.images / 16.0  # (1797, 8, 8), grey levels 0..16 → [0, 1]
    labels = digits.target
    needed = n_base + n_base_test + len(tasks) * (n_train + n_test)
    if needed > len(labels):
        raise ArgumentError(
            f"the splits need {needed} images but load_digits has {len(labels)}: "
            "lower n_base, n_train or n_test"
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))

    def take(count: int) -> np.ndarray:
        nonlocal order
        chosen, order = order[:count], order[count:]
        return chosen

    def split(index: np.ndarray, transform: str | None) -> Split:
        x = images[index]
        if transform is not None:
            x = TRANSFORMS[transform](x, rng)
        features = torch.tensor(np.ascontiguousarray(x).reshape(len(index), -1), dtype=dtype)
        return Split(features, torch.tensor(labels[index], dtype=torch.long))

    base = Task("original", split(take(n_base), None), split(take(n_base_test), None))
    shifted = [Task(name, split(take(n_train), name), split(take(n_test), name)) for name in tasks]
    return Splits(base, shifted)
