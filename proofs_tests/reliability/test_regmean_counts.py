"""Issue 13, streamed RegMean: each Gram is M_t·A_t, M_t the rows (kept positions) A_t is a mean
over, carried in the K-FAC curvature (``KFAC.counts``) and its file.

Two token tasks with sequences of different lengths (and padding) have M_t/N_t of 3 and 7: the
old N_t·A_t weighed the tasks wrongly. The reference is :func:`gm.regmean` on the raw Grams
Σ a aᵀ, gathered here with forward hooks over the kept positions.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import gradmerge as gm
from gradmerge.jobs import MergeConfig, run_merge

DT = torch.float64


class TokenNet(nn.Module):
    """Embedding → Linear → tanh → Linear, position-wise (logits per token)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(11, 4)
        self.l1 = nn.Linear(4, 5)
        self.head = nn.Linear(5, 11)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        return self.head(torch.tanh(self.l1(self.emb(input_ids))))


def _task(seed: int, length: int, n: int = 6) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (n, length), generator=g)
    labels = torch.randint(0, 11, (n, length), generator=g)
    labels[0, -1] = -100  # an ignored position: not counted in M
    return [
        {"input_ids": ids[:3], "labels": labels[:3]},
        {"input_ids": ids[3:], "labels": labels[3:]},
    ]


def _kfac(c: gm.Curvature) -> gm.KFAC:
    return c if isinstance(c, gm.KFAC) else next(b for b in c.blocks if isinstance(b, gm.KFAC))


def _raw_grams(model: nn.Module, batches) -> dict[str, torch.Tensor]:
    """Σ over kept positions of [x, 1][x, 1]ᵀ for every nn.Linear (and of the one-hot inputs
    of the embedding): RegMean's Gram."""
    grams: dict[str, torch.Tensor] = {}
    keep: list[torch.Tensor] = []

    def hook(name):
        def record(_module, inputs, _output):
            x = inputs[0][keep[0]]  # (kept, in)
            x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
            grams[name] = grams.get(name, 0) + x.T @ x

        return record

    def count_tokens(_module, inputs, _output):  # one-hot inputs: Σ e eᵀ = diag(token counts)
        ids = inputs[0][keep[0]]
        grams["emb"] = grams.get("emb", 0) + torch.diag(torch.bincount(ids, minlength=11).to(DT))

    handles = [
        m.register_forward_hook(hook(n))
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]
    handles.append(model.emb.register_forward_hook(count_tokens))
    with torch.no_grad():
        for batch in batches:
            keep[:] = [batch["labels"] != -100]
            model(batch["input_ids"])
    for h in handles:
        h.remove()
    return grams


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("regmean-counts")
    base = TokenNet(0).to(DT)
    models, grams, files = [], [], []
    for t, length in enumerate((3, 7)):
        ft = TokenNet(0).to(DT)
        with torch.no_grad():
            for p in ft.parameters():
                p.add_(
                    0.3
                    * torch.randn(
                        p.shape, generator=torch.Generator().manual_seed(10 + t), dtype=DT
                    )
                )
        data = _task(100 + t, length)
        c = gm.estimate_curvature(ft, data, structure="kfac", fisher="empirical")
        files.append(c.save(root / f"ft{t}.curvature.safetensors"))
        path = root / f"ft{t}.safetensors"
        save_file({k: v.detach().clone() for k, v in ft.state_dict().items()}, path)
        models.append(path)
        grams.append(_raw_grams(ft, data))
    save_file(
        {k: v.detach().clone() for k, v in base.state_dict().items()}, root / "base.safetensors"
    )
    return root, models, files, grams


def _config(root, models, files, **extra):
    return MergeConfig.from_dict(
        {
            "method": "regmean",
            "base_model": "base.safetensors",
            "models": [
                {"model": m.name, "curvature": c.name, "alpha": a}
                for m, c, a in zip(models, files, (0.7, 1.3), strict=True)
            ],
            "compute_dtype": "float64",
            **extra,
        },
        root=root,
    )


def test_kfac_counts_are_the_kept_positions_and_are_saved(tasks):
    _root, _models, files, _grams = tasks
    for path, length in zip(files, (3, 7), strict=True):
        kfac = _kfac(gm.load_curvature(path))
        assert kfac.counts == {"l1": 6 * length - 1, "head": 6 * length - 1, "emb": 6 * length - 1}


def test_streamed_regmean_equals_regmean_on_the_raw_grams(tasks, tmp_path):
    """Each linear layer's weight from its inputs' Gram Σ x xᵀ (the bias column left out: the
    biases are averaged, as in Jin et al.'s code) and, with `embeddings: gram`, the embedding
    from its token counts."""
    root, models, files, grams = tasks
    run_merge(_config(root, models, files, embeddings="gram"), tmp_path / "out", progress=False)
    got = load_file(tmp_path / "out" / "model.safetensors")
    fts = [{k: v for k, v in load_file(m).items()} for m in models]
    r = gm.merge.REGMEAN_OFF_DIAGONAL  # the YAML default of Jin et al.'s off-diagonal factor
    kw = {"transposed": ["emb"], "off_diagonal": r}
    weights = [{m: g[:-1, :-1] if m != "emb" else g for m, g in gs.items()} for gs in grams]
    expected = gm.regmean(fts, weights, alphas=[0.7, 1.3], **kw)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-12)
    # the old N·A Grams (N = 6 examples each) give another merge: the test can tell them apart
    old = []
    for path in files:
        kfac = _kfac(gm.load_curvature(path))
        old.append({m: 6 * kfac.terms[m][0][0][:-1, :-1] for m in ("l1", "head")})
    old = [{**o, "emb": g["emb"]} for o, g in zip(old, grams, strict=True)]
    wrong = gm.regmean(fts, old, alphas=[0.7, 1.3], **kw)
    assert float((wrong["l1.weight"] - expected["l1.weight"]).abs().max()) > 1e-3


def _strip_counts(path, out):
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open API

    def strip(spec):
        spec.pop("counts", None)
        for part in spec.get("parts", []):
            strip(part)
        return spec

    meta["spec"] = json.dumps(strip(json.loads(meta["spec"])))
    save_file(tensors, out, metadata=meta)
    return out


def test_old_files_without_counts_load_and_regmean_refuses_them(tasks, tmp_path, capsys):
    root, models, files, _grams = tasks
    old = [_strip_counts(f, root / f"old{t}.curvature.safetensors") for t, f in enumerate(files)]
    kfac = _kfac(gm.load_curvature(old[0]))
    assert kfac.counts == {}
    with pytest.raises(gm.ArgumentError, match=r"models\[0\].curvature does not record it"):
        run_merge(_config(root, models, old), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    # one model: the Gram's scale cannot matter, RegMean returns that model
    single = {
        "method": "regmean",
        "base_model": "base.safetensors",
        "models": [{"model": models[0].name, "curvature": old[0].name}],
        "damping": 1.0e-3,  # tokens that never occur leave the embedding's Gram singular
        "compute_dtype": "float64",
    }
    run_merge(MergeConfig.from_dict(single, root=root), tmp_path / "one", progress=False)
    got, ft = load_file(tmp_path / "one" / "model.safetensors"), load_file(models[0])
    for k in ft:
        torch.testing.assert_close(got[k], ft[k], rtol=1e-12, atol=1e-14)


def test_counts_survive_to_scaled_and_restrict_but_not_sums(tasks):
    from gradmerge.curvature.io import open_curvature

    _root, _models, files, _grams = tasks
    with open_curvature(files[1]) as f:
        part = f.restrict(["l1.weight", "l1.bias"])
    assert isinstance(part, gm.KFAC) and part.counts == {"l1": 41}
    assert part.to(dtype=torch.float32).counts == part.scaled(2.0).counts == {"l1": 41}
    assert (part + part).counts == {}
    with pytest.raises(gm.StructureError, match="counts must be positive"):
        gm.KFAC({"fc": (torch.eye(2), torch.eye(1))}, counts={"fc": 0})
