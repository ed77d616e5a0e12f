"""Text DATA at scale: tokenising time and peak memory against the size of the file.

Two sections, on a tiny BERT classifier with a word-level tokenizer
(``proofs_tests/text_models.py``), so that reading and tokenising dominate:

- ``tokenise``: a JSONL file of ``--lines`` short reviews (default 10⁶). Timed: the checking pass
  of :class:`gradmerge.io.text_data.TextBatches` (read, tokenise, check, count every example),
  one pass over its padded batches, and as the baseline the tokenizer alone over the same texts
  in the same batches, read from memory. Ratios are against that baseline.
- ``memory``: JSONL files of ``--sizes-mb`` (generated under ``--tmp``, deleted after), each run
  in a fresh process. ``data``: the checking pass and one pass over the batches, as
  ``gradmerge curvature`` reads them; ``curvature`` (sizes up to ``--curvature-max-mb``): the
  whole ``gradmerge curvature MODEL DATA OUT`` command. Recorded: the child's peak resident
  memory (``ru_maxrss``) and, as its floor, that of a process that loads the same model and
  tokenizer and reads no data.

The load average is recorded with every figure (this machine is shared).

    python -m benchmarks.text_data                           # both sections, writes JSON
    python -m benchmarks.text_data --sections memory --sizes-mb 10,100,1000
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.record import RESULTS, Run, load, write_result

LABELS = ("negative", "neutral", "positive")


def write_jsonl(path: Path, *, lines: int | None = None, size: int | None = None) -> int:
    """Reviews of 4 to 24 words, one JSON object per line, until ``lines`` lines or ``size``
    bytes; the number of lines written."""
    from proofs_tests.text_models import WORDS

    rng = random.Random(0)
    written = count = 0
    with path.open("w") as f:
        while (lines is None or count < lines) and (size is None or written < size):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
            line = json.dumps({"text": text, "label": rng.choice(LABELS)}) + "\n"
            f.write(line)
            written += len(line)
            count += 1
    return count


# ----- tokenise ---------------------------------------------------------------------------------
def tokenise(folder: Path, tmp: Path, lines: int, batch_size: int) -> dict[str, Any]:
    from gradmerge.io.sources import load_model
    from gradmerge.io.text_data import TextBatches, load_tokenizer, read_records

    path = tmp / "tokenise.jsonl"
    write_jsonl(path, lines=lines)
    model, tokenizer = load_model(str(folder)), load_tokenizer(str(folder))
    texts = [json.loads(line)["text"] for line in path.open()]
    row: dict[str, Any] = {"lines": lines, "bytes": path.stat().st_size, "batch_size": batch_size}
    start, row["load_before"] = time.perf_counter(), load()
    for i in range(0, len(texts), batch_size):
        tokenizer(texts[i : i + batch_size], verbose=False)
    row["tokenizer_alone_s"] = time.perf_counter() - start
    del texts
    start = time.perf_counter()
    batches = TextBatches(read_records(str(path)), model=model, tokenizer=tokenizer,
                          batch_size=batch_size)  # fmt: skip
    row["checking_pass_s"] = time.perf_counter() - start
    start = time.perf_counter()
    seen = sum(int(b["labels"].shape[0]) for b in batches)
    row["batches_pass_s"] = time.perf_counter() - start
    row["load_after"] = load()
    assert seen == batches.examples == lines, (seen, batches.examples, lines)
    row["checking_pass_over_tokenizer"] = row["checking_pass_s"] / row["tokenizer_alone_s"]
    row["batches_pass_over_tokenizer"] = row["batches_pass_s"] / row["tokenizer_alone_s"]
    row["lines_per_s_checking_pass"] = lines / row["checking_pass_s"]
    path.unlink()
    return row


# ----- memory -----------------------------------------------------------------------------------
PEAK = (
    "import re; print(int(re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read())"
    "[1]) * 1024)"
)
"""Print this process's peak resident memory (VmHWM: of this program only; ``ru_maxrss`` of a
child also counts the memory of the process it was forked from)."""

CHILD = """
import sys
from gradmerge.io.sources import load_data, load_model
model = load_model(sys.argv[1])
if sys.argv[2] != "-":
    data = load_data(sys.argv[2], model=model, tokenizer=sys.argv[1], batch_size=int(sys.argv[3]))
    assert sum(int(b["labels"].shape[0]) for b in data) == data.examples
"""

CURVATURE = "import sys; from gradmerge.cli import main; rc = main(sys.argv[1:]); assert rc == 0\n"


def child_rss(argv: list[str]) -> tuple[float, int]:
    """Run ``argv`` (a ``python -c CODE`` line, :data:`PEAK` appended to CODE); its wall time
    and peak resident memory (bytes)."""
    argv = [*argv[:2], argv[2] + "\n" + PEAK, *argv[3:]]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[3:]} exited {done.returncode}: {done.stderr[-2000:]}")
    return time.perf_counter() - start, int(done.stdout.split()[-1])


def memory(
    folder: Path, tmp: Path, sizes_mb: list[int], batch_size: int, curvature_max_mb: int
) -> list[dict[str, Any]]:
    python = sys.executable
    env_argv = [python, "-c", CHILD, str(folder)]
    _, floor = child_rss([*env_argv, "-", str(batch_size)])
    rows = []
    for mb in sizes_mb:
        path = tmp / f"memory-{mb}mb.jsonl"
        lines = write_jsonl(path, size=mb * 10**6)
        row: dict[str, Any] = {"size_mb": mb, "bytes": path.stat().st_size, "lines": lines}
        row["floor_rss_bytes"] = floor
        row["load_before"] = load()
        seconds, rss = child_rss([*env_argv, str(path), str(batch_size)])
        row.update(data_s=seconds, data_peak_rss_bytes=rss, data_rss_over_file=rss / row["bytes"])
        if mb <= curvature_max_mb:
            out = tmp / "c.safetensors"
            cli = [python, "-c", CURVATURE, "curvature", str(folder), str(path), str(out)]
            cli += ["--batch-size", str(batch_size), "--no-progress", "--overwrite"]
            seconds, rss = child_rss(cli)
            row.update(curvature_s=seconds, curvature_peak_rss_bytes=rss)
            out.unlink()
        row["load_after"] = load()
        print(json.dumps(row), flush=True)
        rows.append(row)
        path.unlink()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sections", default="tokenise,memory")
    p.add_argument("--lines", type=int, default=10**6)
    p.add_argument("--sizes-mb", default="1,3,10,100,1000")
    p.add_argument("--curvature-max-mb", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--memory-batch-size", type=int, default=64)
    p.add_argument("--tmp", default=tempfile.gettempdir())
    p.add_argument("--out", default=str(RESULTS / "text-data-cpu.json"))
    args = p.parse_args()
    from proofs_tests.text_models import bert_classifier

    run = Run("text_data", settings=vars(args))
    sections = args.sections.split(",")
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        tmp = Path(d)
        folder = bert_classifier(tmp / "bert", positions=64)
        if "tokenise" in sections:
            report["tokenise"] = tokenise(folder, tmp, args.lines, args.batch_size)
            print(json.dumps(report["tokenise"]), flush=True)
        if "memory" in sections:
            sizes = [int(s) for s in args.sizes_mb.split(",")]
            report["memory"] = memory(
                folder, tmp, sizes, args.memory_batch_size, args.curvature_max_mb
            )
    report["self_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    write_result(args.out, run.finish(report))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
