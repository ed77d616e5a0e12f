"""mergekit merges BERT sequence classifiers with TIES and DARE: what the study's baselines rest on.

Issue 24 asks for TIES and DARE "as mergekit computes them", and for gradmerge's own TIES/DARE
only if mergekit refuses `BertForSequenceClassification` (its issue #381). The installed mergekit
accepts such folders (its architecture is inferred from the weights), so these tests pin that down
on a tiny BERT classifier (float32, 3 labels) and check what it computes on EVERY tensor, the
classification head included:

- ``ties`` equals TIES as Yadav et al. (2023) define it, computed here entry by entry: trim each
  task vector τ_t to its ⌊density·n⌋ (at least 1) largest magnitudes, elect the sign of
  Σ_t w_t τ̂_t (+ on 0), average the weighted entries that agree with it (Σ w_t τ̂_t / Σ w_t over
  the agreeing t; with mergekit's ``normalize: true``), add to θ_0;
- ``dare_linear`` with density 1 is task arithmetic θ_0 + Σ_t w_t τ_t (nothing dropped);
- ``dare_linear`` with density p (random, mergekit's own RNG) keeps each entry of τ with
  probability p and rescales the kept ones by ONE factor per tensor so that the tensor's L1 norm
  is unchanged (mergekit's ``rescale: true``; Yu et al. (2024) rescale by 1/p, equal in
  expectation): each tensor's step is c·τ on the kept entries and 0 elsewhere, with ‖step‖₁ =
  ‖τ‖₁, and the kept fraction over the model is p within 5 binomial standard deviations.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from safetensors.torch import load_file

from proofs_tests.text_models import bert_classifier

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inside mergekit


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    pytest.importorskip("mergekit", reason="mergekit (test oracle) is not installed")
    root = tmp_path_factory.mktemp("mk_bert")
    base = bert_classifier(root / "base", seed=0)
    model = transformers.BertForSequenceClassification.from_pretrained(base).float()
    model.save_pretrained(base)
    out = [base]
    for t in range(2):
        g = torch.Generator().manual_seed(10 + t)
        tuned = transformers.BertForSequenceClassification.from_pretrained(base)
        with torch.no_grad():
            for p in tuned.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        tuned.save_pretrained(root / f"ft{t}")
        out.append(root / f"ft{t}")
    return out


def _mergekit(folders, out, method, weights, density, **parameters):
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    config = MergeConfiguration.model_validate(
        {
            "merge_method": method,
            "base_model": str(folders[0]),
            "models": [
                {"model": str(m), "parameters": {"weight": w, "density": density}}
                for m, w in zip(folders[1:], weights, strict=True)
            ],
            "parameters": parameters,
            "dtype": "float32",
        }
    )
    run_merge(config, str(out), MergeOptions(quiet=True, write_model_card=False))
    return load_file(str(out / "model.safetensors"))


def _ties_entrywise(base, fts, weights, density):
    """TIES (Yadav et al. 2023) with weights, one entry at a time, in float64."""
    n = base.numel()
    keep = max(1, int(density * n))
    trimmed = []
    for ft in fts:
        tau = (ft - base).double().reshape(-1).tolist()
        order = sorted(range(n), key=lambda i: -abs(tau[i]))  # stable: first index on ties
        kept = set(order[:keep])
        trimmed.append([tau[i] if i in kept else 0.0 for i in range(n)])
    flat = base.double().reshape(-1).tolist()
    out = []
    for i in range(n):
        weighted = [w * tr[i] for w, tr in zip(weights, trimmed, strict=True)]
        sign = 1.0 if sum(weighted) >= 0 else -1.0
        agree = [t for t, v in enumerate(weighted) if v != 0 and math.copysign(1.0, v) == sign]
        total = sum(weighted[t] for t in agree)
        divisor = sum(weights[t] for t in agree) or 1.0
        out.append(flat[i] + total / divisor)
    return torch.tensor(out, dtype=torch.float64).reshape(base.shape)


def _tensors(folder):
    return load_file(str(folder / "model.safetensors"))


def test_ties_on_a_bert_classifier_is_ties_entry_by_entry(folders, tmp_path):
    weights, density = [0.7, 0.4], 0.5
    merged = _mergekit(folders, tmp_path / "ties", "ties", weights, density, normalize=True)
    base, fts = _tensors(folders[0]), [_tensors(f) for f in folders[1:]]
    assert sorted(merged) == sorted(base)  # every tensor, the head included
    assert "classifier.weight" in merged
    for name, b in base.items():
        expected = _ties_entrywise(b, [ft[name] for ft in fts], weights, density)
        torch.testing.assert_close(merged[name].double(), expected, rtol=1e-6, atol=1e-7, msg=name)
    moved = float((merged["classifier.weight"] - base["classifier.weight"]).abs().max())
    assert moved > 1e-3


def test_dare_with_density_one_is_task_arithmetic(folders, tmp_path):
    weights = [0.7, 0.4]
    merged = _mergekit(folders, tmp_path / "dare1", "dare_linear", weights, 1.0)
    base, fts = _tensors(folders[0]), [_tensors(f) for f in folders[1:]]
    for name, b in base.items():
        expected = b.double() + sum(
            w * (ft[name].double() - b) for w, ft in zip(weights, fts, strict=True)
        )
        torch.testing.assert_close(merged[name].double(), expected, rtol=1e-6, atol=1e-7, msg=name)


def test_dare_drops_at_random_and_keeps_each_tensors_l1_norm(folders, tmp_path):
    density = 0.5
    merged = _mergekit(folders[:2], tmp_path / "dare", "dare_linear", [1.0], density)
    base, ft = _tensors(folders[0]), _tensors(folders[1])
    kept = total = 0
    for name, b in base.items():
        tau, step = (ft[name] - b).double(), (merged[name] - b).double()
        on = step != 0
        if bool(on.any()):
            # one rescale factor c per tensor, with ‖c·τ_kept‖₁ = ‖τ‖₁; float32 rounding of
            # θ_0 + c·τ is the only slack (a few ulps of the merged weights)
            c = float(tau.abs().sum() / tau[on].abs().sum())
            expected = torch.where(on, c * tau, torch.zeros_like(tau))
            ulps = 4 * torch.finfo(torch.float32).eps * float(merged[name].abs().max())
            torch.testing.assert_close(step, expected, rtol=0, atol=ulps, msg=name)
        kept += int(on.sum())
        total += tau.numel()
    sd = math.sqrt(total * density * (1 - density))
    assert abs(kept - density * total) < 5 * sd, (kept, total)
