"""benchmarks/interference_refine.py's pieces that need no study: the refinement's pass count,
the rows' names and costs, the YAML it writes (read back by gradmerge's own reader), the check
that refuses a refined folder made with other settings, and the pairs Study 1's comparisons add
(the quick run of test_interference.py runs the rows)."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

from benchmarks import interference as study
from benchmarks import interference_refine as refine
from benchmarks.interference_removal import refine_passes
from gradmerge.jobs.refine import RefineConfig

R = "grad. matching (official), kfac + refine 2"
B = "multi-task fine-tune of task arithmetic α=1, kfac + refine 2's text passes"


def test_the_docstring_examples_hold():
    result = doctest.testmod(refine, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 7 and result.failed == 0


def test_the_refinements_passes_are_its_steps_gradients_and_curvatures_times_the_texts():
    """Four sets (580, 580, 580, 491 texts), 2 steps: the residual at θ^0 and 2 + 3 trials (6
    gradient evaluations) and 2 curvature evaluations per set; the record's 7 diagnostic
    gradient evaluations are not counted."""
    record = {"passes": {"examples": [580, 580, 580, 491],
                         "gradient evaluations, steps": [6, 6, 6, 6],
                         "gradient evaluations, record": [7, 7, 7, 7],
                         "curvature evaluations": [2, 2, 2, 2]}}  # fmt: skip
    assert refine_passes(record) == (3 * 580 + 491) * 8 == 17848


def test_row_names_carry_no_number_that_changes_between_seeds():
    assert refine.refine_method("kfac", 2) == R
    assert refine.baseline_method("kfac", 2) == B
    assert refine.structure_of(["diag", "kfac"]) == "kfac"
    assert refine.structure_of(["diag"]) == "diag"  # --quick: no K-FAC curvature
    assert study.pool_keys({"method": B}) == [B]


def test_pairs_add_the_data_free_merges_the_multitask_model_and_the_baseline():
    methods = ["task arithmetic α=1", "grad. matching (official), kfac", "tsv_merge", "iso_c",
               "iso_cts", "RegMean", "multi-task θ_1:T", R, B]  # fmt: skip
    assert refine.pairs(methods) == [
        (R, "tsv_merge"),
        (R, "iso_c"),
        (R, "iso_cts"),
        (R, "multi-task θ_1:T"),
        (R, B),
        (B, "tsv_merge"),
        (B, "iso_c"),
        (B, "iso_cts"),
        (B, "multi-task θ_1:T"),
    ]
    assert refine.pairs(["tsv_merge", "grad. matching (official), kfac"]) == []  # no refinement
    assert refine.pairs([R, "iso_c"]) == [(R, "iso_c")]  # rows not run: no pair


def test_comparisons_pair_the_refined_merge_with_its_baseline_and_the_data_free_merges():
    """Two seeds of rows on one 4-text set: the refined merge 4/4 correct, TSV-M 2/4, the
    baseline 3/4, the multi-task model 4/4; the pooled differences are the exact means."""

    def rows() -> list[dict]:
        out = []
        for method, correct in (("task arithmetic α=1", "1000"), ("tsv_merge", "1100"),
                                ("multi-task θ_1:T", "1111"), (R, "1111"), (B, "1110")):  # fmt: skip
            out.append(study.row(4, method, {study.BASE: {"accuracy": correct.count("1") / 4,
                                                          "n": 4, "correct": correct}}))  # fmt: skip
        return out

    seeds = [{"seed": s, "rows": rows()} for s in (0, 1)]
    by = {(c["method"], c["against"]): c for c in study.comparisons(seeds, 200)}
    assert by[R, "tsv_merge"]["pooled"]["difference"] == pytest.approx(0.5)
    assert by[R, B]["pooled"]["difference"] == pytest.approx(0.25)
    assert by[R, "multi-task θ_1:T"]["pooled"]["difference"] == pytest.approx(0.0)
    assert by[B, "tsv_merge"]["pooled"]["difference"] == pytest.approx(0.25)
    assert by[R, "task arithmetic α=1"]["pooled"]["difference"] == pytest.approx(0.75)
    assert by[R, "tsv_merge"]["seeds"] == 2
    assert len(by) == len(study.comparisons(seeds, 200))  # every pair once


def test_the_refine_yaml_is_what_gradmerge_reads_and_a_record_of_it_matches(tmp_path):
    """The YAML's keys pass ``RefineConfig``'s checks, and the record gradmerge would write of it
    (``to_dict``) compares equal to it; a record of other settings names what differs."""
    config = refine.refine_config(
        start=tmp_path / "merge",
        base=tmp_path / "base",
        tasks=[(tmp_path / "a", tmp_path / "a.jsonl"), (tmp_path / "b", tmp_path / "b.jsonl")],
        prior={"delta": 1.0, "curvature": str(tmp_path / "f0.safetensors"), "scale": 2.0},
        steps=2,
        structure="kfac",
        seed=3,
        max_length=64,
    )
    assert config["models"][1] == {"model": str(tmp_path / "b"), "data": str(tmp_path / "b.jsonl")}
    assert (config["steps"], config["max_backtracking"], config["seed"]) == (2, 3, 3)
    read = RefineConfig.from_dict(config, check_files=False)
    assert read.steps == 2 and read.max_backtracking == 3 and read.structure == "kfac"
    assert read.prior.files == (Path(tmp_path / "f0.safetensors"),)
    record = {"config": read.to_dict()}
    assert refine.same_settings(record, config) == []
    other = refine.refine_config(
        start=tmp_path / "merge",
        base=tmp_path / "base",
        tasks=[(tmp_path / "a", tmp_path / "a.jsonl")],
        prior={"delta": 0.5, "curvature": str(tmp_path / "f0.safetensors"), "scale": 2.0},
        steps=1,
        structure="kfac",
        seed=3,
        max_length=32,
    )
    assert refine.same_settings(record, other) == ["steps", "models", "text.max_length",
                                                   "prior.delta"]  # fmt: skip


def test_cost_is_the_parts_sum_and_its_fraction_of_the_multitask_models_passes():
    c = refine.cost({"refine": (17848, 600.0), "other": (1000, None)}, 11244)
    assert c["text passes"] == 18848
    assert c["fraction of the multi-task model's passes"] == pytest.approx(18848 / 11244)
    assert c["seconds (this run's parts)"] == 600.0
    unknown = refine.cost({"refine": (None, None)}, 11244)
    assert unknown["text passes"] is None and unknown["seconds (this run's parts)"] is None
    assert refine.cost({"x": (10, 1.0)}, None)["fraction of the multi-task model's passes"] is None


@pytest.mark.parametrize("steps", ["-1", "101"])
def test_refine_steps_out_of_range_is_an_argument_error(steps, capsys):
    with pytest.raises(SystemExit) as err:
        study.main(["--refine-steps", steps, "--markdown", "x.json"])
    assert err.value.code == 2
    assert "--refine-steps must be 0 (off) to 100" in capsys.readouterr().err
