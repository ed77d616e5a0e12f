"""The repository is self-contained: no file cites a file outside it, and every relative link of
its Markdown pages leads to a file or folder inside it that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "build", "dist", "runs", "__pycache__", "node_modules"}
SUFFIXES = {".md", ".py", ".toml", ".txt", ".yaml", ".yml", ".cfg", ".ini", ".sh"}
# outside the repository: the development machine's notes and design files, absolute work paths
OUTSIDE = ("shared" + "/", "DESIGN" + ".md", "/wo" + "rk/")


def _files() -> list[Path]:
    found = []
    for path in ROOT.rglob("*"):
        parts = set(path.relative_to(ROOT).parts)
        if parts & SKIP_DIRS or any(p.startswith(".") and p != ".ci" for p in parts):
            continue
        if path.is_file() and (path.suffix in SUFFIXES or path.name in ("Makefile", "run")):
            found.append(path)
    return sorted(found)


FILES = _files()
PAGES = [p for p in FILES if p.suffix == ".md"]


def test_no_file_cites_a_file_outside_the_repository():
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in FILES
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if any(marker in line for marker in OUTSIDE)
    ]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_stay_inside_and_exist(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or an anchor on the same page
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if ROOT not in path.parents and path != ROOT:
            broken.append(f"{target}: outside the repository")
        elif not path.exists():
            broken.append(f"{target}: no such file")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
