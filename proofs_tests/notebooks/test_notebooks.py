"""Every notebook in ``notebooks/`` runs from top to bottom in a fresh Jupyter kernel.

The notebooks are jupytext percent-format ``.py`` files; their ``assert`` statements are the
checks (against closed forms, exact solves and bounds), so a notebook passes only if every
assertion in it holds. Each runs with nbclient in the ``python3`` kernel of ipykernel, which
jupyter_client starts with the interpreter running these tests, in an empty temporary working
directory (where its figures go) and with matplotlib's non-interactive Agg backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from proofs_tests.limits import HANG_S

jupytext = pytest.importorskip("jupytext", reason="jupytext reads the percent-format notebooks")
nbclient = pytest.importorskip("nbclient", reason="nbclient executes the notebooks")
pytest.importorskip("ipykernel", reason="the notebooks run in an ipykernel kernel")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("[0-9]*.py"))
CELL_TIMEOUT_S = HANG_S


def test_the_notebooks_are_there():
    assert [p.stem for p in NOTEBOOKS] == [
        "01_linear_exactness",
        "02_logistic_mismatch",
        "03_iterative_refinement",
        "04_demo",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_and_its_assertions_hold(path, tmp_path, monkeypatch):
    notebook = jupytext.read(path)
    code = [c.source for c in notebook.cells if c.cell_type == "code"]
    markdown = [c.source for c in notebook.cells if c.cell_type == "markdown"]
    assert markdown and any("assert " in source for source in code), (
        f"{path.name} must explain itself in markdown and check its claims with assertions"
    )
    monkeypatch.setenv("MPLBACKEND", "Agg")
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    errors = [
        out
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors
    assert list(tmp_path.glob("*.png")), f"{path.name} saves its figures to the working directory"
