"""The command-line flags several commands share, each declared once.

A flag that two commands define by hand drifts: its help, default or choices differ the day one
of them changes (``--device`` of ``demo`` once listed other values than that of ``curvature``).
Each :class:`Flag` here is the one declaration of such a flag — its names, its argparse keywords
and its help — and every command adds it with :meth:`Flag.add`; where a part of the help names
the command's own thing (the OUT an ``--overwrite`` replaces), the declaration holds a
``{field}`` the command fills, never a second text.

A flag that stands for a setting (:mod:`gradmerge.foundation.settings`, ``Setting.flag``: the
estimator's ``--structure``, ``--mc-samples``, ``--loss``, ... of
:class:`gradmerge.EstimateOptions`) is added by :func:`setting_flag`: its default, choices, type and
help all come from the setting's one declaration, the help being the setting's description in the
command line's words (:func:`setting_help`), so that docs/config.md's table of the setting and
``--help`` say the same. Where a flag's declaration cannot be read without torch (``--device``: the
merge options' ``device``, ``--timeout``: :data:`gradmerge.distributed.DEFAULT_TIMEOUT`), its value
is written here once and ``proofs_tests/docs/test_flags_reference.py`` checks it against the
declaration.

Building the flags imports no torch (printing ``--help`` stays fast).

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(prog="x")
    >>> _ = OVERWRITE.add(p, what="an existing OUT")
    >>> _ = DEVICE.add(p)
    >>> p.parse_args(["--device", "cpu", "--overwrite"])
    Namespace(overwrite=True, device='cpu')
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Any

from gradmerge.foundation.settings import Setting, declared, default_of


@dataclass(frozen=True)
class Flag:
    """One command-line flag: its names, its help (a ``str.format`` template whose fields the
    command fills, if any) and the other keywords of ``argparse.ArgumentParser.add_argument``.

    Attributes:
        names: the option strings, the first the flag's name (``("--device",)``).
        help: what it does, with its default; ``{name}`` fields filled by :meth:`add`.
        options: ``action``, ``type``, ``default``, ``choices``, ``metavar``, ...
    """

    names: tuple[str, ...]
    help: str
    options: dict[str, Any] = field(default_factory=dict)

    def add(self, parser: Any, **fields: str) -> argparse.Action:
        """Add the flag to ``parser`` (a parser or an argument group), its help's ``{name}``
        fields filled from ``fields``."""
        return parser.add_argument(*self.names, help=self.help.format(**fields), **self.options)


DEVICES = ("auto", "cpu", "cuda")
"""``--device``'s choices; ``auto`` is the default, as the merge options' ``device`` key's."""

DEVICE = Flag(
    ("--device",),
    "where the model runs: auto (a GPU if there is one, else the CPU), cpu or cuda; default: "
    f"{DEVICES[0]}",
    {"choices": DEVICES, "default": DEVICES[0]},
)

OVERWRITE = Flag(("--overwrite",), "replace {what}", {"action": "store_true"})
"""``--overwrite``: ``what`` names the output it replaces ("an existing OUT")."""

NO_PROGRESS = Flag(("--no-progress",), "no progress bar", {"action": "store_true"})

TIMEOUT_SECONDS = 1800.0
"""The seconds of :data:`gradmerge.distributed.DEFAULT_TIMEOUT` (that module imports torch)."""

TIMEOUT = Flag(
    ("--timeout",),
    f"seconds a rank waits for the others before failing (default {TIMEOUT_SECONDS:g}{{when}})",
    {"type": float, "default": None},
)
"""``--timeout``; ``when`` says when it applies ("; --distributed" or "")."""

ADAPTER_BASE = Flag(
    ("--adapter-base",),
    "{which}the base model folder it applies to (default: its adapter_config.json's "
    "base_model_name_or_path; a relative one is read relative to the folder holding the adapter"
    "{refused})",
    {"default": None, "metavar": "FOLDER"},
)
"""``--adapter-base``: ``which`` names the adapter ("MODEL is a LoRA adapter: "), ``refused``
says which relative names are refused, if any."""

SHARED = {
    "device": DEVICE,
    "overwrite": OVERWRITE,
    "no_progress": NO_PROGRESS,
    "timeout": TIMEOUT,
    "adapter_base": ADAPTER_BASE,
}
"""Every shared flag, by its argparse ``dest``."""


SETTING_TYPES = {"integer": int, "number": float}
"""The argparse ``type`` of a setting flag, by the setting's kind (a choice is a string)."""


def setting_help(s: Setting, flags: dict[str, str]) -> str:
    """The description of setting ``s`` (``Setting.doc``, markdown) in the command line's words:
    a setting in backticks becomes its flag (``flags``: setting name → flag), ``name: value``
    the flag and its value, other backticks are dropped, and so is the final full stop.

    Example:
        >>> s = Setting("targets per example for `fisher: mc`, at most `max_params`.")
        >>> setting_help(s, {"fisher": "--fisher", "max_params": "--max-params"})
        'targets per example for --fisher mc, at most --max-params'
    """

    def words(match: re.Match[str]) -> str:
        name, colon, value = match.group(1).partition(": ")
        if name in flags:
            return f"{flags[name]} {value}" if colon else flags[name]
        return match.group(1)

    return re.sub(r"`([^`]+)`", words, s.doc).strip().removesuffix(".")


def setting_flag(
    parser: Any, owner: type, name: str, *, aliases: tuple[str, ...] = (), **options: Any
) -> argparse.Action:
    """Add to ``parser`` the flag of setting ``name`` of the configuration dataclass ``owner``
    (its ``Setting.flag``, then ``aliases``), all from the setting's declaration: the default,
    the choices (as strings), the ``type`` (an integer setting parses as ``int``, a number as
    ``float``) and the help, :func:`setting_help` followed by the default.

    ``options``: argparse keywords that replace or add to those (another ``type``, a
    ``metavar``), never the help: a flag's one description is its setting's.

    Example:
        >>> from gradmerge.estimate.options import EstimateOptions
        >>> p = argparse.ArgumentParser(prog="x")
        >>> print(setting_flag(p, EstimateOptions, "seed").help)
        seed of the Monte-Carlo draws (--fisher mc); default: 0
        >>> p.parse_args(["--seed", "3"])
        Namespace(seed=3)
    """
    settings = declared(owner)
    s = settings[name]
    if s.flag is None or "help" in options:
        raise TypeError(f"{owner.__name__}.{name}: a setting with a flag, its help its own")
    default = default_of(owner, name)
    keywords: dict[str, Any] = {"dest": name, "default": default}
    if s.choices:
        keywords["choices"] = tuple(str(choice) for choice in s.choices)
    if s.kind in SETTING_TYPES:
        keywords["type"] = SETTING_TYPES[s.kind]
    keywords.update(options)
    flags = {key: str(other.flag) for key, other in settings.items() if other.flag}
    text = setting_help(s, flags).replace("%", "%%")
    return parser.add_argument(s.flag, *aliases, help=f"{text}; default: {default}", **keywords)
