"""The text data of benchmarks/realnet.py: one label space, three real text domains.

Labels (the same for every task): ``files`` (file systems, paths, archives), ``network``
(sockets, HTTP, asynchronous I/O, mail), ``numbers`` (arithmetic, special functions, statistics,
random numbers). Domains (one task each), all text written by the authors of installed software,
none by gradmerge's:

- ``stdlib-docs``: first paragraphs of docstrings of Python standard-library modules;
- ``package-docs``: first paragraphs of docstrings of third-party packages installed beside
  gradmerge (fsspec, filelock, pathspec; tornado, anyio, h11, zmq; numpy, mpmath, scipy.special);
- ``code-comments``: ``#`` comments (consecutive lines joined) of the standard-library modules'
  source files.

Module and package names are masked (``lib``) so that a text cannot be classified by naming its
source. Texts that occur under two labels of a domain are dropped. ``python -m benchmarks.realnet_data``
rebuilds ``benchmarks/data/realnet-texts.jsonl`` (one JSON object per text: ``domain``, ``label``,
``text``, ``source``) and its provenance file (Python and package versions, modules, SHA-256).
The committed file is what the study reads, so the study does not depend on what is installed;
its texts keep the licences of their sources (PSF licence for the standard library; BSD, MIT or
Apache-2.0 for the packages, as their distributions state).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import io
import json
import platform
import re
import sys
import tokenize
import warnings
from pathlib import Path

from benchmarks.minilm import MASKED, _builtin_docs, module_texts

DATA = Path(__file__).resolve().parent / "data"
TEXTS = DATA / "realnet-texts.jsonl"
PROVENANCE = DATA / "realnet-texts.provenance.json"
LABELS = ("files", "network", "numbers")

STDLIB = {
    "files": ["os", "shutil", "pathlib", "tarfile", "zipfile", "tempfile", "glob", "gzip",
              "filecmp", "fnmatch", "stat", "io", "bz2", "lzma", "fileinput", "ntpath",
              "posixpath", "genericpath"],
    "network": ["socket", "asyncio.streams", "asyncio.base_events", "asyncio.events",
                "asyncio.selector_events", "asyncio.transports", "asyncio.protocols",
                "http.client", "http.server", "http.cookiejar", "urllib.request",
                "urllib.parse", "ssl", "smtplib", "selectors", "email.message", "ftplib",
                "imaplib", "poplib", "socketserver", "xmlrpc.client"],
    "numbers": ["math", "decimal", "_pydecimal", "statistics", "random", "fractions", "cmath",
                "numbers", "colorsys", "datetime", "calendar", "_strptime"],
}  # fmt: skip
PACKAGES = {
    "files": ["fsspec", "fsspec.spec", "fsspec.implementations.local",
              "fsspec.implementations.zip", "fsspec.implementations.tar",
              "fsspec.implementations.memory", "fsspec.implementations.dirfs",
              "fsspec.implementations.cached", "filelock", "pathspec"],
    "network": ["tornado.httpclient", "tornado.iostream", "tornado.tcpserver",
                "tornado.tcpclient", "tornado.netutil", "tornado.httputil", "tornado.web",
                "tornado.websocket", "anyio", "h11", "zmq"],
    "numbers": ["numpy", "numpy.linalg", "numpy.random", "numpy.polynomial.polynomial",
                "mpmath", "scipy.special", "scipy.stats"],
}  # fmt: skip
PACKAGE_NAMES = re.compile(
    r"\b(fsspec|filelock|pathspec|tornado|Tornado|anyio|AnyIO|h11|zmq|ZMQ|ZeroMQ|ØMQ|pyzmq|"
    r"numpy|NumPy|np|mpmath|mpf|scipy|SciPy|asyncio|urllib|ssl|decimal|Decimal)\b"
)
PER_LABEL = 200
"""Texts kept per domain and label (the first by SHA-256 of the text: a fixed, unbiased pick)."""
COMMENT_WORDS = 5
"""A comment paragraph needs at least this many words (and letters in most of them)."""


def _mask(text: str) -> str:
    return PACKAGE_NAMES.sub("lib", MASKED.sub("lib", text))


def comment_texts(modules: list[str]) -> list[str]:
    """``#`` comments of the modules' source files, consecutive comment lines joined."""
    texts: dict[str, None] = {}
    for name in modules:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):  # a C module: no source
            continue
        block: list[str] = []
        last = -2
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            line = tok.string.lstrip("#").strip()
            if tok.start[0] != last + 1 and block:
                _keep(" ".join(block), texts)
                block = []
            if line and not line.startswith(("!", "-*-", "type:", "noqa", "pragma", "XXX")):
                block.append(line)
            last = tok.start[0]
        if block:
            _keep(" ".join(block), texts)
    return list(texts)


def _keep(text: str, texts: dict[str, None]) -> None:
    words = text.split()
    if len(words) >= COMMENT_WORDS and sum(w.isalpha() for w in words) >= len(words) // 2:
        texts[_mask(" ".join(words))] = None


def build() -> list[dict[str, str]]:
    """Every (domain, label, text, source) row, deterministic for given installed versions."""
    skip = _builtin_docs()
    rows = []
    for domain, per_label in (
        ("stdlib-docs", {k: module_texts(v, skip) for k, v in STDLIB.items()}),
        ("package-docs", {k: module_texts(v, skip) for k, v in PACKAGES.items()}),
        ("code-comments", {k: comment_texts(v) for k, v in STDLIB.items()}),
    ):
        counts: dict[str, int] = {}
        masked = {label: [_mask(t) for t in texts] for label, texts in per_label.items()}
        for texts in masked.values():
            for text in set(texts):
                counts[text] = counts.get(text, 0) + 1
        for label in LABELS:
            unique = {t for t in masked[label] if counts[t] == 1}
            chosen = sorted(unique, key=lambda t: hashlib.sha256(t.encode()).hexdigest())
            rows += [{"domain": domain, "label": label, "text": t} for t in chosen[:PER_LABEL]]
    return rows


def main() -> int:
    rows = build()
    DATA.mkdir(exist_ok=True)
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    TEXTS.write_text(payload)
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        counts.setdefault(r["domain"], {}).setdefault(r["label"], 0)
        counts[r["domain"]][r["label"]] += 1
    versions, licences = {}, {}
    for dist in ("numpy", "scipy", "mpmath", "fsspec", "filelock", "pathspec", "tornado",
                 "anyio", "h11", "pyzmq"):  # fmt: skip
        try:
            meta = importlib.metadata.metadata(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        versions[dist] = meta["Version"]
        licences[dist] = meta.get("License-Expression") or meta.get("License") or ""
        licences[dist] = licences[dist].splitlines()[0][:80] if licences[dist] else "see package"
    provenance = {
        "built by": "python -m benchmarks.realnet_data",
        "python": platform.python_version(),
        "packages": versions,
        "modules": {"stdlib-docs": STDLIB, "package-docs": PACKAGES, "code-comments": STDLIB},
        "counts": counts,
        "sha256": hashlib.sha256(payload.encode()).hexdigest(),
        "licences": {"python standard library": "PSF-2.0"} | licences,
        "note": "each text keeps the licence of the package it was taken from",
    }
    PROVENANCE.write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(counts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
