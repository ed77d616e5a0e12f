"""Settings declared once: a :class:`Setting` record in each configuration dataclass field.

A configuration is a frozen dataclass (:class:`gradmerge.SolverSpec`,
:class:`gradmerge.jobs.MergeConfig`, ...) whose fields are its settings, each declared with
:func:`setting`: the Python default is the field's default, and the :class:`Setting` in the
field's metadata says everything else once — what the value must be (a kind, choices, bounds),
what it means, where its default comes from, its name in the ``gm.*`` rules where that differs,
and whether each method decides on it (the registry, :mod:`gradmerge.methods.registry`). From that
one declaration come:

- the checks and their messages (:func:`check`: what was expected, what came, how to fix it),
  used by the YAML reader (:mod:`gradmerge.jobs.config`) and by :class:`gradmerge.SolverSpec`;
- the method-specific keys of the registry (:data:`gradmerge.jobs.config.KEYS`);
- the keys ``gradmerge merge --help`` lists;
- the tables of docs/config.md (:func:`gradmerge.jobs.reference.tables`, tested equal to the
  page).

Dataclass metadata, not pydantic: the configurations already are frozen dataclasses read by a
strict reader whose messages name the YAML key, the expected value and the fix; pydantic (not a
dependency) would add a package and a second validation layer whose messages would still have to
be rewritten to that form.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Knob:
    ...     level: float = setting(0.5, "how far it is turned.", what="the knob's level", minimum=0.0, maximum=1.0)
    >>> check(declared(Knob)["level"], 2.0, "knob.level")
    Traceback (most recent call last):
    ...
    ValueError: `knob.level` (the knob's level) must be in [0, 1], got 2.0
"""

from __future__ import annotations

import contextlib
import math
import reprlib
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Literal

Kind = Literal[
    "number",
    "integer",
    "flag",
    "choice",
    "strings",
    "path",
    "file",
    "selection",
    "size",
    "device",
    "mapping",
]
REQUIRED: Any = MISSING
"""The default of a setting that must be given."""
IGNORE_INDEX = -100
"""PyTorch's target value of positions a cross-entropy leaves out: the default of the estimator's
``ignore_index`` (:class:`gradmerge.EstimateOptions`) and of the data loaders of
:mod:`gradmerge.io` (which read data without the estimator), declared here, below both."""
PATH_KINDS: tuple[Kind, ...] = ("path", "file", "selection")
"""The kinds whose values name files or folders: every path a setting of these kinds holds (and
every one a ``mapping`` setting's own declarations hold) is an input of the run, which the output
guard protects (:func:`gradmerge.jobs.inputs.path_inputs`; a setting whose type holds a ``Path``
must be declared with one of them: ``proofs_tests/reliability/test_declared_inputs.py``)."""


@dataclass(frozen=True)
class Setting:
    """One setting: what its value must be, what it means and where its default comes from.

    Attributes:
        doc: its meaning, for the docs' table (markdown).
        kind: ``number`` (finite; YAML's ``1e-6`` text read as the number), ``integer`` (a
            whole number), ``flag``, ``choice`` (one of ``choices``), ``strings`` (a list of
            names or globs), ``path`` (a file or folder), ``file``, ``selection`` (a list of
            another configuration's entries, each a 0-based index or a path), ``size`` (bytes
            or ``"5GB"``), ``device`` or ``mapping`` (a nested configuration, read by its own
            declarations).
        what: a short name for messages, e.g. "the prior H_0"; "" for the key alone.
        choices, minimum, maximum, above, below: the allowed values (bounds inclusive for
            ``minimum``/``maximum``, exclusive for ``above``/``below``).
        example: how a valid value looks, added to a refusal ("e.g. 1.0e-6").
        default_doc: the default as the docs state it where the value alone does not say it
            (``None`` defaults, defaults that depend on another setting).
        source: where the default comes from (a paper or implementation), for the docs.
        python: the name of the setting in the in-memory ``gm.*`` rules where it differs.
        per_method: each method of the registry requires, allows or refuses it.
        requires: a method-specific key it goes with: refused by the methods refusing that.
        flag: the command-line flag that sets it (``--max-params``), where a command has one;
            the command takes the flag's default, choices and help (``doc`` in the command
            line's words) from this declaration
            (:func:`gradmerge.commands._flags.setting_flag`).
    """

    doc: str
    kind: Kind = "number"
    what: str = ""
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None
    below: float | None = None
    example: str = ""
    default_doc: str | None = None
    source: str = ""
    python: str | None = None
    per_method: bool = False
    requires: str | None = None
    flag: str | None = None

    def bounds(self) -> str:
        """The allowed range in words ("in [0, 1]", "> 0 and < 1", "≥ 0"); "" if any."""
        low = self.minimum if self.minimum is not None else self.above
        high = self.maximum if self.maximum is not None else self.below
        if self.minimum is not None and self.maximum is not None:
            return f"in [{self.minimum:g}, {self.maximum:g}]"
        parts = []
        if low is not None:
            parts.append(f"{'≥' if self.minimum is not None else '>'} {low:g}")
        if high is not None:
            parts.append(f"{'≤' if self.maximum is not None else '<'} {high:g}")
        return " and ".join(parts)


def setting(default: Any = REQUIRED, doc: str = "", **declared: Any) -> Any:
    """A dataclass field declaring one setting: ``default`` (:data:`REQUIRED`: none) and the
    :class:`Setting` (``doc`` and the other attributes as keywords) in its metadata."""
    meta = {"setting": Setting(doc, **declared)}
    if isinstance(default, (list, dict, set)):
        raise TypeError("a mutable default: use a tuple")
    return field(default=default, metadata=meta)


def declared(cls: Any) -> dict[str, Setting]:
    """The declared settings of a dataclass (or instance), by field name, in field order."""
    return {f.name: f.metadata["setting"] for f in fields(cls) if "setting" in f.metadata}


def default_of(cls: Any, name: str) -> Any:
    """The Python default of setting ``name`` of ``cls`` (:data:`REQUIRED` if it has none)."""
    found: Field[Any] = next(f for f in fields(cls) if f.name == name)
    if found.default_factory is not MISSING:
        return found.default_factory()
    return found.default


def check(s: Setting, value: Any, name: str, error: type[Exception] = ValueError) -> Any:
    """``value`` checked against ``s`` (and normalised: a number as ``float``, an integer as
    ``int``, a list of strings as a tuple); else ``error`` naming ``name``, what was expected,
    what came and, where declared, an example.

    Paths, sizes, devices and mappings are read by the YAML reader (they need its folder); here
    they pass unchecked.
    """
    label = f"`{name}`" + (f" ({s.what})" if s.what else "")
    fix = f" ({s.example})" if s.example else ""
    if s.kind in ("number", "integer"):
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            if s.kind == "integer":
                raise error(
                    f"`{name}` must be a whole number, got the text {shown(value)}: write it "
                    f"without quotes ({name.rpartition('.')[2]}: 10)"
                )
            with contextlib.suppress(ValueError):
                value = float(value)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise error(f"`{name}` must be a finite number, got {shown(value)}{fix}")
        if s.kind == "integer" and value != int(value):
            raise error(f"`{name}` must be a whole number, got {shown(value)}{fix}")
        if not _within(s, value):
            raise error(f"{label} must be {s.bounds()}, got {shown(value)}{fix}")
        return int(value) if s.kind == "integer" else float(value)
    if s.kind == "flag":
        if not isinstance(value, bool):
            raise error(f"`{name}` must be true or false, got {shown(value)}")
        return value
    if s.kind == "choice":
        if value not in s.choices:
            raise error(f"`{name}` must be one of {', '.join(s.choices)}; got {shown(value)}")
        return str(value)
    if s.kind == "strings":
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise error(
                f"`{name}` must be a list of names or globs, e.g. "
                f"[lm_head.weight, '*.rotary_emb.*'], got {shown(value)}"
            )
        return tuple(value)
    return value


def _within(s: Setting, value: float) -> bool:
    return (
        (s.minimum is None or value >= s.minimum)
        and (s.maximum is None or value <= s.maximum)
        and (s.above is None or value > s.above)
        and (s.below is None or value < s.below)
    )


def shown(value: Any, *, quoted: bool = True) -> str:
    """``repr(value)`` shortened for an error message: at most a few levels, items and
    characters, without expanding the value (a YAML alias bomb shares one list a billion times:
    its full repr would never finish)."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxtuple = 2, 4, 4, 4
    short.maxstring = short.maxother = 80
    if isinstance(value, str) and not quoted:
        return value if len(value) <= 80 else value[:77] + "..."
    return short.repr(value)
