"""The model card's Markdown holds whatever the inputs hold (issue 38, cases 11 and 12).

11: the configuration block was fenced by three backticks, so a line of the YAML holding three
(a multi-line value, a pasted snippet) closed it early and the rest of the YAML, and of the card,
became Markdown. The fence is now longer than any run of backticks in the YAML.
12: a newline (or a ``|``) in a model folder's name split the Inputs table's row. Every table
cell is now escaped: pipes as ``\\|``, control characters shown as escapes (``\\n``), Markdown's
inline characters backslash-escaped in text and code spans delimited by a longer run of
backticks.

Oracle: markdown-it-py (CommonMark with GitHub's tables; a dependency of jupytext, which the
tests install), parsing the card as the Hub renders it: the fenced block's content must be the
YAML byte for byte, each table row must have its header's cells and each cell must read as the
name it shows. One real ``gradmerge merge`` of tiny folders named so, and a property over names
and YAML texts.
"""

from __future__ import annotations

import json
import string

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st
from markdown_it import MarkdownIt
from safetensors.torch import save_file

from gradmerge import cli
from gradmerge.jobs.card import model_card

MARKDOWN = MarkdownIt("commonmark").enable("table")


def _inline(token) -> str:
    """The text a cell (an inline token) reads as; formatting shows as a tag, so that it fails
    the comparisons."""
    parts = []
    for child in token.children or []:
        if child.type in ("text", "code_inline"):
            parts.append(child.content)
        elif child.type in ("softbreak", "hardbreak"):
            parts.append("\n")
        else:
            parts.append(f"<{child.type}>")
    return "".join(parts)


def parse(card: str) -> tuple[list[str], list[list[list[str]]], list[str]]:
    """The card's fenced blocks' contents, its tables (rows of cell texts) and headings."""
    fences, tables, headings, row, heading = [], [], [], None, False
    for token in MARKDOWN.parse(card):
        if token.type == "fence":
            fences.append(token.content)
        elif token.type == "table_open":
            tables.append([])
        elif token.type == "tr_open":
            row = []
        elif token.type == "tr_close":
            tables[-1].append(row)
            row = None
        elif token.type == "heading_open":
            heading = True
        elif token.type == "inline" and row is not None:
            row.append(_inline(token))
        elif token.type == "inline" and heading:
            headings.append(token.content)
            heading = False
    return fences, tables, headings


HEADINGS = ["Method", "Inputs", "Configuration", "Certificates"]


def _shown(name: str) -> str:
    """A name as the card shows it: control characters as escapes (``\\n``, ``\\x1b``)."""
    escapes = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return "".join(
        escapes.get(c, f"\\x{ord(c):02x}") if ord(c) < 0x20 or ord(c) == 0x7F else c for c in name
    )


@pytest.fixture
def odd(tmp_path):
    """A task arithmetic of a base folder named ``base ```\u0060`` and a fine-tune named
    ``ft\\nnext|pipe`x*``, from a YAML whose comments hold runs of backticks and whose
    ``base_model`` continues on a line that starts with three of them."""
    base, ft = tmp_path / "base ```", tmp_path / "ft\nnext|pipe`x*"
    for i, folder in enumerate((base, ft)):
        folder.mkdir()
        save_file({"w": torch.full((2,), float(i))}, folder / "model.safetensors")
    text = (
        "# a merge: see ```gradmerge merge``` and ````` five\n"
        "method: task_arithmetic\n"
        "base_model: base\n"
        "  ```\n"  # a plain scalar continued: the folder 'base ```'
        "models:\n"
        f"- model: {json.dumps(ft.name)}\n"
        "# ```\n"
    )
    (tmp_path / "merge.yaml").write_text(text)
    assert yaml.safe_load(text)["base_model"] == "base ```"
    return tmp_path, text, ft


def test_a_real_merge_card_keeps_its_yaml_and_its_rows(odd, capsys):
    root, text, ft = odd
    assert cli.main(["merge", str(root / "merge.yaml"), str(root / "out"), "--no-progress"]) == 0
    card = (root / "out" / "README.md").read_text()
    fences, tables, headings = parse(card)
    assert fences == [text]  # the YAML byte for byte, and nothing else became a block
    assert headings[1:] == HEADINGS  # the rest of the card is the card
    inputs = tables[0]
    assert [len(r) for r in inputs] == [4, 4, 4]  # the header, base_model, models[0].model
    assert [r[:2] for r in inputs[1:]] == [
        ["base_model", "base ```"],
        ["models[0].model", _shown(ft.name)],
    ]


NAMES = st.text(
    alphabet=string.ascii_letters[:6] + string.digits[:3] + "|`*_[]<>&~\\#!- .\n\r\t\x1b",
    min_size=1,
    max_size=12,
).filter(lambda s: s == s.strip(" ") and not s.startswith("models--") and s not in (".", ".."))
YAMLS = (
    st.lists(st.text(alphabet="`~ a#:-|\t", max_size=10), min_size=1, max_size=6)
    .map(lambda lines: "\n".join(lines) + "\n")
    .filter(lambda text: text.strip("\n"))
)


def _record(names: list[str], solve: str) -> dict:
    return {
        "command": "merge",
        "method": "gradient_matching",
        "gradmerge_version": "1.0",
        "effective_alphas": [1.0] * len(names),
        "config": {"prior": {"delta": 0.1, "curvature": [f"/w/{names[0]}"]}},
        "inputs": {
            f"models[{i}].model": {
                "path": f"/w/{n}",
                "fingerprint_sha256": "ab",
                "header_sha256": "cd",
            }
            for i, n in enumerate(names)
        },
        "curvatures": {
            "models[0].curvature": {"path": f"/w/{names[0]}", "structure": "kfac", "info": {}}
        },
        "solves": {solve: {"method": "kfac_cg", "iterations": 3, "residual": 1e-9}},
        "max_residual": 1e-9,
    }


@given(names=st.lists(NAMES, min_size=1, max_size=3), config=YAMLS, solve=NAMES)
def test_every_cell_reads_as_its_name_and_the_yaml_as_written(names, config, solve):
    card = model_card(_record(names, solve), config_yaml=config, library=None)
    fences, tables, headings = parse(card)
    assert fences == [config.rstrip("\n") + "\n"]  # as written (its last newlines: one)
    assert headings[1:] == HEADINGS
    inputs, curvatures, residuals = tables
    assert inputs[1:] == [
        [f"models[{i}].model", _shown(n), "ab", "cd"] for i, n in enumerate(names)
    ]
    assert curvatures[1][:3] == ["models[0].curvature", _shown(names[0]), "kfac"]
    assert residuals[1] == [_shown(solve), "kfac_cg", "3", "1.00e-09"]
