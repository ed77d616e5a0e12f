"""Issue 21, items 2, 7 and 8: text DATA at any size, limits that leave no text, byte-order marks.

- Item 2: ``--max-length`` bounds tokenisation (a long line is not tokenised whole, then cut),
  and records are streamed batch by batch: the data are never held whole. Reference: the
  tokenizer's own truncation of the whole text (``truncation=True, max_length``).
- Item 7: a ``--max-length`` at or below the tokenizer's special tokens is refused.
- Item 8: a byte-order mark at the start of a .jsonl, .csv or .txt file is skipped: the same
  curvature as the file without it.
The memory of a large file is measured in benchmarks/text_data.py (too slow for the suite).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from gradmerge import cli
from gradmerge.io.sources import load_model
from gradmerge.io.text_data import TextBatches, TextOptions, load_tokenizer
from proofs_tests.text_models import bert_classifier, gpt2_lm

WORDS = ["the", "cat", "sat", "on", "the", "mat"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_input")
    return {"bert": bert_classifier(root / "bert"), "gpt2": gpt2_lm(root / "gpt2")}


class _Spy:
    """A tokenizer that records the longest text it was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def __call__(self, *texts, **options):
        for text in texts:
            for t in [text] if isinstance(text, str) else text:
                self.longest = max(self.longest, len(t))
        return self.tokenizer(*texts, **options)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


class _Records:
    """Re-iterable records that count how many were read, in all and before each batch."""

    def __init__(self, rows):
        self.rows, self.read = rows, 0

    def __iter__(self):
        for row in self.rows:
            self.read += 1
            yield row


def test_max_length_bounds_the_text_tokenised(folders):
    """A 600,000-word line with --max-length 8: only a prefix is tokenised, and the example is
    the tokenizer's own truncation of the whole line."""
    bert = folders["bert"]
    line = " ".join(WORDS * 100_000)
    tokenizer = load_tokenizer(str(bert))
    spy = _Spy(tokenizer)
    batches = TextBatches(
        [{"text": line, "label": 1}, {"text": "a cat", "label": 0}],
        model=load_model(str(bert)),
        tokenizer=spy,
        options=TextOptions(max_length=8),
    )
    assert spy.longest < 10_000 < len(line)
    (batch,) = list(batches)
    reference = tokenizer([line, "a cat"], truncation=True, max_length=8, padding=True)
    assert batch["input_ids"].tolist() == reference["input_ids"]
    assert batch["attention_mask"].tolist() == reference["attention_mask"]
    assert batches.truncated == 1 and batches.tokens == 8 + 4


def test_a_long_line_without_whitespace_is_still_truncated_exactly(folders):
    """No whitespace to cut at: the whole text decides (exact, if slower)."""
    bert = folders["bert"]
    tokenizer = load_tokenizer(str(bert))
    line = "the" + "." * 20_000
    batches = TextBatches(
        [{"text": line, "label": 1}],
        model=load_model(str(bert)),
        tokenizer=tokenizer,
        options=TextOptions(max_length=6),
    )
    (batch,) = list(batches)
    assert (
        batch["input_ids"].tolist() == tokenizer([line], truncation=True, max_length=6)["input_ids"]
    )


def test_records_are_streamed_a_batch_at_a_time(folders):
    """The data are read again on every pass and a batch is made from ``batch_size`` records
    read: nothing but counts is kept of the examples."""
    bert = folders["bert"]
    rows = _Records([{"text": " ".join(WORDS[: 1 + i % 6]), "label": i % 3} for i in range(100)])
    batches = TextBatches(
        rows,
        model=load_model(str(bert)),
        tokenizer=load_tokenizer(str(bert)),
        batch_size=8,
    )
    assert rows.read == 100 and batches.examples == 100 and len(batches) == 13
    it = iter(batches)
    first = next(it)
    assert first["input_ids"].shape[0] == 8
    assert rows.read - 100 <= 8  # one batch's records read, not the file
    rest = list(it)
    assert sum(b["input_ids"].shape[0] for b in rest) == 92
    assert rows.read == 200


@pytest.mark.parametrize(("limit", "pair", "special"), [(1, False, 2), (2, False, 2), (3, True, 3)])
def test_a_max_length_that_leaves_no_text_is_refused(
    folders, tmp_path, capsys, limit, pair, special
):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"text": "a cat", "b": "the dog", "label": 0}) + "\n")
    argv = ["curvature", str(folders["bert"]), str(path), str(tmp_path / "o.safetensors")]
    argv += ["--max-length", str(limit), "--no-progress"]
    if pair:
        argv += ["--text-pair-field", "b"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"adds {special} special token(s)" in err and f"at least {special + 1}" in err
    assert not (tmp_path / "o.safetensors").exists()


def _run(model, path, out):
    assert cli.main(["curvature", str(model), str(path), str(out), "--no-progress"]) == 0
    return load_file(str(out))


@pytest.mark.parametrize(
    ("name", "model", "content"),
    [
        ("r.jsonl", "bert", '{"text": "a cat sat", "label": "positive"}\n{"text": "the mat", '
         '"label": 0}\n'),
        ("r.csv", "bert", "text,label\na cat sat,positive\nthe mat,0\n"),
        ("r.txt", "gpt2", "a cat sat\nthe mat\n"),
    ],
)  # fmt: skip
def test_a_byte_order_mark_is_skipped_in_every_format(folders, tmp_path, name, model, content):
    plain, marked = tmp_path / name, tmp_path / f"bom-{name}"
    plain.write_text(content, encoding="utf-8")
    marked.write_text(content, encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    a = _run(folders[model], plain, tmp_path / "a.safetensors")
    b = _run(folders[model], marked, tmp_path / "b.safetensors")
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=0, atol=0, msg=key)
