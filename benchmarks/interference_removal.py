r"""Study 2, extended: removal from one trained model against retraining, at equal compute.

The question: can a dataset t be taken back out of the multi-task model M (trained on every set)
so that the result lands near the model retrained without t, for a small fraction of retraining's
compute, and ahead of what a practitioner would try with that compute? Rows added to Study 2
(:mod:`benchmarks.interference`), every gradmerge step a CLI call as a user would run it:

- **Eq. 13 with δ chosen without labels**: ``gradmerge remove`` at every δ of
  :data:`LABEL_FREE_DELTAS` the step check accepts; the δ kept is the
  smallest (the largest step) whose predictions on the remaining sets' training texts agree with
  M's on ≥ :data:`~benchmarks.interference.NEGATION_AGREEMENT` (negation's rule; no label read).
- **Koh & Liang with δ chosen without labels**: ``influence_remove`` (the removed set's
  gradient at M, H_rest at M: no fine-tune θ_t, so the cheapest curvature removal) at every δ,
  the δ kept by the same agreement rule; refined as below.
- **Eq. 13 (or Koh & Liang) + refinement** (Sec. 1.5): ``gradmerge refine`` from that removal (and from the one at
  the smallest δ the step check accepts, Study 2's rule, where it differs), :data:`REFINE_STEPS`
  Newton steps on the remaining objective Σ_{d≠t} ℓ̄_d(θ) + ½(δ/s)‖θ − θ_LLM‖² over the remaining
  sets' curvature sample (n texts, the sample of H_rest; s = N_rest/n, so that the prior has
  Eq. 13's relative weight), curvature (MC Fisher, the study's) re-estimated at every iterate.
- **Eq. 13 along a path** (a Newton homotopy): k = :data:`HOMOTOPY_STEPS` steps
  θ_{j+1} = θ_j − (1/k) H̄_j⁻¹ (δ + H_t)(θ_t − θ_j), H̄_j = δ + s·H_rest(θ_j) re-estimated at each
  point (``gradmerge curvature``), each a ``gradmerge remove`` with ``alpha: 1/k`` from θ_j.
- **Baselines at equal compute** (plain torch, as the study's fine-tunes): M fine-tuned on the
  remaining sets alone (AdamW, the study's lr and batch size) for a given number of text passes,
  and NegGrad+ (each step: CE on a batch of the rest − :data:`NEGGRAD_WEIGHT` · CE on a batch of
  t, so one step spends two batches), at :data:`BUDGET_FRACTION` of retraining's passes and at
  the passes of the costliest curvature removal here, capped at retraining's
  (:func:`baseline_budgets`).

Cost: forward-backward passes over texts (one per text per gradient, curvature sample or training
epoch), counted from what each step did (``cost.json`` of a fine-tune, the texts of a curvature
or gradient file, ``passes`` of ``gradmerge refine``'s record), and seconds where this run
measured them. Retraining's cost is the gold model's ``cost.json``. The gold model is never read
to choose a setting.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.interference_data import DATASETS
from benchmarks.paper_recipe import batches, encode, load_classifier, pooled, yaml_dump

LABEL_FREE_DELTAS = (1e-2, 1.0, 1e2, 1e3, 1e4)
"""The δ grid the label-free rule searches: Study 2's (:data:`~benchmarks.interference.
REMOVAL_DELTAS`, where it takes the first δ the step check accepts) widened by two larger δ, so
that the agreement the rule asks for is within the grid's reach (a larger δ takes a shorter step
from M)."""
REFINE_STEPS = 2
HOMOTOPY_STEPS = 2
NEGGRAD_WEIGHT = 1.0
BUDGET_FRACTION = 0.10


def texts_in(path: Path) -> int:
    """Texts of a JSONL file (one per line)."""
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def cost_of(folder: Path) -> dict[str, Any] | None:
    """A checkpoint's ``cost.json`` (None where it was trained before costs were recorded)."""
    f = folder / "cost.json"
    return json.loads(f.read_text()) if f.exists() else None


def train_steps(
    model: Any,
    rest: list[list[tuple[list[int], int]]],
    *,
    texts: int,
    lr: float,
    batch_size: int,
    seed: int,
    forget: list[tuple[list[int], int]] | None = None,
    forget_weight: float = NEGGRAD_WEIGHT,
) -> int:
    """AdamW (no weight decay, bfloat16 autocast, evaluation mode: as the study's
    ``fine_tune``) on batches of the remaining sets, shuffled together epoch after epoch, until
    ``texts`` forward-backward text passes are spent. With ``forget`` (NegGrad+): each step's loss
    is CE(rest batch) − w·CE(forget batch), the forget batches cycled, so a step spends both
    batches' texts. Returns the text passes spent (≥ ``texts`` by less than one step)."""
    torch.manual_seed(seed)
    named = {k: p for k, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(named.values(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    spent, epoch, f_epoch = 0, 0, 0
    f_plan: list[Any] = []

    def ce(b: dict[str, Any]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model.classifier(pooled(model, b))
        return nn.functional.cross_entropy(logits.float(), b["labels"])

    while spent < texts:
        plan = [b for d in rest for b in batches(d, batch_size, seed * 1000 + epoch)]
        rng.shuffle(plan)
        epoch += 1
        for b in plan:
            if spent >= texts:
                break
            loss = ce(b)
            spent += len(b["labels"])
            if forget is not None:
                if not f_plan:
                    f_plan = list(batches(forget, batch_size, seed * 1000 + 500 + f_epoch))
                    f_epoch += 1
                fb = f_plan.pop()
                loss = loss - forget_weight * ce(fb)
                spent += len(fb["labels"])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return spent


def baseline(
    study: Any,
    folder: Path,
    rest: dict[str, list[tuple[str, int]]],
    forget: list[tuple[str, int]] | None,
    texts: int,
    seed: int,
    start: Path | None = None,
) -> Path:
    """``start`` (default: M) trained by :func:`train_steps` into ``folder`` (its
    ``training.json`` records how; a folder trained otherwise is refused, as every checkpoint of
    the study), with ``cost.json``."""
    from benchmarks.interference import done, save

    args = study.args
    start = start or study.multi
    settings = {
        "start": str(start),
        "texts": {d: len(e) for d, e in rest.items()},
        "forget texts": len(forget) if forget is not None else 0,
        "forget weight": NEGGRAD_WEIGHT if forget is not None else 0.0,
        "text passes": texts,
        "lr": args.lr,
        "batch size": args.batch_size,
        "max length": args.max_length,
        "seed": seed,
    }
    if done(folder, settings):
        return folder
    begin = time.perf_counter()
    tok = study.tokenizer
    _, model = load_classifier(str(start))
    spent = train_steps(
        model,
        [encode(tok, e, args.max_length) for e in rest.values()],
        texts=texts,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=seed,
        forget=encode(tok, forget, args.max_length) if forget is not None else None,
    )
    save(model, tok, folder, settings)
    cost = {"text passes": spent, "seconds": time.perf_counter() - begin}
    (folder / "cost.json").write_text(json.dumps(cost, indent=1) + "\n")
    return folder


def seconds_of(study: Any, out: Path) -> float | None:
    """Seconds of the CLI call of this run that wrote ``out`` (None: written by an earlier run)."""
    for entry in reversed(study.log):
        if str(out) in entry["command"].split():
            return float(entry["seconds"])
    return None


def extend(study: Any, ctx: dict[str, Any]) -> tuple[dict[str, tuple[Path, list[str]]], dict]:
    """The extended removal rows of one seed (module docstring): name → (folder, datasets) to
    score with Study 2's rows, and name → facts (cost, δ, choice, records) for their rows.

    ``ctx`` carries Study 2's inputs: ``t``, ``rest`` (remaining set names), ``rem_dir``, ``ft``
    (θ_t), ``curv`` ((who, structure) → file), ``rest_file`` (H_rest's text sample),
    ``rest_scale`` (s), ``grad`` (∇ℓ_t at M over t's training texts, Koh & Liang's)."""
    from benchmarks.interference import NEGATION_AGREEMENT, agree, safe

    args, t, rem_dir = study.args, ctx["t"], ctx["rem_dir"]
    ft, curv, rest_file, s_rest = ctx["ft"], ctx["curv"], ctx["rest_file"], ctx["rest_scale"]
    M, base = str(study.multi), str(study.base_dir)
    n_f = texts_in(rest_file)
    n_t = texts_in(study.fisher_files[t])
    ft_cost = cost_of(ft) or {"text passes": None, "seconds": None}
    gold_cost = cost_of(study.gold) or {"text passes": None, "seconds": None}
    items: dict[str, tuple[Path, list[str]]] = {}
    facts: dict[str, dict[str, Any]] = {}

    def cost(parts: dict[str, tuple[int | None, float | None]]) -> dict[str, Any]:
        passes = [p for p, _ in parts.values()]
        secs = [s for _, s in parts.values()]
        total = sum(passes) if None not in passes else None  # type: ignore[arg-type]
        retrain = gold_cost["text passes"]
        return {
            "text passes": total,
            "fraction of retraining": total / retrain if total and retrain else None,
            "seconds (this run's parts)": sum(x for x in secs if x is not None),
            "parts": {k: {"text passes": p, "seconds": s} for k, (p, s) in parts.items()},
        }

    common = {
        f"θ_t: M fine-tuned on {t}": (ft_cost["text passes"], ft_cost["seconds"]),
        f"H_t at θ_t ({n_t} texts)": (n_t, None),
    }
    facts["gold: retrained without"] = {"cost": cost({"retraining": (
        gold_cost["text passes"], gold_cost["seconds"])})}  # fmt: skip
    best_cost = 0
    n_g = texts_in(study.train_files[t])
    families = [(f, s) for s in args.structures for f in ("Eq. 13", "Koh & Liang")]
    for family, s in families:
        # the rule at every δ; the label-free choice by agreement with M on the rest's texts
        body: dict[str, Any]
        if family == "Eq. 13":  # θ_t and H_t at θ_t: the removed set's fine-tune
            body = {"method": "remove", "model": str(ft), "curvature": str(curv["t", s])}
            parts13 = common | {f"H_rest at M ({n_f} texts)": (n_f, None)}
        else:  # the removed set's gradient at M (its training texts): no θ_t
            body = {"method": "influence_remove", "gradient": str(ctx["grad"])}
            parts13 = {
                f"∇ℓ_t at M ({n_g} texts)": (n_g, None),
                f"H_rest at M ({n_f} texts)": (n_f, None),
            }
        grid = {
            f"from M | {family}, {s} δ={d:g}": body
            | ({"prior": {"delta": d}} if family == "Eq. 13" else {})
            | {
                "base_model": M,
                "remaining": {"delta": d, "curvature": str(curv["rest", s]), "scale": s_rest},
                "_command": "remove",
            }
            for d in LABEL_FREE_DELTAS
        }
        got = study.run_merges(grid, "remove", rem_dir)
        ok = {n: f for n, f in got.items() if isinstance(f, Path)}
        if not ok:
            continue
        pred = study.score(
            {"M": (Path(M), ["rest"])} | {n: (f, ["rest"]) for n, f in ok.items()},
            "agreement",
            study.r_ns,
        )
        agreement = {n: agree(pred["M"]["rest"], pred[n]["rest"]) for n in ok}

        def delta_of(n: str) -> float:
            return float(n.rsplit("δ=", 1)[1])

        keep = [n for n, a in agreement.items() if a >= NEGATION_AGREEMENT]
        chosen = min(keep, key=delta_of) if keep else max(agreement, key=lambda n: agreement[n])
        for n, f in ok.items():
            items[n] = (f, study.sets)
            facts[n] = {
                "δ": delta_of(n),
                "agreement with M on remaining texts": agreement[n],
                "label-free choice": n == chosen,
                "cost": cost(parts13),
            }
        for n, f in got.items():
            if not isinstance(f, Path):
                facts[n] = f
        # from the label-free δ (agreement) and from the smallest δ the step check accepts
        smallest = min(ok, key=delta_of)
        starts = {chosen: "agreement"}
        if smallest != chosen and not args.quick:  # --quick: the label-free start only
            starts[smallest] = "step check"
        for first, rule in starts.items():
            delta = delta_of(first)
            tag = f"{rule} δ={delta:g}"
            # Eq. 13 + refinement on the remaining objective
            steps = 1 if args.quick else REFINE_STEPS  # --quick: one step
            name = f"from M | {family}, {s}, {tag} + refine {steps}"
            out = rem_dir / safe(name)
            config = {
                "start": str(ok[first]),
                "base_model": base,
                "models": [{"model": M, "data": str(rest_file)}],
                "prior": {"delta": delta / s_rest},
                "steps": steps,
                "structure": s,
                "fisher": "mc",
                "batch_size": 32,
                "seed": study.seed_id,
                "device": "cpu",
                "text": {"max_length": args.max_length},
            }
            path = yaml_dump(config, rem_dir / f"{safe(name)}.yaml")
            if not (out / "gradmerge_refine.json").exists():
                ((result, secs),) = study.cli.run(
                    [[study.cli.exe, "refine", str(path), str(out), "--overwrite"]]
                )
                if isinstance(result, Exception):
                    from benchmarks.interference import failure

                    facts[name] = {"failed": failure(str(result))}
                    print(f"    {name}: FAILED {facts[name]['failed']}", flush=True)
                else:
                    study.cache[f"{study.r_ns} | {name} | seconds"] = secs
            if (out / "gradmerge_refine.json").exists():
                record = json.loads((out / "gradmerge_refine.json").read_text())
                steps_passes = refine_passes(record)
                c = cost(
                    parts13
                    | {
                        f"refine: {steps} steps (gradients incl. backtracking, curvatures)": (
                            steps_passes,
                            study.cache.get(f"{study.r_ns} | {name} | seconds"),
                        )
                    }
                )
                items[name] = (out, study.sets)
                facts[name] = {
                    "δ (Eq. 13)": delta,
                    "δ rule": rule,
                    "refine prior δ/s": delta / s_rest,
                    "refine record": {k: record[k] for k in ("steps", "passes")},
                    "gradient evaluations per step": evaluations_per_step(record),
                    "cost": c,
                }
                best_cost = max(best_cost, c["text passes"] or 0)
            # Eq. 13 along a path: k steps of 1/k, H_rest re-estimated at each point
            if family != "Eq. 13":
                continue
            k = HOMOTOPY_STEPS
            name = f"from M | Eq. 13 homotopy k={k}, {s}, {tag}"
            point, parts = Path(M), dict(common)
            path_ok = True
            for j in range(k):
                h_rest = (
                    curv["rest", s] if j == 0 else rem_dir / f"{safe(name)}-rest{j}-{s}.safetensors"
                )
                if j > 0 and not h_rest.exists():
                    study.cli.all(
                        [study.curvature_call(point, rest_file, h_rest, s, study.seed_id)]
                    )
                parts[f"H_rest at point {j} ({n_f} texts)"] = (
                    n_f,
                    seconds_of(study, h_rest) if j > 0 else None,
                )
                step = f"{name} step {j + 1}"
                got = study.run_merges(
                    {
                        step: {
                            "method": "remove",
                            "base_model": str(point),
                            "model": str(ft),
                            "curvature": str(curv["t", s]),
                            "prior": {"delta": delta},
                            "remaining": {
                                "delta": delta,
                                "curvature": str(h_rest),
                                "scale": s_rest,
                            },
                            "alpha": 1.0 / k,
                            "_command": "remove",
                        }
                    },
                    "remove",
                    rem_dir,
                )
                if not isinstance(got[step], Path):
                    facts[name] = {"failed": f"step {j + 1}: {got[step]['failed']}"}
                    path_ok = False
                    break
                point = got[step]
            if path_ok:
                items[name] = (point, study.sets)
                facts[name] = {"δ": delta, "δ rule": rule, "cost": cost(parts)}
                best_cost = max(best_cost, facts[name]["cost"]["text passes"] or 0)
    # baselines at equal compute
    budgets = baseline_budgets(gold_cost["text passes"], best_cost, quick=args.quick)
    rest_train = {d: study.train_set(d, study.seed_id if d != DATASETS[0] else 0)
                  for d in ctx["rest"]}  # fmt: skip
    forget = study.train_set(t, study.seed_id)
    for label, texts in budgets.items():
        for kind, f in (("fine-tune M on the rest", None), ("NegGrad+", forget)):
            name = f"baseline | {kind}, {texts} text passes ({label})"
            folder = baseline(study, rem_dir / safe(name), rest_train, f, texts,
                              study.seed_id * 100 + 11)  # fmt: skip
            c = cost_of(folder) or {}
            items[name] = (folder, study.sets)
            facts[name] = {"cost": cost({kind: (c.get("text passes"), c.get("seconds"))})}
    # the quadratic model's error, measured (a diagnostic, not a cost): the remaining sample's
    # summed gradient ‖Σ_i ∇ℓ_i(θ)‖ at M, at the gold model and at each removal's point. Eq. 13
    # assumes the remaining data's gradient at its point is what its quadratic model says; a
    # point far from stationary on the rest, next to the gold model's own norm, is where it
    # failed. The gold model is read here only, after every choice was made.
    points = {"M (multi-task, all)": Path(M), "gold: retrained without": study.gold}
    points |= {n: f for n, (f, _) in items.items() if not n.startswith("baseline")
               and ("+ refine" in n or "homotopy" in n or facts[n].get("label-free choice"))}  # fmt: skip
    outs, calls = {}, []
    for n, f in points.items():
        outs[n] = rem_dir / f"grad-rest-{safe(n)}.safetensors"
        if not outs[n].exists():
            calls.append(("gradient", f, rest_file, outs[n], "--max-length",
                          str(args.max_length), "--no-progress", "--overwrite"))  # fmt: skip
    study.cli.all(calls)
    for n, out in outs.items():
        facts.setdefault(n, {})["‖Σ ∇ℓ(θ)‖ on the remaining sample"] = gradient_norm(out)
    return items, facts


COSTLIEST = "the costliest curvature removal's"
"""The label of the second baseline budget (a row name: the run in progress caches by it)."""


def baseline_budgets(retrain: int | None, costliest: int, *, quick: bool = False) -> dict[str, int]:
    """Label → text passes of the equal-compute baselines: :data:`BUDGET_FRACTION` of
    retraining's passes, and (not with ``quick``) the costliest curvature removal's, capped at
    retraining's (a baseline that spends more than retraining answers no question retraining
    does not; the label says when the cap applied).

    Example:
        >>> baseline_budgets(9000, 11020)
        {'10% of retraining': 900, "retraining's: the costliest curvature removal's 11020, capped": 9000}
    """
    budgets: dict[str, int] = {}
    if retrain:
        budgets[f"{BUDGET_FRACTION:.0%} of retraining"] = math.ceil(BUDGET_FRACTION * retrain)
    if costliest and not quick:  # --quick: one budget
        if retrain and costliest > retrain:
            budgets[f"retraining's: {COSTLIEST} {costliest}, capped"] = retrain
        else:
            budgets[COSTLIEST] = costliest
    return budgets


def evaluations_per_step(record: dict[str, Any]) -> list[float]:
    """Per task, the gradient evaluations (passes over its data) one refinement step took, on
    average over the record's steps: the line search's trials, without the one at θ^0
    (``gradient evaluations, steps`` counts 1 + Σ_k trials_k; :func:`gradmerge.refine`)."""
    steps = len(record["steps"]) - 1  # the record lists θ^0, …, θ^K
    evaluations = record["passes"]["gradient evaluations, steps"]
    return [(n - 1) / steps for n in evaluations] if steps > 0 else []


def refine_passes(record: dict[str, Any]) -> int:
    """Forward-backward text passes a ``gradmerge refine`` run spent on its steps, from its
    record's ``passes``: Σ_t n_t·(g_t + c_t), n_t the texts of task t's data, g_t its gradient
    evaluations in the steps (the residual at θ^0 and every backtracking trial) and c_t its
    curvature evaluations (one MC-Fisher pass per text per step). The record's own diagnostics
    (θ_t's gradient, the mismatch and ‖R‖ at each iterate) are not the method's cost and are not
    counted.

    Example:
        >>> refine_passes({"passes": {"examples": [580, 491],
        ...     "gradient evaluations, steps": [4, 4], "curvature evaluations": [2, 2]}})
        6426
    """
    p = record["passes"]
    return sum(
        e * (g + c)
        for e, g, c in zip(
            p["examples"], p["gradient evaluations, steps"], p["curvature evaluations"], strict=True
        )
    )


def gradient_norm(path: Path) -> float:
    """‖g‖ of a ``gradmerge gradient`` file (every tensor in it)."""
    from safetensors.torch import load_file

    return math.sqrt(sum(float(v.double().square().sum()) for v in load_file(path).values()))
