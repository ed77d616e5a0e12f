r"""The options of a curvature estimate, checked once: :class:`EstimateOptions` and its choices.

Every front end of the estimators builds one :class:`EstimateOptions` and hands it to one path:
``gm.estimate_curvature(model, data, **keywords)`` is
``gm.estimate.estimate_with(model, data, EstimateOptions(**keywords))``,
``gm.distributed.estimate_curvature`` builds the same options on every rank, and
``gradmerge curvature`` builds them from its flags. The checks (and their messages) live here
only; the lower-level estimators (``estimate_diagonal``, ``estimate_dense``,
``estimate_kfac_factors``) check their own keywords with the same functions.

The choices are string-valued enums (:class:`Structure`, :class:`Fisher`, :class:`LossFunction`,
:class:`KFACApprox`): a member equals, hashes and prints as its string, so ``"kfac"`` and
``Structure.KFAC`` are interchangeable everywhere, and the strings recorded in ``C.meta`` (and in
curvature files) are the plain values, as before.

Example:
    >>> from gradmerge.estimate.options import EstimateOptions, Structure
    >>> options = EstimateOptions(structure="kfac", fisher="mc", mc_samples=4)
    >>> options.structure is Structure.KFAC, options.structure == "kfac", options.fisher
    (True, True, 'mc')
    >>> EstimateOptions(structure="kfac", fisher="hessian")
    Traceback (most recent call last):
    ...
    gradmerge.errors.ArgumentError: fisher='hessian' is available for structure='full' (and gm.MatrixFree) only: diagonal and K-FAC estimates are of a Fisher or GGN

References:
    Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate
    Curvature", ICML 2015 (K-FAC); Eschenhagen et al., "Kronecker-Factored Approximate Curvature
    for Modern Neural Network Architectures", NeurIPS 2023 (``expand`` / ``reduce``);
    Kunstner, Balles & Hennig, "Limitations of the Empirical Fisher Approximation", NeurIPS 2019
    (empirical vs. Monte-Carlo Fisher and GGN).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Literal, TypedDict, TypeVar

from gradmerge.errors import ArgumentError
from gradmerge.foundation.settings import IGNORE_INDEX, setting

StructureName = Literal["diag", "kfac", "full"]
FisherName = Literal["empirical", "mc", "ggn"]
"""The curvature types every structure estimates (``"hessian"``: dense estimates only)."""
LossName = Literal["cross_entropy", "mse"]
KFACApproxName = Literal["expand", "reduce"]

MAX_FACTOR_SIDE = 16384
"""Default ``kfac_max_factor_side``, the largest side of a K-FAC factor: 16384² × 4 bytes = 1 GiB
per float32 factor (2 GiB in float64), the most that one layer's A or G may take. It keeps every
layer inside the blocks of common transformers on K-FAC (hidden sizes ≤ 8192, MLP widths ≤ 14336
in LLaMA-2-13B, Mistral-7B, LLaMA-3-8B) and sends their vocabulary-sized output heads (30k–152k:
3.7–92 GB per G) to the diagonal. ``None`` lifts the limit."""

_C = TypeVar("_C", bound="_Choice")


class _Choice(str, Enum):
    """One of a fixed set of strings: equal to its value, and shown as it (``'kfac'``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def check(cls: type[_C], value: object, name: str, allowed: Sequence[_C] | None = None) -> _C:
        """The member ``value`` names (a member or its string), if it is among ``allowed``
        (default: every member).

        Raises:
            ArgumentError: ``{name} must be 'a', 'b' or 'c', got …``.
        """
        choices = list(cls) if allowed is None else list(allowed)
        for member in choices:
            if isinstance(value, str) and value == member.value:
                return member
        names = ", ".join(repr(c.value) for c in choices[:-1]) + f" or {choices[-1].value!r}"
        raise ArgumentError(f"{name} must be {names}, got {value!r}")


class Structure(_Choice):
    """What an estimate is: a diagonal (``gm.Diagonal``), K-FAC (``gm.KFAC``, plus a diagonal
    block for what it does not cover: ``gm.Blocks``) or a dense matrix (``gm.Dense``)."""

    DIAG = "diag"
    KFAC = "kfac"
    FULL = "full"


class Fisher(_Choice):
    """Which curvature: the empirical Fisher Σ_i ∇ℓ_i ∇ℓ_iᵀ (observed targets), the Monte-Carlo
    Fisher (targets drawn from the model), the GGN Σ_i J_iᵀ Λ_i J_i, or the exact Hessian
    (dense estimates only)."""

    EMPIRICAL = "empirical"
    MC = "mc"
    GGN = "ggn"
    HESSIAN = "hessian"


FISHERS = (Fisher.EMPIRICAL, Fisher.MC, Fisher.GGN)
"""The curvature types every structure estimates; ``Fisher.HESSIAN`` joins them for dense
estimates."""


class LossFunction(_Choice):
    """The per-example loss ℓ_i: cross-entropy over the last dimension (a sum over positions,
    ``ignore_index`` left out) or ½‖f_i − y_i‖²."""

    CROSS_ENTROPY = "cross_entropy"
    MSE = "mse"


class KFACApprox(_Choice):
    """K-FAC's treatment of weight sharing (sequence positions, conv locations): ``expand``
    (each position an example of the layer) or ``reduce`` (positions summed first)."""

    EXPAND = "expand"
    REDUCE = "reduce"


def check_fisher(fisher: object, allowed: Sequence[Fisher] = FISHERS) -> Fisher:
    """``fisher`` as a :class:`Fisher` if it names one of ``allowed`` (the estimators' check)."""
    return Fisher.check(fisher, "fisher", allowed)


def check_mc_samples(mc_samples: object, fisher: object | None = None) -> int:
    """``mc_samples`` if it is a positive int; with ``fisher`` given (K-FAC's rule), 1 unless
    ``fisher`` is ``"mc"``.

    Raises:
        ArgumentError: anything else.
    """
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
        raise ArgumentError(
            f"mc_samples must be a positive int (labels drawn per example for fisher='mc'), got "
            f"{mc_samples!r}"
        )
    if fisher is not None and fisher != Fisher.MC and mc_samples != 1:
        raise ArgumentError(
            f"mc_samples={mc_samples} only applies to fisher='mc'; leave it at 1 for "
            f"fisher={fisher!r}"
        )
    return mc_samples


def check_kfac_max_factor_side(value: object) -> int | None:
    """``value`` if it is a usable ``kfac_max_factor_side`` (a positive int, or None: no limit)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError(
            "kfac_max_factor_side must be a positive int (the largest side of a K-FAC factor; "
            f"default {MAX_FACTOR_SIDE}) or None for no limit, got {value!r}"
        )
    return value


def check_params(params: object) -> tuple[str, ...] | None:
    """``params`` (parameter names) as a tuple, or None."""
    if params is None:
        return None
    names: tuple[object, ...] | None = None
    if isinstance(params, Iterable) and not isinstance(params, str):
        names = tuple(params)
    if names is None or not all(isinstance(name, str) for name in names):
        raise ArgumentError(
            f"params must be a list of parameter names, got {params!r}; pass e.g. ['0.weight']"
        )
    return tuple(str(name) for name in names)


@dataclass(frozen=True)
class EstimateOptions:
    r"""How to estimate a curvature H = Σ_i H_i (a SUM over examples): every keyword of
    :func:`gradmerge.estimate_curvature`, checked once, when the options are made.

    A string for a choice is turned into its enum member (equal to the string), ``params`` into
    a tuple; the options are frozen and hashable, so one object serves every call (and every rank
    of :func:`gradmerge.distributed.estimate_curvature`, which compares them across ranks).

    Each field is a setting declared once (:func:`gradmerge.foundation.settings.setting`): its
    meaning, kind, choices and default, which :func:`gradmerge.estimate_curvature`'s keywords, the
    flags of ``gradmerge curvature`` (``Setting.flag``) and docs/config.md's ``estimate`` table read
    (:func:`gradmerge.foundation.settings.declared`; ``python -m gradmerge.commands.reference``
    writes the table).

    Raises:
        ArgumentError: on construction, for an unknown choice, ``fisher="hessian"`` with a
            structure other than ``"full"``, ``params`` with ``"kfac"``, or a count that is not a
            positive int; the message names the option, what it must be and what came.

    Example:
        >>> import torch, gradmerge as gm
        >>> model = torch.nn.Linear(2, 1, bias=False).double()
        >>> X = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> data = [(X, torch.zeros(2, 1, dtype=torch.float64))]
        >>> options = gm.EstimateOptions(fisher="ggn", loss="mse")
        >>> gm.estimate.estimate_with(model, data, options).values["weight"]   # diag(XᵀX)
        tensor([[1., 4.]], dtype=torch.float64)
        >>> gm.EstimateOptions(structure="kfac", params=["weight"])
        Traceback (most recent call last):
        ...
        gradmerge.errors.ArgumentError: params= restricts 'diag' and 'full' estimates; K-FAC covers the model
    """

    structure: Structure | StructureName = setting(
        Structure.DIAG.value,
        "what the estimate is: `diag` (`gm.Diagonal`, one number per parameter), `kfac` "
        "(`gm.KFAC` per Linear, Conv2d, Embedding and GPT-2 Conv1D layer, a diagonal block for "
        "every other parameter: `gm.Blocks`) or `full` (`gm.Dense`, small models only: "
        "`max_params`).",
        kind="choice",
        choices=tuple(Structure),
        flag="--structure",
    )
    fisher: Fisher | FisherName | Literal["hessian"] = setting(
        Fisher.EMPIRICAL.value,
        "which curvature: `empirical` Σ_i ∇ℓ_i ∇ℓ_iᵀ with the observed targets, `mc` with "
        "targets drawn from the model (`mc_samples`, seeded), `ggn` the generalised Gauss-Newton "
        "Σ_i J_iᵀ Λ_i J_i, `hessian` (`structure: full` only) the exact Hessian.",
        kind="choice",
        choices=tuple(Fisher),
        flag="--fisher",
    )
    loss: LossFunction | LossName = setting(
        LossFunction.CROSS_ENTROPY.value,
        "the per-example loss ℓ_i: `cross_entropy` over the last dimension (classifiers, language "
        "models; a sum over positions, `ignore_index` left out) or `mse`, ½‖f_i − y_i‖² "
        "(regression).",
        kind="choice",
        choices=tuple(LossFunction),
        flag="--loss",
    )
    mc_samples: int = setting(
        1,
        "targets drawn per example for `fisher: mc` (`structure: kfac` refuses values other "
        "than 1 with another `fisher`).",
        kind="integer",
        minimum=1,
        flag="--mc-samples",
    )
    seed: int = setting(
        0, "seed of the Monte-Carlo draws (`fisher: mc`).", kind="integer", flag="--seed"
    )
    ignore_index: int = setting(
        IGNORE_INDEX,
        "cross-entropy target value of positions to leave out (PyTorch's convention).",
        kind="integer",
        flag="--ignore-index",
    )
    kfac_approx: KFACApprox | KFACApproxName = setting(
        KFACApprox.EXPAND.value,
        "K-FAC's treatment of weight sharing (sequence positions, conv locations): `expand` "
        "(each position an example of the layer) or `reduce` (positions summed first); "
        "`structure: kfac` only.",
        kind="choice",
        choices=tuple(KFACApprox),
        flag="--kfac-approx",
    )
    params: Sequence[str] | None = setting(
        None,
        "restrict `diag` and `full` to these parameter names (K-FAC covers the whole model and "
        "refuses it).",
        kind="strings",
        default_doc="every trainable parameter",
    )
    max_params: int = setting(
        20_000,
        "the largest model, in parameters, that `structure: full` accepts: its n × n matrix "
        "takes n² × 4 bytes in float32.",
        kind="integer",
        minimum=1,
        flag="--max-params",
    )
    kfac_max_factor_side: int | None = setting(
        MAX_FACTOR_SIDE,
        "`structure: kfac` only: a layer whose A or G factor would have a side larger than "
        "this gets a diagonal block instead (a side n takes n² × 4 bytes per float32 factor), "
        "e.g. an untied vocabulary head; `none` (`None` in Python): no limit.",
        kind="integer",
        minimum=1,
        source="`gradmerge.estimate.options.MAX_FACTOR_SIDE`: 1 GiB per float32 factor, which "
        "keeps the blocks of common transformers on K-FAC",
        flag="--kfac-max-factor-side",
    )
    progress: bool = setting(
        False,
        "print a line per batch (and per layer left to the diagonal) to stderr.",
        kind="flag",
        default_doc="`false` (the command: on, `--no-progress` turns it off)",
    )

    def __post_init__(self) -> None:
        structure = Structure.check(self.structure, "structure")
        fisher = Fisher.check(self.fisher, "fisher")
        if fisher == Fisher.HESSIAN and structure != Structure.FULL:
            raise ArgumentError(
                "fisher='hessian' is available for structure='full' (and gm.MatrixFree) only: "
                "diagonal and K-FAC estimates are of a Fisher or GGN"
            )
        kfac = structure == Structure.KFAC
        checked: dict[str, object] = {
            "structure": structure,
            "fisher": fisher,
            "loss": LossFunction.check(self.loss, "loss"),
            "mc_samples": check_mc_samples(self.mc_samples, fisher if kfac else None),
            "kfac_approx": KFACApprox.check(self.kfac_approx, "kfac_approx"),
            "params": check_params(self.params),
            "kfac_max_factor_side": check_kfac_max_factor_side(self.kfac_max_factor_side),
        }
        if kfac and self.params is not None:
            raise ArgumentError(
                "params= restricts 'diag' and 'full' estimates; K-FAC covers the model"
            )
        for name in ("seed", "ignore_index", "max_params"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ArgumentError(f"{name} must be an int, got {value!r}")
            checked[name] = int(value)  # numpy integers too
        if int(self.max_params) < 1:
            raise ArgumentError(f"max_params must be a positive int, got {self.max_params!r}")
        if not isinstance(self.progress, bool):
            raise ArgumentError(f"progress must be True or False, got {self.progress!r}")
        for name, value in checked.items():
            object.__setattr__(self, name, value)


class EstimateKeywords(TypedDict, total=False):
    """:class:`EstimateOptions`' fields as keywords (the ``**options`` of
    ``gm.distributed.estimate_curvature``, for type checkers)."""

    structure: Structure | StructureName
    fisher: Fisher | FisherName | Literal["hessian"]
    loss: LossFunction | LossName
    mc_samples: int
    seed: int
    ignore_index: int
    kfac_approx: KFACApprox | KFACApproxName
    params: Sequence[str] | None
    max_params: int
    kfac_max_factor_side: int | None
    progress: bool


__all__ = [
    "FISHERS",
    "MAX_FACTOR_SIDE",
    "EstimateKeywords",
    "EstimateOptions",
    "Fisher",
    "KFACApprox",
    "LossFunction",
    "Structure",
    "check_fisher",
    "check_kfac_max_factor_side",
    "check_mc_samples",
    "check_params",
]
