"""The inputs a job's YAML names: a merge's models (:class:`ModelInput`), a precision term
(:class:`CurvatureTerm`), the files and folders they name for the output guard
(:func:`path_inputs`), and the warning on a checkpoint listed as several models.

Each key is declared once, as a field with its :class:`~gradmerge.foundation.settings.Setting`. A
merge's configuration (:mod:`gradmerge.jobs.config`) holds its models, merges and removals hold
precision terms (refine's too: :mod:`gradmerge.jobs.refine`); :func:`path_inputs` walks any of them.

Example:
    >>> term = CurvatureTerm(delta=1e-6, curvature=(Path("a.safetensors"), Path("b.safetensors")))
    >>> [(i.role, i.path.name) for i in path_inputs(term, "remaining")]
    [('remaining.curvature[0]', 'a.safetensors'), ('remaining.curvature[1]', 'b.safetensors')]
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from gradmerge.errors import InputWarning
from gradmerge.foundation.guard import Input
from gradmerge.foundation.settings import REQUIRED, setting


@dataclass(frozen=True)
class ModelInput:
    """One fine-tuned model θ_t of a merge, its curvature H_t and its weight α_t (each field
    declared once: :mod:`gradmerge.foundation.settings`)."""

    model: Path = setting(
        REQUIRED,
        "θ_t: a `.safetensors` file, a shard folder, a Hugging Face folder or a PEFT LoRA "
        "adapter folder (applied over `base_model`).",
        kind="path",
        what="the fine-tuned model θ_t",
    )
    curvature: Path | None = setting(
        None,
        "H_t: a curvature file (`gradmerge curvature`, `C.save`).",
        kind="file",
        what="the curvature H_t",
        per_method=True,
    )
    alpha: float = setting(1.0, "α_t, the task's weight.", python="`alphas=[...]` (one per model)")
    scale: float = setting(
        1.0,
        "multiplies H_t (not α_t): a curvature summed over n of the task's N examples, or a "
        "mean Fisher, stands for the task's N_t·F_t at `scale: N/n` (or N).",
        what="the factor on the curvature H_t, e.g. N/n for a curvature summed over n of the "
        "task's N examples",
        above=0.0,
        python="`curvatures=[scale * C, ...]`",
        requires="curvature",
    )
    adapter_base: Path | None = setting(
        None,
        "when `model` is a LoRA adapter whose relative `base_model_name_or_path` cannot be "
        "told apart, the base it was trained on; it must hold `base_model`'s weights "
        "(`gradmerge.io.sources.adapter_base`).",
        kind="path",
        requires="model",
    )


@dataclass(frozen=True)
class CurvatureTerm:
    """A precision δ·I + scale·C: a prior H_0, or the remaining curvature H̄_\\t of a removal.

    ``curvature`` is one file, or several whose SUM is C (YAML: a list), e.g. the per-task
    curvatures of the tasks that stay in a merge when one is removed.
    """

    delta: float = setting(0.0, "δ ≥ 0.", minimum=0.0, python="`prior=δ` (a float)")
    curvature: Path | tuple[Path, ...] | None = setting(
        None,
        "C: one curvature file, or a list of files whose SUM is C (e.g. the per-task "
        "curvatures of the tasks that stay); a list must not be empty.",
        kind="file",
        python="`prior=δ + s * C` (a curvature)",
    )
    scale: float = setting(1.0, "s ≥ 0.", minimum=0.0)

    @property
    def files(self) -> tuple[Path, ...]:
        """The curvature files whose sum is C (none, one or several)."""
        if self.curvature is None:
            return ()
        return self.curvature if isinstance(self.curvature, tuple) else (self.curvature,)


NOT_KEYS = ("source", "also_reads")
"""Fields of a configuration that are no YAML key: the file it was read from, and the inputs of
the file it was made from (:attr:`gradmerge.jobs.options.Options.also_reads`)."""

_SPEC_KEYS = ("start", "base_model", "model", "data")
"""Keys whose string values are MODEL/DATA specs (a path or an entry point; refine's YAML)."""


def path_inputs(value: Any, key: str) -> list[Input]:
    """The inputs named by ``value`` (a path, a spec under a key of :data:`_SPEC_KEYS`, or a
    tuple or dataclass of them), each under its YAML key; a ``model`` with the LoRA adapter base
    given beside it (``adapter_base``)."""
    from gradmerge.io.sources import spec_inputs

    if isinstance(value, Path) or (isinstance(value, str) and key.rpartition(".")[2] in _SPEC_KEYS):
        return spec_inputs(key, value)
    if isinstance(value, (tuple, list)):
        return [i for n, item in enumerate(value) for i in path_inputs(item, f"{key}[{n}]")]
    if not is_dataclass(value):
        return []
    found: list[Input] = []
    for f in fields(value):
        item, sub = getattr(value, f.name), f"{key}.{f.name}" if key else f.name
        if f.name == "model" and item is not None:
            found += spec_inputs(sub, item, base=getattr(value, "adapter_base", None))
        elif f.name not in NOT_KEYS:
            found += path_inputs(item, sub)
    return found


def warn_repeated(models: tuple[ModelInput, ...], check_files: bool) -> None:
    """Warn, once, when a checkpoint is listed as several models: it is then merged as many
    times, as one model with the sum of their weights — rarely what was meant. One warning
    names every repeated checkpoint with its count (not one per repetition)."""
    listed: dict[Path, list[int]] = {}
    for i, m in enumerate(models):
        listed.setdefault(m.model.resolve() if check_files else m.model, []).append(i)
    repeated = [indices for indices in listed.values() if len(indices) > 1]
    if not repeated:
        return
    parts = []
    for indices in repeated[:3]:
        names = [f"models[{i}].model" for i in indices]
        shown = " and ".join(names) if len(names) == 2 else ", ".join(names[:3])
        if len(names) > 3:
            shown += f", ... ({len(names) - 3} more)"
        alpha = sum(models[i].alpha for i in indices)
        parts.append(
            f"{shown} are the same checkpoint ({models[indices[0]].model}), "
            f"listed {len(indices)} times: it is merged {len(indices)} times, as if listed once "
            f"with alpha {alpha:g}"
        )
    more = f"; and {len(repeated) - 3} more repeated checkpoint(s)" if len(repeated) > 3 else ""
    warnings.warn(
        "; ".join(parts) + more + ". List each checkpoint once (with the summed `alpha` if that "
        "is meant)",
        InputWarning,
        stacklevel=4,
    )
