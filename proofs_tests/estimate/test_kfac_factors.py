"""K-FAC factors against independent references.

- brute-force per-example gradients (autograd) for the cases where K-FAC is exact: one example
  at one position, and deep linear networks with MSE and the type-2 GGN (exact GGN from Jacobians);
- curvlinops' ``KFACLinearOperator`` (reduction="sum") on an MLP and a CNN;
- invariance to padding and ignored targets (a position-wise model and a tiny GPT-2).
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch import Tensor, nn

import gradmerge as gm
from gradmerge.estimate.kfac import KFACFactors, estimate_kfac_factors

DT = torch.float64


def _wb(module: nn.Module, gw: Tensor, gb: Tensor | None) -> Tensor:
    """vec([W | b]) row-major, W the (out, in) view of the weight (the documented layout)."""
    name = type(module).__name__
    w = gw.T if name in ("Conv1D", "Embedding") else gw.reshape(gw.shape[0], -1)
    if gb is not None:
        w = torch.cat([w, gb.reshape(-1, 1)], dim=1)
    return w.reshape(-1)


def _bias(module: nn.Module) -> Tensor | None:
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, Tensor) else None


def _example_grads(model: nn.Module, names: list[str], loss_fn) -> dict[str, Tensor]:
    """vec([∇W | ∇b]) of ``loss_fn(model)`` per module name."""
    mods = [model.get_submodule(n) for n in names]
    params = [p for m in mods for p in (m.weight, _bias(m)) if p is not None]
    grads = iter(torch.autograd.grad(loss_fn(model), params, allow_unused=True))
    out = {}
    for name, m in zip(names, mods, strict=True):
        gw = next(grads)
        gw = torch.zeros_like(m.weight) if gw is None else gw
        gb = next(grads) if _bias(m) is not None else None
        out[name] = _wb(m, gw, gb)
    return out


def _mlp(seed: int = 0, sizes=(5, 7, 6, 3), act=nn.Tanh) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers += [nn.Linear(a, b)] + ([act()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers).to(DT)


def _close(a: Tensor, b: Tensor, rtol: float = 1e-8, atol: float = 1e-10) -> None:
    torch.testing.assert_close(a.to(b.dtype), b, rtol=rtol, atol=atol)


# --- exact: one example at one position ------------------------------------------------------


class _ConvNet(nn.Module):
    """Conv2d whose output is 1×1 (one position), then a bias-free Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, kernel_size=3, padding=1, stride=3)
        self.fc = nn.Linear(4, 3, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class _EmbedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4, padding_idx=0)
        self.fc = nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.emb(ids)))


@pytest.mark.parametrize("fisher", ["empirical", "mc", "ggn"])
@pytest.mark.parametrize("case", ["mlp", "conv", "embedding"])
def test_one_example_one_position_is_the_exact_block(case: str, fisher: str) -> None:
    torch.manual_seed(1)
    if case == "mlp":
        model, x = _mlp(), torch.randn(1, 5, dtype=DT)
    elif case == "conv":
        model, x = _ConvNet().to(DT), torch.randn(1, 2, 3, 3, dtype=DT)
    else:
        model, x = _EmbedNet().to(DT), torch.tensor([[4]])
    y = torch.tensor([2]) if case != "embedding" else torch.tensor([[2]])
    kf = estimate_kfac_factors(model, [(x, y)], fisher=fisher, seed=3)
    names = list(kf.factors)
    logits = model(x)
    if fisher == "empirical":
        targets = [y]
    elif fisher == "mc":  # the same draw as the estimator's (same generator, same seed)
        gen = torch.Generator().manual_seed(3)
        probs = torch.softmax(logits.detach().reshape(-1, 3), -1)
        targets = [torch.multinomial(probs, 1, generator=gen).reshape(y.shape)]
    else:  # type-2: Σ_c over all classes weighted by p_c = the expected Fisher
        targets = [torch.full_like(y, c) for c in range(3)]
    p = torch.softmax(logits.detach().reshape(-1), -1)
    expected = dict.fromkeys(names, 0.0)
    for t in targets:
        grads = _example_grads(
            model,
            names,
            lambda m, t=t: nn.functional.cross_entropy(m(x).reshape(-1, 3), t.reshape(-1)),
        )
        weight = p[int(t.reshape(-1)[0])] if fisher == "ggn" else 1.0
        for n in names:
            expected[n] = expected[n] + weight * torch.outer(grads[n], grads[n])
    for n in names:
        _close(kf.dense(n), expected[n])
    assert kf.num_examples == 1


def test_single_linear_layer_mse_ggn_is_xtx_kron_identity() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(DT)
    x, y = torch.randn(10, 4, dtype=DT), torch.randn(10, 3, dtype=DT)
    kf = estimate_kfac_factors(model, [(x[:6], y[:6]), (x[6:], y[6:])], fisher="ggn", loss="mse")
    xt = torch.cat([x, torch.ones(10, 1, dtype=DT)], dim=1)
    a, g = kf.factors[""]
    _close(a, xt.T @ xt / 10)
    _close(g, 10 * torch.eye(3, dtype=DT))
    _close(kf.dense(""), torch.kron(torch.eye(3, dtype=DT), xt.T @ xt))  # = the exact GGN
    assert kf.counts[""] == 10 and kf.num_examples == 10


# --- exact: deep linear networks, MSE, type-2 (Eschenhagen et al. 2023) -----------------------


class _DeepLinear(nn.Module):
    """Position-wise linear layers on (N, S, d); with ``pool`` the positions are averaged after
    the first layer (the reduce setting), otherwise every position has its own output (expand)."""

    def __init__(self, pool: bool) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(3, 5), nn.Linear(5, 4, bias=False), nn.Linear(4, 2)
        self.pool = pool

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x)
        return self.l3(self.l2(h.mean(dim=1) if self.pool else h))


def _exact_ggn_block(model: nn.Module, name: str, x: Tensor) -> Tensor:
    """Σ_i J_iᵀ J_i (MSE: Λ = I) over vec([W | b]) of module ``name``, by autograd Jacobians."""
    total = 0.0
    for i in range(x.shape[0]):
        out = model(x[i : i + 1]).reshape(-1)
        rows = [
            _example_grads(model, [name], lambda m, k=k, i=i: m(x[i : i + 1]).reshape(-1)[k])[name]
            for k in range(out.numel())
        ]
        jac = torch.stack(rows)
        total = total + jac.T @ jac
    return total


@pytest.mark.parametrize(("approx", "pool"), [("expand", False), ("reduce", True)])
def test_deep_linear_mse_ggn_is_exact(approx: str, pool: bool) -> None:
    torch.manual_seed(0)
    model = _DeepLinear(pool).to(DT)
    x = torch.randn(5, 4, 3, dtype=DT)
    y = model(x).detach() + torch.randn(model(x).shape, dtype=DT)
    kf = estimate_kfac_factors(
        model, [(x[:2], y[:2]), (x[2:], y[2:])], fisher="ggn", loss="mse", kfac_approx=approx
    )
    for name in ("l1", "l2", "l3"):
        _close(kf.dense(name), _exact_ggn_block(model, name, x))


def test_expand_and_reduce_agree_with_one_position() -> None:
    torch.manual_seed(0)
    model = _DeepLinear(pool=False).to(DT)
    x = torch.randn(6, 1, 3, dtype=DT)
    y = torch.randn(6, 1, 2, dtype=DT)
    expand, reduce = (
        estimate_kfac_factors(model, [(x, y)], loss="mse", kfac_approx=k)
        for k in ("expand", "reduce")
    )
    for name in expand.factors:
        for u, v in zip(expand.factors[name], reduce.factors[name], strict=True):
            _close(u, v)


def test_reduce_with_identical_positions_is_exact_empirical() -> None:
    """With the same input at every position, Σ_s g_s aᵀ = ḡ āᵀ: reduce is the exact empirical
    Fisher of one example even though the layer is shared."""
    torch.manual_seed(0)
    model = _DeepLinear(pool=False).to(DT)
    x = torch.randn(1, 1, 3, dtype=DT).expand(1, 4, 3).contiguous()
    y = torch.randn(1, 4, 2, dtype=DT)
    kf = estimate_kfac_factors(model, [(x, y)], loss="mse", kfac_approx="reduce")
    grads = _example_grads(model, ["l1"], lambda m: 0.5 * ((m(x) - y) ** 2).sum())
    _close(kf.dense("l1"), torch.outer(grads["l1"], grads["l1"]))


def test_mc_fisher_converges_to_the_type2_ggn() -> None:
    """For cross-entropy E_y[g gᵀ] over y ~ p is the GGN: G_mc → G_ggn as samples grow."""
    model = _mlp(sizes=(4, 5, 3))
    torch.manual_seed(0)
    data = [(torch.randn(4, 4, dtype=DT), torch.randint(0, 3, (4,)))]
    ggn = estimate_kfac_factors(model, data, fisher="ggn")
    mc = estimate_kfac_factors(model, data, fisher="mc", mc_samples=4000, seed=1)
    for name in ggn.factors:
        _close(mc.factors[name][0], ggn.factors[name][0])
        g_mc, g_ggn = mc.factors[name][1], ggn.factors[name][1]
        assert (g_mc - g_ggn).norm() < 0.05 * g_ggn.norm()
    again = estimate_kfac_factors(model, data, fisher="mc", mc_samples=3, seed=1)
    same = estimate_kfac_factors(model, data, fisher="mc", mc_samples=3, seed=1)
    _close(again.factors["0"][1], same.factors["0"][1], rtol=0, atol=0)


# --- curvlinops ------------------------------------------------------------------------------


class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, kernel_size=3, padding=1, stride=2)
        self.fc = nn.Linear(3 * 3 * 3, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _curvlinops_dense(model: nn.Module, data, fisher: str, approx: str, names: list[str]) -> Tensor:
    curvlinops = pytest.importorskip("curvlinops")
    params = [p for n in names for p in model.get_submodule(n).parameters()]
    op = curvlinops.KFACLinearOperator(
        model,
        nn.CrossEntropyLoss(reduction="sum"),
        params,
        data,
        fisher_type=fisher,
        kfac_approx=approx,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    dim = sum(p.numel() for p in params)
    return op @ torch.eye(dim, dtype=DT)


def _ours_dense(kf: KFACFactors, model: nn.Module, names: list[str]) -> Tensor:
    """Our blocks, permuted to curvlinops' order (per module: weight flattened, then bias)."""
    blocks = []
    for n in names:
        m = model.get_submodule(n)
        out, n_in = m.weight.shape[0], m.weight[0].numel()
        index = torch.arange(out * (n_in + 1)).reshape(out, n_in + 1)
        perm = torch.cat([index[:, :n_in].reshape(-1), index[:, n_in]])
        blocks.append(kf.dense(n)[perm][:, perm])
    return torch.block_diag(*blocks)


@pytest.mark.parametrize(
    ("net", "fisher", "approx"),
    [
        ("mlp", "empirical", "expand"),
        ("mlp", "type-2", "expand"),
        ("cnn", "empirical", "expand"),
        ("cnn", "type-2", "reduce"),
        ("cnn", "empirical", "reduce"),
    ],
)
def test_agrees_with_curvlinops(net: str, fisher: str, approx: str) -> None:
    torch.manual_seed(0)
    if net == "mlp":
        model = _mlp(sizes=(6, 8, 5, 4), act=nn.ReLU)
        xs = [torch.randn(7, 6, dtype=DT), torch.randn(5, 6, dtype=DT)]
    else:
        model = _CNN().to(DT)
        xs = [torch.randn(7, 2, 6, 6, dtype=DT), torch.randn(5, 2, 6, 6, dtype=DT)]
    data = [(x, torch.randint(0, 4, (x.shape[0],))) for x in xs]
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    ours = estimate_kfac_factors(
        model, data, fisher="ggn" if fisher == "type-2" else fisher, kfac_approx=approx
    )
    reference = _curvlinops_dense(model, data, fisher, approx, names)
    _close(_ours_dense(ours, model, names), reference, rtol=1e-7, atol=1e-9)


# --- masks: ignored targets and padding ------------------------------------------------------


class _TokenNet(nn.Module):
    """Position-wise: embedding → Linear → tanh → Linear (logits per position)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.l1 = nn.Linear(4, 5)
        self.head = nn.Linear(5, 7)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.head(torch.tanh(self.l1(self.emb(input_ids))))


def _assert_same_factors(a: KFACFactors, b: KFACFactors) -> None:
    assert a.factors.keys() == b.factors.keys() and a.counts == b.counts
    for name in a.factors:
        for u, v in zip(a.factors[name], b.factors[name], strict=True):
            _close(u, v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("fisher", ["empirical", "ggn"])
def test_ignored_and_padded_positions_change_nothing(approx: str, fisher: str) -> None:
    torch.manual_seed(0)
    model = _TokenNet().to(DT)
    ids = torch.randint(0, 7, (3, 6))
    labels = torch.randint(0, 7, (3, 6))
    attention = torch.ones(3, 6, dtype=torch.long)
    attention[0, 4:] = 0
    labels[0, 4:] = -100
    labels[1, 2] = -100  # an ignored target inside a sequence
    padded = [{"input_ids": ids, "attention_mask": attention, "labels": labels}]
    keep = labels != -100
    packed = [(ids[i][keep[i]][None], labels[i][keep[i]][None]) for i in range(3)]
    kw = {"fisher": fisher, "kfac_approx": approx}
    _assert_same_factors(
        estimate_kfac_factors(model, padded, **kw), estimate_kfac_factors(model, packed, **kw)
    )


def _gpt2(tie: bool = False) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=16, tie_word_embeddings=tie
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GPT2LMHeadModel(config).eval()


def _gpt2_covered(model: nn.Module) -> set[str]:
    return {
        n
        for n, m in model.named_modules()
        if type(m).__name__ == "Conv1D" or n in ("lm_head", "transformer.wte")
    }


def test_gpt2_one_token_is_the_exact_block_for_every_layer() -> None:
    model = _gpt2().to(DT)
    ids, target = torch.tensor([[7]]), torch.tensor([[3]])
    kf = estimate_kfac_factors(model, [({"input_ids": ids}, target)])
    # with one example the position embedding (its ids broadcast over the batch) is covered too
    assert set(kf.factors) == _gpt2_covered(model) | {"transformer.wpe"}
    assert kf.uncovered and all(".ln" in n for n in kf.uncovered)
    assert all(kf.transposed[n] for n in kf.factors if n != "lm_head")
    names = list(kf.factors)
    grads = _example_grads(
        model,
        names,
        lambda m: nn.functional.cross_entropy(
            m(input_ids=ids).logits.reshape(-1, 50), target.reshape(-1)
        ),
    )
    for n in names:  # kron(G, A) = v vᵀ, checked on random probes V: G V A = M ⟨M, V⟩
        a, g = kf.factors[n]
        a = torch.diag(a) if a.ndim == 1 else a
        m = grads[n].reshape(g.shape[0], a.shape[0])
        probes = torch.randn(3, *m.shape, dtype=DT)
        _close(g @ probes @ a, m * (probes * m).sum(dim=(1, 2), keepdim=True), rtol=1e-7, atol=1e-9)


def test_gpt2_padding_changes_nothing() -> None:
    model = _gpt2()
    torch.manual_seed(1)
    lengths = [5, 8, 3]
    seqs = [torch.randint(0, 50, (n,)) for n in lengths]

    def batch(rows: list[Tensor]) -> dict[str, Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for i, r in enumerate(rows):
            ids[i, : len(r)], attention[i, : len(r)] = r, 1
            labels[i, : len(r) - 1] = r[1:]
        return {"input_ids": ids, "attention_mask": attention, "labels": labels}

    for approx in ("expand", "reduce"):
        with pytest.warns(
            UserWarning, match="'transformer.wpe'.*batch dimension 1, not the batch's 3"
        ):
            padded = estimate_kfac_factors(model, [batch(seqs)], kfac_approx=approx)
        assert set(padded.factors) == _gpt2_covered(model)
        assert "transformer.wpe.weight" in padded.uncovered
        alone = estimate_kfac_factors(
            model, [batch([s]) for s in seqs], kfac_approx=approx, modules=list(padded.factors)
        )
        _assert_same_factors(padded, alone)
        assert padded.counts["lm_head"] == (sum(lengths) - 3 if approx == "expand" else 3)


def test_gpt2_tied_embedding_is_left_uncovered() -> None:
    model = _gpt2(tie=True)
    data = [({"input_ids": torch.randint(0, 50, (2, 4))}, torch.randint(0, 50, (2, 4)))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kf = estimate_kfac_factors(model, data, modules=None)
    assert "lm_head" not in kf.factors and "transformer.wte" not in kf.factors
    assert "transformer.wte.weight" in kf.uncovered


# --- precision, hooks, options and bad input -------------------------------------------------


def test_bf16_model_accumulates_in_float32() -> None:
    model = _mlp(sizes=(6, 8, 3)).float()
    torch.manual_seed(0)
    data = [(torch.randn(16, 6), torch.randint(0, 3, (16,)))]
    ref = estimate_kfac_factors(model, data)
    low = estimate_kfac_factors(model.to(torch.bfloat16), [(data[0][0].bfloat16(), data[0][1])])
    for name, (a, g) in low.factors.items():
        assert a.dtype == g.dtype == torch.float32
        _close(a, ref.factors[name][0], rtol=0.05, atol=0.05)
        _close(
            g, ref.factors[name][1], rtol=0.1, atol=0.1 * float(ref.factors[name][1].abs().max())
        )


def test_modules_restricts_and_the_rest_is_uncovered() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    data = [(torch.randn(5, 3), torch.randint(0, 2, (5,)))]
    kf = estimate_kfac_factors(model, data, modules=["2"])
    assert list(kf.factors) == ["2"]
    assert kf.uncovered == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_modules_used_functionally_are_left_uncovered() -> None:
    """nn.MultiheadAttention uses out_proj.weight without calling out_proj: no silent zero."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
            self.head = nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.attn(x, x, x)[0])

    data = [(torch.randn(2, 5, 4), torch.randint(0, 3, (2, 5)))]
    with pytest.warns(UserWarning, match="'attn.out_proj'.*never called"):
        kf = estimate_kfac_factors(Attention(), data)
    assert list(kf.factors) == ["head"]
    assert "attn.out_proj.weight" in kf.uncovered and "attn.in_proj_weight" in kf.uncovered


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def test_bad_input_raises_typed_errors_and_removes_hooks() -> None:
    model = _mlp(sizes=(3, 4, 2))
    x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    with pytest.raises(gm.StructureError, match=r"no K-FAC layer.*nn.Linear.*Conv2d.*Embedding"):
        estimate_kfac_factors(nn.Sequential(nn.LayerNorm(3)), [(x, y)])
    with pytest.raises(gm.ArgumentError, match="empty"):
        estimate_kfac_factors(model, [])
    bad = x.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(gm.NonFiniteError, match="batch 1"):
        estimate_kfac_factors(model, [(x, y), (bad, y)])
    assert _hooks(model) == 0
    with pytest.raises(gm.StructureError, match="shape"):
        estimate_kfac_factors(model, [(x, y[:, None].expand(4, 2))])
    with pytest.raises(gm.StructureError, match="integer class targets"):
        estimate_kfac_factors(model, [(x, y.to(DT))])
    with pytest.raises(gm.StructureError, match="mse needs targets"):
        estimate_kfac_factors(model, [(x, y.to(DT))], loss="mse")
    assert _hooks(model) == 0
    for kwargs, message in [
        ({"fisher": "kfac"}, "fisher must be"),
        ({"kfac_approx": "both"}, "kfac_approx must be"),
        ({"loss": "hinge"}, "loss must be"),
        ({"mc_samples": 0, "fisher": "mc"}, "positive int"),
        ({"mc_samples": 2}, "only applies to fisher='mc'"),
        ({"modules": ["nope"]}, r"\['nope'\] are not in the model"),
        ({"modules": ["1"]}, r"\['1 \(Tanh\)'\] are not K-FAC layers"),
        ({"fisher": "ggn", "max_ggn_columns": 1}, "use fisher='mc'"),
    ]:
        with pytest.raises(gm.ArgumentError, match=message):
            estimate_kfac_factors(model, [(x, y)], **kwargs)
    assert _hooks(model) == 0


def test_reduce_refuses_a_module_called_twice() -> None:
    lin = nn.Linear(3, 3)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x: Tensor) -> Tensor:
            return self.lin(torch.tanh(self.lin(x)))

    data = [(torch.randn(4, 3), torch.randint(0, 3, (4,)))]
    with pytest.raises(gm.StructureError, match="called more than once"):
        estimate_kfac_factors(Twice(), data, kfac_approx="reduce")
    assert estimate_kfac_factors(Twice(), data).counts["lin"] == 8  # expand: two calls
