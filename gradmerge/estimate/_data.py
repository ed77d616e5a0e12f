"""Batches, model outputs and per-example losses shared by the curvature estimators.

Conventions (every estimator follows them):

- ``data`` is an iterable of batches. A batch is ``(inputs, targets)``: ``inputs`` is a tensor
  (called as ``model(inputs)``) or a dict of tensors (``model(**inputs)``); ``targets`` a tensor
  whose first dimension is the batch. A dict batch may instead carry the targets under
  ``"labels"`` (Hugging Face style): ``{"input_ids": ..., "attention_mask": ..., "labels": ...}``.
- An EXAMPLE is one row of a batch (one image, one sequence). Its loss ℓ_i is a SUM over its
  positions/outputs (token-level language modelling sums the token losses of the sequence;
  positions whose target is ``ignore_index`` contribute nothing). Curvatures are SUMS over
  examples: H = Σ_i ∇²ℓ_i, matching the paper's ℓ̄ = Σ_i ℓ_i. A mean-normalised estimate is this
  divided by the number of examples N (``Curvature.num_examples`` records N).
- Losses: ``"cross_entropy"`` (logits over the last dimension; ℓ_i = −Σ_s log p(y_is)) and
  ``"mse"`` (ℓ_i = ½‖f_i − y_i‖², so that its Hessian in f is the identity).
- Model outputs may be a tensor, a tuple (first element used) or an object with ``.logits``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gradmerge.errors import ArgumentError, NonFiniteError, StructureError
from gradmerge.estimate.options import EstimateOptions, LossFunction, LossName

Inputs = Tensor | Mapping[str, Tensor]


@dataclass(frozen=True)
class Loss:
    """Which loss, and which target value marks a position to ignore (cross-entropy only)."""

    name: LossFunction | LossName = EstimateOptions.loss
    ignore_index: int = EstimateOptions.ignore_index

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", LossFunction.check(self.name, "loss"))


def accumulation_dtype(t: Tensor) -> torch.dtype:
    """The dtype curvature sums accumulate in: float32 for 16-bit tensors, else their own."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def batches(
    data: Iterable[Any], *, device: torch.device | None = None
) -> Iterator[tuple[int, Inputs, Tensor]]:
    """Yield ``(index, inputs, targets)``, checking each batch's form; raise on empty data.

    With ``device``, the batch's tensors are moved there (the model's device).
    """
    count = 0
    for index, batch in enumerate(data):
        inputs, targets = split_batch(batch, index)
        if device is not None:
            targets = targets.to(device)
            if isinstance(inputs, Mapping):
                inputs = {
                    k: v.to(device) if isinstance(v, Tensor) else v for k, v in inputs.items()
                }
            elif isinstance(inputs, Tensor):
                inputs = inputs.to(device)
        count += 1
        yield index, inputs, targets
    if count == 0:
        raise ArgumentError("data is empty: expected at least one (inputs, targets) batch")


def split_batch(batch: Any, index: int) -> tuple[Inputs, Tensor]:
    """``(inputs, targets)`` of one batch (see the module docstring for the accepted forms)."""
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise StructureError(
                f"batch {index} is a dict without 'labels': pass (inputs, targets) or a dict "
                "with a 'labels' entry"
            )
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        targets = batch["labels"]
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
    else:
        raise StructureError(
            f"batch {index} must be (inputs, targets) or a dict with 'labels', got "
            f"{type(batch).__name__}{f' of length {len(batch)}' if hasattr(batch, '__len__') else ''}"
        )
    if not isinstance(targets, Tensor):
        raise StructureError(
            f"batch {index}: targets must be a tensor, got {type(targets).__name__}"
        )
    return inputs, targets


def forward(model: nn.Module, inputs: Inputs) -> Tensor:
    """The model's output tensor (logits or predictions) for ``inputs``."""
    out = model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
    if hasattr(out, "logits"):
        out = out.logits
    elif isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, Tensor):
        raise StructureError(f"model returned {type(out).__name__}; expected a tensor of outputs")
    return out


def num_examples(targets: Tensor) -> int:
    """Examples in a batch: its first dimension."""
    return int(targets.shape[0]) if targets.ndim else 1


def check_targets(outputs: Tensor, targets: Tensor, loss: Loss, *, batch: int = 0) -> None:
    """Raise :class:`StructureError` when ``targets`` do not fit ``outputs`` under ``loss``."""
    if loss.name == "cross_entropy":
        if targets.is_floating_point():
            raise StructureError(
                f"batch {batch}: cross_entropy needs integer class targets, got {targets.dtype}; "
                "for regression targets use loss='mse'"
            )
        if outputs.shape[:-1] != targets.shape:
            raise StructureError(
                f"batch {batch}: logits of shape {tuple(outputs.shape)} do not fit targets of "
                f"shape {tuple(targets.shape)}: expected logits (*targets.shape, classes)"
            )
    elif outputs.shape != targets.shape:
        raise StructureError(
            f"batch {batch}: mse needs targets of the outputs' shape {tuple(outputs.shape)}, "
            f"got {tuple(targets.shape)}"
        )


def per_example_loss(outputs: Tensor, targets: Tensor, loss: Loss, *, batch: int = 0) -> Tensor:
    """ℓ_i for each example of the batch, shape ``(B,)``, each a SUM over positions/outputs.

    Raises:
        StructureError: outputs and targets that do not fit the loss (the shapes are named).
        NonFiniteError: a NaN/Inf loss (naming the batch).
    """
    outputs = outputs.float() if outputs.dtype in (torch.float16, torch.bfloat16) else outputs
    check_targets(outputs, targets, loss, batch=batch)
    if loss.name == "cross_entropy":
        flat = nn.functional.cross_entropy(
            outputs.reshape(-1, outputs.shape[-1]),
            targets.reshape(-1),
            ignore_index=loss.ignore_index,
            reduction="none",
        )
        per_example = flat.reshape(targets.shape).reshape(targets.shape[0], -1).sum(dim=1)
    else:
        diff = (outputs - targets.to(outputs.dtype)).reshape(outputs.shape[0], -1)
        per_example = 0.5 * (diff**2).sum(dim=1)
    if not bool(torch.isfinite(per_example).all()):
        raise NonFiniteError(
            f"batch {batch}: the loss is NaN/Inf for {int((~torch.isfinite(per_example)).sum())} "
            "example(s); check the inputs, targets and model weights of that batch"
        )
    return per_example


def sample_targets(
    outputs: Tensor, targets: Tensor, loss: Loss, generator: torch.Generator | None
) -> Tensor:
    """Targets drawn from the model's predictive distribution (for Monte-Carlo Fishers).

    Cross-entropy: y ~ Categorical(softmax(logits)) at every position whose observed target is
    not ``ignore_index`` (ignored positions stay ignored). MSE: y ~ N(f, I).
    """
    outputs = outputs.detach()
    if outputs.dtype in (torch.float16, torch.bfloat16):
        outputs = outputs.float()
    if loss.name == "cross_entropy":
        probs = torch.softmax(outputs.reshape(-1, outputs.shape[-1]), dim=-1)
        draws = torch.multinomial(probs.cpu(), 1, generator=generator).reshape(outputs.shape[:-1])
        draws = draws.to(targets.device, targets.dtype)
        return torch.where(targets == loss.ignore_index, targets, draws)
    noise = torch.randn(outputs.shape, generator=generator, dtype=outputs.dtype)
    return outputs + noise.to(outputs.device)


def loss_gradient(outputs: Tensor, targets: Tensor, loss: Loss, *, batch: int = 0) -> Tensor:
    """``∂(Σ_i ℓ_i)/∂f`` at the (detached) outputs: row ``i`` is ``∇_f ℓ(f_i, y_i)``, zero at
    ignored positions; backpropagated from the outputs it gives every example's loss gradient."""
    f = outputs.detach().requires_grad_(True)
    with torch.enable_grad():
        total = per_example_loss(f, targets, loss, batch=batch).sum()
    return torch.autograd.grad(total, f)[0]
