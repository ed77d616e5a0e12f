r"""Study 1, extended: refinement past a one-shot merge, against the data-free merges, the
multi-task model and a multi-task fine-tune at equal compute.

The question: does data plus curvature beat the best data-free merge (TSV-M, Iso-C) once it is
allowed a few steps, and does it spend those steps better than plain fine-tuning would? Rows added
to Study 1 (:mod:`benchmarks.interference`) at the largest T only (T = 4 in a full run), with
``--refine-steps K`` (default :data:`REFINE_STEPS`, 0 turns them off; ``--quick``: at most 1), every
gradmerge step a CLI call as a user would run it:

- **K-FAC gradient matching + refinement** (Sec. 1.5), ``T=4 | grad. matching (official), kfac +
  refine K``: ``gradmerge refine`` from Study 1's K-FAC merge θ^0 (``--quick``, which has no
  K-FAC curvature: from the diagonal merge, ``structure: diag``), K Newton steps on the merge's
  own objective

  .. math::

      \theta^{k+1} = \theta^k - \big(H_0 + \sum_t H_t(\theta^k)\big)^{-1}
          \Big[H_0(\theta^k - \theta_{LLM}) + \sum_t \nabla\bar\ell_t(\theta^k)\Big],

  H_0 = δ + s·F_0 the merge's prior (``Study.official_prior``: δ = 1 for K-FAC, F_0 on N_0/s of
  θ_LLM's texts scaled by s = N/n), ∇ℓ̄_t and H_t SUMS over the N training texts t was fine-tuned
  on (the study's ``{d}-train.jsonl``; the merge's H_t were sums over n = N/2 of them scaled by
  s, the same scale), H_t the MC-Fisher K-FAC re-estimated at every iterate, at most
  :data:`MAX_BACKTRACKING` trial steps per step (1, ½, ¼: each trial is one gradient pass over
  every task's data, so the budget stays bounded), MC labels seeded by the study's seed.
- **The equal-compute baseline**, ``T=4 | multi-task fine-tune of task arithmetic α=1, kfac +
  refine K's text passes``: the task-arithmetic merge at α = 1 fine-tuned as the multi-task
  model M was trained (AdamW, the study's lr and batch size, bfloat16 autocast, evaluation mode:
  :func:`benchmarks.interference_removal.train_steps`) on M's training texts — the T added sets
  AND θ_LLM's set, shuffled together (the refinement sees θ_LLM's data through F_0 in H_0; the
  fine-tune sees the data itself) — until it has spent the text passes the refinement spent
  (:func:`benchmarks.interference_removal.refine_passes`; it stops at the first batch past them,
  so it spends at most one batch more). α = 1, not the label-free α ``gradmerge tune`` chose:
  α = 1 is task arithmetic's one merge that takes no choice and no data (tune's forward passes
  over the training texts would have to come out of the budget), it is the same start in every
  seed, and the fine-tune, which reads the data, can undo a poor α itself; it is Study 1's own
  ``task arithmetic α=1`` folder.

The row names carry no number that changes between seeds (the pass budget is in the row's
``cost``), so that Study 1 pools them over seeds as it pools every row. Paired intervals
(:func:`pairs`, added to Study 1's ``comparisons``): the refined merge and the baseline each
against TSV-M, Iso-C, Iso-CTS (where the run has them: ``--data-free tsv_merge --data-free-full
iso_c iso_cts``), the multi-task model, and the refined merge against the baseline; both also
against Study 1's usual rows (task arithmetic α = 1, the label-free α, the K-FAC merge).

Cost, in forward-backward passes over texts (one per text per gradient, curvature evaluation or
training step): the refinement's steps (its record's ``passes``: gradient evaluations including
every backtracking trial, and curvature evaluations; the record's own diagnostics — θ_t's
gradient, the mismatch and ‖R‖ at each iterate — are listed beside, not counted), the baseline's
training passes (its ``cost.json``); each also as a fraction of M's training passes and in the
seconds this run measured. Not counted in either: the fine-tunes θ_t, which every merge needs,
and the one-shot merge's curvatures (H_t on N/2 texts per task, F_0), listed in the refined
row's cost. Resumable: the refined folder, its record, the baseline checkpoint (its
``training.json``) and the scores live in ``--work``; a refined folder whose record was made
with other settings is refused, as a checkpoint trained otherwise is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.interference_removal import (
    baseline,
    cost_of,
    evaluations_per_step,
    refine_passes,
    texts_in,
)
from benchmarks.paper_recipe import yaml_dump
from gradmerge.errors import ArgumentError

REFINE_STEPS = 2
"""Refinement steps of a full run (``--refine-steps``); ``--quick`` takes 1."""
MAX_BACKTRACKING = 3
"""Trial points per refinement step (step sizes 1, ½, ¼): a step costs at most 3 gradient passes
over every task's data (the record of the removal study's refinements: up to 13 trials a step at
the default of 30)."""
BATCH_SIZE = 32
"""Texts per batch of the refinement's gradient and curvature passes (sums: the batch changes
their cost in seconds, not their value)."""
BASELINE_ALPHA = 1.0
BASELINE_SEED_OFFSET = 12
"""The baseline fine-tune's seed: study seed · 100 + 12 (the study's fine-tunes use + 0..9,
removal's baselines + 11)."""
RECORD = "gradmerge_refine.json"
DATA_FREE = ("tsv_merge", "iso_c", "iso_cts")
"""The data-free merges the refined merge and the baseline are paired with (where run)."""
MULTI = "multi-task θ_1:T"


def structure_of(structures: list[str]) -> str:
    """The curvature the refinement starts from and re-estimates: K-FAC where the run has it,
    else the run's first (``--quick``: diag).

    Example:
        >>> structure_of(["diag", "kfac"]), structure_of(["diag"])
        ('kfac', 'diag')
    """
    return "kfac" if "kfac" in structures else structures[0]


def refine_method(structure: str, steps: int) -> str:
    """The refined merge's row (method) name.

    Example:
        >>> refine_method("kfac", 2)
        'grad. matching (official), kfac + refine 2'
    """
    return f"grad. matching (official), {structure} + refine {steps}"


def baseline_method(structure: str, steps: int) -> str:
    """The equal-compute baseline's row (method) name: its budget is the refinement's passes,
    named by the refinement, not by their number (which differs between seeds).

    Example:
        >>> baseline_method("kfac", 2)
        "multi-task fine-tune of task arithmetic α=1, kfac + refine 2's text passes"
    """
    return (
        f"multi-task fine-tune of task arithmetic α={BASELINE_ALPHA:g}, "
        f"{structure} + refine {steps}'s text passes"
    )


def pairs(methods: list[str]) -> list[tuple[str, str]]:
    """(method, against) pairs Study 1's ``comparisons`` adds for the rows of this module, among
    ``methods`` (one T's rows): each refined merge against each data-free merge of
    :data:`DATA_FREE`, the multi-task model and each equal-compute baseline; each baseline against
    the data-free merges and the multi-task model. Pairs whose rows are absent are left out.

    Example:
        >>> pairs(["tsv_merge", "multi-task θ_1:T", refine_method("kfac", 2)])
        [('grad. matching (official), kfac + refine 2', 'tsv_merge'), \
('grad. matching (official), kfac + refine 2', 'multi-task θ_1:T')]
    """
    present = set(methods)
    refined = [m for m in methods if " + refine " in m and m.startswith("grad. matching")]
    baselines = [m for m in methods if m.startswith("multi-task fine-tune of task arithmetic")]
    references = [m for m in (*DATA_FREE, MULTI) if m in present]
    out = [(r, a) for r in refined for a in (*references, *baselines)]
    return out + [(b, a) for b in baselines for a in references]


def refine_config(
    *,
    start: Path,
    base: Path,
    tasks: list[tuple[Path, Path]],
    prior: dict[str, Any],
    steps: int,
    structure: str,
    seed: int,
    max_length: int,
) -> dict[str, Any]:
    """The ``gradmerge refine`` YAML of the refined row: from ``start`` (the one-shot merge),
    θ_LLM ``base``, each task's (fine-tune, training-text file), the merge's ``prior``; paths
    absolute (the record holds them so, and a later run compares them).

    Example:
        >>> c = refine_config(start=Path("/w/m"), base=Path("/w/b"), tasks=[(Path("/w/a"),
        ...     Path("/w/a.jsonl"))], prior={"delta": 1.0}, steps=2, structure="kfac", seed=0,
        ...     max_length=64)
        >>> c["models"], c["max_backtracking"], c["fisher"]
        ([{'model': '/w/a', 'data': '/w/a.jsonl'}], 3, 'mc')
    """
    return {
        "start": str(start.absolute()),
        "base_model": str(base.absolute()),
        "models": [{"model": str(m.absolute()), "data": str(d.absolute())} for m, d in tasks],
        "prior": {k: str(Path(v).absolute()) if k == "curvature" else v for k, v in prior.items()},
        "steps": steps,
        "max_backtracking": MAX_BACKTRACKING,
        "structure": structure,
        "fisher": "mc",
        "batch_size": BATCH_SIZE,
        "seed": seed,
        "device": "cpu",
        "text": {"max_length": max_length},
    }


def same_settings(record: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """The keys on which a refine record's ``config`` differs from ``config`` (the YAML this run
    would write): start, models, steps, trials, structure, Fisher, batch size, seed, max length
    and the prior's δ, scale and curvature file (empty: the record answers this run's question).

    Example:
        >>> c = {"start": "/m", "base_model": "/b", "models": [{"model": "/a", "data": "/d"}],
        ...      "prior": {"delta": 1.0}, "steps": 2, "max_backtracking": 3, "structure": "kfac",
        ...      "fisher": "mc", "batch_size": 32, "seed": 0, "text": {"max_length": 64}}
        >>> rec = {"config": c | {"steps": 1, "models": [{"model": "/a", "data": "/d",
        ...        "alpha": 1.0}], "prior": {"delta": 1.0, "scale": 1.0}}}
        >>> same_settings(rec, c)
        ['steps']
    """
    had = record.get("config", {})
    keys = ("start", "base_model", "steps", "max_backtracking", "structure", "fisher",
            "batch_size", "seed")  # fmt: skip
    out = [k for k in keys if had.get(k) != config[k]]
    models = [(m.get("model"), m.get("data")) for m in had.get("models", [])]
    if models != [(m["model"], m["data"]) for m in config["models"]]:
        out.append("models")
    if had.get("text", {}).get("max_length") != config["text"]["max_length"]:
        out.append("text.max_length")
    had_prior, prior = had.get("prior", {}), config["prior"]
    for key, default in (("delta", 0.0), ("scale", 1.0), ("curvature", None)):
        if had_prior.get(key, default) != prior.get(key, default):
            out.append(f"prior.{key}")
    return out


def cost(
    parts: dict[str, tuple[int | None, float | None]], multitask: int | None
) -> dict[str, Any]:
    """A row's cost: the text passes of its ``parts`` (label → (passes, seconds or None)), their
    fraction of the multi-task model's training passes, and the seconds this run measured.

    Example:
        >>> c = cost({"refine": (2320, 60.0)}, 11244)
        >>> c["text passes"], round(c["fraction of the multi-task model's passes"], 4)
        (2320, 0.2063)
    """
    passes = [p for p, _ in parts.values()]
    secs = [s for _, s in parts.values() if s is not None]
    total = None if None in passes else sum(p for p in passes if p is not None)
    return {
        "text passes": total,
        "fraction of the multi-task model's passes": total / multitask
        if total is not None and multitask
        else None,
        "seconds (this run's parts)": sum(secs) if secs else None,
        "parts": {k: {"text passes": p, "seconds": s} for k, (p, s) in parts.items()},
    }


def extend(study: Any, T: int, merged: dict[str, Any]) -> list[dict[str, Any]]:
    """The refined merge's and the baseline's Study 1 rows at ``T`` (the largest) for one seed
    (module docstring), scored on the test sets as Study 1's rows; a step that failed gives a
    row with its reason. ``merged``: Study 1's merges, name → folder or failure."""
    from benchmarks.interference import BASE, failure, row, safe

    args = study.args
    steps = args.refine_steps
    s = structure_of(args.structures)
    tasks = study.added[:T]
    sets = [BASE, *tasks]
    where = study.root / "refine"
    where.mkdir(parents=True, exist_ok=True)
    r_method, b_method = refine_method(s, steps), baseline_method(s, steps)
    r_name, b_name = f"T={T} | {r_method}", f"T={T} | {b_method}"
    m_cost = cost_of(study.multi) or {}
    multitask = m_cost.get("text passes")
    first = merged.get(f"T={T} | grad. matching (official), {s}")
    if not isinstance(first, Path):
        why = (first or {}).get("failed", "not run")
        return [{"T": T, "method": r_method, "failed": f"no one-shot merge to refine: {why}"},
                {"T": T, "method": b_method, "failed": "no refinement to match"}]  # fmt: skip
    # the refinement, from the one-shot merge, on the tasks' training texts
    out = where / safe(r_method)
    config = refine_config(
        start=first,
        base=study.base_dir,
        tasks=[(study.models["a"][d], study.train_files[d]) for d in tasks],
        prior=study.official_prior(s),
        steps=steps,
        structure=s,
        seed=study.seed_id,
        max_length=args.max_length,
    )
    if (out / RECORD).exists():
        differs = same_settings(json.loads((out / RECORD).read_text()), config)
        if differs:
            raise ArgumentError(
                f"{out} was refined with other settings ({', '.join(differs)} differ from this "
                "run's): run with another --work, or move that folder away"
            )
    else:
        path = yaml_dump(config, where / f"{safe(r_method)}.yaml")
        ((result, secs),) = study.cli.run(
            [[study.cli.exe, "refine", str(path), str(out), "--overwrite"]]
        )
        if isinstance(result, Exception):
            why = failure(str(result))
            print(f"    {r_name}: FAILED {why}", flush=True)
            return [{"T": T, "method": r_method, "failed": why},
                    {"T": T, "method": b_method, "failed": "no refinement to match"}]  # fmt: skip
        study.cache[f"{study.seed_id} | {r_name} | seconds"] = secs
        study.save_cache()
    record = json.loads((out / RECORD).read_text())
    passes = refine_passes(record)
    p = record["passes"]
    diagnostics = sum(
        e * g for e, g in zip(p["examples"], p["gradient evaluations, record"], strict=True)
    )
    seconds = study.cache.get(f"{study.seed_id} | {r_name} | seconds")
    r_cost = cost({f"refine: {steps} steps (gradients incl. backtracking, curvatures)":
                   (passes, seconds)}, multitask)  # fmt: skip
    n_f = {d: texts_in(study.fisher_files[d]) for d in tasks}
    n_f0 = texts_in(study.work / "data" / "base-fisher.jsonl")
    r_cost["not counted"] = {
        "the record's diagnostics (θ_t's gradient, mismatch and ‖R‖ at each iterate), "
        "in the seconds": diagnostics,
        "the one-shot merge's curvatures (H_t per task, F_0)": sum(n_f.values()) + n_f0,
        "the fine-tunes θ_t (every merge's)": sum(
            (cost_of(study.models["a"][d]) or {}).get("text passes") or 0 for d in tasks
        ),
    }
    r_facts = {
        "started from": f"T={T} | grad. matching (official), {s}",
        "refine steps": steps,
        "max_backtracking": MAX_BACKTRACKING,
        "refine record": {k: record[k] for k in ("steps", "passes")},
        "gradient evaluations per step": evaluations_per_step(record),
        "cost": r_cost,
    }
    # the baseline: task arithmetic α = 1 fine-tuned on M's training texts for those passes
    ta_name = f"T={T} | task arithmetic α={BASELINE_ALPHA:g}"
    ta = merged.get(ta_name)
    if not isinstance(ta, Path):  # --alphas without 1: the merge, as Study 1 would write it
        ta = study.run_merges({ta_name: {"method": "task_arithmetic",
                                         "base_model": str(study.base_dir),
                                         "models": study.models_of(tasks, alpha=BASELINE_ALPHA)}})[
            ta_name
        ]  # fmt: skip
    items = {r_name: (out, sets)}
    facts = {r_name: r_facts}
    rows: list[dict[str, Any]] = []
    if isinstance(ta, Path):
        train = {d: study.train_set(d, study.seed_id if d != BASE else 0) for d in sets}
        folder = baseline(study, where / f"{safe(b_method)}-{passes}", train, None, passes,
                          study.seed_id * 100 + BASELINE_SEED_OFFSET, start=ta)  # fmt: skip
        c = cost_of(folder) or {}
        b_key = f"{b_name} | {passes} text passes"  # scores keyed by the budget too
        items[b_key] = (folder, sets)
        facts[b_key] = {
            "started from": ta_name,
            "budget: the refinement's text passes": passes,
            "trained on (texts per set)": {d: len(e) for d, e in train.items()},
            "cost": cost({"fine-tune": (c.get("text passes"), c.get("seconds"))}, multitask),
        }
    else:
        rows.append({"T": T, "method": b_method, "failed": f"{ta_name}: {ta['failed']}"})
    test = study.score(items, "test")
    for key in items:
        method = key.split(" | ")[1]
        rows.append(row(T, method, test[key], **facts[key]))
    return rows
