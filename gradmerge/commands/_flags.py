"""The command-line flags several commands share, each declared once.

A flag that two commands define by hand drifts: its help, default or choices differ the day one
of them changes (``--device`` of ``demo`` once listed other values than that of ``curvature``).
Each :class:`Flag` here is the one declaration of such a flag — its names, its argparse keywords
and its help — and every command adds it with :meth:`Flag.add`; where a part of the help names
the command's own thing (the OUT an ``--overwrite`` replaces), the declaration holds a
``{field}`` the command fills, never a second text.

Flags that stand for a setting take their default and choices from that setting's declaration
(:mod:`gradmerge.foundation.settings`; e.g. ``--loss``, ``--ignore-index``: :class:`gradmerge.EstimateOptions`)
where it can be read without torch; where it cannot (``--device``: the merge options' ``device``,
``--timeout``: :data:`gradmerge.distributed.DEFAULT_TIMEOUT`), the value is written here once and
``proofs_tests/docs/test_flags_reference.py`` checks it against the declaration.

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
from dataclasses import dataclass, field
from typing import Any


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
