r"""``gradmerge inspect CONFIG.yaml``: the numbers for choosing δ, for exactly the merge a YAML
describes.

The merge is read by the merge's own reader (:class:`~gradmerge.jobs.config.MergeConfig`), its
inputs opened and grouped into units by the engine (:func:`~gradmerge.jobs.opening.open_job`: the
plan of ``gradmerge merge``), and each merged unit's curvature terms built as the dry run builds
them (:mod:`gradmerge.jobs.conditioning`: α_t·scale_t·H_t of every model with a curvature there,
the prior H_0 = δ·I + s·C_0), in float64. The method's own system (the
:class:`~gradmerge.methods.base.MergeMethod` record's ``system``) combines them into the matrix
the merge solves, for ``gradient_matching``

.. math::

    \bar H = \delta I + s\,C_0 + \sum_t \alpha_t\,\mathrm{scale}_t\,H_t .

Reported:

- per unit, the conditioning of that system: [λ_min, λ_max] and κ = λ_max/λ_min, exact where
  the structure gives them (diagonal, dense, one-term K-FAC layers, small multi-term layers),
  else Weyl bounds (``exact`` false: λ_min is a lower and λ_max an upper bound, so κ is an
  upper bound), and each K-FAC term's factor spectra;
- for ``gradient_matching``, over the merged coordinates with H_i = Σ_t α_t scale_t h_{t,i} > 0
  (diagonal entries; K-FAC's stand in for its spectrum, as in
  :mod:`gradmerge.curvature.summary`): the δ window for this YAML's α's, scales and prior
  curvature, and the prior's share s_i = (δ + c_i)/(δ + c_i + H_i) at its δ
  (:class:`~gradmerge.curvature.summary.PriorShare`), streamed with exact percentiles.

Example:
    >>> import tempfile, torch, gradmerge as gm
    >>> from safetensors.torch import save_file
    >>> from gradmerge.jobs import MergeConfig
    >>> with tempfile.TemporaryDirectory() as d:
    ...     save_file({"w": torch.zeros(2)}, f"{d}/base.safetensors")
    ...     save_file({"w": torch.ones(2)}, f"{d}/ft.safetensors")
    ...     _ = gm.Diagonal({"w": torch.tensor([1.0, 4.0])}).save(f"{d}/c.safetensors")
    ...     cfg = MergeConfig.from_dict({"method": "gradient_matching", "base_model": "base.safetensors",
    ...         "models": [{"model": "ft.safetensors", "curvature": "c.safetensors", "scale": 2.0}],
    ...         "prior": {"delta": 2.0}}, root=d)
    ...     report = inspect_config(cfg)
    >>> report["units"][0]["min_eigenvalue"], report["units"][0]["max_eigenvalue"]
    (4.0, 10.0)
    >>> report["prior_share"]["share"]["max"]  # δ/(δ + 2·1)
    0.5
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch

from gradmerge.curvature import Curvature
from gradmerge.curvature.summary import (
    RHO,
    PriorShare,
    diagonal_values,
    factor_spectra,
    kfac_parts,
    max_eigenvalue,
)
from gradmerge.errors import ArgumentError
from gradmerge.jobs.conditioning import _inputs, _term
from gradmerge.jobs.config import MergeConfig
from gradmerge.jobs.opening import open_job
from gradmerge.methods import registry


def inspect_config(
    config: MergeConfig, *, rho: float = RHO, spectra: bool = True
) -> dict[str, Any]:
    """The δ window, the prior's share and each merged unit's conditioning for the merge
    ``config`` describes (module docstring), as plain JSON values: ``method``, ``models``,
    ``prior``, ``units`` (in the plan's order) and, for gradient matching, ``prior_share``.

    Raises:
        ArgumentError: a method that solves no linear system here (task arithmetic; RegMean,
            whose Gram systems ``gradmerge merge --dry-run`` checks).
        FileFormatError, StructureError, MissingInputError: inputs that do not open or fit
            together, as ``gradmerge merge`` would refuse them.
    """
    spec = registry.get(config.method)
    if spec.system is None:
        raise ArgumentError(
            f"method {config.method!r} solves no curvature system that inspect can describe "
            "(task_arithmetic uses no curvature; regmean's Gram systems are checked by "
            "`gradmerge merge CONFIG OUT --dry-run`): inspect a gradient_matching or "
            "fisher_average configuration, or the curvature files themselves"
        )
    system_of = spec.system
    wide = torch.float64
    share = (
        PriorShare(delta=config.prior.delta, rho=rho)
        if "prior" in spec.uses and config.prior is not None
        else None
    )
    bare = replace(config.prior, delta=0.0) if config.prior is not None else None
    units: list[dict[str, Any]] = []
    with ExitStack() as stack:
        job = open_job(config, stack)
        merged = [u for u in job.plan.units if u.merged]
        first = True
        while first or (share is not None and share.wants_pass):
            for unit in merged:
                inputs = _inputs(config, job.curvatures, unit.keys, wide)
                if first:
                    units.append(_conditioning(unit.keys, system_of(inputs), spectra))
                if share is None or not inputs.models:
                    continue
                models = inputs.models
                h = diagonal_values(sum(models[1:], models[0]))
                prior = _term(bare, "prior", job.curvatures, unit.keys, wide)
                c = diagonal_values(prior) if prior is not None else {}
                for key, values in h.items():
                    share.add(values, c.get(key))
            if share is not None:
                share.end_pass()
            first = False
        files = {name: f for name, f in job.curvatures.items()}
    report: dict[str, Any] = {
        "config": str(config.source) if config.source else None,
        "method": config.method,
        "models": [
            {
                "model": str(m.model),
                "curvature": str(m.curvature) if m.curvature else None,
                "alpha": alpha,
                "scale": m.scale,
                "num_examples": _num_examples(files.get(f"models[{t}].curvature")),
            }
            for t, (m, alpha) in enumerate(zip(config.models, config.alphas, strict=True))
        ],
        "prior": None
        if config.prior is None
        else {
            "delta": config.prior.delta,
            "scale": config.prior.scale,
            "curvature": [str(p) for p in config.prior.files],
        },
        "damping": config.damping,
        "units": units,
    }
    if share is not None:
        report["prior_share"] = share.to_json()
    return report


def _conditioning(keys: tuple[str, ...], system: Curvature | None, spectra: bool) -> dict[str, Any]:
    """One unit's system: its structure, [λ_min, λ_max], κ (None where λ_min ≤ 0) and whether
    they are exact (else bounds: κ an upper bound)."""
    row: dict[str, Any] = {"keys": list(keys)}
    if system is None:
        row.update(structure=None, min_eigenvalue=None, max_eigenvalue=None, condition=None)
        return row
    low = float(system.min_eigenvalue())
    high, high_exact = max_eigenvalue(system)
    row.update(
        structure=type(system).__name__,
        min_eigenvalue=low,
        max_eigenvalue=high,
        condition=high / low if low > 0 else None,  # None: singular, or no positive bound
        exact=bool(system.min_eigenvalue_exact and high_exact),
    )
    kfacs = kfac_parts(system)
    if spectra and kfacs:
        row["factors"] = {name: terms for k in kfacs for name, terms in factor_spectra(k).items()}
    return row


def _num_examples(file: Any) -> int | None:
    """The file's recorded ``num_examples`` (checked where it was opened:
    :func:`gradmerge.curvature.io.recorded_examples`), ``None`` without a file."""
    return file.num_examples if file is not None else None
