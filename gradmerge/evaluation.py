"""Accuracy and mean loss of a model on labelled data: the companion of every merge.

For a batch of logits f and targets y (the batches of :mod:`gradmerge.estimate._data`: tensor
``(inputs, targets)`` pairs or Hugging Face dicts with ``labels``), a SCORED POSITION is an entry
of y that is not ``ignore_index``: one per example for a classifier (targets of shape
``(examples,)``), one per predicted token for a causal LM (targets ``(examples, positions)``, the
next tokens). Over all of DATA:

- mean loss  L̄ = (Σ_positions −log softmax(f)_y) / P  (nats per scored position; for a classifier
  the mean per-example cross-entropy, for a causal LM the mean per-token negative log-likelihood,
  whose exp is the perplexity);
- accuracy   A = #{positions with argmax f = y} / P (ties in argmax go to the lowest index, as
  ``torch.argmax``);
- with ``loss="mse"``: L̄ = (Σ_i ½‖f_i − y_i‖²) / N over the N examples, and no accuracy.

Per example i (kept in DATA's order, so that two models scored on the same DATA can be compared
pair by pair, e.g. by a paired bootstrap): the summed loss ℓ_i, the number of correct positions
c_i and of scored positions p_i; for a classifier also the predicted class.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 3)
    >>> with torch.no_grad():
    ...     _ = model.weight.copy_(torch.eye(3, 2)); _ = model.bias.zero_()
    >>> x, y = torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, 0.0]]), torch.tensor([0, 1, 1])
    >>> result = evaluate(model, [(x, y)])
    >>> result.examples, result.accuracy
    (3, 0.6666666666666666)
    >>> result.correct_per_example
    [1, 1, 0]

References:
    Hugging Face transformers' losses (``ForSequenceClassification`` / ``ForCausalLM`` with
    ``labels``), which these figures equal per example (tested in
    ``proofs_tests/commands/test_evaluate_command.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradmerge.errors import ArgumentError, StructureError
from gradmerge.estimate._data import Loss, batches, forward, per_example_loss
from gradmerge.estimate.options import EstimateOptions, LossFunction


@dataclass
class Evaluation:
    """What :func:`evaluate` measured (module docstring).

    Attributes:
        loss: ``"cross_entropy"`` or ``"mse"``.
        token_level: whether the targets were per position (a causal LM) rather than one per
            example (a classifier).
        loss_per_example: ℓ_i, the loss of example i summed over its scored positions.
        correct_per_example: c_i, correct scored positions of example i (cross-entropy only).
        positions_per_example: p_i, scored positions of example i (cross-entropy only).
        predictions: the predicted class of each example (classifiers only).
    """

    loss: str
    token_level: bool = False
    loss_per_example: list[float] = field(default_factory=list)
    correct_per_example: list[int] | None = None
    positions_per_example: list[int] | None = None
    predictions: list[int] | None = None

    @property
    def examples(self) -> int:
        """N, the examples scored."""
        return len(self.loss_per_example)

    @property
    def positions(self) -> int:
        """P, the scored positions (N for a classifier and for mse)."""
        if self.positions_per_example is None:
            return self.examples
        return sum(self.positions_per_example)

    @property
    def mean_loss(self) -> float:
        """L̄: the summed loss over P (module docstring), computed with ``math.fsum``."""
        return math.fsum(self.loss_per_example) / self.positions

    @property
    def accuracy(self) -> float | None:
        """A = correct positions / P; ``None`` for mse."""
        if self.correct_per_example is None:
            return None
        return sum(self.correct_per_example) / self.positions

    def in_order(self, order: Sequence[int]) -> Evaluation:
        """The per-example lists put back in the data's order, when example j was the data's
        example ``order[j]`` (e.g. ``TextBatches.by_length`` of :mod:`gradmerge.io.text_data`).

        Raises:
            ArgumentError: ``order`` is not a permutation of the examples.
        """
        if sorted(order) != list(range(self.examples)):
            raise ArgumentError(
                f"order must be a permutation of the {self.examples} examples scored"
            )

        def restore(values: list[Any] | None) -> list[Any] | None:
            if values is None:
                return None
            out: list[Any] = [None] * len(values)
            for j, index in enumerate(order):
                out[index] = values[j]
            return out

        return Evaluation(
            loss=self.loss,
            token_level=self.token_level,
            loss_per_example=restore(self.loss_per_example) or [],
            correct_per_example=restore(self.correct_per_example),
            positions_per_example=restore(self.positions_per_example),
            predictions=restore(self.predictions),
        )

    def summary(self, *, per_example: bool = False) -> dict[str, Any]:
        """A JSON-able dict: ``examples``, ``positions`` (token level), ``accuracy``,
        ``mean_loss`` (and ``perplexity`` for a causal LM); with ``per_example``, the lists
        ``loss`` (ℓ_i), ``correct`` (c_i; for a classifier 0 or 1), ``positions`` (p_i, token
        level) and ``prediction`` (classifiers)."""
        out: dict[str, Any] = {
            "loss_function": self.loss,
            "level": "token" if self.token_level else "example",
            "examples": self.examples,
        }
        if self.token_level:
            out["positions"] = self.positions
        out["accuracy"] = self.accuracy
        out["mean_loss"] = self.mean_loss
        if self.token_level:
            out["perplexity"] = math.exp(self.mean_loss) if self.mean_loss < 700 else math.inf
        if per_example:
            lists: dict[str, Any] = {"loss": list(self.loss_per_example)}
            if self.correct_per_example is not None:
                lists["correct"] = list(self.correct_per_example)
            if self.token_level and self.positions_per_example is not None:
                lists["positions"] = list(self.positions_per_example)
            if self.predictions is not None:
                lists["prediction"] = list(self.predictions)
            out["per_example"] = lists
        return out


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: Iterable[Any],
    *,
    loss: str = EstimateOptions.loss,
    ignore_index: int = EstimateOptions.ignore_index,
    device: torch.device | None = None,
    autocast: torch.dtype | None = None,
) -> Evaluation:
    """Accuracy and mean loss of ``model`` on ``data`` (module docstring), without gradients.

    The model is used as given (call ``model.eval()`` first for dropout-free scores; the command
    ``gradmerge evaluate`` does). Losses are summed in float64.

    Args:
        model: called as ``model(inputs)`` or ``model(**inputs)``; its output is the logits
            (a tensor, the first of a tuple, or ``.logits``).
        data: batches ``(inputs, targets)`` or dicts with ``labels``.
        loss: ``"cross_entropy"`` (class or token ids as targets) or ``"mse"``.
        ignore_index: targets with this value are not scored (cross-entropy).
        device: move each batch there (the model's device); ``None``: leave them.
        autocast: run the model's forward under ``torch.autocast`` in this dtype
            (``torch.bfloat16`` or ``torch.float16``; the weights stay as they are) and score its
            logits in float32: 3-4x faster on CPUs with AMX and on GPUs, at the price of
            bfloat16's rounding in the logits (a prediction within that rounding of a tie may
            flip). ``None`` (default): the model's own dtype. Weights stored in the other 16-bit
            dtype are refused (:func:`autocast_conflict`; ``gradmerge evaluate`` upcasts them).

    Returns:
        An :class:`Evaluation`.

    Raises:
        ArgumentError: empty data; data in which no position is scored; weights in the other
            16-bit dtype than ``autocast``.
        StructureError: targets that do not fit the logits; batches mixing one target per
            example with per-position targets.
        NonFiniteError: a NaN/Inf loss (the batch is named): never a NaN mean.
    """
    spec = Loss(LossFunction.check(loss, "loss"), ignore_index)
    result = Evaluation(loss=LossFunction.check(loss, "loss").value)
    cross_entropy = result.loss == LossFunction.CROSS_ENTROPY.value
    token_level: bool | None = None
    if autocast not in (None, torch.bfloat16, torch.float16):
        raise ArgumentError(
            f"autocast: expected torch.bfloat16, torch.float16 or None, got {autocast}"
        )
    stored = autocast_conflict(model, autocast)
    if stored is not None:
        name, other = str(autocast).removeprefix("torch."), str(stored).removeprefix("torch.")
        raise ArgumentError(
            f"autocast={autocast}: the model's weights are {other}, which {name} autocast cannot "
            f"run with (torch: 'mixed dtype'); autocast works on float32/float64 weights and on "
            f"{name} ones: pass model.float() (exact) or autocast=torch.{other}"
        )
    for index, inputs, targets in batches(data, device=device):
        kind = (device or _device_of(model)).type
        with torch.autocast(kind, dtype=autocast) if autocast else contextlib.nullcontext():
            outputs = forward(model, inputs)
        if autocast is not None:
            outputs = outputs.float()
        losses = per_example_loss(outputs, targets, spec, batch=index)  # checks shapes, finite
        result.loss_per_example.extend(float(v) for v in losses.double().cpu())
        if not cross_entropy:
            continue
        level = targets.ndim >= 2
        if token_level is not None and level != token_level:
            raise StructureError(
                f"batch {index}: targets of shape {tuple(targets.shape)}, but earlier batches had "
                f"{'per-position' if token_level else 'one-per-example'} targets; every batch "
                "must be scored the same way"
            )
        token_level = level
        scored = (targets != ignore_index).reshape(targets.shape[0], -1)
        predicted = outputs.argmax(dim=-1)
        hits = ((predicted == targets).reshape(targets.shape[0], -1) & scored).sum(dim=1)
        result.correct_per_example = (result.correct_per_example or []) + hits.tolist()
        result.positions_per_example = (result.positions_per_example or []) + scored.sum(
            dim=1
        ).tolist()
        if not level:
            result.predictions = (result.predictions or []) + predicted.reshape(-1).tolist()
    result.token_level = bool(token_level)
    if cross_entropy and result.positions == 0:
        raise ArgumentError(
            f"no position of DATA is scored: every target is ignore_index ({ignore_index}); "
            "check the labels (and --ignore-index)"
        )
    return result


def autocast_conflict(model: nn.Module, autocast: torch.dtype | None) -> torch.dtype | None:
    """The 16-bit dtype of ``model``'s weights that ``torch.autocast`` in ``autocast`` cannot run
    with, else ``None``.

    Autocast casts the inputs of its low-precision ops (matmuls, linear layers) to ``autocast``
    but leaves the other ops (layer norms, softmax) to run on what they get: with weights
    stored in bfloat16 under float16 autocast (or the reverse), a layer norm meets float16
    activations and bfloat16 weights, which torch refuses (``mixed dtype``). Weights in float32
    or float64, or in ``autocast`` itself, work.

    Example:
        >>> import torch
        >>> layer = torch.nn.LayerNorm(3).to(torch.bfloat16)
        >>> autocast_conflict(layer, torch.float16), autocast_conflict(layer, torch.bfloat16)
        (torch.bfloat16, None)
    """
    if autocast is None:
        return None
    other = {torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}.get(autocast)
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.dtype == other:
            return other
    return None


def _device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))
