"""``estimate_diagonal`` against independent references.

References: a per-example autograd loop (batch size 1, its own loss code); the dense GGN
``Σ_i J_iᵀ Λ_i J_i`` from ``torch.func.jacrev``; the exact Fisher by enumerating every class (for
the Monte-Carlo estimator's expectation); ``diag(XᵀX)`` for linear least squares; BackPACK.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

import gradmerge as gm
from gradmerge.estimate import diagonal as D
from gradmerge.estimate._data import Loss, sample_targets
from gradmerge.estimate.diagonal import estimate_diagonal

F64 = torch.float64
IGNORE = -100
SLOW_PATH = "no fast per-example rule"


# ----- references --------------------------------------------------------------------------
def model_output(model, inputs, params=None):
    if params is not None:
        args = ((), inputs) if isinstance(inputs, dict) else ((inputs,), {})
        out = functional_call(model, params, args[0], args[1])
    else:
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return out.logits if hasattr(out, "logits") else out


def loss_sum(out, target, loss):
    """ℓ of one example (written independently of gradmerge)."""
    if loss == "mse":
        return 0.5 * ((out - target) ** 2).sum()
    return nn.functional.cross_entropy(
        out.reshape(-1, out.shape[-1]), target.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


def rows(data):
    """The examples of batched data as batches of one."""
    for inputs, targets in data:
        for i in range(targets.shape[0]):
            if isinstance(inputs, dict):
                yield {k: v[i : i + 1] for k, v in inputs.items()}, targets[i : i + 1]
            else:
                yield inputs[i : i + 1], targets[i : i + 1]


def brute_force(model, examples, loss="cross_entropy"):
    """Σ_i (∇ℓ_i)² with one backward pass per example; ``examples`` yields (inputs, target)."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = {n: torch.zeros_like(p) for n, p in named.items()}
    for inputs, target in examples:
        value = loss_sum(model_output(model, inputs), target, loss)
        grads = torch.autograd.grad(value, list(named.values()), allow_unused=True)
        for n, g in zip(named, grads, strict=True):
            if g is not None:
                out[n] += g**2
    return out


def dense_ggn_diagonal(model, data, loss="cross_entropy"):
    """diag(Σ_i J_iᵀ Λ_i J_i): J from jacrev, Λ the loss Hessian in the outputs, built densely."""
    named = {n: p.detach() for n, p in model.named_parameters()}
    out = {n: torch.zeros_like(p) for n, p in named.items()}
    for inputs, targets in data:
        f = model_output(model, inputs).detach()
        batch, size = f.shape[0], f[0].numel()
        jac = jacrev(lambda ps, x=inputs: model_output(model, x, ps))(named)
        if loss == "mse":
            lam = torch.eye(size, dtype=f.dtype).expand(batch, size, size)
        else:
            p = torch.softmax(f.reshape(batch, -1, f.shape[-1]), -1)
            keep = (targets.reshape(batch, -1) != IGNORE).to(f.dtype)[..., None, None]
            blocks = (torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)) * keep
            lam = torch.stack([torch.block_diag(*b) for b in blocks])
        for n, j in jac.items():
            j = j.reshape(batch, size, -1)  # (B, outputs, params)
            out[n] += torch.einsum("bop,bok,bkp->p", j, lam, j).reshape(named[n].shape)
    return out


def assert_close(got: gm.Diagonal, want: dict, rtol=1e-10):
    assert set(got.values) == set(want)
    for n, w in want.items():
        g = got.values[n]
        assert g.shape == w.shape and g.dtype == w.dtype, n
        scale = max(float(w.abs().max()), 1e-30)
        err = float((g - w).abs().max()) / scale
        assert err <= rtol, f"{n}: relative error {err:.2e}"


def no_slow_path(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    assert not [w for w in caught if SLOW_PATH in str(w.message)]
    return out


# ----- models and data ---------------------------------------------------------------------
def mlp(n_in=5, n_out=4, seed=0, dtype=F64):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(n_in, 7), nn.ReLU(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, n_out)
    ).to(dtype)


def class_data(n_in=5, classes=4, sizes=(7, 5), seed=1, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(b, n_in, generator=g, dtype=dtype),
            torch.randint(0, classes, (b,), generator=g),
        )
        for b in sizes
    ]


def regression_data(n_in=5, n_out=3, sizes=(7, 5), seed=2):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(b, n_in, generator=g, dtype=F64),
            torch.randn(b, n_out, generator=g, dtype=F64),
        )
        for b in sizes
    ]


VOCAB, SEQ = 11, 5


class SeqModel(nn.Module):
    """Embedding → Linear over positions → Tanh → LayerNorm → Linear head (position-wise)."""

    def __init__(self, tie=False, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6, padding_idx=padding_idx)
        self.mix = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, VOCAB, bias=not tie)
        if tie:
            self.head.weight = self.emb.weight
        with torch.no_grad():
            self.norm.weight.normal_()
            self.norm.bias.normal_()

    def forward(self, tokens):
        return self.head(self.norm(torch.tanh(self.mix(self.emb(tokens)))))


def seq_model(seed=0, **kw):
    torch.manual_seed(seed)
    return SeqModel(**kw).to(F64)


def seq_data(sizes=(4, 3), seed=3):
    """Tokens with repeats; targets with some positions at ignore_index (never a whole row)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in sizes:
        tokens = torch.randint(0, 4, (b, SEQ), generator=g)  # few symbols: repeats in a sequence
        targets = torch.randint(0, VOCAB, (b, SEQ), generator=g)
        drop = torch.rand(b, SEQ, generator=g) < 0.3
        drop[:, 0] = False
        out.append((tokens, torch.where(drop, IGNORE, targets)))
    return out


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 3, 3, padding=1)
        self.c2 = nn.Conv2d(3, 4, (2, 3), stride=2, padding=(1, 0), dilation=(1, 2), bias=False)
        self.fc = nn.Linear(4 * 4 * 1, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).flatten(1))


def cnn_data(sizes=(3, 2), seed=4):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(b, 2, 6, 6, generator=g, dtype=F64), torch.randint(0, 3, (b,), generator=g))
        for b in sizes
    ]


# ----- empirical Fisher vs the per-example loop -------------------------------------------
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_empirical_mlp(loss):
    model = mlp(n_out=4 if loss == "cross_entropy" else 3)
    data = class_data() if loss == "cross_entropy" else regression_data()
    got = no_slow_path(lambda: estimate_diagonal(model, data, loss=loss))
    assert_close(got, brute_force(model, rows(data), loss))


@pytest.mark.parametrize("tie", [False, True])
def test_empirical_sequences_with_ignored_positions(tie):
    model, data = seq_model(tie=tie, padding_idx=0), seq_data()
    got = no_slow_path(lambda: estimate_diagonal(model, data))
    assert_close(got, brute_force(model, rows(data)))


def test_ignored_positions_contribute_nothing():
    """Padded, ignored positions give the estimate of the sequences cut to their kept positions."""
    model = seq_model()
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(5))
    targets = tokens.roll(1, dims=1)
    lengths = [5, 3, 2]
    padded = torch.stack(
        [
            torch.where(torch.arange(SEQ) < n, t, IGNORE)
            for t, n in zip(targets, lengths, strict=True)
        ]
    )
    cut = [(tokens[i : i + 1, :n], targets[i : i + 1, :n]) for i, n in enumerate(lengths)]
    assert_close(estimate_diagonal(model, [(tokens, padded)]), estimate_diagonal(model, cut).values)


def test_empirical_cnn():
    torch.manual_seed(0)
    model, data = CNN().to(F64), cnn_data()
    got = no_slow_path(lambda: estimate_diagonal(model, data))
    assert_close(got, brute_force(model, rows(data)))


class CalledTwice(nn.Module):
    """One layer of ``kind`` applied twice (one weight, two hooked calls whose per-example
    gradients are summed before squaring), then a Linear head over positions."""

    def __init__(self, kind):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.kind = kind
        self.layer = {
            "linear": lambda: nn.Linear(4, 4),
            "conv1d": lambda: Conv1D(4, 4),
            "conv2d": lambda: nn.Conv2d(4, 4, 3, padding=1),
            "embedding": lambda: nn.Embedding(VOCAB, 4, padding_idx=0),
        }[kind]()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        if self.kind == "embedding":  # the tokens and the same tokens reversed
            h = torch.tanh(self.layer(x) + self.layer(x.flip(1)))
        elif self.kind == "conv2d":  # (B, 4, 2, 3): 6 pixels are the positions
            h = torch.tanh(self.layer(torch.tanh(self.layer(x)))).flatten(2).transpose(1, 2)
        else:
            h = torch.tanh(self.layer(torch.tanh(self.layer(x))))
        return self.head(h)


@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d", "embedding"])
def test_a_layer_called_twice_sums_its_calls_before_squaring(kind):
    """Each rule's ``per_example_into`` (products written in place, embedding rows added last)
    against the per-example loop; the tied embedding/head is in the sequence tests above."""
    torch.manual_seed(0)
    model = CalledTwice(kind).to(F64)
    g = torch.Generator().manual_seed(5)
    shape = {"conv2d": (3, 4, 2, 3), "embedding": (3, 6)}.get(kind, (3, 6, 4))
    if kind == "embedding":
        x = torch.randint(0, 4, shape, generator=g)  # token 0 is the padding row
    else:
        x = torch.randn(shape, generator=g, dtype=F64)
    data = [(x, torch.randint(0, 3, (3, 6), generator=g))]
    got = no_slow_path(lambda: estimate_diagonal(model, data))
    assert_close(got, brute_force(model, rows(data)))


class Doubled(nn.Linear):
    """A subclass that overrides forward: the hooks must not trust it."""

    def forward(self, x):
        return 2 * super().forward(x)


class Mixed(nn.Module):
    """A custom parameter, a module called twice, an overridden forward, an output changed in
    place and a head whose weight is also used raw."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))
        self.shared = nn.Linear(5, 5)
        self.doubled = Doubled(5, 5)
        self.inplace = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.shared(x * self.scale))))
        h = torch.tanh(self.doubled(h))
        z = self.inplace(h)
        h = torch.tanh(z.mul_(h))
        return self.head(h) + h[:, :3] @ self.head.weight[:, :3].T


def test_fallback_parameters_are_exact_and_named():
    torch.manual_seed(0)
    model, data = Mixed().to(F64), class_data(classes=3)
    with pytest.warns(UserWarning, match=SLOW_PATH) as caught, torch.no_grad():
        got = estimate_diagonal(model, data)
    message = str(caught[0].message)
    assert all(n in message for n in ("scale", "doubled.weight", "inplace.weight", "head.weight"))
    assert "shared.weight" not in message  # two hooked calls, summed before squaring
    assert_close(got, brute_force(model, rows(data)))


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=16, use_cache=False
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(F64).eval()


def test_empirical_gpt2_with_padding():
    """Padded batches with a mask vs each sequence alone, unpadded: only real tokens count."""
    model = tiny_gpt2()
    g = torch.Generator().manual_seed(6)
    lengths = torch.tensor([10, 7, 4, 9])
    ids = torch.randint(0, 50, (4, 10), generator=g)
    mask = (torch.arange(10) < lengths[:, None]).long()
    targets = torch.full_like(ids, IGNORE)
    targets[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], IGNORE)
    data = [
        ({"input_ids": ids[:2], "attention_mask": mask[:2]}, targets[:2]),
        {"input_ids": ids[2:], "attention_mask": mask[2:], "labels": targets[2:]},
    ]
    got = no_slow_path(lambda: estimate_diagonal(model, data))
    alone = [(ids[i : i + 1, :n], targets[i : i + 1, :n]) for i, n in enumerate(lengths.tolist())]
    assert_close(got, brute_force(model, alone), rtol=1e-9)


# ----- Monte-Carlo Fisher -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "loss"),
    [
        (lambda: (mlp(), class_data()), "cross_entropy"),
        (lambda: (mlp(n_out=3), regression_data()), "mse"),
        (lambda: (seq_model(), seq_data()), "cross_entropy"),
    ],
)
def test_mc_equals_loop_over_the_same_draws(make, loss):
    model, data = make()
    k, seed = 3, 11
    got = estimate_diagonal(model, data, fisher="mc", loss=loss, mc_samples=k, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    want = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for inputs, targets in data:
        with torch.no_grad():
            f = model(inputs)
        for _ in range(k):
            drawn = sample_targets(f, targets, Loss(loss, IGNORE), gen)
            if loss == "cross_entropy":
                assert torch.equal(drawn == IGNORE, targets == IGNORE)
            for n, v in brute_force(model, rows([(inputs, drawn)]), loss).items():
                want[n] += v / k
    assert_close(got, want)


def test_mc_expectation_is_the_exact_fisher():
    """k → large: the MC average approaches Σ_i Σ_c p_ic (∇ℓ_i(c))² within 5 standard errors."""
    model, data = mlp(n_in=3, n_out=3, seed=7), class_data(n_in=3, classes=3, sizes=(6,))
    k = 3000
    got = estimate_diagonal(model, data, fisher="mc", mc_samples=k, seed=0)
    x = data[0][0]
    mean = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    var = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(x.shape[0]):
        p = torch.softmax(model(x[i : i + 1]), -1)[0].detach()
        per_class = [brute_force(model, [(x[i : i + 1], torch.tensor([c]))]) for c in range(3)]
        for n in mean:
            m1 = sum(p[c] * per_class[c][n] for c in range(3))
            m2 = sum(p[c] * per_class[c][n] ** 2 for c in range(3))
            mean[n] += m1
            var[n] += m2 - m1**2  # examples are independent: variances add
    for n in mean:
        tol = 5 * (var[n].clamp_min(0) / k).sqrt() + 1e-12 * mean[n].abs().max()
        assert bool(((got.values[n] - mean[n]).abs() <= tol).all()), n
    assert_close(estimate_diagonal(model, data, fisher="ggn"), mean)  # Fisher = GGN for softmax


# ----- exact GGN ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "loss"),
    [
        (lambda: (mlp(), class_data()), "cross_entropy"),
        (lambda: (mlp(n_out=3), regression_data()), "mse"),
        (lambda: (seq_model(tie=True), seq_data()), "cross_entropy"),
        (lambda: (CNN().to(F64), cnn_data()), "cross_entropy"),
    ],
)
def test_ggn_equals_dense_jacobian_reference(make, loss):
    torch.manual_seed(0)
    model, data = make()
    got = no_slow_path(lambda: estimate_diagonal(model, data, fisher="ggn", loss=loss))
    assert_close(got, dense_ggn_diagonal(model, data, loss))


def test_ggn_of_linear_least_squares_is_diag_xtx():
    torch.manual_seed(0)
    model = nn.Linear(4, 3, bias=False).to(F64)
    data = regression_data(n_in=4, n_out=3)
    got = estimate_diagonal(model, data, fisher="ggn", loss="mse")
    x = torch.cat([inputs for inputs, _ in data])
    assert_close(got, {"weight": torch.diag(x.T @ x).expand(3, 4).clone()})


@pytest.mark.parametrize("fisher", ["empirical", "mc", "ggn"])
def test_fully_ignored_batch_adds_nothing(fisher):
    model, data = seq_model(), seq_data()
    tokens = data[0][0]
    padded = [*data, (tokens, torch.full_like(tokens, IGNORE))]  # last: earlier MC draws unchanged
    got = estimate_diagonal(model, padded, fisher=fisher, mc_samples=2)
    assert_close(got, estimate_diagonal(model, data, fisher=fisher, mc_samples=2).values, rtol=0)


def test_ggn_refuses_too_many_columns(monkeypatch):
    monkeypatch.setattr(D, "MAX_GGN_COLUMNS", 10)
    with pytest.raises(gm.ArgumentError, match="fisher='mc'"):
        estimate_diagonal(seq_model(), seq_data(), fisher="ggn")


# ----- BackPACK -------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_matches_backpack():
    backpack = pytest.importorskip("backpack")
    from backpack.extensions import DiagGGNExact, SumGradSquared

    model, data = mlp(), class_data()
    ours = estimate_diagonal(model, data, fisher="empirical")
    ggn = estimate_diagonal(model, data, fisher="ggn")
    bp_model = backpack.extend(copy.deepcopy(model))
    bp_loss = backpack.extend(nn.CrossEntropyLoss(reduction="sum"))
    sq = {n: torch.zeros_like(p) for n, p in bp_model.named_parameters()}
    dg = {n: torch.zeros_like(p) for n, p in bp_model.named_parameters()}
    for x, y in data:
        bp_model.zero_grad()
        with backpack.backpack(SumGradSquared(), DiagGGNExact()):
            bp_loss(bp_model(x), y).backward()
        for n, p in bp_model.named_parameters():
            sq[n] += p.sum_grad_squared
            dg[n] += p.diag_ggn_exact
    assert_close(ours, sq)
    assert_close(ggn, dg)


# ----- dtypes, parameter subsets, state -------------------------------------------------------
def test_bf16_model_gives_float32_close_to_float32_model():
    model32 = mlp(dtype=torch.float32)
    data = class_data(dtype=torch.float32)
    want = estimate_diagonal(model32, data)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    got = estimate_diagonal(model16, [(x.to(torch.bfloat16), y) for x, y in data])
    for n, w in want.values.items():
        g = got.values[n]
        assert g.dtype == torch.float32
        assert float((g - w).norm() / w.norm()) < 0.05, n


def test_parameter_subset_and_state_restored():
    model, data = seq_model(), seq_data()
    model.train()
    full = estimate_diagonal(model, data)
    sub = estimate_diagonal(model, data, params=["mix.weight", "head.bias"])
    assert_close(sub, {n: full.values[n] for n in ("mix.weight", "head.bias")}, rtol=1e-12)
    assert all(p.requires_grad for p in model.parameters())
    assert model.training
    assert not any(m._forward_hooks for m in model.modules())


def test_hooks_removed_and_state_restored_after_an_error():
    model = mlp()
    bad = class_data()
    bad[1][0][2, 1] = float("nan")
    with pytest.raises(gm.NonFiniteError, match="batch 1"):
        estimate_diagonal(model, bad, params=["0.weight"])
    assert all(p.requires_grad for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())


# ----- bad input --------------------------------------------------------------------------------
def test_bad_input_raises_typed_errors():
    model, data = mlp(), class_data()
    frozen = mlp().requires_grad_(False)
    with pytest.raises(gm.ArgumentError, match="no trainable parameters"):
        estimate_diagonal(frozen, data)
    with pytest.raises(gm.ArgumentError, match="empty"):
        estimate_diagonal(model, [])
    with pytest.raises(gm.ArgumentError, match="fisher must be"):
        estimate_diagonal(model, data, fisher="hessian")
    with pytest.raises(gm.ArgumentError, match="loss must be"):
        estimate_diagonal(model, data, loss="hinge")
    with pytest.raises(gm.ArgumentError, match="mc_samples"):
        estimate_diagonal(model, data, fisher="mc", mc_samples=0)
    with pytest.raises(gm.ArgumentError, match="'nope'"):
        estimate_diagonal(model, data, params=["nope"])
    with pytest.raises(gm.StructureError, match="integer class targets"):
        estimate_diagonal(model, [(x, y.double()) for x, y in data])
    with pytest.raises(gm.StructureError, match="do not fit"):
        estimate_diagonal(model, [(x, y[:-1]) for x, y in data])
    with pytest.raises(gm.StructureError, match="mse needs targets"):
        estimate_diagonal(model, data, loss="mse")
    assert not any(m._forward_hooks for m in model.modules())


def test_diag_estimate_accepts_a_one_shot_iterator():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    batches = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(3)]
    c = gm.estimate_curvature(model, iter(batches))
    assert c.meta["num_examples"] == "12"
    ref = gm.estimate_curvature(model, batches)
    for key in ref.values:
        torch.testing.assert_close(c.values[key], ref.values[key])
