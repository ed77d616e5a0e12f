r"""Study 1's Figure-1 protocol with LoRA adapters instead of whole-model fine-tunes.

Question: the interference study (``benchmarks/interference.py``) ties K-FAC gradient matching
with TSV-M and Iso-C when whole models are fine-tuned. Most practitioners merge LoRA adapters
instead: does the ranking change, and does it depend on how strongly the adapters interfere?

Protocol: Study 1 of ``benchmarks/interference.py`` — its data (``snippets`` then ``reviews``,
``sentences``, ``dutch``, ``french``), its θ_LLM (MiniLM-L6 with a linear-probe head, fine-tuned
on ``snippets``), its F_0, scoring, label-free α (``gradmerge tune``), bootstrap and record — with
every added dataset t learnt as a peft LoRA adapter of θ_LLM: rank r on ``query``/``value``
(lora_alpha = 2r), the shared 2-class head in ``modules_to_save``, AdamW on the adapter and head
only (:func:`benchmarks.interference.fine_tune`). The multi-task model θ_1:T is an adapter of the
same rank trained on all five datasets. For T = 1..4 the first T adapters are merged into θ_LLM by
every method of the whole-model table, each a ``gradmerge`` command given the adapter folders
themselves (curvatures are estimated over the adapted parameters only): task arithmetic at each
α of ``--alphas`` (α = 1, α on validation labels — an ORACLE — and α by ``gradmerge tune``), the
guide's gradient matching (H_0 = N_0·F_0 + δ, δ = 1e-12 diagonal, δ = 1 K-FAC: Study 1's official
recipe), TSV-M; at the largest T also Fisher averaging, RegMean, Iso-C, Iso-CTS, and TIES and DARE
through ``mergekit-yaml`` on the adapters written as full folders by ``gradmerge materialize``.

Levels of interference (``--levels RANK:LR ...``): the same study at each adapter rank and
learning rate; the interference each level produces is MEASURED, as Study 1 does, as fine-tuned
θ_t − task arithmetic α = 1 on t's test set at the largest T. Every adapter is checked to learn:
its accuracy on its own test set against θ_LLM's (the record's ``adapters learn``).

Statistics: per level, the paired-bootstrap 95% intervals of the interference study (per seed and
pooled over seeds, test texts resampled within each dataset) of each merge against task
arithmetic at α = 1, at the label-free α, and K-FAC gradient matching.

    python -m benchmarks.adapters                  # full run: results/adapters-cpu.json, .png
    python -m benchmarks.adapters --quick          # smoke run in one process (the test runs it)
    python -m benchmarks.adapters --work DIR       # resumes: adapters, curvatures, scores cached

Every adapter records its training settings (``training.json``); one in ``--work`` trained
otherwise is refused, never reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import interference as base_study
from benchmarks.interference import (
    ADDED,
    BASE,
    COST,
    STAMP,
    Study,
    comparisons,
    fine_tune,
    interference,
    summary,
    write_cost,
)
from benchmarks.paper_recipe import encode, libraries, load_classifier, write_jsonl
from benchmarks.record import Run, output, write_result
from gradmerge.errors import ArgumentError

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGETS = ("query", "value")
ADAPTER_FILE = "adapter_model.safetensors"


def level_name(rank: int, lr: float) -> str:
    """A level's name in the record and its work folder's: ``r=8, lr=0.0005``."""
    return f"r={rank}, lr={lr:g}"


def parse_level(text: str) -> tuple[int, float]:
    """``RANK:LR`` (``8:5e-4``) → (8, 0.0005); anything else is an argument error (exit 2)."""
    rank, sep, lr = text.partition(":")
    try:
        r, rate = int(rank), float(lr)
    except ValueError:
        r, rate = 0, 0.0
    if not sep or r < 1 or rate <= 0:
        raise argparse.ArgumentTypeError(
            f"expected RANK:LR with a positive integer rank and learning rate (8:5e-4), "
            f"got {text!r}"
        )
    return r, rate


def train_adapter(
    base: Path,
    tokenizer: Any,
    folder: Path,
    data: dict[str, Any],
    settings: dict[str, Any],
    *,
    rank: int,
    lr: float,
    epochs: int,
    batch_size: int,
    seed: int,
) -> Path:
    """A peft LoRA adapter of ``base`` (rank ``rank`` on :data:`TARGETS`, lora_alpha = 2·rank,
    no dropout, the head in ``modules_to_save``) trained by :func:`fine_tune` on the encoded
    ``data`` (dataset → texts), written whole into ``folder`` (adapter, tokenizer,
    :data:`STAMP`, :data:`COST`) via a renamed folder, or the adapter already there when it was
    trained with ``settings`` (:func:`adapter_done`)."""
    if adapter_done(folder, settings):
        return folder
    import peft

    begin = time.perf_counter()
    _, model = load_classifier(str(base))
    torch.manual_seed(seed)  # LoRA's A is drawn at random (B = 0)
    config = peft.LoraConfig(
        task_type="SEQ_CLS",
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=list(TARGETS),
        modules_to_save=["classifier"],
    )
    wrapped = peft.get_peft_model(model, config)
    wrapped.eval()
    fine_tune(wrapped, list(data.values()), epochs=epochs, lr=lr, batch_size=batch_size, seed=seed)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    wrapped.save_pretrained(tmp, safe_serialization=True)
    saved = json.loads((tmp / "adapter_config.json").read_text())
    saved["base_model_name_or_path"] = str(base.resolve())
    (tmp / "adapter_config.json").write_text(json.dumps(saved, indent=1) + "\n")
    tokenizer.save_pretrained(tmp)
    (tmp / STAMP).write_text(json.dumps(settings, indent=1, ensure_ascii=False) + "\n")
    write_cost(tmp, data, epochs, batch_size, time.perf_counter() - begin)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(folder)
    return folder


def adapter_done(folder: Path, settings: dict[str, Any]) -> bool:
    """Whether ``folder`` holds an adapter trained with exactly ``settings`` (reuse it); False
    where none is there. One trained otherwise, or without a record of how, is never reused:
    :class:`~gradmerge.errors.ArgumentError` names both settings."""
    if not (folder / ADAPTER_FILE).exists():
        return False
    stamp = folder / STAMP
    had = json.loads(stamp.read_text()) if stamp.exists() else None
    if had != settings:
        raise ArgumentError(
            f"{folder} holds an adapter trained with {had or 'unrecorded settings'}, but this "
            f"run asks for {settings}: run with another --work, or move that folder away"
        )
    return True


class AdapterStudy(Study):
    """Study 1 (``benchmarks.interference.Study``) with LoRA adapters as the fine-tunes: θ_LLM
    and F_0 shared by every level and seed; per (level, seed) the adapters, their curvatures and
    materialised folders, then Study 1's merges and scores (:meth:`Study.study1`)."""

    def level_seed(self, rank: int, lr: float, seed: int) -> dict[str, Any]:
        """One seed at one level: its rows (Study 1's) and what each adapter cost."""
        args = self.args
        level = level_name(rank, lr)
        root = self.work / f"r{rank}-lr{lr:g}" / f"seed{seed}"
        start = time.perf_counter()
        train = {d: self.train_set(d, seed if d != BASE else 0) for d in self.sets}
        enc = {d: encode(self.tokenizer, train[d], args.max_length) for d in self.sets}
        self.train_files = {
            d: write_jsonl(root / "data" / f"{d}-train.jsonl", train[d]) for d in self.sets
        }
        n_f = min(self.n, args.curvature_examples)
        self.fisher_files = {
            d: write_jsonl(root / "data" / f"{d}-fisher.jsonl", train[d][:n_f]) for d in self.sets
        }
        self.extras, self.recipes = True, ("a",)
        self.criteria = list(args.criteria)

        def adapter(folder: Path, data: dict[str, Any], epochs: int, offset: int) -> Path:
            settings = {
                "base": str(self.base_dir.resolve()),
                "texts": {d: len(e) for d, e in data.items()},
                "rank": rank,
                "lora_alpha": 2 * rank,
                "targets": list(TARGETS),
                "modules_to_save": ["classifier"],
                "epochs": epochs,
                "lr": lr,
                "batch size": args.batch_size,
                "max length": args.max_length,
                "seed": seed * 100 + offset,
            }
            return train_adapter(
                self.base_dir, self.tokenizer, folder, data, settings, rank=rank, lr=lr,
                epochs=epochs, batch_size=args.batch_size, seed=seed * 100 + offset,
            )  # fmt: skip

        adapters = {
            d: adapter(root / "a" / d, {d: enc[d]}, args.epochs, i)
            for i, d in enumerate(self.added)
        }
        epochs = args.multitask_epochs
        self.multi = adapter(root / f"multitask-e{epochs}", enc, epochs, 7)
        self.m_ns = f"{level} | seed {seed} | multi-task {epochs} epochs"
        self.stage("adapters θ_t and the multi-task adapter", start)
        start = time.perf_counter()
        curv: dict[str, dict[str, Path]] = {}
        calls: list[tuple[str | Path, ...]] = []
        for d in self.added:
            curv[d] = {s: root / "a" / f"{d}-{s}.safetensors" for s in args.structures}
            calls += [
                self.curvature_call(adapters[d], self.fisher_files[d], out, s, seed)
                for s, out in curv[d].items()
                if not out.exists()
            ]
        self.cli.all(calls)
        self.stage("curvatures H_t over the adapted parameters", start)
        start = time.perf_counter()
        self.materialized: dict[str, Path] = {}
        if args.mergekit:  # TIES and DARE read model folders only
            calls = []
            for d, folder in adapters.items():
                full = root / "materialized" / d
                self.materialized[d] = full
                if not (full / "config.json").exists():
                    calls.append(("materialize", folder, full, "--overwrite"))
            self.cli.all(calls)
        self.stage("gradmerge materialize (for mergekit)", start)
        self.models, self.curv = {"a": adapters, "b": {}}, {"a": curv, "b": {}}
        self.root, self.seed_id, self.mergekit_seed = root, f"{level} | seed {seed}", seed
        rows = self.study1()
        cost = {d: json.loads((f / COST).read_text()) for d, f in adapters.items()}
        cost["multi-task"] = json.loads((self.multi / COST).read_text())
        return {"seed": seed, "rows": rows, "adapter cost": cost}

    def mergekit_models(self, tasks: list[str]) -> list[Path]:
        """TIES and DARE (Study 1's settings: density 0.2 / 0.5) merge the adapters materialised
        by ``gradmerge materialize``: mergekit reads whole-model folders."""
        return [self.materialized[d] for d in tasks]


# ----- report ------------------------------------------------------------------------------------------
def learns(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per seed and added dataset t: the adapter θ_t's test accuracy on t against θ_LLM's, and
    whether it is higher (an adapter that does not beat θ_LLM on its own set learnt nothing to
    merge)."""
    out: dict[str, Any] = {"per seed": [], "every adapter beats θ_LLM on its own set": True}
    for s in seeds:
        T = max(r["T"] for r in s["rows"])
        rows = {r["method"]: r for r in s["rows"] if r["T"] == T}
        entry = {}
        for d in ADDED:
            if f"fine-tuned θ_{d}" not in rows:
                continue
            own, llm = rows[f"fine-tuned θ_{d}"]["accuracy"][d], rows["θ_LLM"]["accuracy"][d]
            entry[d] = {"adapter": own, "θ_LLM": llm, "adapter − θ_LLM": own - llm}
            out["every adapter beats θ_LLM on its own set"] &= own > llm
        out["per seed"].append({"seed": s["seed"], "datasets": entry})
    return out


def level_report(name: str, seeds: list[dict[str, Any]], resamples: int) -> dict[str, Any]:
    """One level's results: its seeds' rows, Study 1's summary, intervals and interference, and
    whether its adapters learn."""
    gap = interference(seeds)
    mean_gap = gap["mean over seeds"]
    return {
        "level": name,
        "seeds": seeds,
        "summary": summary(seeds),
        "comparisons": comparisons(seeds, resamples),
        "interference (fine-tuned − task arithmetic α=1, largest T)": gap,
        "mean interference over datasets": sum(mean_gap.values()) / len(mean_gap)
        if mean_gap
        else None,
        "adapters learn": learns(seeds),
    }


def table(report: dict[str, Any]) -> str:
    """Each level's table as Study 1 prints it, headed by its measured interference."""
    out = []
    for lv in report["levels"]:
        gap = lv["mean interference over datasets"]
        out += ["", f"=== {lv['level']}: mean interference {100 * (gap or 0):+.1f} points ==="]
        out.append(base_study.table({**lv, "removal": []}))
        ok = lv["adapters learn"]["every adapter beats θ_LLM on its own set"]
        out.append(f"every adapter beats θ_LLM on its own set: {ok}")
    return "\n".join(out)


def plot(report: dict[str, Any], path: Path) -> None:
    """Per level (columns): mean accuracy by T of the key methods (top), and every merge's pooled
    paired difference to task arithmetic α = 1 at the largest T with its 95% interval (bottom)."""
    from matplotlib.figure import Figure

    levels = report["levels"]
    fig = Figure(figsize=(6 * len(levels), 9), layout="constrained")
    axes = fig.subplots(2, len(levels), squeeze=False)
    for col, lv in enumerate(levels):
        ax, bx = axes[0][col], axes[1][col]
        for method in (*base_study.KEY_METHODS, "tsv_merge", "θ_LLM"):
            pts = [e for e in lv["summary"] if e["method"] == method and e["seeds"]]
            if pts:
                ax.errorbar([e["T"] for e in pts], [e["accuracy"]["mean"]["mean"] for e in pts],
                            yerr=[e["accuracy"]["mean"]["std"] for e in pts], marker="o",
                            capsize=3, label=method)  # fmt: skip
        gap = lv["mean interference over datasets"]
        ax.set_title(f"{lv['level']}: interference {100 * (gap or 0):+.1f} points", fontsize=9)
        ax.set_xlabel("adapters merged (T)")
        ax.set_ylabel(f"mean test accuracy ({BASE} + T sets)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        last = max(e["T"] for e in lv["summary"])
        comps = [
            c for c in lv["comparisons"] if c["against"] == "task arithmetic α=1" and c["T"] == last
        ]
        for i, c in enumerate(comps):
            d, (lo, hi) = c["pooled"]["difference"], c["pooled"]["ci95"]
            bx.errorbar([100 * d], [i], xerr=[[100 * (d - lo)], [100 * (hi - d)]], fmt="o",
                        capsize=3, color="black")  # fmt: skip
        bx.axvline(0, color="tab:red", linewidth=1)
        bx.set_yticks(range(len(comps)), [c["method"] for c in comps], fontsize=7)
        bx.set_xlabel(f"T={last}: − task arithmetic α=1, points (pooled paired 95% CI)")
        bx.grid(alpha=0.3)
    fig.suptitle("MiniLM-L6 LoRA adapters (query/value, shared head saved) merged into θ_LLM",
                 fontsize=10)  # fmt: skip
    fig.savefig(path, dpi=110)


def report_of(
    levels: dict[str, list[dict[str, Any]]],
    base: dict[str, Any],
    resamples: int,
    extra: dict[str, Any],
    data: Path,
) -> dict[str, Any]:
    """The study's results (a record's ``results``)."""
    report: dict[str, Any] = {
        "datasets": {d: base_study.LANGUAGE[d] for d in [BASE, *ADDED]},
        "data provenance": json.loads((data.parent / "interference.provenance.json").read_text()),
        "base": base,
        "levels": [level_report(n, s, resamples) for n, s in levels.items()],
        **extra,
        "libraries": libraries() | {"peft": __import__("peft").__version__},
    }
    report["table"] = table(report)
    return report


MERGE_SECONDS = {
    "task arithmetic": 3.1,
    "grad. matching, diag": 3.7,
    "grad. matching, kfac": 71.7,
    "tsv_merge": 12.4,
    "Fisher averaging": 4.7,
    "RegMean": 32.0,
    "iso_c": 8.1,
    "iso_cts": 22.8,
    "TIES (mergekit)": 21.3,
    "DARE (mergekit)": 13.1,
}
"""Mean wall seconds of one whole-model MiniLM merge per method in Study 1's committed run
(``benchmarks/results/interference-cpu.json``, its ``cli log``; two commands at a time on 2
cores): the merge part of :func:`estimate`'s projection (a merge reads and writes the whole
model whether its inputs are adapters or full checkpoints)."""


def estimate(args: argparse.Namespace) -> dict[str, Any]:
    """The full run's cost on this machine, projected from measured parts: one adapter
    fine-tune of ``--train`` texts × ``--epochs`` at the last level's rank and learning rate
    (on MiniLM with a new head: θ_LLM's cost per pass), one ``gradmerge curvature`` of it per
    structure on ``--curvature-examples`` texts and one ``gradmerge evaluate`` of it on
    ``--test`` texts, each timed (wall and CPU seconds); merges from :data:`MERGE_SECONDS`;
    θ_LLM and F_0 (shared) from the per-text costs. Counts follow :meth:`AdapterStudy.level_seed`
    and :meth:`Study.study1`."""
    import resource
    import subprocess

    from benchmarks.interference_data import build, load
    from benchmarks.paper_recipe import mc_fisher_call, pretrained_folder, subset

    def cpu() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    work = args.work / "estimate"
    shutil.rmtree(work, ignore_errors=True)
    data = load(build(args.work / "data"))
    tokenizer, model = load_classifier(pretrained_folder())
    base = work / "base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    d = ADDED[0]
    train = subset(data[d]["train"], args.train, 0)
    enc = encode(tokenizer, train, args.max_length)
    rank, lr = args.levels[-1]
    measured: dict[str, Any] = {}
    wall, c0 = time.perf_counter(), cpu()
    folder = train_adapter(base, tokenizer, work / d, {d: enc}, {}, rank=rank, lr=lr,
                           epochs=args.epochs, batch_size=args.batch_size, seed=0)  # fmt: skip
    measured["adapter fine-tune"] = {
        "texts × epochs": len(train) * args.epochs,
        "wall seconds": time.perf_counter() - wall,
        "cpu seconds": cpu() - c0,
    }
    exe = [sys.executable, "-m", "gradmerge"]
    fisher = write_jsonl(work / "fisher.jsonl", train[: args.curvature_examples])
    test = write_jsonl(work / "test.jsonl", subset(data[d]["test"], args.test, 0))
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    calls: dict[str, tuple[str | Path, ...]] = {}
    for s in args.structures:
        out = work / f"{s}.safetensors"
        calls[f"curvature {s}"] = mc_fisher_call(folder, fisher, out, s, 0, args.max_length)
    calls["evaluate"] = ("evaluate", folder, test, "--max-length", str(args.max_length),
                         "--batch-size", "64", "--autocast", "bfloat16", "--no-progress")  # fmt: skip
    for name, call in calls.items():
        wall, c0 = time.perf_counter(), cpu()
        done = subprocess.run([*exe, *map(str, call)], capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed: {done.stderr[-2000:]}")
        measured[name] = {"wall seconds": time.perf_counter() - wall, "cpu seconds": cpu() - c0}
    shutil.rmtree(work)
    # the full run's counts (per level and seed unless shared)
    T, A, S = args.datasets, len(args.alphas), len(args.levels) * len(args.seeds)
    # CPU seconds: on a shared machine the wall clock measures the other jobs; on an idle one
    # a one-thread process's wall and CPU seconds agree
    ft = measured["adapter fine-tune"]["cpu seconds"]
    per_text_ft = ft / (len(train) * args.epochs)
    curv = sum(measured[f"curvature {s}"]["cpu seconds"] for s in args.structures)
    per_text_curv = curv / args.curvature_examples
    ev = measured["evaluate"]["cpu seconds"]
    merges = T * (A * MERGE_SECONDS["task arithmetic"] + len(args.data_free) * 12.4)
    merges += T * sum(MERGE_SECONDS[f"grad. matching, {s}"] for s in args.structures)
    extra = ["Fisher averaging", "RegMean", *args.data_free_full]
    extra += ["TIES (mergekit)", "DARE (mergekit)"] if args.mergekit else []
    merges += sum(MERGE_SECONDS.get(m, 12.4) for m in extra)
    tune = T * len(args.criteria) * A * (MERGE_SECONDS["task arithmetic"] + ev)
    models_scored = T * (A + len(args.structures) + len(args.data_free) + 2) + len(extra) + T + 2
    projected = {
        "θ_LLM (shared): full fine-tune, --base-train × --base-epochs texts": per_text_ft
        * args.base_train
        * args.base_epochs,
        "F_0 (shared): whole-model curvatures on N_0/scale texts": per_text_curv
        * args.base_train
        * min(args.train, args.curvature_examples)
        / args.train,
        "adapters: T fine-tunes and the multi-task one, all levels and seeds": S
        * (T * ft + (T + 1) * ft * args.multitask_epochs / args.epochs),
        "curvatures of the adapters": S * T * curv,
        "merges (Study 1's per-method seconds)": S * merges,
        "gradmerge tune": S * tune,
        "evaluations (each model on its sets, two at a time)": S * models_scored * ev / 2,
    }
    projected["total"] = sum(projected.values())
    return {
        "measured": measured,
        "load average at the end": os.getloadavg(),
        "projected seconds (from CPU seconds)": projected,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run in one process, tiny splits")
    p.add_argument(
        "--levels",
        type=parse_level,
        nargs="+",
        default=[(8, 5e-4), (8, 3e-3)],
        metavar="RANK:LR",
        help="adapter rank and learning rate of each level of interference (8:5e-4 8:3e-3)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--train", type=int, default=580, help="training texts per added dataset")
    p.add_argument("--base-train", type=int, default=3000, help="θ_LLM's training texts (N_0)")
    p.add_argument("--val", type=int, default=200)
    p.add_argument("--test", type=int, default=500)
    p.add_argument("--curvature-examples", type=int, default=290)
    p.add_argument("--base-epochs", type=int, default=2)
    p.add_argument("--base-lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--multitask-epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0])
    p.add_argument("--criteria", nargs="+", default=["loss+base"])
    p.add_argument("--structures", nargs="+", default=["diag", "kfac"])
    p.add_argument("--data-free", nargs="*", default=["tsv_merge"])
    p.add_argument("--data-free-full", nargs="*", default=["iso_c", "iso_cts"])
    p.add_argument("--no-mergekit", dest="mergekit", action="store_false")
    p.add_argument("--datasets", type=int, default=len(ADDED), help="datasets added (largest T)")
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--work", type=Path, default=Path("/tmp/adapters"))
    p.add_argument(
        "--out",
        type=Path,
        help="the record's folder (default: benchmarks/results; --quick: a new temporary one)",
    )
    p.add_argument("--stem", default="adapters-cpu")
    p.add_argument(
        "--estimate",
        action="store_true",
        help="time one adapter fine-tune, its curvatures and an evaluation at the configured "
        "size and print the full run's projected cost (no study is run)",
    )
    args = p.parse_args(argv)
    args.out = output(args.out, quick=args.quick, default=RESULTS, name="adapters")
    if args.estimate:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)
        print(json.dumps(estimate(args), indent=1, ensure_ascii=False))
        return 0
    if args.quick:
        args.seeds, args.train, args.val, args.test = [0], 16, 8, 16
        args.curvature_examples, args.epochs, args.base_epochs = 8, 1, 1
        args.base_train, args.multitask_epochs = 32, 1
        args.max_length, args.alphas, args.bootstrap = 16, [0.5, 1.0], 200
        args.structures, args.mergekit, args.datasets = ["diag"], False, 1
        args.data_free, args.data_free_full = [], ["tsv_merge"]
    # what benchmarks.interference.Study reads and this study does not vary
    args.removal_only, args.delta, args.lr = False, 0.0, None
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)
    begin = time.perf_counter()
    settings = vars(args) | {"levels": [level_name(r, lr) for r, lr in args.levels]}
    run = Run("adapters", settings=settings, argv=argv)
    load_avg = [os.getloadavg()]
    study = AdapterStudy(args)
    base = study.base()
    levels: dict[str, list[dict[str, Any]]] = {}
    path = None
    for rank, lr in args.levels:
        name = level_name(rank, lr)
        for seed in args.seeds:
            print(f"{name}, seed {seed}", flush=True)
            levels.setdefault(name, []).append(study.level_seed(rank, lr, seed))
            load_avg.append(os.getloadavg())
            extra = {
                "stage seconds": study.timings,
                "load average (1, 5, 15 min) at start and after each seed": load_avg,
                "cli log": study.log,
            }
            record = run.finish(report_of(levels, base, args.bootstrap, extra, study.data_file))
            path = write_result(
                args.out / f"{args.stem}.json",
                record,
                figure=lambda p, r=record["results"]: plot(r, p),
            )
    assert path is not None
    print(record["results"]["table"], flush=True)
    print(f"\nwrote {path} ({time.perf_counter() - begin:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
