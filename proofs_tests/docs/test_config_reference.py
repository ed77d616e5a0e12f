"""docs/config.md, the YAML reference, against the real parser.

- Every ```yaml example of the page is read by the parser it documents (``MergeConfig``,
  ``RemoveConfig``, ``RefineConfig``.from_yaml) in a workspace holding every file the examples
  name, with real curvature files of a tiny model estimated at the weights they are paired with.
- Every merge and removal example then runs (``run_merge`` / ``run_remove``) on that tiny model;
  the outputs keep the base's tensors and shapes, stay finite, copy ``passthrough`` tensors
  unchanged, and the task-arithmetic example equals ``gm.task_arithmetic`` in memory.
- Every key the parser accepts, at every level (read from its own "allowed keys" message), is
  documented on the page.
- The page's tables of keys are the ones generated from the settings' declarations
  (:mod:`gradmerge.jobs.reference`, with the commands' flags: :mod:`gradmerge.commands.reference`),
  and every declared setting has a row.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

import gradmerge as gm
from gradmerge.errors import GradmergeError
from gradmerge.jobs import reference
from gradmerge.jobs.config import load
from gradmerge.jobs.refine import RefineConfig
from gradmerge.methods.registry import names

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
TEXT = DOC.read_text(encoding="utf-8")
EXAMPLES = re.findall(r"```yaml\n(.*?)```", TEXT, flags=re.S)


class Tiny(nn.Module):
    """Two layers: ``body`` (weight and bias, a K-FAC layer) and a bias-free ``lm_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.lm_head = nn.Linear(3, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.body(x)))


def _kind(data: dict) -> str:
    if "start" in data:
        return "refine"
    return "remove" if data.get("method") in names("remove") else "merge"


def _save_model(weights: dict[str, torch.Tensor], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, folder / "model.safetensors")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Every file the examples name: models (folders of model.safetensors), diagonal
    (``*.curvature.safetensors``) and K-FAC (``*.kfac.curvature.safetensors``) curvatures
    estimated at the weights of the model each is paired with, a gradient, text data."""
    root = tmp_path_factory.mktemp("config-reference")
    torch.manual_seed(0)
    model = Tiny().double()
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = torch.randn(16, 4, dtype=torch.float64)
    batches = [(x[:8], torch.randint(0, 2, (8,))), (x[8:], torch.randint(0, 2, (8,)))]

    def weights_near(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {
            k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in base.items()
        }

    models = {
        "path/to/base": base,
        "path/to/finetuned_a": weights_near(1),
        "path/to/finetuned_b": weights_near(2),
        "path/to/finetuned_c": weights_near(3),
        "path/to/finetuned_on_Dt": weights_near(4),
        "merged": weights_near(5),
    }
    for name, weights in models.items():
        _save_model(weights, root / name)
    shutil.copytree(root / "path/to/finetuned_b", root / "ft_b")
    merge = {  # the merge the `remerge` example leaves ft_b/ out of
        "method": "task_arithmetic",
        "base_model": "path/to/base",
        "models": [{"model": "path/to/finetuned_a"}, {"model": "ft_b"}],
    }
    (root / "merge.yaml").write_text(yaml.safe_dump(merge))

    def curvature(weights: dict[str, torch.Tensor], structure: str) -> gm.Curvature:
        model.load_state_dict(weights)
        return gm.estimate_curvature(model, batches, structure=structure, fisher="empirical")

    at = {
        "a": "path/to/finetuned_a",
        "b": "path/to/finetuned_b",
        "c": "path/to/finetuned_c",
        "Dt": "path/to/finetuned_on_Dt",
        "base": "path/to/base",
        "rest": "path/to/base",
    }
    for name, where in at.items():
        curvature(models[where], "diag").save(root / f"{name}.curvature.safetensors")
        curvature(models[where], "kfac").save(root / f"{name}.kfac.curvature.safetensors")
    save_file({k: 1e-9 * torch.ones_like(v) for k, v in base.items()}, root / "grad_Dt.safetensors")
    (root / "task_a.jsonl").write_text('{"text": "a", "label": 0}\n')
    return root


@pytest.mark.parametrize("number", range(len(EXAMPLES)))
@pytest.mark.filterwarnings(
    "ignore::gradmerge.errors.InputWarning"
)  # per-task curvatures in a removal
def test_every_example_parses_and_merges_or_removals_run(workspace, number, tmp_path):
    text = EXAMPLES[number]
    config_file = workspace / f"example{number}.yaml"
    config_file.write_text(text, encoding="utf-8")
    kind = _kind(yaml.safe_load(text))
    if kind == "refine":
        # the page's example names an entry point (mypkg.data:task_b): trusted, as its reader would
        config = RefineConfig.from_yaml(config_file, allow_entry_points=True)
        assert config.steps >= 1 and config.models
        return  # refinement needs a Hugging Face model and its data: parsed only
    config = load(config_file, kind)  # remerge: the MergeConfig it runs
    run = gm.run_merge if isinstance(config, gm.MergeConfig) else gm.run_remove
    out = tmp_path / "out"
    run(config, out, progress=False)
    written = load_file(out / "model.safetensors")
    base = load_file(Path(config.base_model) / "model.safetensors")
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in base.items()}
    assert all(torch.isfinite(v).all() for v in written.values())
    for name in config.passthrough:  # copied, in the output dtype
        torch.testing.assert_close(
            written[name], base[name].to(written[name].dtype), rtol=0, atol=0
        )
    if isinstance(config, gm.MergeConfig) and config.method == "task_arithmetic":
        models = [load_file(Path(m.model) / "model.safetensors") for m in config.models]
        expected = gm.task_arithmetic(base, models, alphas=config.alphas)
        for name, tensor in expected.items():
            torch.testing.assert_close(written[name], tensor)


def test_the_page_has_an_example_of_every_method_and_file():
    methods = {yaml.safe_load(text).get("method") for text in EXAMPLES}
    assert {*names("merge"), *names("remove")} <= methods
    assert any(_kind(yaml.safe_load(text)) == "refine" for text in EXAMPLES)
    assert any("solver" in yaml.safe_load(text) for text in EXAMPLES)


def _allowed(parse, data: dict) -> list[str]:
    """The keys the parser accepts where ``data`` holds the unknown key ``zzz``, read from its
    own error message."""
    with pytest.raises(GradmergeError, match="allowed keys: ") as info:
        parse(data)
    return info.value.args[0].split("allowed keys: ", 1)[1].split(", ")


def _merge(data):
    return gm.MergeConfig.from_dict(data, check_files=False)


def _remove(data):
    return gm.RemoveConfig.from_dict(data, check_files=False)


def _refine(data):
    return RefineConfig.from_dict(data, check_files=False)


MODELS = [{"model": ".", "curvature": "a.curvature.safetensors"}]
REFINE = {"start": ".", "base_model": ".", "models": [{"model": ".", "data": "a.pt"}], "steps": 1}
LEVELS = {
    "merge": (_merge, {"method": "gradient_matching", "zzz": 1}),
    "models[]": (_merge, {"method": "task_arithmetic", "base_model": ".", "models": [{"zzz": 1}]}),
    "prior": (
        _merge,
        {"method": "gradient_matching", "base_model": ".", "models": MODELS, "prior": {"zzz": 1}},
    ),
    "solver": (
        _merge,
        {"method": "fisher_average", "models": MODELS, "solver": {"zzz": 1}},
    ),
    "remove": (_remove, {"method": "remove", "zzz": 1}),
    "influence_remove": (_remove, {"method": "influence_remove", "zzz": 1}),
    "refine": (_refine, {**REFINE, "zzz": 1}),
    "refine models[]": (_refine, {**REFINE, "models": [{"zzz": 1}]}),
    "refine text": (_refine, {**REFINE, "prior": {"delta": 1.0}, "text": {"zzz": 1}}),
}


@pytest.mark.parametrize("level", LEVELS)
def test_every_key_the_parser_accepts_is_documented(level):
    parse, data = LEVELS[level]
    keys = _allowed(parse, data)
    assert keys, level
    documented = set(re.findall(r"`([a-z_]+)`", TEXT)) | {
        key for text in EXAMPLES for key in re.findall(r"^\s*-?\s*([a-z_]+):", text, flags=re.M)
    }
    missing = [key for key in keys if key not in documented]
    assert not missing, f"{level}: keys the parser accepts that docs/config.md does not name"


def test_the_tables_are_generated_from_the_declarations():
    """Each table of keys on the page is what ``python -m gradmerge.commands.reference
    docs/config.md`` writes from the declarations (and the commands' parsers): a declaration
    changed without the page (or the page edited by hand) fails here."""
    from gradmerge.commands import reference as page

    on_page = reference.blocks(TEXT)
    generated = page.tables()
    assert set(on_page) == set(generated)
    assert set(reference.tables()) == set(generated) - {"flags"}
    for name, table in generated.items():
        assert on_page[name] == table, f"docs/config.md's {name!r} table is stale: regenerate it"
    assert page.render(TEXT) == TEXT


def test_every_declared_setting_has_a_row():
    from gradmerge.foundation.settings import declared

    generated = reference.tables()
    for name, cls in [
        ("merge", gm.MergeConfig),
        ("models", gm.jobs.inputs.ModelInput),
        ("remove", gm.RemoveConfig),
        ("term", gm.jobs.inputs.CurvatureTerm),
        ("solver", gm.KroneckerCG),
        ("estimate", gm.EstimateOptions),
        ("refine", RefineConfig),
        ("refine_models", gm.jobs.refine.TaskInput),
        ("text", gm.io.text_data.TextOptions),
    ]:
        rows = set(re.findall(r"^\| `([a-z_]+)` \|", generated[name], flags=re.M))
        shared = set(declared(gm.jobs.options.Options)) if name in ("merge", "remove") else set()
        assert set(declared(cls)) - shared == rows, name
