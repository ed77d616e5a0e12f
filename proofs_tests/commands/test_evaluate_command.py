"""`gradmerge evaluate MODEL... DATA`: accuracy and mean loss against brute force.

References: Hugging Face's own loss, one example at a time (``model(**enc, labels=...).loss``:
the cross-entropy of a classifier; for a causal LM the next-token NLL summed by hand from its
float64 logits, since HF's causal-LM loss is computed in float32), and argmax by hand, on tiny float64 BERT and GPT-2 folders with offline tokenizers
(proofs_tests/text_models.py); a LoRA adapter folder against peft's ``merge_and_unload`` of it;
an MLP entry point with ``--loss mse`` against ½‖f − y‖² by hand. Then bad input, as cases.
"""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from gradmerge import cli
from gradmerge.errors import ArgumentError, NonFiniteError, StructureError
from gradmerge.evaluation import evaluate
from proofs_tests.text_models import LABELS, bert_classifier, gpt2_lm

REVIEWS = [
    ("the movie was very good", "positive"),
    ("a dull film", "negative"),
    ("the plot is not bad", "neutral"),
    ("big red dog", "positive"),
    ("the cat sat on the mat", "neutral"),
    ("slow", "negative"),
    ("a very very good film with a big fun plot", "positive"),
]
SENTENCES = [
    "the cat sat on the mat",
    "a big dog ran fast",
    "the movie was not very good",
    "red blue",
    "the small blue cat is slow",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    reviews = root / "reviews.jsonl"
    reviews.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in REVIEWS))
    sentences = root / "sentences.txt"
    sentences.write_text("\n".join(SENTENCES) + "\n")
    return {
        "bert0": bert_classifier(root / "bert0", seed=0),
        "bert1": bert_classifier(root / "bert1", seed=1),
        "gpt2": gpt2_lm(root / "gpt2"),
        "reviews": reviews,
        "sentences": sentences,
        "root": root,
    }


def _evaluate(*argv):
    """Run `gradmerge evaluate ... --out -`; the JSON it prints."""
    code = cli.main(["evaluate", *map(str, argv), "--no-progress"])
    assert code == 0
    return code


def _json(capsys, *argv):
    capsys.readouterr()
    _evaluate(*argv, "--out", "-")
    return json.loads(capsys.readouterr().out)


def _brute_classifier(folder):
    """Per review: HF's cross-entropy and whether the argmax is the label (one at a time)."""
    model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    losses, correct, predicted = [], [], []
    with torch.no_grad():
        for text, label in REVIEWS:
            y = torch.tensor([LABELS.index(label)])
            out = model(**tok(text, return_tensors="pt"), labels=y)
            losses.append(float(out.loss))
            predicted.append(int(out.logits.argmax()))
            correct.append(int(predicted[-1] == int(y)))
    return losses, correct, predicted


def test_classifiers_equal_hugging_faces_loss_and_argmax(folders, capsys):
    report = _json(
        capsys,
        folders["bert0"],
        folders["bert1"],
        folders["reviews"],
        "--per-example",
        "--batch-size",
        3,
    )
    assert report["format"] == "gradmerge-evaluate/2"
    assert report["data"] == [str(folders["reviews"])]
    assert [row["model"] for row in report["models"]] == [
        str(folders["bert0"]),
        str(folders["bert1"]),
    ]
    for row, name in zip(report["models"], ("bert0", "bert1"), strict=True):
        losses, correct, predicted = _brute_classifier(folders[name])
        assert row["task"] == "sequence classification" and row["level"] == "example"
        assert row["examples"] == len(REVIEWS)
        assert row["per_example"]["correct"] == correct
        assert row["per_example"]["prediction"] == predicted
        torch.testing.assert_close(
            torch.tensor(row["per_example"]["loss"], dtype=torch.float64),
            torch.tensor(losses, dtype=torch.float64),
            rtol=1e-10,
            atol=1e-12,
        )
        assert row["accuracy"] == sum(correct) / len(REVIEWS)
        assert math.isclose(row["mean_loss"], sum(losses) / len(REVIEWS), rel_tol=1e-10)
        assert row["provenance"]["source.examples"] == str(len(REVIEWS))
    # two random models disagree somewhere, so the comparison above is not vacuous
    assert report["models"][0]["per_example"] != report["models"][1]["per_example"]


def test_a_causal_lm_scores_next_tokens(folders, capsys):
    report = _json(capsys, folders["gpt2"], folders["sentences"], "--per-example")
    row = report["models"][0]
    model = transformers.GPT2LMHeadModel.from_pretrained(folders["gpt2"]).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folders["gpt2"])
    sums, hits, counts = [], [], []
    with torch.no_grad():
        for text in SENTENCES:
            ids = tok(text, return_tensors="pt")["input_ids"]
            out = model(ids, labels=ids)  # HF shifts: the mean over the n - 1 next tokens
            n = ids.shape[1] - 1
            nll = -torch.log_softmax(out.logits[0, :-1], -1).gather(1, ids[0, 1:, None]).sum()
            # HF's loss upcasts the logits to float32 only: equal to that precision
            assert math.isclose(float(out.loss) * n, float(nll), rel_tol=1e-6)
            sums.append(float(nll))
            hits.append(int((out.logits[0, :-1].argmax(-1) == ids[0, 1:]).sum()))
            counts.append(n)
    assert row["task"] == "causal language modelling" and row["level"] == "token"
    assert row["examples"] == len(SENTENCES) and row["positions"] == sum(counts)
    assert row["per_example"]["positions"] == counts
    assert row["per_example"]["correct"] == hits
    assert "prediction" not in row["per_example"]
    torch.testing.assert_close(
        torch.tensor(row["per_example"]["loss"], dtype=torch.float64),
        torch.tensor(sums, dtype=torch.float64),
        rtol=1e-10,
        atol=1e-12,
    )
    assert math.isclose(row["mean_loss"], sum(sums) / sum(counts), rel_tol=1e-10)
    assert math.isclose(row["perplexity"], math.exp(sum(sums) / sum(counts)), rel_tol=1e-10)
    assert row["accuracy"] == sum(hits) / sum(counts)


def test_a_lora_adapter_folder_scores_as_its_merged_model(folders, capsys, tmp_path):
    peft = pytest.importorskip("peft")
    base = folders["bert0"]
    model = transformers.BertForSequenceClassification.from_pretrained(base)
    wrapped = peft.get_peft_model(
        model,
        peft.LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4, target_modules=["query", "value"]),
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    wrapped.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base)
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    wrapped.merge_and_unload().save_pretrained(tmp_path / "full")
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "full")
    report = _json(
        capsys, tmp_path / "adapter", tmp_path / "full", base, folders["reviews"], "--per-example"
    )
    adapter, full, plain = report["models"]
    assert adapter["per_example"]["correct"] == full["per_example"]["correct"]
    torch.testing.assert_close(
        torch.tensor(adapter["per_example"]["loss"]),
        torch.tensor(full["per_example"]["loss"]),
        rtol=1e-12,
        atol=1e-14,
    )
    assert adapter["per_example"]["loss"] != plain["per_example"]["loss"]  # the adapter acts


MLP = textwrap.dedent(
    """
    import torch

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                   torch.nn.Linear(4, 2)).double()
    """
)


def test_mse_on_a_tensor_file_and_the_json_file(tmp_path, capsys):
    (tmp_path / "m.py").write_text(MLP)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 3, generator=g, dtype=torch.float64)
    y = torch.randn(9, 2, generator=g, dtype=torch.float64)
    save_file({"inputs": x, "targets": y}, tmp_path / "d.safetensors")
    argv = [f"{tmp_path / 'm.py'}:mlp", tmp_path / "d.safetensors", "--loss", "mse"]
    _evaluate(*argv, "--batch-size", 4, "--out", tmp_path / "scores.json")
    row = json.loads((tmp_path / "scores.json").read_text())["models"][0]
    namespace: dict = {}
    exec(MLP, namespace)
    with torch.no_grad():
        expected = 0.5 * ((namespace["mlp"]()(x) - y) ** 2).sum(dim=1)
    assert row["accuracy"] is None and row["examples"] == 9
    assert math.isclose(row["mean_loss"], float(expected.mean()), rel_tol=1e-12)
    assert "wrote" in capsys.readouterr().out


# ----- the library function -------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(
    examples=st.integers(1, 12),
    classes=st.integers(2, 5),
    batch=st.integers(1, 5),
    seed=st.integers(0, 10_000),
)
def test_evaluate_equals_a_loop_over_examples(examples, classes, batch, seed):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(4, classes).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    x = torch.randn(examples, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (examples,), generator=g)
    data = [(x[i : i + batch], y[i : i + batch]) for i in range(0, examples, batch)]
    result = evaluate(model, data)
    losses, hits = [], []
    with torch.no_grad():
        for i in range(examples):
            logits = model(x[i])
            losses.append(float(torch.logsumexp(logits, 0) - logits[y[i]]))
            hits.append(int(int(logits.argmax()) == int(y[i])))
    assert result.correct_per_example == hits
    assert math.isclose(result.mean_loss, sum(losses) / examples, rel_tol=1e-12, abs_tol=1e-14)
    assert result.accuracy == sum(hits) / examples


def test_evaluate_refuses_what_it_cannot_score():
    model = torch.nn.Linear(2, 3)
    x = torch.randn(4, 2)
    with pytest.raises(ArgumentError, match="no position of DATA is scored"):
        evaluate(model, [(x, torch.full((4,), -100))])
    with pytest.raises(ArgumentError, match="data is empty"):
        evaluate(model, [])
    with pytest.raises(StructureError, match="earlier batches"):
        evaluate(
            torch.nn.Identity(),
            [
                (torch.randn(2, 3), torch.tensor([0, 1])),
                (torch.randn(2, 2, 3), torch.zeros(2, 2, dtype=torch.long)),
            ],
        )
    broken = torch.nn.Linear(2, 3)
    with torch.no_grad():
        broken.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="NaN/Inf"):
        evaluate(broken, [(x, torch.tensor([0, 1, 2, 0]))])


# ----- bad input ------------------------------------------------------------------------------
def _nan_model(folders, tmp_path):
    model = transformers.BertForSequenceClassification.from_pretrained(folders["bert0"])
    with torch.no_grad():
        model.classifier.weight.fill_(float("nan"))
    model.save_pretrained(tmp_path / "nan")
    transformers.AutoTokenizer.from_pretrained(folders["bert0"]).save_pretrained(tmp_path / "nan")
    return tmp_path / "nan"


def _bad_labels(folders, tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "a film", "label": "great"}) + "\n")
    return tmp_path / "bad.jsonl"


BAD = [
    # (name, argv builder, exit code, stderr fragment)
    ("per-example without --out", lambda f, t: [f["bert0"], f["reviews"], "--per-example"], 2,
     "--per-example adds lists"),
    ("--out exists", lambda f, t: [f["bert0"], f["reviews"], "--out", _old(t)], 2,
     "exists; pass --overwrite"),
    ("--out is DATA", lambda f, t: [f["bert0"], f["reviews"], "--out", f["reviews"],
                                    "--overwrite"], 2, "is DATA"),
    ("--out inside a model", lambda f, t: [f["bert0"], f["reviews"], "--out",
                                           f["bert0"] / "scores.json"], 2, "lies inside MODEL"),
    ("--out is a folder", lambda f, t: [f["bert0"], f["reviews"], "--out", t], 2, "is a folder"),
    ("no such model", lambda f, t: [t / "nothing", f["reviews"]], 2, "neither a folder"),
    ("no such data", lambda f, t: [f["bert0"], t / "none.jsonl"], 2, "does not exist"),
    ("text flag on a tensor file", lambda f, t: [f["bert0"], _tensor(t), "--text-field", "x"], 2,
     "apply to text DATA"),
    ("NaN weights", lambda f, t: [f["bert0"], _nan_model(f, t), f["reviews"], "--out",
                                  t / "s.json"], 1, "NaN/Inf"),
    ("unknown label", lambda f, t: [f["bert0"], _bad_labels(f, t), "--out", t / "s.json"], 1,
     "not a label of the model"),
]  # fmt: skip


def _old(tmp_path):
    (tmp_path / "old.json").write_text("{}")
    return tmp_path / "old.json"


def _tensor(tmp_path):
    save_file({"inputs": torch.zeros(2, 3), "targets": torch.zeros(2)}, tmp_path / "t.safetensors")
    return tmp_path / "t.safetensors"


@pytest.mark.parametrize(("name", "argv", "code", "message"), BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_refused_and_writes_nothing(folders, tmp_path, capsys, name, argv, code,
                                                 message):  # fmt: skip
    before = sorted(p.name for p in tmp_path.iterdir())
    args = ["evaluate", *map(str, argv(folders, tmp_path)), "--no-progress"]
    if code == 2:
        with pytest.raises(SystemExit) as exit_:
            cli.main(args)
        assert exit_.value.code == 2
    else:
        assert cli.main(args) == 1
    assert message in capsys.readouterr().err
    made = {"nan", "bad.jsonl", "t.safetensors", "old.json"}  # inputs the cases build
    assert sorted(p.name for p in tmp_path.iterdir() if p.name not in made) == [
        p for p in before if p not in made
    ]
    assert not list(folders["root"].rglob("scores.json"))


def test_the_json_is_not_clobbered_by_a_failing_run(folders, tmp_path):
    out = tmp_path / "scores.json"
    assert cli.main(["evaluate", str(folders["bert0"]), str(folders["reviews"]), "--out",
                     str(out), "--no-progress"]) == 0  # fmt: skip
    first = out.read_text()
    bad = _nan_model(folders, tmp_path)
    code = cli.main(
        ["evaluate", str(bad), str(folders["reviews"]), "--out", str(out), "--overwrite",
         "--no-progress"]
    )  # fmt: skip
    assert code == 1 and out.read_text() == first
    assert load_file(str(bad / "model.safetensors"))  # the inputs are untouched


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), examples=st.integers(1, 9))
def test_in_order_undoes_a_permutation_of_the_examples(seed, examples):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(3, 4).double()
    x = torch.randn(examples, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (examples,), generator=g)
    order = torch.randperm(examples, generator=g).tolist()
    straight = evaluate(model, [(x, y)])
    shuffled = evaluate(model, [(x[order], y[order])]).in_order(order)
    assert shuffled.predictions == straight.predictions
    assert shuffled.correct_per_example == straight.correct_per_example
    torch.testing.assert_close(
        torch.tensor(shuffled.loss_per_example), torch.tensor(straight.loss_per_example)
    )
    with pytest.raises(ArgumentError, match="permutation"):
        straight.in_order([0] * examples if examples > 1 else [1])


def test_issue29_a_causal_lm_says_it_ignores_the_labels(folders, capsys):
    """Labelled records scored by a causal LM: the labels take no part (next-token prediction
    of the text), and the command says so instead of ignoring them silently; records without
    the field get no such line, and a classifier uses it."""
    capsys.readouterr()
    assert (
        cli.main(["evaluate", str(folders["gpt2"]), str(folders["reviews"]), "--no-progress"]) == 0
    )
    err = capsys.readouterr().err
    assert f"{len(REVIEWS)} of {len(REVIEWS)} records have a `label` field" in err
    assert "a causal LM ignores it (it is scored on next-token prediction of the text)" in err
    assert cli.main(["evaluate", str(folders["gpt2"]), str(folders["sentences"]),
                     "--no-progress"]) == 0  # fmt: skip
    assert "ignores it" not in capsys.readouterr().err
    assert cli.main(["evaluate", str(folders["bert0"]), str(folders["reviews"]),
                     "--no-progress"]) == 0  # fmt: skip
    assert "ignores it" not in capsys.readouterr().err
