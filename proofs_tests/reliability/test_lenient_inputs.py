"""Issue 21, items 6 and 10: raw tracebacks become typed errors, and lenient checks strict.

Item 6: labels ``"--1"`` and ``"²"`` (``int()`` after ``lstrip("-")``/``isdigit``), integer labels
over 4300 digits, a LoRA factor or a ``modules_to_save`` tensor whose shape the base does not
have in ``gradmerge curvature`` (the merge path typed these already).
Item 10: LoRA ``r: NaN``; a config ``r`` that disagrees with the factors' rank (peft refuses
it); ``target_modules`` without factors; a key given twice in a JSONL record; ``solver.maxiter``
as a string; the Arabic-Indic digit ``"١"`` as label 1.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from gradmerge import cli
from gradmerge.errors import ConfigError, FileFormatError, StructureError
from gradmerge.io.lora import read_adapter
from gradmerge.io.text_data import label_id
from gradmerge.jobs.config import MergeConfig
from proofs_tests.reliability.test_adapter_base import QUERY, _adapter
from proofs_tests.text_models import bert_classifier


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    root = tmp_path_factory.mktemp("lenient")
    bert_classifier(root / "base")
    (root / "d.jsonl").write_text(json.dumps({"text": "a good film", "label": 2}) + "\n")
    return root


def _curvature(capsys, model, data, out):
    """`gradmerge curvature`'s exit status (a raw exception fails the test) and stderr."""
    code = cli.main(["curvature", str(model), str(data), str(out), "--no-progress"])
    return code, capsys.readouterr().err


BAD_LABELS = [
    ("--1", "is not a label"),
    ("²", "is not a label"),
    ("١", "is not a label"),  # item 10: not read as 1
    ("9" * 5000, "of 5000 digits is out of range"),
    ("-" + "9" * 30, "of 30 digits is out of range"),
]


@pytest.mark.parametrize(("label", "message"), BAD_LABELS)
def test_labels_that_are_not_ids_are_typed_errors(bert, tmp_path, capsys, label, message):
    with pytest.raises(FileFormatError, match=message):
        label_id(label, {"positive": 2}, 3, "row 0")
    path = tmp_path / "d.csv"
    path.write_text(f"text,label\na good film,{label}\n", encoding="utf-8")
    code, err = _curvature(capsys, bert / "base", path, tmp_path / "o.safetensors")
    assert code == 1 and message in err and len(err) < 2000


def test_a_json_integer_over_4300_digits_is_a_typed_error(bert, tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a good film", "label": ' + "9" * 5000 + "}\n")
    code, err = _curvature(capsys, bert / "base", path, tmp_path / "o.safetensors")
    assert code == 1 and "line 1" in err
    with pytest.raises(FileFormatError, match="bits is out of range"):
        label_id(10**5000, {}, 3, "row 0")


def test_a_key_given_twice_in_a_jsonl_record_is_refused(bert, tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a good film", "label": 0, "label": 2}\n')
    code, err = _curvature(capsys, bert / "base", path, tmp_path / "o.safetensors")
    assert code == 1 and "line 1" in err and "'label' is given twice" in err


def _edit(folder, config=None, tensors=None):
    if config is not None:
        old = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**old, **config}))
    if tensors is not None:
        old = load_file(str(folder / "adapter_model.safetensors"))
        save_file({**old, **tensors}, folder / "adapter_model.safetensors")
    return folder


@pytest.mark.parametrize(
    ("config", "tensors", "error", "message"),
    [
        (None, {f"base_model.model.{QUERY}.lora_B.weight": torch.ones(9, 2).double()},
         StructureError, r"has shape \(9, 8\), the base's is \(8, 8\)"),
        (None, {"base_model.model.classifier.weight": torch.ones(5, 8).double()},
         StructureError, r"'classifier.weight' has shape \(5, 8\), the base's is \(3, 8\)"),
        ({"r": float("nan")}, None, FileFormatError, "`r` must be a positive number, got nan"),
        ({"r": 4}, None, StructureError, "rank 2, but adapter_config.json gives it r = 4"),
        ({"target_modules": ["query", "valve"]}, None, StructureError,
         r"target_modules \['valve'\] have no LoRA factors"),
    ],
)  # fmt: skip
def test_bad_adapters_are_typed_errors_in_curvature(
    bert, tmp_path, capsys, config, tensors, error, message
):
    folder = _edit(_adapter(tmp_path / "ad", str(bert / "base")), config, tensors)
    code, err = _curvature(capsys, folder, bert / "d.jsonl", tmp_path / "o.safetensors")
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("gradmerge curvature: error: ") and "Traceback" not in err
    assert re.search(message, last)
    if tensors is None:  # the config alone is wrong: reading the adapter says so
        with pytest.raises(error, match=message):
            read_adapter(folder)
    assert not (tmp_path / "o.safetensors").exists()


def test_a_rank_pattern_gives_the_rank_it_names(bert, tmp_path):
    folder = _adapter(tmp_path / "ad", str(bert / "base"))
    _edit(folder, {"r": 4, "rank_pattern": {"query": 2}})
    updates, _ = read_adapter(folder)
    assert updates[f"{QUERY}.weight"].scale == 4 / 2  # lora_alpha / the module's rank


def test_solver_maxiter_as_text_is_refused(tmp_path):
    config = {
        "method": "task_arithmetic",
        "base_model": "b.safetensors",
        "models": [{"model": "a.safetensors"}],
        "solver": {"maxiter": "10"},
    }
    with pytest.raises(
        ConfigError, match=r"`solver\.maxiter` must be a whole number, got the text"
    ):
        MergeConfig.from_dict(config, root=tmp_path, check_files=False)
    config["solver"] = {"maxiter": 10}
    assert MergeConfig.from_dict(config, root=tmp_path, check_files=False).solver.maxiter == 10
