"""Text DATA for `gradmerge curvature`: the same curvature as the same examples given as tensors.

Reference: a tensor file built here with the model folder's tokenizer called directly (padding to
the longest example, labels mapped by hand through the config's label2id; for the causal LM,
labels = input_ids with --shift-labels, the convention of tensor files checked against Hugging
Face's own loss in proofs_tests/unit/cli/test_cli_curvature.py). Models are tiny float64 BERT and
GPT-2 folders with offline tokenizers (proofs_tests/text_models.py), so curvatures agree to
round-off. Then every format (.jsonl, .csv, .tsv, .txt, datasets folder) against the JSONL, and
bad input for each.
"""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.errors import ArgumentError, FileFormatError, StructureError
from gradmerge.io.sources import load_data, load_model
from gradmerge.io.text_data import TextOptions, label_id
from proofs_tests.text_models import LABELS, bert_classifier, gpt2_lm

REVIEWS = [
    ("the movie was very good", "positive", "fun plot"),
    ("a dull film", "negative", "bad actor"),
    ("the plot is not bad", "neutral", "the actor"),
    ("big red dog", "positive", "very fun"),
    ("the cat sat on the mat", "neutral", "a film"),
    ("slow", "negative", "not good"),
    ("a very very good film with a big fun plot", "positive", "good"),
]
SENTENCES = [
    "the cat sat on the mat",
    "a big dog ran fast",
    "the movie was not very good",
    "red",
    "the small blue cat is slow",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    return {"bert": bert_classifier(root / "bert"), "gpt2": gpt2_lm(root / "gpt2")}


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _reviews(pairs: bool = False, ids: bool = False):
    return [
        {
            "text": text,
            "label": LABELS.index(label) if ids else label,
            **({"second": second} if pairs else {}),
        }
        for text, label, second in REVIEWS
    ]


def _curvature(*argv):
    """Run `gradmerge curvature`; the file's tensors and metadata."""
    assert cli.main(["curvature", *map(str, argv), "--no-progress"]) == 0
    out = str(argv[2])
    return SimpleNamespace(tensors=load_file(out), meta=gm.load_curvature(out).meta)


def _assert_same(a, b):
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, x in a.tensors.items():
        torch.testing.assert_close(x, b.tensors[name], rtol=1e-10, atol=1e-14, msg=name)


def _bert_tensors(folder, path, *, pairs: bool = False):
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    texts = [t for t, _, _ in REVIEWS]
    enc = (
        tok(texts, [s for _, _, s in REVIEWS], padding=True) if pairs else tok(texts, padding=True)
    )
    tensors = {k: torch.tensor(v) for k, v in enc.items()}
    tensors["labels"] = torch.tensor([LABELS.index(label) for _, label, _ in REVIEWS])
    torch.save(tensors, path)
    return path


@pytest.mark.parametrize("structure", ["diag", "kfac"])
def test_classification_jsonl_equals_the_same_examples_as_tensors(folders, tmp_path, structure):
    bert = folders["bert"]
    jsonl = _write_jsonl(tmp_path / "reviews.jsonl", _reviews())
    tensors = _bert_tensors(bert, tmp_path / "reviews.pt")
    common = ["--structure", structure, "--batch-size", "3"]
    from_text = _curvature(bert, jsonl, tmp_path / "text.safetensors", *common)
    from_tensors = _curvature(bert, tensors, tmp_path / "tensors.safetensors", *common)
    _assert_same(from_text, from_tensors)
    assert from_text.meta["num_examples"] == str(len(REVIEWS))
    assert from_text.meta["source.examples"] == str(len(REVIEWS))
    tok = transformers.AutoTokenizer.from_pretrained(bert, local_files_only=True)
    tokens = sum(len(tok(t)["input_ids"]) for t, _, _ in REVIEWS)
    assert from_text.meta["source.tokens"] == str(tokens)
    assert from_text.meta["source.task"] == "sequence classification"


@pytest.mark.parametrize("structure", ["diag", "kfac"])
def test_causal_lm_text_equals_shifted_token_tensors(folders, tmp_path, structure):
    gpt2 = folders["gpt2"]
    jsonl = _write_jsonl(tmp_path / "lm.jsonl", [{"text": s} for s in SENTENCES])
    tok = transformers.AutoTokenizer.from_pretrained(gpt2, local_files_only=True)
    enc = [tok(s)["input_ids"] for s in SENTENCES]
    width = max(map(len, enc))
    ids = torch.tensor([e + [0] * (width - len(e)) for e in enc])
    mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in enc])
    torch.save({"input_ids": ids, "labels": ids, "attention_mask": mask}, tmp_path / "lm.pt")
    common = ["--structure", structure, "--batch-size", "2"]
    from_text = _curvature(gpt2, jsonl, tmp_path / "text.safetensors", *common)
    from_tensors = _curvature(
        gpt2, tmp_path / "lm.pt", tmp_path / "tensors.safetensors", *common, "--shift-labels"
    )
    _assert_same(from_text, from_tensors)
    assert from_text.meta["source.tokens"] == str(sum(map(len, enc)))
    assert from_text.meta["source.task"] == "causal language modelling"


def test_causal_lm_labels_are_the_next_tokens_with_padding_ignored(folders):
    """The batches themselves: labels[:, s] = input_ids[:, s + 1], -100 at the end and padding."""
    model = load_model(str(folders["gpt2"]))
    tmp = folders["gpt2"].parent / "two.txt"
    tmp.write_text("the cat sat\nred\n")
    (batch,) = load_data(str(tmp), model=model, tokenizer=str(folders["gpt2"]), batch_size=2)
    ids = batch["input_ids"]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[ids[0, 1].item(), ids[0, 2].item(), -100], [-100] * 3]


def test_sentence_pairs_equal_tensors_of_the_pairs(folders, tmp_path):
    bert = folders["bert"]
    jsonl = _write_jsonl(tmp_path / "pairs.jsonl", _reviews(pairs=True))
    tensors = _bert_tensors(bert, tmp_path / "pairs.pt", pairs=True)
    from_text = _curvature(
        bert, jsonl, tmp_path / "text.safetensors", "--text-pair-field", "second"
    )
    _assert_same(from_text, _curvature(bert, tensors, tmp_path / "tensors.safetensors"))
    single = _curvature(bert, jsonl, tmp_path / "single.safetensors")
    assert int(from_text.meta["source.tokens"]) > int(single.meta["source.tokens"])  # pairs used
    assert any(not torch.equal(single.tensors[k], from_text.tensors[k]) for k in single.tensors)


def _write_csv(path, records, delimiter):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(records)
    return path


def test_every_format_gives_the_jsonl_curvature(folders, tmp_path):
    datasets = pytest.importorskip("datasets")
    bert, gpt2 = folders["bert"], folders["gpt2"]
    records = [{"review": r["text"], "y": r["label"]} for r in _reviews()]
    flags = ["--text-field", "review", "--label-field", "y"]
    reference = _curvature(
        bert, _write_jsonl(tmp_path / "r.jsonl", records), tmp_path / "ref.safetensors", *flags
    )
    folder = tmp_path / "reviews_ds"
    datasets.Dataset.from_list(records).save_to_disk(str(folder))
    ids = [{"review": r["review"], "y": LABELS.index(r["y"])} for r in records]
    for name, data in {
        "csv": _write_csv(tmp_path / "r.csv", records, ","),
        "tsv": _write_csv(tmp_path / "r.tsv", records, "\t"),
        "ids.jsonl": _write_jsonl(tmp_path / "ids.jsonl", ids),  # ids instead of names
        "ids.csv": _write_csv(tmp_path / "ids.csv", ids, ","),
        "datasets": folder,
    }.items():
        _assert_same(_curvature(bert, data, tmp_path / f"{name}.safetensors", *flags), reference)
    lm_ref = _curvature(
        gpt2,
        _write_jsonl(tmp_path / "lm.jsonl", [{"text": s} for s in SENTENCES]),
        tmp_path / "lm.safetensors",
    )
    txt = tmp_path / "lm.txt"
    txt.write_text("\n".join(SENTENCES[:2]) + "\n\n" + "\n".join(SENTENCES[2:]) + "\n")  # a blank
    _assert_same(_curvature(gpt2, txt, tmp_path / "txt.safetensors"), lm_ref)


def test_max_length_truncates_and_reports(folders, tmp_path, capsys):
    bert = folders["bert"]
    jsonl = _write_jsonl(tmp_path / "r.jsonl", _reviews())
    c = _curvature(bert, jsonl, tmp_path / "c.safetensors", "--max-length", "6")
    tok = transformers.AutoTokenizer.from_pretrained(bert, local_files_only=True)
    lengths = [len(tok(t)["input_ids"]) for t, _, _ in REVIEWS]
    cut = sum(n > 6 for n in lengths)
    assert cut > 0
    assert c.meta["source.truncated"] == str(cut)
    assert c.meta["source.tokens"] == str(sum(min(n, 6) for n in lengths))
    assert f"{cut} truncated" in capsys.readouterr().err
    # the same as tensors truncated by the tokenizer itself
    texts = [t for t, _, _ in REVIEWS]
    enc = tok(texts, padding=True, truncation=True, max_length=6)
    tensors = {k: torch.tensor(v) for k, v in enc.items()}
    tensors["labels"] = torch.tensor([LABELS.index(label) for _, label, _ in REVIEWS])
    torch.save(tensors, tmp_path / "cut.pt")
    _assert_same(c, _curvature(bert, tmp_path / "cut.pt", tmp_path / "t.safetensors"))


def test_max_examples_keeps_the_first_examples(folders, tmp_path):
    bert = folders["bert"]
    jsonl = _write_jsonl(tmp_path / "r.jsonl", _reviews())
    head = _write_jsonl(tmp_path / "head.jsonl", _reviews()[:4])
    c = _curvature(bert, jsonl, tmp_path / "c.safetensors", "--max-examples", "4")
    _assert_same(c, _curvature(bert, head, tmp_path / "h.safetensors"))
    assert c.meta["num_examples"] == "4"
    tensors = _bert_tensors(bert, tmp_path / "r.pt")
    t = _curvature(bert, tensors, tmp_path / "t.safetensors", "--max-examples", "4")
    assert t.meta["num_examples"] == "4"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("positive", 2), (0, 0), ("1", 1), ("negative", 0)],
)
def test_label_names_and_ids(value, expected):
    assert label_id(value, {n: i for i, n in enumerate(LABELS)}, 3, "row") == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("happy", "label 'happy' is not a label"),
        (3, "label id 3 is out of range"),
        ("-1", "label id -1 is out of range"),
        (1.5, "label 1.5 is not a label"),
        (True, "label True is not a label"),
        (None, "label None is not a label"),
    ],
)
def test_bad_labels_list_the_known_ones(value, message):
    with pytest.raises(FileFormatError, match=message) as err:
        label_id(value, {n: i for i, n in enumerate(LABELS)}, 3, "row 4")
    assert "'negative', 'neutral', 'positive'" in str(err.value)
    assert "row 4" in str(err.value)


# ----- bad input, per format -------------------------------------------------------------------
def _error(capsys, *argv) -> str:
    assert cli.main(["curvature", *map(str, argv), "--no-progress"]) == 1
    return capsys.readouterr().err


BAD_FILES = [
    ("bad.jsonl", '{"text": "a cat", "label": 0}\n{"text": "a dog", "label"\n', "line 2: not JSON"),
    ("list.jsonl", '["a cat", 0]\n', "line 1: a JSON list; expected an object"),
    ("empty.jsonl", "\n\n", "holds no examples"),
    ("nofield.jsonl", '{"review": "a cat", "label": 0}\n', "has no field 'text'"),
    ("nolabel.jsonl", '{"text": "a cat", "y": 0}\n', "--label-field"),
    ("unknown.jsonl", '{"text": "a cat", "label": "happy"}\n', "'happy' is not a label"),
    ("number.jsonl", '{"text": 3, "label": 0}\n', "holds int 3; expected text"),
    ("ragged.csv", "text,label\na cat,0\na dog,1,extra\n", "line 3: 2 columns"),
    ("short.tsv", "text\tlabel\na cat\n", "fewer"),
    ("empty.csv", "", "expected a header row"),
    ("unknown.csv", "text,label\na cat,happy\n", "'happy' is not a label"),
    ("latin1.jsonl", b'{"text": "caf\xe9", "label": 0}\n', "not UTF-8"),
    ("nolabel.txt", "a cat\n", "has no field 'label'"),  # .txt has no labels: not for classifiers
]


@pytest.mark.parametrize(("name", "content", "message"), BAD_FILES)
def test_bad_text_files_are_typed_errors(folders, tmp_path, capsys, name, content, message):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    err = _error(capsys, folders["bert"], path, tmp_path / "o.safetensors")
    assert message in err
    assert not (tmp_path / "o.safetensors").exists()


def test_a_dataset_dict_names_its_splits(folders, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    split = datasets.Dataset.from_list(_reviews())
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    err = _error(capsys, folders["bert"], tmp_path / "dd", tmp_path / "o.safetensors")
    assert "splits ['test', 'train']" in err and "dd/test" in err
    (tmp_path / "plain").mkdir()
    err = _error(capsys, folders["bert"], tmp_path / "plain", tmp_path / "o.safetensors")
    assert "not a dataset saved with save_to_disk" in err


def test_tokens_outside_the_vocabulary_are_an_error(folders, tmp_path, capsys):
    small = tmp_path / "small"
    model = transformers.BertForSequenceClassification.from_pretrained(folders["bert"])
    model.resize_token_embeddings(6)  # the tokenizer's ids go up to 30
    model.save_pretrained(small)
    jsonl = _write_jsonl(tmp_path / "r.jsonl", _reviews())
    err = _error(capsys, small, jsonl, tmp_path / "o.safetensors", "--tokenizer", folders["bert"])
    assert "outside the model's vocabulary of 6" in err
    err = _error(capsys, small, jsonl, tmp_path / "o.safetensors")
    assert "no usable tokenizer" in err


def test_sequences_longer_than_the_positions_are_an_error(folders, tmp_path, capsys):
    long = " ".join(["the cat"] * 20)  # 40 words + 2 special tokens > 24 positions
    jsonl = _write_jsonl(tmp_path / "long.jsonl", [{"text": long, "label": 0}])
    err = _error(capsys, folders["bert"], jsonl, tmp_path / "o.safetensors")
    assert "42 tokens, but the model has 24 positions; pass --max-length 24" in err
    err = _error(capsys, folders["bert"], jsonl, tmp_path / "o.safetensors", "--max-length", "30")
    assert "--max-length 30 exceeds the model's 24 positions" in err
    assert (
        _curvature(folders["bert"], jsonl, tmp_path / "o.safetensors", "--max-length", "24").meta[
            "source.truncated"
        ]
        == "1"
    )


@pytest.mark.parametrize(
    ("data", "flags", "message"),
    [
        ("r.pt", ["--text-field", "x"], "--text-field apply to text DATA"),
        ("r.pt", ["--max-length", "5"], "--max-length apply to text DATA"),
        ("r.jsonl", ["--shift-labels"], "--shift-labels applies to tensor files"),
        ("r.jsonl", ["--max-length", "0"], "--max-length must be at least 1"),
        ("r.jsonl", ["--data-arg", "task=a"], "--data-arg applies to entry points"),
        ("r.jsonl", ["--model-arg", "n=1"], "--model-arg applies to entry points"),
    ],
)
def test_flags_for_another_kind_of_data_are_usage_errors(
    folders, tmp_path, capsys, data, flags, message
):
    _write_jsonl(tmp_path / "r.jsonl", _reviews())
    _bert_tensors(folders["bert"], tmp_path / "r.pt")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["curvature", str(folders["bert"]), str(tmp_path / data), "o.st", *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_model_of_another_task_is_refused(tmp_path, capsys, folders):
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
        max_position_embeddings=24,
    )
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "mlm")
    jsonl = _write_jsonl(tmp_path / "r.jsonl", _reviews())
    err = _error(
        capsys, tmp_path / "mlm", jsonl, tmp_path / "o.safetensors", "--tokenizer", folders["bert"]
    )
    assert "needs a sequence-classification or causal-LM model" in err


def test_text_needs_a_tokenizer_folder_for_an_entry_point_model(tmp_path, capsys):
    (tmp_path / "m.py").write_text("import torch\ndef model():\n    return torch.nn.Linear(2, 2)\n")
    jsonl = _write_jsonl(tmp_path / "r.jsonl", _reviews())
    err = _error(capsys, f"{tmp_path / 'm.py'}:model", jsonl, tmp_path / "o.safetensors")
    assert "is not a folder" in err and "--tokenizer" in err


def test_text_options_default_to_the_documented_fields():
    assert TextOptions() == TextOptions("text", None, "label", None, None)


# ----- tensor files with one label per sequence -------------------------------------------------
def test_per_sequence_labels_refuse_shift_labels(folders, tmp_path, capsys):
    tensors = _bert_tensors(folders["bert"], tmp_path / "r.pt")
    err = _error(capsys, folders["bert"], tensors, tmp_path / "o.safetensors", "--shift-labels")
    assert "one class per sequence" in err and "leave it out" in err


def test_mismatched_per_position_labels_suggest_the_per_sequence_form(tmp_path, capsys, folders):
    ids = torch.ones(4, 5, dtype=torch.long)
    torch.save(
        {"input_ids": ids, "attention_mask": ids, "labels": torch.zeros(4, 3, dtype=torch.long)},
        tmp_path / "bad.pt",
    )
    err = _error(capsys, folders["bert"], tmp_path / "bad.pt", tmp_path / "o.safetensors")
    assert "one class per sequence, shape (4,)" in err


def test_errors_are_typed(folders, tmp_path):
    model = load_model(str(folders["bert"]))
    bad = _write_jsonl(tmp_path / "r.jsonl", [{"text": "a", "label": "happy"}])
    with pytest.raises(FileFormatError):
        load_data(str(bad), model=model, tokenizer=str(folders["bert"]))
    with pytest.raises(ArgumentError, match="needs the model"):
        load_data(str(bad))
    long = _write_jsonl(tmp_path / "l.jsonl", [{"text": "a " * 40, "label": 0}])
    with pytest.raises(StructureError):
        load_data(str(long), model=model, tokenizer=str(folders["bert"]))
