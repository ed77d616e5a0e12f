"""``--no-progress`` silences every progress bar, Hugging Face's "Loading weights" included, for
the duration of the command only: before and after, transformers' bars are as the caller left
them. Checked in this process (transformers loaded already: its logging switch) and in a fresh
interpreter (transformers imported during the command: the environment variable)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import transformers

from gradmerge import cli
from proofs_tests.limits import HANG_S
from proofs_tests.text_models import LABELS, bert_classifier

BAR = "Loading weights"


def _inputs(tmp_path):
    folder = bert_classifier(tmp_path / "bert")
    rows = [{"text": "the movie was fun", "label": LABELS[0]}, {"text": "dull", "label": LABELS[1]}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, tmp_path / "d.jsonl"


def test_no_progress_silences_transformers_bars_and_restores_them(tmp_path, capsys):
    folder, data = _inputs(tmp_path)
    logging = transformers.utils.logging
    logging.enable_progress_bar()
    argv = ["gradient", str(folder), str(data), str(tmp_path / "g.safetensors"), "--overwrite"]
    assert cli.main(argv) == 0
    assert BAR in capsys.readouterr().err  # the bar this test looks for is there without the flag
    assert cli.main([*argv, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert BAR not in err and "it/s" not in err and "examples/s" not in err, err
    assert logging.is_progress_bar_enabled()  # the caller's setting is back
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ


def test_no_progress_in_a_fresh_interpreter(tmp_path):
    folder, data = _inputs(tmp_path)
    out = tmp_path / "g.safetensors"
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradmerge",
            "gradient",
            str(folder),
            str(data),
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert BAR not in done.stderr and "it/s" not in done.stderr, done.stderr
