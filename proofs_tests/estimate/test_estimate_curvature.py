"""gm.estimate_curvature: each structure, the K-FAC operator built from the factors, whole-model
coverage, metadata, and merges with the estimates."""

import pytest
import torch
from torch import nn

import gradmerge as gm
from gradmerge import params as P
from gradmerge.curvature.provenance import sample_hash
from gradmerge.estimate import estimate_dense, estimate_diagonal, estimate_kfac_factors

DT = torch.float64


def _cnn():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.LayerNorm(8), nn.Linear(8, 3)
    ).double()
    X, y = torch.randn(6, 1, 4, 4, dtype=DT), torch.randint(0, 3, (6,))
    return model, [(X[:3], y[:3]), (X[3:], y[3:])]


def _trainable(model):
    return {k: tuple(v.shape) for k, v in model.named_parameters() if v.requires_grad}


def _kfac_block(curvature):
    return next(b for b in curvature.blocks if isinstance(b, gm.KFAC))


@pytest.mark.parametrize("fisher", ["empirical", "ggn"])
def test_kfac_covers_the_whole_model_and_matches_the_factors(fisher):
    model, data = _cnn()
    c = gm.estimate_curvature(model, data, structure="kfac", fisher=fisher)
    assert isinstance(c, gm.Blocks)
    assert {k: tuple(s) for k, s in c.layout} == _trainable(model)  # every parameter, once
    factors = estimate_kfac_factors(model, data, fisher=fisher)
    kfac = _kfac_block(c)
    for name in ("0", "4"):  # the conv (weight viewed (out, in·kh·kw)) and the linear layer
        w = dict(model.named_parameters())[f"{name}.weight"]
        v = {
            f"{name}.weight": torch.randn_like(w),
            f"{name}.bias": torch.randn(w.shape[0], dtype=DT),
        }
        got = gm.KFAC(
            {name: kfac.terms[name][0]}, bias=[name], weight_shapes={name: tuple(w.shape)}
        )
        out = got.mv(v)
        mat = torch.cat(
            [v[f"{name}.weight"].reshape(w.shape[0], -1), v[f"{name}.bias"][:, None]], 1
        )
        ref = factors.dense(name) @ mat.reshape(-1)  # row-major vec of [W | b]
        res = torch.cat(
            [out[f"{name}.weight"].reshape(w.shape[0], -1), out[f"{name}.bias"][:, None]], 1
        )
        torch.testing.assert_close(res.reshape(-1), ref)
    diag = next(b for b in c.blocks if isinstance(b, gm.Diagonal))
    expected = estimate_diagonal(model, data, fisher=fisher, params=list(diag.values))
    for k, v in diag.values.items():
        torch.testing.assert_close(v, expected.values[k])
    assert c.meta == {
        "structure": "kfac",
        "fisher": fisher,
        "loss": "cross_entropy",
        "num_examples": "6",
        "normalisation": "sum over examples",
        "kfac_approx": "expand",
        "kfac_max_factor_side": "16384",  # the default limit: nothing routed to the diagonal
        "kfac_diagonal_layers": "{}",
        # the weights it was estimated at (gradmerge.curvature.provenance), checked by merges
        "weights_sample_sha256": sample_hash(dict(model.named_parameters()), _trainable(model)),
    }


def test_diag_and_full_dispatch_to_their_estimators():
    model, data = _cnn()
    d = gm.estimate_curvature(model, data, structure="diag", fisher="ggn")
    ref = estimate_diagonal(model, data, fisher="ggn")
    assert all(torch.equal(d.values[k], ref.values[k]) for k in ref.values)
    f = gm.estimate_curvature(model, data, structure="full", fisher="hessian")
    torch.testing.assert_close(f.matrix, estimate_dense(model, data, fisher="hessian").matrix)
    # the diagonal of the dense GGN is the diagonal estimate
    g = gm.estimate_curvature(model, data, structure="full", fisher="ggn")
    torch.testing.assert_close(torch.diagonal(g.matrix), P.flatten(d.values, g.layout))


def _dense_merge(base, fts, curvatures, delta):
    """Eq. 6 solved with the operators' dense matrices (an independent linear solve)."""
    lay = P.layout_of(base)
    n = P.numel(base)
    h0 = delta * torch.eye(n, dtype=DT)
    hs = [c.dense(lay) for c in curvatures]
    b = P.flatten(base)
    rhs = sum((h0 + h) @ (P.flatten(ft, lay) - b) for h, ft in zip(hs, fts, strict=True))
    return b + torch.linalg.solve(h0 + sum(hs), rhs)


def test_merge_with_each_structure_equals_a_dense_solve_and_survives_save_load(tmp_path):
    """Two fine-tunes of the CNN merged with each structure equal Eq. 6 solved densely."""
    model, data = _cnn()
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    torch.manual_seed(1)
    fts = [{k: v + 0.05 * torch.randn_like(v) for k, v in base.items()} for _ in range(2)]
    for structure in ("diag", "kfac", "full"):
        curvatures = []
        for ft in fts:
            model.load_state_dict(ft, strict=False)
            curvatures.append(gm.estimate_curvature(model, data, structure=structure, fisher="ggn"))
        merged = gm.gradient_matching(base, fts, curvatures, prior=1e-2)
        expected = _dense_merge(base, fts, curvatures, 1e-2)
        torch.testing.assert_close(P.flatten(merged, P.layout_of(base)), expected)
        if structure == "kfac":
            path = curvatures[0].save(tmp_path / "c.safetensors")
            back = gm.load_curvature(path, like=model)
            assert back.meta["structure"] == "kfac"
            again = gm.gradient_matching(base, fts, [back, curvatures[1]], prior=1e-2)
            torch.testing.assert_close(P.flatten(again, P.layout_of(merged)), P.flatten(merged))


def _tiny_gpt2():
    """A 2-layer GPT-2 (untied head, vocabulary 40) in float64 and 3 sequences of 8 tokens."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=40, n_positions=12, tie_word_embeddings=False
    )
    model = transformers.GPT2LMHeadModel(config).double().eval()
    return model, torch.randint(0, 40, (3, 8))


def test_gpt2_kfac_covers_every_parameter():
    model, ids = _tiny_gpt2()
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[2, 5:] = 0
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], dim=1)
    labels[mask == 0] = -100
    data = [({"input_ids": ids, "attention_mask": mask}, labels)]
    c = gm.estimate_curvature(model, data, structure="kfac")
    assert {k: tuple(s) for k, s in c.layout} == _trainable(model)
    kfac = _kfac_block(c)
    assert "transformer.h.0.attn.c_attn" in kfac.transposed  # GPT-2's Conv1D, stored (in, out)
    assert "transformer.wte" in kfac.terms  # the embedding, with a diagonal A (small vocabulary)
    base = {k: v.detach() for k, v in model.named_parameters()}
    fts = [{k: v + 0.01 * torch.randn_like(v) for k, v in base.items()} for _ in range(2)]
    merged = gm.gradient_matching(base, fts, [c, 2.0 * c], prior=1e-3)
    # Eq. 6 with H_2 = 2 H_1: θ = θ_LLM + (δI + 3C)⁻¹ Σ_t (δI + c_t C)(θ_t − θ_LLM); check the
    # stationarity residual H̄(θ − θ_LLM) − Σ_t (H_0 + H_t)(θ_t − θ_LLM) with the operator itself
    hbar = c * 3.0 + 1e-3
    lhs = hbar.mv(P.sub(merged, base))
    rhs = P.add((c + 1e-3).mv(P.sub(fts[0], base)), (c * 2.0 + 1e-3).mv(P.sub(fts[1], base)))
    assert P.distance(lhs, rhs) <= 1e-8 * P.norm(rhs)


def test_bad_arguments():
    model, data = _cnn()
    with pytest.raises(gm.ArgumentError, match="structure must be"):
        gm.estimate_curvature(model, data, structure="block")
    with pytest.raises(gm.ArgumentError, match="hessian"):
        gm.estimate_curvature(model, data, structure="diag", fisher="hessian")
    with pytest.raises(gm.ArgumentError, match="one-shot iterator"):
        gm.estimate_curvature(model, iter(data), structure="kfac")
    with pytest.raises(gm.ArgumentError, match="params="):
        gm.estimate_curvature(model, data, structure="kfac", params=["4.weight"])
    with pytest.raises(gm.StructureError):
        gm.estimate_curvature(nn.Sequential(nn.Tanh()), data, structure="kfac")


class _Passes:
    """A list of batches that counts the passes made over it."""

    def __init__(self, batches: list) -> None:
        self.batches, self.passes = batches, 0

    def __iter__(self):
        self.passes += 1
        return iter(self.batches)


@pytest.mark.parametrize(
    ("fisher", "passes"), [("empirical", 1), ("mc", 1), ("ggn", 2)], ids=["emp", "mc", "ggn"]
)
def test_kfac_takes_its_diagonal_block_from_the_same_pass(fisher: str, passes: int) -> None:
    """GPT-2's LayerNorms, its position embedding (looked up with one row for the whole batch,
    left out at call time) and a vocabulary routed to the diagonal (limit 30 < 40 rows): the
    K-FAC pass collects their diagonal (one pass over the data; the GGN's per-position columns
    need a second), equal to structure="diag" with the same seed, i.e. the same draws."""
    model, ids = _tiny_gpt2()
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], dim=1)
    data = _Passes([({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels)] * 2)
    options = {"fisher": fisher, "seed": 3, **({"mc_samples": 2} if fisher == "mc" else {})}
    with pytest.warns(UserWarning, match="transformer.wpe"):
        c = gm.estimate_curvature(model, data, structure="kfac", kfac_max_factor_side=30, **options)
    assert data.passes == passes
    diag = next(b for b in c.blocks if isinstance(b, gm.Diagonal))
    assert {"transformer.wpe.weight", "transformer.wte.weight", "transformer.ln_f.weight"} <= set(
        diag.values
    )
    expected = gm.estimate_curvature(model, data.batches, structure="diag", **options)
    for name, value in diag.values.items():
        assert value.abs().max() > 0, name
        torch.testing.assert_close(value, expected.values[name], rtol=1e-10, atol=1e-14)


def test_the_empirical_diagonal_from_the_loss_backward_is_the_vectors_bit_for_bit(monkeypatch):
    """With the empirical Fisher the shared-pass diagonal takes its gradients from the loss's own
    backward pass; forcing the path through the explicit vector ∂(Σ_i ℓ_i)/∂f (the one riders
    with an exact fallback take) gives the same factors and diagonal, bit for bit."""
    from gradmerge.estimate.diagonal import SharedPassDiagonal
    from gradmerge.estimate.kfac import estimate_kfac_factors

    model, ids = _tiny_gpt2()
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], dim=1)
    data = [({"input_ids": ids}, labels)] * 2
    runs = []
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(SharedPassDiagonal, "needs_vectors", property(lambda self: True))
        with pytest.warns(UserWarning, match="transformer.wpe"):
            runs.append(estimate_kfac_factors(model, data, fisher="empirical", diagonal=True))
    fast, vector = runs
    assert (
        fast.factors.keys() == vector.factors.keys()
        and fast.diagonal.keys() == vector.diagonal.keys()
    )
    for name, (a, g) in fast.factors.items():
        assert torch.equal(a, vector.factors[name][0]) and torch.equal(g, vector.factors[name][1])
    assert "transformer.wte.weight" in fast.diagonal
    for name, value in fast.diagonal.items():
        assert value.abs().max() > 0 and torch.equal(value, vector.diagonal[name]), name
