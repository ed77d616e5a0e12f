"""The model card (README.md) of every folder `gradmerge merge` and `gradmerge remove` write.

Its front matter is read back with huggingface_hub's own parsers (``ModelCard.load``,
``metadata_load``: what the Hub reads) and by PyYAML; its body is checked against the run's
record (gradmerge_merge.json: fingerprints, residuals), the YAML file the run read, and the
base folder's own README.md, which must stay the base's and never be copied over the card.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import yaml

from gradmerge import cli
from gradmerge.jobs import MergeConfig, run_merge
from gradmerge.jobs.card import hub_name, model_card
from proofs_tests.workspace import make_workspace

THEIRS = "---\nlicense: mit\nbase_model: someone/else\n---\n# The base model\n\nTheir own card.\n"


def _front(text: str) -> dict:
    match = re.match(r"^---\n(.*?)\n---\n", text, re.DOTALL)
    assert match, "no YAML front matter"
    return yaml.safe_load(match.group(1))


def _hub_metadata(path):
    """(ModelCard.load's data, metadata_load's dict): both of huggingface_hub's readers."""
    hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub.repocard import metadata_load

    return hub.ModelCard.load(path).data.to_dict(), metadata_load(path)


def _merge(config_path, out, *extra):
    assert cli.main(["merge", str(config_path), str(out), "--no-progress", *extra]) == 0
    return json.loads((out / "gradmerge_merge.json").read_text())


def test_a_kfac_merge_of_hugging_face_folders(hf_models, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(hf_models.base, base)
    (base / "README.md").write_text(THEIRS)  # the user's own card of the base
    config = tmp_path / "merge.yaml"
    text = (
        "# gradient matching of two GPT-2 fine-tunes\n"
        "method: gradient_matching\n"
        "base_model: base\n"
        "models:\n"
        + "".join(
            f"  - {{model: {m}, curvature: {hf_models.curvature}, alpha: 0.5}}\n"
            for m in hf_models.models
        )
        + "prior: {delta: 0.01}\n"
    )
    config.write_text(text)
    record = _merge(config, tmp_path / "merged")
    card_path = tmp_path / "merged" / "README.md"
    card = card_path.read_text()
    expected = {
        "base_model": ["base", "ft0", "ft1"],
        "library_name": "transformers",
        "tags": ["gradmerge", "gradient-matching", "merge"],
    }
    assert _front(card) == expected
    data, metadata = _hub_metadata(card_path)
    assert data == expected and metadata == expected
    # the inputs with the record's fingerprints, the YAML as the user wrote it
    for name, entry in record["inputs"].items():
        row = next(line for line in card.splitlines() if line.startswith(f"| `{name}` |"))
        assert entry["fingerprint_sha256"] in row and entry["header_sha256"] in row
    assert f"```yaml\n{text}```" in card
    # the certificates: every K-FAC solve counted, the largest residual as recorded
    assert record["solves"] and f"{len(record['solves'])} systems solved" in card
    assert f"**{record['max_residual']:.2e}**" in card
    worst = max(record["solves"], key=lambda k: record["solves"][k]["residual"])
    assert f"| `{worst}` |" in card
    assert "Every solve reached its tolerance." in card
    assert "α_t (scale included): 0.5, 0.5." in card and "δ = 0.01" in card
    # the base's own card is neither copied nor touched, and the card says so
    assert "Their own card" not in card and "## The base model's card" in card
    assert (base / "README.md").read_text() == THEIRS
    # and the folder still loads as a Hugging Face model
    transformers = pytest.importorskip("transformers")
    transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "merged")


def test_an_elementwise_merge_of_safetensors_files_and_a_removal(tmp_path):
    ws = make_workspace(tmp_path, "diag")
    config = ws.yaml("ta.yaml", {"method": "task_arithmetic", "base_model": ws.base.name,
                                 "models": [{"model": m.name} for m in ws.models]})  # fmt: skip
    _merge(config, tmp_path / "ta")
    card = (tmp_path / "ta" / "README.md").read_text()
    # no config.json beside the weights: not a transformers folder
    assert _front(card) == {
        "base_model": ["base", "ft0", "ft1"],
        "tags": ["gradmerge", "task-arithmetic", "merge"],
    }
    assert "No linear system was solved" in card
    assert "## The base model's card" not in card
    removal = ws.yaml("remove.yaml", {
        "method": "remove", "base_model": ws.base.name, "model": ws.models[0].name,
        "curvature": ws.curvatures[0].name, "prior": {"delta": 1e-2},
        "remaining": {"delta": 1e-2, "curvature": ws.base_curvature.name},
    })  # fmt: skip
    assert cli.main(["remove", str(removal), str(tmp_path / "out"), "--no-progress"]) == 0
    record = json.loads((tmp_path / "out" / "gradmerge_remove.json").read_text())
    card = (tmp_path / "out" / "README.md").read_text()
    assert _front(card) == {"base_model": ["base", "ft0"], "tags": ["gradmerge", "remove"]}
    assert f"{record['step']['ratio']:.3g} times the" in card


def test_a_configuration_the_yaml_file_does_not_hold_is_recorded_as_run(tmp_path):
    """From Python, or a file's config changed before the run (as gradmerge tune does): the card
    shows the configuration as recorded, not a file that describes another merge."""
    ws = make_workspace(tmp_path, "diag")
    path = ws.yaml("gm.yaml", ws.merge_dict())
    for name, config in (
        ("python", MergeConfig.from_dict(ws.merge_dict(), root=tmp_path)),
        ("tuned", dataclasses.replace(MergeConfig.from_yaml(path), scale=0.5)),
        ("file", MergeConfig.from_yaml(path)),
    ):
        report = run_merge(config, tmp_path / name, progress=False)
        assert tmp_path / name / "README.md" in report.files
        card = (tmp_path / name / "README.md").read_text()
        block = card.split("```yaml\n")[1].split("```")[0]
        record = json.loads((tmp_path / name / "gradmerge_merge.json").read_text())
        if name == "file":
            assert block == path.read_text()
        else:
            assert block.startswith("# the configuration as run")
            assert yaml.safe_load(block) == record["config"]
    assert "α_t (scale included): 0.5, 0.5." in (tmp_path / "tuned" / "README.md").read_text()


def test_names_of_inputs():
    assert hub_name("/h/hub/models--meta-llama--Llama-3.2-1B/snapshots/0a1b") == (
        "meta-llama/Llama-3.2-1B"
    )
    assert hub_name("/h/hub/models--gpt2/snapshots/0a1b") == "gpt2"
    assert hub_name("runs/ft-a/") == "ft-a" and hub_name("w/base.safetensors") == "base"


def test_a_record_without_its_facts_is_refused():
    from gradmerge.errors import ArgumentError

    with pytest.raises(ArgumentError, match="inputs"):
        model_card({"command": "merge", "method": "task_arithmetic"},
                   config_yaml="", library=None)  # fmt: skip


def test_approximate_solves_above_their_tolerance_are_named():
    record = {
        "command": "merge",
        "method": "gradient_matching",
        "config": {"solver": {"tol": 1e-5}, "prior": {"delta": 1e-3, "curvature": "/p/f0.safetensors",
                                                 "scale": 2.0}},
        "inputs": {"base_model": {"path": "/m/base"}},
        "solves": {
            "h.0.fc": {"method": "cg", "iterations": 7, "residual": 3e-3, "success": False},
            "h.0.proj": {"method": "cg", "iterations": 9, "residual": 2e-6, "success": True},
        },
        "max_residual": 3e-3,
    }  # fmt: skip
    card = model_card(record, config_yaml="method: gradient_matching\n", library=None)
    assert "2 systems solved (cg: 2; 16 CG iterations in all)" in card
    assert "**3.00e-03** (tolerance: 1e-05)" in card
    assert "1 approximate solves (`solver: {approximate: true}`) stopped above the tolerance: " \
        "`h.0.fc`." in card  # fmt: skip
    assert "δ = 0.001 plus 2 × the curvature in `f0`" in card
