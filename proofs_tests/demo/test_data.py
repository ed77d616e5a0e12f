"""The digits splits: sizes, disjointness, the shifts themselves, determinism, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

import gradmerge as gm
from gradmerge.demo.data import TRANSFORMS, make_splits


@pytest.fixture(scope="module")
def digits():
    d = load_digits()
    return (d.images / 16.0).reshape(len(d.target), -1), d.target


def _rows(x: torch.Tensor) -> set[bytes]:
    return {row.tobytes() for row in x.numpy()}


def test_sizes_labels_and_disjoint_original_images(digits):
    images, labels = digits
    splits = make_splits(
        ("rotated", "mirrored", "shifted"),
        n_base=100,
        n_base_test=30,
        n_train=40,
        n_test=20,
        seed=4,
    )
    assert (len(splits.base.train), len(splits.base.test)) == (100, 30)
    assert [(len(t.train), len(t.test)) for t in splits.tasks] == [(40, 20)] * 3
    # undo each invertible shift and find every image among the originals, each at most once
    index = {row.tobytes(): i for i, row in enumerate(images)}
    undo = {
        "original": lambda x: x,
        "rotated": lambda x: np.rot90(x, k=-1, axes=(1, 2)),
        "mirrored": lambda x: x[:, :, ::-1],
    }
    seen: list[int] = []
    for task in [splits.base, *splits.tasks]:
        if task.name not in undo:
            continue
        for split in (task.train, task.test):
            x = undo[task.name](split.x.numpy().reshape(-1, 8, 8)).reshape(len(split), -1)
            found = [index[np.ascontiguousarray(row).tobytes()] for row in x]
            assert np.array_equal(labels[found], split.y.numpy())
            seen += found
    assert len(seen) == len(set(seen)) == 100 + 30 + 2 * 60


def test_transforms_do_what_they_say():
    rng = np.random.default_rng(0)
    image = rng.random((1, 8, 8))
    assert np.array_equal(TRANSFORMS["rotated"](image, rng)[0], np.rot90(image[0]))
    assert np.array_equal(TRANSFORMS["mirrored"](image, rng)[0], image[0, :, ::-1])
    shifted = TRANSFORMS["shifted"](image, rng)[0]
    assert np.array_equal(shifted[1:, 2:], image[0, :-1, :-2])
    assert not shifted[0].any() and not shifted[:, :2].any()
    noisy = TRANSFORMS["noisy"](image, rng)[0] - image[0]
    assert 0.2 < noisy.std() < 0.5


def test_seeded_and_deterministic():
    a = make_splits(("noisy", "rotated"), n_base=50, n_train=20, n_test=10, seed=1)
    b = make_splits(("noisy", "rotated"), n_base=50, n_train=20, n_test=10, seed=1)
    c = make_splits(("noisy", "rotated"), n_base=50, n_train=20, n_test=10, seed=2)
    assert torch.equal(a.tasks[0].train.x, b.tasks[0].train.x)
    assert _rows(a.base.train.x) != _rows(c.base.train.x)
    assert a.base.train.x.dtype == torch.float64 and a.base.train.y.dtype == torch.long


def test_bad_input():
    with pytest.raises(gm.ArgumentError, match="distinct names"):
        make_splits(("rotated", "upside-down"), n_base=10, n_train=5, n_test=5)
    with pytest.raises(gm.ArgumentError, match="distinct names"):
        make_splits(("rotated", "rotated"), n_base=10, n_train=5, n_test=5)
    with pytest.raises(gm.ArgumentError, match="load_digits has 1797"):
        make_splits(("rotated",), n_base=1000, n_train=500, n_test=500)
    with pytest.raises(gm.ArgumentError, match="at least one image"):
        make_splits(("rotated",), n_base=10, n_train=0, n_test=5)
