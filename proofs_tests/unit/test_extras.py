"""The optional extras: ``pip install .`` (torch, numpy, safetensors, pyyaml, tqdm) imports
and merges, in memory and through the command line; the testbed (sympy), the demo (scikit-learn,
matplotlib, scipy) and Hugging Face folders and text (transformers, tokenizers) each raise a
:class:`gradmerge.MissingExtraError` naming the extra to install when its modules are missing.

"Missing" is made real in a fresh interpreter: a finder placed first on ``sys.meta_path`` refuses
every blocked module (and its submodules) as an uninstalled package would, before gradmerge is
imported. ``import gradmerge`` must not import any optional module even when they are installed
(lazy imports), which the last test checks in an ordinary interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import gradmerge as gm
from gradmerge.errors import MissingExtraError
from gradmerge.foundation import extras
from proofs_tests.limits import HANG_S

SOURCE = Path(gm.__file__).resolve().parent.parent
"""The checkout the tests run from: the missing-extra message names it (``pip install '.[x]'``)."""

OPTIONAL = tuple(module for modules in extras.EXTRAS.values() for module in modules)

BLOCKER = textwrap.dedent(
    f"""
    import sys
    BLOCKED = {OPTIONAL!r}

    class _NotInstalled:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, _NotInstalled)
    """
)


def _run_without_extras(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter in which no optional module can be imported."""
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=cwd,
    )


def test_the_blocker_blocks(tmp_path):
    """The test's premise: under the blocker, every optional module fails to import."""
    done = _run_without_extras(
        f"""
        import importlib
        for name in {OPTIONAL!r}:
            try:
                importlib.import_module(name)
            except ImportError:
                continue
            raise SystemExit(f"{{name}} imported")
        print("blocked")
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "blocked"


def test_core_install_imports_and_merges_in_memory(tmp_path):
    """Eq. 6 with diagonal curvatures against its closed form, with no extra installed."""
    done = _run_without_extras(
        """
        import json, sys, torch
        import gradmerge as gm
        base = {"w": torch.zeros(3, dtype=torch.float64)}
        models = [{"w": torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)},
                  {"w": torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)}]
        h = [torch.tensor([9.0, 0.1, 1.0], dtype=torch.float64),
             torch.tensor([0.1, 9.0, 1.0], dtype=torch.float64)]
        merged = gm.gradient_matching(base, models, [gm.Diagonal({"w": x}) for x in h], prior=0.01)
        print(json.dumps(merged["w"].tolist()))
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    h1, h2 = [9.0, 0.1, 1.0], [0.1, 9.0, 1.0]
    t1, t2 = [1.0, 0.0, 2.0], [0.0, 1.0, 2.0]
    # Eq. 6 with θ_LLM = 0, α_t = 1, H_0 = δ·I: θ = (δ + Σ_t H_t)⁻¹ Σ_t (δ + H_t) θ_t
    expected = [
        ((0.01 + a) * x + (0.01 + b) * y) / (0.01 + a + b)
        for a, b, x, y in zip(h1, h2, t1, t2, strict=True)
    ]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == pytest.approx(expected, rel=1e-12, abs=0)


def test_core_install_merges_checkpoints_with_the_cli(tmp_path):
    """``gradmerge merge`` on safetensors files and curvature files, with no extra installed,
    writes what the in-memory rule computes."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    base = {
        "layer.weight": torch.randn(4, 3, generator=g),
        "layer.bias": torch.randn(4, generator=g),
    }
    models = [{k: v + torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    curvatures = [
        gm.Diagonal({k: torch.rand(v.shape, generator=g) + 0.5 for k, v in base.items()})
        for _ in range(2)
    ]
    save_file(base, tmp_path / "base.safetensors")
    lines = ["method: gradient_matching", "base_model: base.safetensors", "models:"]
    for t, (model, curvature) in enumerate(zip(models, curvatures, strict=True)):
        save_file(model, tmp_path / f"ft{t}.safetensors")
        curvature.save(tmp_path / f"ft{t}.curvature.safetensors")
        lines.append(f"  - {{model: ft{t}.safetensors, curvature: ft{t}.curvature.safetensors}}")
    lines.append("prior: {delta: 0.1}")
    (tmp_path / "merge.yaml").write_text("\n".join(lines) + "\n")
    done = _run_without_extras(
        """
        import sys
        from gradmerge.cli import main
        code = main(["merge", "merge.yaml", "merged", "--no-progress"])
        blocked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not blocked, blocked
        sys.exit(code)
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    expected = gm.gradient_matching(base, models, curvatures, prior=0.1)
    written: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "merged").glob("*.safetensors")):
        written |= load_file(shard)
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(written[name], tensor, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["verify", "--seeds", "1", "--study", "0"], "testbed"),
        (["demo", "--quick", "--out", "demo-out"], "demo"),
    ],
)
def test_commands_without_their_extra_name_it(tmp_path, argv, extra):
    done = _run_without_extras(
        f"""
        import sys
        from gradmerge.cli import main
        sys.exit(main({argv!r}))
        """,
        tmp_path,
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"gradmerge {argv[0]}: error:" in done.stderr
    assert f"pip install '{SOURCE}[{extra}]'" in done.stderr  # a form pip accepts (test_install.py)
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "demo-out").exists()


ENTRY_POINTS = {
    "import gradmerge.theory.symbolic": "testbed",
    "import gradmerge.theory.verify": "testbed",
    "import gradmerge.demo": "demo",
    # text DATA is tokenised with the model folder's tokenizer (the file checks come first)
    "from gradmerge.io.text_data import load_tokenizer; load_tokenizer('tok')": "hf",
    "from gradmerge.io.sources import hugging_face_model; hugging_face_model(Path('tok'))": "hf",
}


def test_python_entry_points_without_their_extra_raise_the_typed_error(tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    (tmp_path / "tok" / "config.json").write_text("{}")
    done = _run_without_extras(
        f"""
        import json
        from pathlib import Path
        from gradmerge.errors import MissingExtraError
        raised = {{}}
        for code in {list(ENTRY_POINTS)!r}:
            try:
                exec(code)
            except MissingExtraError as err:
                raised[code] = [err.extra, str(err)]
        print(json.dumps(raised))
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    raised = json.loads(done.stdout.strip().splitlines()[-1])
    assert {code: extra for code, (extra, _) in raised.items()} == ENTRY_POINTS
    for code, (extra, message) in raised.items():
        assert f"pip install '{SOURCE}[{extra}]'" in message, code


def test_require_names_every_missing_module(monkeypatch):
    monkeypatch.setitem(extras.EXTRAS, "demo", ("numpy", "no_such_module_a", "no_such_module_b"))
    with pytest.raises(MissingExtraError, match=r"no_such_module_a, no_such_module_b") as info:
        extras.require("demo", "the demo")
    assert info.value.extra == "demo"
    assert info.value.missing == ("no_such_module_a", "no_such_module_b")
    assert isinstance(info.value, ImportError)  # code that catches ImportError still does
    extras.require("testbed", "the testbed")  # installed here: no error


def test_import_gradmerge_loads_no_optional_module():
    """Lazy imports: with every extra installed, ``import gradmerge`` and the command line's
    start-up (``gradmerge.cli``) import none of their modules."""
    probe = (
        "import sys, gradmerge, gradmerge.cli\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {OPTIONAL!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=HANG_S
    )
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_extras_match_pyproject():
    """Each extra of ``extras.EXTRAS`` is declared in pyproject.toml, and the core
    dependencies are exactly the five the merge core and the CLI need."""
    tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11
    config = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    project = config["project"]
    core = {dep.split(">")[0].split("<")[0].split("=")[0] for dep in project["dependencies"]}
    assert core == {"torch", "numpy", "safetensors", "pyyaml", "tqdm"}
    distribution = {"sklearn": "scikit-learn"}
    for extra, modules in extras.EXTRAS.items():
        declared = {
            dep.split(">")[0].split("=")[0] for dep in project["optional-dependencies"][extra]
        }
        assert {distribution.get(m, m) for m in modules} == declared, extra
