r"""Refinement of a merged checkpoint on the tasks' data: ``gradmerge refine CONFIG OUT_DIR``.

Iterative refinement (Sec. 1.5 of the appendix, :func:`gradmerge.refine`) takes a merge θ^0 and
steps towards the multi-task MAP θ_{1:T} = argmin Σ_t α_t ℓ̄_t(θ) + ½‖θ − θ_LLM‖²_{H_0}:

.. math::

    \theta^{k+1} = \theta^k - \big(H_0 + \sum_t \alpha_t H_t(\theta^k)\big)^{-1}
        \Big[H_0(\theta^k - \theta_{LLM}) + \sum_t \alpha_t \nabla\bar\ell_t(\theta^k)\Big],

with each task's gradient and curvature (SUMS over D_t) re-estimated at the iterate θ^k (and a
backtracking on the norm of the bracket, the stationarity residual R). The configuration is a
YAML file (:class:`RefineConfig`): ``start`` (θ^0), ``base_model`` (θ_LLM), ``models`` (each
θ_t with its ``data`` and ``alpha``), ``prior`` (H_0), ``steps`` (k) and how H_t is estimated;
every key, its default and an example are in ``docs/config.md``.

MODEL entries (``start``, ``base_model``, ``models[].model``) are Hugging Face folders or
``module:function`` entry points, DATA entries text (``.jsonl``, ``.csv``/``.tsv``, ``.txt``, a
``datasets`` folder; tokenised with the ``start`` folder's tokenizer), tensor files or entry
points, as for ``gradmerge curvature`` (:mod:`gradmerge.io.sources`); ``text`` takes the keys of
:class:`gradmerge.io.text_data.TextOptions`. Every model must have the parameters of
``start`` (names and shapes).

An entry point runs code (it is imported and called): :meth:`RefineConfig.from_yaml` refuses a
YAML file that names one unless ``allow_entry_points`` (``gradmerge refine
--allow-entry-points``) or the environment variable ``GRADMERGE_ALLOW_ENTRY_POINTS=1`` says to
trust it as a script (``docs/trust.md``); :meth:`~RefineConfig.from_dict`, called from Python
code, is trusted as that code is. Unlike a merge, refinement is not streamed: it holds T + 2 copies
of the parameters (θ^k, θ_LLM, θ_1 … θ_T), the model, and one curvature at a time in memory.

The output folder appears only when everything succeeded (:func:`~gradmerge.io.writer.
staged_output`): θ^k saved as the start model was (``save_pretrained`` for a Hugging Face model,
with the start folder's tokenizer files; ``model.safetensors`` otherwise) and
``gradmerge_refine.json``: the configuration, and per step k = 0 … K the gradient mismatch
‖∇ℓ̄_t(θ^k) − ∇ℓ̄_t(θ_t)‖ per task (Eq. 2), its sum and ‖R(θ^k)‖; and ``passes``, the cost in
forward-backward passes over each D_t (``examples`` per task): gradient evaluations the steps
took (the residual at θ^0 and every backtracking trial), those the record took (θ_t's gradient
and the mismatch and ‖R‖ at each iterate: diagnostics, not the method's cost) and curvature
evaluations (one per step).

Example:
    >>> from gradmerge.jobs.refine import RefineConfig
    >>> cfg = RefineConfig.from_dict({"start": ".", "base_model": ".", "steps": 2,
    ...     "models": [{"model": ".", "data": "a.safetensors"}], "prior": {"delta": 0.1}},
    ...     check_files=False)
    >>> cfg.steps, cfg.structure, cfg.alphas
    (2, 'kfac', [1.0])
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from gradmerge import params as P
from gradmerge._version import __version__
from gradmerge.curvature import Curvature, load_curvature
from gradmerge.diagnostics import gradient_mismatch
from gradmerge.errors import (
    ConfigError,
    EntryPointsNotAllowedError,
    MissingInputError,
    StructureError,
)
from gradmerge.estimate import EstimateOptions, estimate_with, gradient_fn
from gradmerge.estimate.options import Structure
from gradmerge.foundation import guard
from gradmerge.foundation.devices import resolve_device
from gradmerge.foundation.guard import Output
from gradmerge.foundation.settings import REQUIRED, Setting, declared, default_of, setting, shown
from gradmerge.foundation.text import key_list
from gradmerge.io import sources
from gradmerge.io.forms import BATCH_SIZE
from gradmerge.io.reader import ASSET_PATTERNS
from gradmerge.io.text_data import TEXT_SUFFIXES, TextOptions
from gradmerge.io.writer import staged_output
from gradmerge.jobs.inputs import CurvatureTerm
from gradmerge.jobs.options import FromYaml, plain
from gradmerge.jobs.setting_values import read_term
from gradmerge.jobs.yaml_reader import Reader
from gradmerge.merge import refine
from gradmerge.merge.refinement import MAX_BACKTRACKING
from gradmerge.params import Params

RECORD = "gradmerge_refine.json"


MAX_STEPS = 100
"""The most refinement steps one run takes (each re-estimates every task's gradient and
curvature; the appendix's refinement takes a few)."""
ALLOW_ENTRY_POINTS = "GRADMERGE_ALLOW_ENTRY_POINTS"
"""The environment variable that, set to 1, lets YAML files name entry points."""
_ESTIMATE = declared(EstimateOptions)


@dataclass(frozen=True)
class TaskInput:
    """One task: its fine-tuned model θ_t (MODEL), its data D_t (DATA) and its weight α_t; each
    field declared once (docs/config.md's ``refine_models`` table)."""

    model: str = setting(
        REQUIRED, "θ_t, for the gradient mismatch of Eq. 2: a MODEL entry, as `start`.", kind="path"
    )
    data: str = setting(
        REQUIRED,
        "D_t: `.jsonl`/`.csv`/`.tsv`/`.txt` text tokenised with the `start` folder's tokenizer, "
        "a `datasets` folder, a `.safetensors`/`.pt` tensor file, or an entry point.",
        kind="path",
    )
    alpha: float = setting(1.0, "α_t, the task's weight.")


@dataclass(frozen=True, kw_only=True)
class RefineConfig(FromYaml):
    """A refinement: k steps of :func:`gradmerge.refine` from ``start`` (module docstring).

    Each key is declared once (:func:`gradmerge.foundation.settings.setting`): its meaning, checks
    and default, which the reader (:meth:`from_dict`) and docs/config.md's ``refine`` table read;
    the estimator's keys take their choices (and, but for ``structure``, their defaults) from
    :class:`gradmerge.EstimateOptions`."""

    start: str = setting(
        REQUIRED,
        "θ^0, the merge to refine: a MODEL entry, a Hugging Face folder or a `module:function` / "
        "`file.py:function` entry point returning an `nn.Module`. Every model must have the "
        "parameters of `start`. An entry point runs code: a YAML file naming one is refused "
        "unless `--allow-entry-points` or `GRADMERGE_ALLOW_ENTRY_POINTS=1` says to trust it as "
        "a script ([trust.md](trust.md)).",
        kind="path",
    )
    base_model: str = setting(REQUIRED, "θ_LLM: a MODEL entry, as `start`.", kind="path")
    models: tuple[TaskInput, ...] = setting(
        REQUIRED,
        "the tasks: a non-empty list of mappings with the keys of the `models[]` table below.",
        kind="mapping",
    )
    prior: CurvatureTerm = setting(
        REQUIRED, "H_0, a [precision term](#precision-terms-prior-and-remaining).", kind="mapping"
    )
    steps: int = setting(
        REQUIRED,
        "k (each step re-estimates every task's gradient and curvature; refine again from the "
        "output to go further).",
        kind="integer",
        minimum=1,
        maximum=MAX_STEPS,
    )
    max_backtracking: int = setting(
        MAX_BACKTRACKING,
        "trial points per step (step sizes 1, ½, … until ‖R‖ falls; none falls: the step is "
        "not taken). Each is one gradient evaluation per task, so a run costs at most 1 + "
        "steps·max_backtracking passes over each task's data.",
        kind="integer",
        minimum=1,
    )
    structure: str = setting(
        Structure.KFAC.value,
        "how H_t is estimated at each iterate, as `gradmerge curvature`'s `--structure` (the "
        "options of [curvature estimates](#curvature-estimates-gradmerge-curvature-and-gm"
        "estimate_curvature)).",
        kind="choice",
        choices=_ESTIMATE["structure"].choices,
    )
    fisher: str = setting(
        EstimateOptions.fisher,
        "as `--fisher`; `hessian` needs `structure: full`.",
        kind="choice",
        choices=_ESTIMATE["fisher"].choices,
    )
    loss: str = setting(
        EstimateOptions.loss, "as `--loss`.", kind="choice", choices=_ESTIMATE["loss"].choices
    )
    batch_size: int = setting(
        BATCH_SIZE, "rows per batch of a tensor or text DATA file.", kind="integer", minimum=1
    )
    shift_labels: bool = setting(
        False,
        "labels are `input_ids` (Hugging Face's causal-LM convention): shift them left by one.",
        kind="flag",
    )
    ignore_index: int = setting(
        EstimateOptions.ignore_index, "label of positions that count for nothing.", kind="integer"
    )
    seed: int = setting(
        EstimateOptions.seed, "seed of the Monte-Carlo labels (`fisher: mc`).", kind="integer"
    )
    device: str = setting("auto", "`auto`, `cpu`, `cuda`, `cuda:N`.", kind="device")
    text: TextOptions = field(
        default_factory=TextOptions,
        metadata={
            "setting": Setting(
                "how text DATA is read: a mapping with the keys of the `text` table below.",
                kind="mapping",
                default_doc="—",
            )
        },
    )
    source: Path | None = field(default=None, compare=False)

    @property
    def estimate_options(self) -> EstimateOptions:
        """How H_t is re-estimated at each iterate (``gm.estimate_curvature``'s options)."""
        return EstimateOptions(
            structure=self.structure,  # type: ignore[arg-type]  # checked by from_dict
            fisher=self.fisher,  # type: ignore[arg-type]
            loss=self.loss,  # type: ignore[arg-type]
            seed=self.seed,
            ignore_index=self.ignore_index,
        )

    @property
    def alphas(self) -> list[float]:
        """α_t, in the order of ``models``."""
        return [m.alpha for m in self.models]

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain JSON values (paths absolute), for the run's record."""
        skip = ("source", "models", "text")
        out = {f.name: plain(getattr(self, f.name)) for f in fields(self) if f.name not in skip}
        return out | {"models": [asdict(m) for m in self.models], "text": asdict(self.text)}

    _WHAT: ClassVar[str] = "the refine config"

    @classmethod
    def from_yaml(
        cls, path: str | os.PathLike[str], *, allow_entry_points: bool | None = None
    ) -> RefineConfig:
        """Read a refinement YAML file; relative paths are relative to its folder.

        ``allow_entry_points``: accept MODEL/DATA entry points, which run code (module
        docstring); ``None``: only when the environment has ``GRADMERGE_ALLOW_ENTRY_POINTS=1``.

        Raises:
            EntryPointsNotAllowedError: the file names an entry point and they are not allowed.
            ConfigError, MissingInputError: as :meth:`from_dict`.
        """
        config = super().from_yaml(path)
        if allow_entry_points is None:
            allow_entry_points = os.environ.get(ALLOW_ENTRY_POINTS) == "1"
        named = config.entry_points()
        if named and not allow_entry_points:
            raise EntryPointsNotAllowedError(
                f"{path} names Python entry points ({', '.join(f'{k}: {v}' for k, v in named)})"
                ", which gradmerge would import and run, with your permissions, like a script. "
                "If you trust this file as you would a script, pass --allow-entry-points (or "
                f"set {ALLOW_ENTRY_POINTS}=1); otherwise give model folders and data files"
            )
        return config

    def entry_points(self) -> list[tuple[str, str]]:
        """(key, spec) of every MODEL or DATA entry that is a Python entry point."""
        specs = [("start", self.start), ("base_model", self.base_model)]
        for i, m in enumerate(self.models):
            specs += [(f"models[{i}].model", m.model), (f"models[{i}].data", m.data)]
        return [(key, spec) for key, spec in specs if _is_entry_point(spec)]

    @classmethod
    def _read(cls, r: Reader, source: Path | None) -> RefineConfig:
        """The checks of a refinement's keys (:meth:`FromYaml.from_dict`; also: ``steps`` < 1
        is a :class:`ConfigError`)."""
        settings = declared(cls)
        r.allow(*settings)
        task = declared(TaskInput)
        models = []
        for i, entry in enumerate(r.entries("models")):
            m = r.sub(entry, f"models[{i}]")
            m.allow(*task)
            models.append(
                TaskInput(
                    model=_spec(m, "model", "MODEL"),
                    data=_spec(m, "data", "DATA"),
                    alpha=m.number("alpha", default_of(TaskInput, "alpha")),
                )
            )
        prior = read_term(r, "prior", required=True)
        assert prior is not None  # required=True raises instead

        def choice(key: str) -> str:
            return r.choice(key, settings[key].choices, default=default_of(cls, key))

        def integer(key: str) -> int:
            return _integer(r, key, default_of(cls, key), minimum=settings[key].minimum)

        structure, fisher = choice("structure"), choice("fisher")
        if fisher == "hessian" and structure != "full":
            raise ConfigError("`fisher: hessian` needs `structure: full` (diag and kfac are GGNs)")
        return cls(
            start=_spec(r, "start", "MODEL"),
            base_model=_spec(r, "base_model", "MODEL"),
            models=tuple(models),
            prior=prior,
            steps=_steps(r),
            max_backtracking=integer("max_backtracking"),
            structure=structure,
            fisher=fisher,
            loss=choice("loss"),
            batch_size=integer("batch_size"),
            shift_labels=r.flag("shift_labels", default=default_of(cls, "shift_labels")),
            ignore_index=integer("ignore_index"),
            seed=integer("seed"),
            device=r.device("device"),
            text=_text_options(r),
            source=source,
        )


@dataclass(frozen=True)
class RefineReport:
    """What ``run_refine`` wrote: the folder, its files, and the record's ``steps``."""

    out_dir: Path
    files: tuple[Path, ...]
    steps: list[dict[str, Any]]
    seconds: float
    device: str


def run_refine(
    config: RefineConfig,
    out_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> RefineReport:
    """Run ``config.steps`` refinement steps from ``config.start`` and write θ^k to ``out_dir``.

    Args:
        config: the refinement (:class:`RefineConfig`).
        out_dir: the output folder; it must not exist unless ``overwrite``.
        overwrite: replace an existing ``out_dir`` (only once the new output is complete).
        log: receives one line per step (mismatch and ‖R‖).

    Raises:
        OutputExistsError: ``out_dir`` exists and ``overwrite`` is false.
        OutputOverlapError: ``out_dir`` is, lies inside or contains an input (the guard,
            :mod:`gradmerge.foundation.guard`, over :meth:`RefineConfig.inputs`).
        OutputWriteError: ``out_dir`` cannot be written.
        StructureError: a model whose parameters differ from the start's (named).
        ArgumentError, FileFormatError: unusable MODEL/DATA (see :mod:`gradmerge.io.sources`).
        NotPositiveDefiniteError, NonFiniteError: from the solve or the data.
    """
    begin = time.perf_counter()
    target = Path(out_dir).absolute()
    guard.check([Output("OUT_DIR", target, "folder")], config.inputs(), overwrite=overwrite)
    device = resolve_device(config.device)
    say = log if log is not None else (lambda line: None)

    model = sources.load_model(config.start).to(device).eval()
    theta0 = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    if not theta0:
        raise StructureError(f"start {config.start}: the model has no trainable parameters")
    base = _parameters(config.base_model, "base_model", theta0, device)
    finetuned = [
        _parameters(m.model, f"models[{i}].model", theta0, device)
        for i, m in enumerate(config.models)
    ]
    data = [_batches(m.data, config, model) for m in config.models]
    names = list(theta0)
    counts = _Counts(len(data))
    gradients = [
        _cached(
            counts.gradients(
                t,
                gradient_fn(
                    model,
                    d,
                    loss=config.loss,  # type: ignore[arg-type]
                    ignore_index=config.ignore_index,
                    params=names,
                ),
            ),
            ft,
        )
        for t, (d, ft) in enumerate(zip(data, finetuned, strict=True))
    ]
    curvatures = [counts.curvatures(t, _curvature_at(model, d, config)) for t, d in enumerate(data)]
    before = list(counts.gradient)  # θ_t's gradient, for the mismatch only
    prior: float | Curvature = config.prior.delta
    if config.prior.files:  # one file, or several whose sum is the curvature
        parts = [load_curvature(path, like=theta0) for path in config.prior.files]
        prior = config.prior.scale * sum(parts[1:], parts[0]) + config.prior.delta

    iterates = refine(
        theta0,
        base,
        gradients,
        curvatures,
        prior=prior,
        alphas=config.alphas,
        steps=config.steps,
        max_backtracking=config.max_backtracking,
    )
    in_steps = [n - b for n, b in zip(counts.gradient, before, strict=True)]
    steps = []
    for k, theta in enumerate([theta0, *iterates]):
        mismatch = gradient_mismatch(theta, finetuned, gradients, alphas=config.alphas)
        residual = _residual(theta, base, gradients, prior, config.alphas)
        steps.append(
            {
                "step": k,
                "mismatch": mismatch.norms,
                "mismatch_total": mismatch.total,
                "residual": residual,
            }
        )
        say(f"step {k}: mismatch Σ‖Δ_t‖ = {mismatch.total:.6g}, ‖R‖ = {residual:.6g}")

    with torch.no_grad():
        for key, value in iterates[-1].items():
            model.get_parameter(key).copy_(value)
    with staged_output(target, overwrite=overwrite) as stage:
        written = _save(model, stage, config.start)
        seconds = time.perf_counter() - begin
        record = {
            "gradmerge_version": _version(),
            "torch_version": torch.__version__,
            "command": "refine",
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": str(device),
            "config": config.to_dict(),
            "steps": steps,
            "passes": {
                "examples": [_examples(d) for d in data],
                "gradient evaluations, steps": in_steps,
                "gradient evaluations, record": [
                    n - k for n, k in zip(counts.gradient, in_steps, strict=True)
                ],
                "curvature evaluations": list(counts.curvature),
            },
            "seconds": seconds,
        }
        (stage / RECORD).write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
        names_out = [*written, RECORD]
    return RefineReport(
        out_dir=target,
        files=tuple(target / n for n in names_out),
        steps=steps,
        seconds=seconds,
        device=str(device),
    )


# ----- inputs ---------------------------------------------------------------------------------
def _spec(r: Reader, key: str, what: str) -> str:
    """A MODEL or DATA entry: a path (made absolute against the config's folder; it must exist)
    or a ``module:function`` / ``file.py:function`` entry point (a relative file likewise)."""
    value = r.data.get(key)
    if value is None:
        raise ConfigError(f"{r.where} needs `{key}`")
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"`{key}` in {r.where} must be a path or module:function, got {shown(value)}"
        )
    is_file = what == "DATA" and value.endswith((*sources.TENSOR_SUFFIXES, *TEXT_SUFFIXES))
    path = (r.root / Path(value).expanduser()).absolute()
    if ":" in value and not is_file and not path.exists():
        module, _, attr = value.rpartition(":")
        if module.endswith(".py") and not Path(module).is_absolute():
            module = str((r.root / module).absolute())
        return f"{module}:{attr}"
    if r.check_files and not (path.is_file() if is_file else path.exists()):
        raise MissingInputError(
            f"`{key}` in {r.where}: no {'file' if is_file else 'folder'} at {path}"
        )
    return str(path)


def _text_options(r: Reader) -> TextOptions:
    """The ``text`` mapping: fields and limits of text DATA (:class:`TextOptions`)."""
    if "text" not in r.data:
        return TextOptions()
    t = r.sub(r.data["text"], "text")
    settings = declared(TextOptions)
    t.allow(*settings)
    values: dict[str, Any] = {}
    for name, s in settings.items():
        if name not in t.data:
            continue
        if s.kind == "integer":
            values[name] = _integer(t, name, None, minimum=s.minimum)
        elif not isinstance(t.data[name], str) or not t.data[name]:
            raise ConfigError(f"`text.{name}` must be a field name, got {shown(t.data[name])}")
        else:
            values[name] = t.data[name]
    return TextOptions(**values)


def _steps(r: Reader) -> int:
    steps = _integer(r, "steps", REQUIRED, minimum=declared(RefineConfig)["steps"].minimum)
    if steps > MAX_STEPS:
        raise ConfigError(
            f"`steps` must be at most {MAX_STEPS}, got {steps}: each step re-estimates every "
            "task's gradient and curvature. To go further, refine again from the output folder "
            "(`start:` it)"
        )
    return steps


def _integer(r: Reader, key: str, default: Any, *, minimum: float | None = None) -> int:
    value = r.data.get(key, default)
    if value is REQUIRED:
        raise ConfigError(f"{r.where} needs `{key}`")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"`{key}` must be an integer, got {shown(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"`{key}` must be at least {minimum:g}, got {value}")
    return value


def _is_entry_point(spec: str) -> bool:
    return ":" in spec and not Path(spec).exists()


def _parameters(spec: str, key: str, like: Params, device: torch.device) -> dict[str, Tensor]:
    """The parameters of the model ``spec`` that ``like`` (the start's) names, checked to match."""
    model = sources.load_model(spec)
    own = {k: v for k, v in model.named_parameters() if v.requires_grad}
    missing = [k for k in like if k not in own]
    if missing or len(own) != len(like):
        extra = [k for k in own if k not in like]
        raise StructureError(
            f"`{key}` ({spec}) does not have the parameters of `start`: "
            + (f"missing {key_list(missing, 4)}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"not in start {key_list(extra, 4)}" if extra else "")
            + ". Every model must be the same architecture as the merge"
        )
    out = {k: own[k].detach().to(device=device, dtype=like[k].dtype) for k in like}
    P.check_compatible(like, out, ref_name="start", name=f"`{key}`")
    return out


def _batches(spec: str, config: RefineConfig, model: nn.Module) -> list[Any]:
    """DATA as a list of batches (refinement passes over it many times); text is tokenised
    with the start folder's tokenizer."""
    tokenizer = config.start if Path(config.start).is_dir() else None
    data: Iterable[Any] = sources.load_data(
        spec,
        batch_size=config.batch_size,
        shift_labels=config.shift_labels,
        ignore_index=config.ignore_index,
        max_examples=config.text.max_examples,
        model=model,
        tokenizer=tokenizer,
        text=config.text,
    )
    return list(data)


class _Counts:
    """How often each task's gradient and curvature were evaluated: each evaluation is one
    forward-backward pass over every example of D_t (the cost of a refinement, in passes)."""

    def __init__(self, tasks: int) -> None:
        self.gradient = [0] * tasks
        self.curvature = [0] * tasks

    def gradients(
        self, t: int, fn: Callable[[Params], dict[str, Tensor]]
    ) -> Callable[[Params], dict[str, Tensor]]:
        def counted(theta: Params) -> dict[str, Tensor]:
            self.gradient[t] += 1
            return fn(theta)

        return counted

    def curvatures(
        self, t: int, fn: Callable[[Params], Curvature]
    ) -> Callable[[Params], Curvature]:
        def counted(theta: Params) -> Curvature:
            self.curvature[t] += 1
            return fn(theta)

        return counted


def _examples(batches: list[Any]) -> int:
    """Examples in a list of batches (the leading size of each batch's first tensor)."""
    total = 0
    for b in batches:
        first = next(iter(b.values())) if isinstance(b, dict) else b[0]
        total += int(first.shape[0])
    return total


def _cached(
    gradient: Callable[[Params], dict[str, Tensor]], finetuned: Params
) -> Callable[[Params], dict[str, Tensor]]:
    """``gradient``, computed once at θ_t (the same dict object every mismatch passes), and
    reused at the point it was last evaluated at when asked again for that same dict object (the
    record asks twice per iterate, for the mismatch and for ‖R‖: one pass over D_t, not two).
    A point is the same only if it is the same object, never by value: a refinement step builds
    a new dict, so nothing stale is returned."""
    at_finetuned = gradient(finetuned)
    last: list[tuple[Params, dict[str, Tensor]]] = []

    def at(theta: Params) -> dict[str, Tensor]:
        if theta is finetuned:
            return at_finetuned
        if last and last[0][0] is theta:
            return last[0][1]
        value = gradient(theta)
        last[:] = [(theta, value)]
        return value

    return at


def _curvature_at(
    model: nn.Module, data: list[Any], config: RefineConfig
) -> Callable[[Params], Curvature]:
    """θ ↦ H_t(θ): the model's weights set to θ, then ``gm.estimate_curvature`` on D_t."""
    options = config.estimate_options

    def at(theta: Params) -> Curvature:
        with torch.no_grad():
            for key, value in theta.items():
                model.get_parameter(key).copy_(value)
        return estimate_with(model, data, options)

    return at


def _residual(
    theta: Params,
    base: Params,
    gradients: Sequence[Callable[[Params], dict[str, Tensor]]],
    prior: float | Curvature,
    alphas: Sequence[float],
) -> float:
    """‖R(θ)‖ = ‖H_0(θ − θ_LLM) + Σ_t α_t ∇ℓ̄_t(θ)‖, zero at the multi-task MAP."""
    diff = P.sub(theta, base)
    out = P.scale(prior, diff) if isinstance(prior, float) else prior.mv(diff)
    for alpha, grad in zip(alphas, gradients, strict=True):
        out = P.axpy(alpha, grad(theta), out)
    return P.norm(out)


# ----- output ---------------------------------------------------------------------------------
def _save(model: nn.Module, stage: Path, start: str) -> list[str]:
    """Save the refined model into ``stage`` as the start model was; returns the file names."""
    save_pretrained = getattr(model, "save_pretrained", None)
    if callable(save_pretrained) and Path(start).is_dir():
        save_pretrained(stage, safe_serialization=True)
        for asset in sorted(Path(start).iterdir()):  # tokenizer files, not written above
            fresh = asset.is_file() and not (stage / asset.name).exists()
            if fresh and any(fnmatch.fnmatch(asset.name, p) for p in ASSET_PATTERNS):
                shutil.copyfile(asset, stage / asset.name)
    else:
        from safetensors.torch import save_model

        save_model(model, str(stage / "model.safetensors"))
    return sorted(p.name for p in stage.iterdir())


def _version() -> str:
    return __version__
