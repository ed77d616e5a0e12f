"""RegMean as Jin et al. define it, with its defaults, on a BERT and a GPT-2 (issue 31, item 3).

Tiny random checkpoints built offline (``proofs_tests.text_models``), two fine-tunes each (the
base plus seeded noise), K-FAC curvatures estimated by ``gm.estimate_curvature`` on each task's
own batch, merged by ``gradmerge merge`` with `method: regmean` and no other key. The result is
compared with two references that share nothing with gradmerge's merge code:

- a re-derivation from dense matrices: each linear layer's input Gram G_t = Σ x xᵀ collected by
  forward hooks on the fine-tuned model (GPT-2's ``Conv1D`` included), G̃_t = r·G_t +
  (1 − r)·diag(G_t) with Jin et al.'s r = 0.1, W = (Σ α_t G̃_t)⁻¹ Σ α_t G̃_t W_t by numpy, every
  other tensor (biases, embeddings, LayerNorms) the α-weighted average;
- FusionBench's ``merging_with_regmean_weights`` on the same hooked Grams, where it is installed
  (it is not a dependency: the test is skipped without it).

The BERT's word and token-type embeddings have rows no task looked up (singular Grams): RegMean
averages them by default, and ``embeddings: gram`` solves them too — refused without damping,
with the damping the dry run and the error name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

import gradmerge as gm
from gradmerge.cli import main
from gradmerge.io import open_checkpoint

transformers = pytest.importorskip("transformers")

from proofs_tests import text_models  # noqa: E402  (needs transformers)

R = gm.merge.REGMEAN_OFF_DIAGONAL


def _batch(kind: str, vocab: int, seed: int):
    """One task's data: 6 sequences of 7 tokens, no padding (every position is kept)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (6, 7), generator=g)
    if kind == "bert":
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return [(inputs, torch.randint(0, 3, (6,), generator=g))]
    labels = torch.randint(5, vocab, (6, 7), generator=g)  # no position ignored
    return [({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels)]


def _linear_modules(model):
    conv1d = transformers.pytorch_utils.Conv1D
    return {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, conv1d))}


def _hooked_grams(model, data):
    """Σ x xᵀ of every linear layer's inputs over every row (FusionBench's hook, as a sum)."""
    grams: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args, output):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
            grams[name] = grams.get(name, 0) + x.T @ x

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in _linear_modules(model).items()]
    with torch.no_grad():
        for inputs, _ in data:
            model(**inputs)
    for h in handles:
        h.remove()
    return grams


@pytest.fixture(scope="module", params=["bert", "gpt2"])
def task(request, tmp_path_factory):
    """A base folder, two fine-tuned folders, their K-FAC curvature files and hooked Grams."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"regmean-{kind}")
    build = text_models.bert_classifier if kind == "bert" else text_models.gpt2_lm
    cls = (
        transformers.BertForSequenceClassification
        if kind == "bert"
        else transformers.GPT2LMHeadModel
    )
    build(root / "base")
    fts, grams, linear = [], [], None
    for t in range(2):
        model = cls.from_pretrained(root / "base").eval()
        g = torch.Generator().manual_seed(10 + t)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        model.save_pretrained(root / f"ft{t}")
        data = _batch(kind, model.config.vocab_size, seed=t)
        curvature = gm.estimate_curvature(model, data, structure="kfac")
        curvature.save(root / f"c{t}.safetensors")
        grams.append(_hooked_grams(model, data))
        fts.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        linear = {n: isinstance(m, torch.nn.Linear) for n, m in _linear_modules(model).items()}
    return kind, root, fts, grams, linear


def _config(root, alphas=(1.0, 1.0), **extra):
    models = [
        {"model": f"ft{t}", "curvature": f"c{t}.safetensors", "alpha": a}
        for t, a in enumerate(alphas)
    ]
    return {"method": "regmean", "base_model": "base", "models": models, **extra}


def _run(root, config, name, *flags):
    (root / f"{name}.yaml").write_text(yaml.safe_dump(config))
    return main(["merge", str(root / f"{name}.yaml"), str(root / name), "--no-progress", *flags])


def _merged(folder):
    with open_checkpoint(folder) as ckpt:
        names = ckpt.keys()
        return {k: ckpt.get(k) for k in names}


def _reference(fts, grams, linear, alphas, r):
    """Jin et al.'s RegMean from dense matrices (numpy): linear weights solved, the rest averaged."""
    out = {}
    for key in fts[0]:
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module in grams[0]:
            scaled = [
                r * g[module].numpy() + (1 - r) * np.diag(np.diag(g[module].numpy())) for g in grams
            ]
            # W stored (out, in) by nn.Linear, (in, out) by Conv1D: solve for the (in, out) form
            ws = [ft[key].numpy().T if linear[module] else ft[key].numpy() for ft in fts]
            lhs = sum(a * g for a, g in zip(alphas, scaled, strict=True))
            rhs = sum(a * g @ w for a, g, w in zip(alphas, scaled, ws, strict=True))
            solved = np.linalg.solve(lhs, rhs)
            out[key] = solved.T if linear[module] else solved
        else:
            out[key] = sum(a * ft[key].numpy() for a, ft in zip(alphas, fts, strict=True)) / sum(
                alphas
            )
    return out


def test_regmean_with_its_defaults_equals_the_dense_closed_form(task, capsys):
    kind, root, fts, grams, linear = task
    alphas = (0.7, 1.3)
    assert _run(root, _config(root, alphas), "defaults", "--dry-run") == 0
    assert _run(root, _config(root, alphas), "defaults") == 0, capsys.readouterr().err
    # the same merge computed in float64 (the default computes in float32), to compare tightly
    assert _run(root, _config(root, alphas, compute_dtype="float64"), "wide") == 0
    merged = _merged(root / "wide")
    expected = _reference(fts, grams, linear, alphas, r=0.1)
    assert R == 0.1  # the one default, of gm.regmean and of the YAML key
    solved = [k for k in merged if k.removesuffix(".weight") in grams[0]]
    # q, k, v, attention output, MLP in and out, pooler, classifier; GPT-2's four Conv1D (its
    # head is tied to the embedding)
    assert len(solved) == (8 if kind == "bert" else 4)
    for key, value in merged.items():
        if key in expected:
            np.testing.assert_allclose(value.numpy(), expected[key], rtol=1e-9, err_msg=key)


def test_regmean_equals_fusionbench(task):
    """FusionBench's own merge function on the same Grams (α = 1: it averages with equal weights)."""
    pytest.importorskip("fusion_bench")
    from fusion_bench.method.regmean.regmean import merging_with_regmean_weights

    kind, root, fts, grams, linear = task
    # FusionBench scales the off-diagonals by float32(0.1) (its weight mask is float32): give
    # gradmerge that same r, so that the two agree to float64 round-off
    r32 = float(np.float32(R))
    assert _run(root, _config(root, compute_dtype="float64", off_diagonal=r32), "fb") == 0
    merged = _merged(root / "fb")
    params = {k: [ft[k] for ft in fts] for k in fts[0] if k in merged}
    # FusionBench takes one transpose flag for every module: nn.Linear for BERT, Conv1D for GPT-2
    assert len(set(linear.values())) == 1 or kind == "gpt2"
    keep = {n for n, is_linear in linear.items() if is_linear == (kind == "bert")}
    expected = merging_with_regmean_weights(
        params,
        [{n: g[n] for n in keep} for g in grams],
        reduce_non_diagonal_ratio=0.1,
        weight_transpose=kind == "bert",
    )
    for key, value in merged.items():
        torch.testing.assert_close(value, expected[key], rtol=1e-9, atol=0, msg=key)


def test_embeddings_solved_from_their_grams_need_damping(task, capsys):
    kind, root, fts, _, _ = task
    if kind == "gpt2":
        pytest.skip("GPT-2's tied embedding is covered by the diagonal block, not by K-FAC")
    config = _config(root, embeddings="gram")
    assert _run(root, config, "emb", "--dry-run") == 1
    out = capsys.readouterr().out
    assert "word_embeddings" in out and "token_type_embeddings" in out
    assert _run(root, config, "emb") == 1
    assert "damping" in capsys.readouterr().err
    needed = float(out.split("set `damping` to at least ")[-1].split(" ")[0])
    assert _run(root, {**config, "damping": needed}, "emb-damped") == 0
    merged = _merged(root / "emb-damped")
    key = "bert.embeddings.token_type_embeddings.weight"  # only row 0 was looked up
    unseen = merged[key][1]  # damping alone weighs it: the plain average
    torch.testing.assert_close(unseen, (fts[0][key][1] + fts[1][key][1]) / 2)
