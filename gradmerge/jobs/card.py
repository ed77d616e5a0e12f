"""The model card of an output folder: a README.md that the Hugging Face Hub reads.

Every folder that ``gradmerge merge`` and ``gradmerge remove`` write (and ``gradmerge tune
--out-dir``, which merges the same way) holds a README.md built from the run's record
(``gradmerge_<command>.json``, :meth:`gradmerge.jobs.job.Job.record`): a YAML front matter
with the Hub's model-card metadata, then the method, the inputs with their fingerprints, the
configuration and the solver's certificates.

Front matter (what ``huggingface_hub.ModelCard.load`` / ``metadata_load`` parse):

- ``base_model``: every input checkpoint, the base first (the Hub lists a model with several
  ``base_model`` entries and the ``merge`` tag as a merge of them). An input is named by its Hub
  id when its path is a Hub cache snapshot (``.../models--ORG--NAME/snapshots/...``), else by
  its folder's (or file's) name: replace those with Hub ids before pushing, since the Hub
  accepts only model ids there;
- ``tags``: ``gradmerge``, the method (``gradient-matching``, ``task-arithmetic``, ...) and, for
  a merge, ``merge``;
- ``library_name: transformers`` when the base is a Hugging Face folder (it has a config.json).

The base folder's own README.md (the base model's card) is never copied: it describes another
model. The card says so when there is one, so that its license and citation can be carried over
by hand.

Example:
    >>> record = {"command": "merge", "method": "task_arithmetic", "gradmerge_version": "1.0",
    ...           "effective_alphas": [1.0], "config": {"scale": 1.0},
    ...           "inputs": {"base_model": {"path": "/m/base", "fingerprint_sha256": "ab",
    ...                                     "header_sha256": "cd"},
    ...                      "models[0].model": {"path": "/m/ft", "fingerprint_sha256": "ef",
    ...                                          "header_sha256": "01"}}}
    >>> text = model_card(record, config_yaml="method: task_arithmetic\\n", library="transformers")
    >>> print(text.split("---")[1].strip())
    base_model:
    - base
    - ft
    library_name: transformers
    tags:
    - gradmerge
    - task-arithmetic
    - merge
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from gradmerge.errors import ArgumentError

README = "README.md"
"""The card's file name, as the Hub expects it."""

_HUB_CACHE = re.compile(r"models--(?P<org>[^/\\]+?)--(?P<name>[^/\\]+)$")


def hub_name(path: str | Path) -> str:
    """How the card names an input: its Hub id when ``path`` lies in a Hub cache snapshot
    (``models--ORG--NAME/snapshots/REV``), else its folder's or file's name (without
    ``.safetensors``).

    Example:
        >>> hub_name("/cache/hub/models--bert-base--uncased/snapshots/abc123")
        'bert-base/uncased'
        >>> hub_name("/cache/hub/models--gpt2/snapshots/abc123"), hub_name("runs/ft-a.safetensors")
        ('gpt2', 'ft-a')
    """
    path = Path(path)
    for part in (path, *path.parents):
        match = _HUB_CACHE.search(part.name)
        if match:
            return f"{match['org']}/{match['name']}"
        if part.name.startswith("models--"):
            return part.name.removeprefix("models--")
    return path.stem if path.suffix == ".safetensors" else path.name


_CONTROL = {i: f"\\x{i:02x}" for i in (*range(0x20), 0x7F)} | {
    ord("\n"): "\\n",
    ord("\r"): "\\r",
    ord("\t"): "\\t",
}
"""Control characters as escapes (a newline as the two characters ``\n``): one line stays one
line."""
_ACTIVE = re.compile(r"([\\`*_\[\]<>&~])")
"""The characters that start inline Markdown: emphasis, code, links, HTML, entities,
strikethrough (and the backslash that escapes them)."""


def fence(text: str) -> str:
    """A fence for a code block holding ``text``: backticks, one more than the longest run of
    them in ``text`` and at least three, so that no line of ``text`` closes the block.

    Example:
        >>> fence("a: 1  # see ```x```"), fence("plain")
        ('````', '```')
    """
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def code(text: str) -> str:
    r"""``text`` as an inline code span, whatever backticks it holds (delimited by a longer run,
    padded with a space where it starts or ends with a backtick or a space), control characters
    shown as escapes (``\n``).

    Example:
        >>> print(code("models[0].model"), code("a`b"), code("`x"), code("a\nb"))
        `models[0].model` ``a`b`` `` `x `` `a\nb`
    """
    text = text.translate(_CONTROL)
    ticks = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text[:1] in ("`", " ") or text[-1:] in ("`", " ") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def plain(text: str) -> str:
    r"""``text`` as literal Markdown text: each character that starts inline Markdown escaped
    by a backslash, control characters shown as escapes (``\n``).

    Example:
        >>> print(plain("ft_a*"), plain("a\nb"), plain("<b>"))
        ft\_a\* a\nb \<b\>
    """
    return _ACTIVE.sub(r"\\\1", text).translate(_CONTROL)


def row(*cells: str) -> str:
    r"""One row of a GitHub-flavoured Markdown table of ``cells`` (Markdown: :func:`code`,
    :func:`plain`), each pipe escaped as ``\|`` so that no cell splits: GFM reads ``\|`` as a
    pipe of the cell's content, inside code spans too.

    Example:
        >>> print(row(code("a|b"), plain("c")))
        | `a\|b` | c |
    """
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def model_card(
    record: Mapping[str, Any],
    *,
    config_yaml: str,
    library: str | None,
    base_card: bool = False,
) -> str:
    """The README.md text of an output folder (module docstring).

    Args:
        record: the run's record (``gradmerge_<command>.json``'s content).
        config_yaml: the configuration as YAML (the file the run read, comments included).
        library: ``"transformers"`` when the base is a Hugging Face folder, else ``None``.
        base_card: whether the base folder has a README.md of its own (not copied; the card
            says so).

    Raises:
        ArgumentError: a record without ``command``, ``method`` or ``inputs``.
    """
    missing = [k for k in ("command", "method", "inputs") if k not in record]
    if missing:
        raise ArgumentError(f"a run record needs {missing} to make a model card")
    command, method = record["command"], record["method"]
    inputs: Mapping[str, Mapping[str, Any]] = record["inputs"]
    tags = ["gradmerge", str(method).replace("_", "-")] + (["merge"] if command == "merge" else [])
    meta: dict[str, Any] = {"base_model": [hub_name(i["path"]) for i in inputs.values()]}
    if library:
        meta["library_name"] = library
    meta["tags"] = tags
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    version = record.get("gradmerge_version", "")
    lines = [
        f"---\n{front}---",
        "",
        f"# A {command} made with gradmerge: `{method}`",
        "",
        f"Made with gradmerge {version} (`gradmerge {command}`, method `{method}`), which merges "
        "fine-tuned models by uncertainty-based gradient matching (Daheim, Möllenhoff, Ponti, "
        "Gurevych & Khan, ICLR 2024) and its special cases. Every figure below is also in "
        f"`gradmerge_{command}.json`, beside this file.",
        "",
        "## Method",
        "",
        *_method(record),
        "",
        "## Inputs",
        "",
        "Fingerprints: `values` is the SHA-256 of each checkpoint's tensors (every small tensor, "
        "16 evenly spaced rows of every large one), `header` that of its safetensors headers "
        "(names, shapes, dtypes).",
        "",
        "| input | name | values (SHA-256) | header (SHA-256) |",
        "|---|---|---|---|",
        *(
            row(
                code(name),
                plain(hub_name(i["path"])),
                code(str(i.get("fingerprint_sha256", "-"))),
                code(str(i.get("header_sha256", "-"))),
            )
            for name, i in inputs.items()
        ),
        *_curvatures(record),
        "",
        "## Configuration",
        "",
        f"{fence(config_yaml)}yaml",
        config_yaml.rstrip("\n"),
        fence(config_yaml),
        "",
        "## Certificates",
        "",
        *_certificates(record),
    ]
    if base_card:
        lines += [
            "",
            "## The base model's card",
            "",
            "The base folder has a README.md of its own; it describes the base model and is not "
            "copied here. Carry its license and citation over, and those of every fine-tuned "
            "model, before publishing this one.",
        ]
    return "\n".join(lines) + "\n"


def _method(record: Mapping[str, Any]) -> list[str]:
    """The method's formula (from the registry) and its weights."""
    from gradmerge.methods import registry

    try:
        summary = " ".join(registry.get(str(record["method"])).summary.split())
    except ArgumentError:
        summary = ""
    lines = [f"`{record['method']}`" + (f": {summary}." if summary else ".")]
    alphas = record.get("effective_alphas")
    if alphas:
        lines += ["", "α_t (scale included): " + ", ".join(f"{a:g}" for a in alphas) + "."]
    prior = record.get("config", {}).get("prior")
    if isinstance(prior, Mapping):
        lines += ["", f"Prior H_0: δ = {prior.get('delta', 0.0):g}" + _curvature_term(prior) + "."]
    return lines


def _curvature_term(term: Mapping[str, Any]) -> str:
    files = term.get("curvature")
    if not files:
        return ""
    names = files if isinstance(files, list) else [files]
    return f" plus {term.get('scale', 1.0):g} × the curvature in " + ", ".join(
        code(hub_name(f)) for f in names
    )


def _curvatures(record: Mapping[str, Any]) -> list[str]:
    """The curvature files: structure, layout fingerprint, examples summed."""
    curvatures: Mapping[str, Mapping[str, Any]] = record.get("curvatures") or {}
    if not curvatures:
        return []
    lines = [
        "",
        "| curvature | file | structure | examples | layout (SHA-256) |",
        "|---|---|---|---|---|",
    ]
    for name, c in curvatures.items():
        examples = (c.get("info") or {}).get("num_examples", "-")
        lines.append(
            row(
                code(name),
                plain(Path(c["path"]).name),
                plain(str(c.get("structure", "-"))),
                plain(str(examples)),
                code(str(c.get("layout_fingerprint_sha256", "-"))),
            )
        )
    return lines


def _certificates(record: Mapping[str, Any]) -> list[str]:
    """What the solves certify (how many, by which method, the largest relative residual, any
    approximate solve left above its tolerance) and a removal's step and rounding."""
    solves: Mapping[str, Mapping[str, Any]] = record.get("solves") or {}
    lines = []
    if not solves:
        lines.append(
            "No linear system was solved iteratively (every merged tensor has an elementwise or "
            "closed-form rule): nothing to certify beyond the compute dtype's rounding."
        )
    else:
        methods = Counter(str(s.get("method")) for s in solves.values())
        iterations = sum(int(s.get("iterations") or 0) for s in solves.values())
        failed = [name for name, s in solves.items() if s.get("success") is False]
        config = record.get("config", {})
        tol = config.get("solver", {}).get("tol", config.get("solver_tol"))  # 0.1.0: solver_tol
        tolerance = "the compute dtype's default" if tol is None else f"{tol:g}"
        lines += [
            f"{len(solves)} systems solved ("
            + ", ".join(f"{m}: {n}" for m, n in sorted(methods.items()))
            + f"; {iterations:,} CG iterations in all). Largest relative residual "
            f"‖b − H̄x‖/‖b‖, measured in float64: **{record.get('max_residual', 0.0):.2e}** "
            f"(tolerance: {tolerance}). Tensors outside these systems (diagonal blocks, "
            "δ·I) are merged elementwise, exactly up to rounding.",
            "",
        ]
        if failed:
            shown = ", ".join(code(n) for n in failed[:10]) + (" ..." if len(failed) > 10 else "")
            lines.append(
                f"{len(failed)} approximate solves (`solver: {{approximate: true}}`) stopped "
                f"above the tolerance: {shown}."
            )
        else:
            lines.append("Every solve reached its tolerance.")
        worst = sorted(solves.items(), key=lambda kv: -float(kv[1].get("residual") or 0.0))
        lines += [
            "",
            f"The {min(5, len(worst))} largest residuals:",
            "",
            "| block | method | iterations | residual |",
            "|---|---|---|---|",
        ]
        lines += [
            row(
                code(name),
                plain(str(s.get("method"))),
                plain(str(s.get("iterations"))),
                f"{float(s.get('residual') or 0.0):.2e}",
            )
            for name, s in worst[:5]
        ]
    step = record.get("step")
    if isinstance(step, Mapping) and step.get("ratio") is not None:
        lines += [
            "",
            f"Removal step ‖θ − θ_LLM‖ = {step['norm']:.3g}, {step['ratio']:.3g} times the "
            f"{step.get('relative_to', 'reference')}.",
        ]
    rounding = record.get("rounding")
    if isinstance(rounding, Mapping):
        lines += [
            "",
            f"Float rounding amplified by the removal: at most {rounding['bound']:.2e} "
            f"({rounding['relative_to_task_vector']:.2e} of the task vector).",
        ]
    return lines


def write(folder: Path, record: Mapping[str, Any], *, source: str | None, base: Path) -> Path:
    """Write ``folder``/README.md for a run whose record is ``record`` and whose base checkpoint
    is ``base`` (a Hugging Face folder: ``library_name: transformers``); ``source``: the text of
    the YAML file the run read, when it describes the run exactly (it is the card's
    configuration), else ``None``: the record's configuration, as YAML."""
    if source is not None:
        config_yaml = source
    else:
        config_yaml = (
            "# the configuration as run (gradmerge's record of it, not a YAML file to rerun)\n"
        )
        config_yaml += yaml.safe_dump(dict(record.get("config", {})), sort_keys=False)
    hugging_face = base.is_dir() and (base / "config.json").is_file()
    text = model_card(
        record,
        config_yaml=config_yaml,
        library="transformers" if hugging_face else None,
        base_card=base.is_dir() and (base / README).is_file(),
    )
    path = folder / README
    path.write_text(text)
    return path


__all__ = ["README", "code", "fence", "hub_name", "model_card", "plain", "row", "write"]
