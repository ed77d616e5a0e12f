"""One command that checks gradmerge on an accelerator: the CUDA tests, a GPT-2-124M K-FAC
estimation and merge through the command line, and a 7B-shaped streamed diagonal merge; one
JSON naming the device. Whenever a GPU is available, run this first and commit its JSON.

Steps (each timed, each recorded even when it fails; the exit status is 1 if any failed):

1. ``tests``: the tests that take a CUDA branch (``CUDA_TESTS``), run with pytest;
2. ``kfac``: GPT-2-124M from its config (random weights, nothing downloaded), 2 noisy
   "fine-tunes", ``gradmerge curvature --structure kfac`` of each over 2,048 tokens (16 × 128),
   then ``gradmerge merge`` (gradient matching, ``prior: {delta: 6}``) on the device, with the
   largest certified residual from the merge record;
3. ``diagonal``: a streamed diagonal gradient-matching merge of 2 Llama-7B-shaped decoder layers
   (hidden 4096, MLP 11008; 2 tasks; bfloat16 files) on the device: wall time and the bytes
   read and written per second.

``--quick`` runs the same steps at toy sizes on the CPU in seconds (tests: found, not run;
GPT-2 of width 64 and depth 2 over 2 × 32 tokens; 7B-shaped layers scaled to hidden 64), so this
script cannot rot: ``proofs_tests/benchmarks/test_device_check.py`` runs it in the test suite.

    python -m benchmarks.device_check                  # on a GPU machine, ≤ 8 minutes
    python -m benchmarks.device_check --quick --out /tmp/check.json   # default: a temp folder

The JSON is the suite's record (``benchmarks.record``): its ``results`` hold the device, the
mode, each step's figures, ``ok`` and ``complete``; it is rewritten whole after every step.
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

from benchmarks.record import Run, write_result

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "device-check.json"
CUDA_TESTS = [  # every test that takes another branch where CUDA is available
    "proofs_tests/unit/merge/test_merge_rules.py::test_cuda_matches_cpu",
    "proofs_tests/jobs/test_bad_input.py::test_devices",
    "proofs_tests/demo/test_cli.py::test_bad_arguments",
]
LLAMA_7B = {"hidden": 4096, "mlp": 11008}


def device_name(device: str) -> str:
    """What ran the check: the GPU's name, or the CPU's model."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"cpu: {line.split(':', 1)[1].strip()}"
    return f"cpu: {platform.processor() or 'unknown'}"


def gradmerge(*args: str) -> list[str]:
    return [sys.executable, "-m", "gradmerge", *args]


def run(cmd: list[str], timeout: float) -> dict[str, Any]:
    """Run ``cmd`` (environment inherited): wall seconds, return code, the output's tail."""
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        code, out = 124, f"timed out after {timeout:.0f} s: {err}"
    return {"wall_seconds": time.perf_counter() - start, "returncode": code, "tail": out[-2000:]}


def step_tests(quick: bool) -> dict[str, Any]:
    """Run the CUDA tests; ``quick``: check that each still exists, without running it (parsed,
    not imported: the list cannot go stale)."""
    if quick:
        start = time.perf_counter()
        missing = []
        for node in CUDA_TESTS:
            path, name = node.split("::")
            tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
            if not any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body):
                missing.append(node)
        return {
            "wall_seconds": time.perf_counter() - start,
            "returncode": 1 if missing else 0,
            "tests": CUDA_TESTS,
            "tail": f"not found: {missing}" if missing else "",
        }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    return run([*cmd, *(str(ROOT / n) for n in CUDA_TESTS)], timeout=240)


def gpt2_inputs(folder: Path, quick: bool, tasks: int = 2) -> dict[str, Any]:
    """GPT-2 from its config (124M, or width 64 and depth 2), ``tasks`` noisy copies, tokens."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    small = {"n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 512, "n_positions": 64}
    config = transformers.GPT2Config(**(small if quick else {}))
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(folder / "base")
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    sequences, length = (2, 16) if quick else (16, 128)
    quarter = config.vocab_size // 4
    paths: dict[str, Any] = {"base": folder / "base", "models": [], "data": []}
    for t in range(tasks):
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(base[k] + 0.02 * torch.randn(p.shape, generator=gen))
        model.save_pretrained(folder / f"ft{t}")
        ids = torch.randint(t * quarter, (t + 1) * quarter, (sequences, length), generator=gen)
        save_file({"input_ids": ids, "labels": ids.clone()}, folder / f"tokens{t}.safetensors")
        paths["models"].append(folder / f"ft{t}")
        paths["data"].append(folder / f"tokens{t}.safetensors")
    paths["tokens"] = sequences * length
    return paths


def step_kfac(folder: Path, device: str, quick: bool) -> dict[str, Any]:
    start = time.perf_counter()
    paths = gpt2_inputs(folder, quick)
    out: dict[str, Any] = {"build_seconds": time.perf_counter() - start}
    out["tokens_per_task"] = paths["tokens"]
    limit = 300 if quick else 150  # quick: generous for a loaded test machine
    for t, (model, data) in enumerate(zip(paths["models"], paths["data"], strict=True)):
        target = folder / f"ft{t}.kfac.safetensors"
        cmd = gradmerge("curvature", str(model), str(data), str(target), "--structure", "kfac")
        cmd += ["--shift-labels", "--batch-size", "4", "--device", device, "--no-progress"]
        out[f"estimate_task{t}"] = run(cmd, limit)
    config = {
        "method": "gradient_matching",
        "base_model": str(paths["base"]),
        "models": [
            {"model": str(m), "curvature": str(folder / f"ft{t}.kfac.safetensors")}
            for t, m in enumerate(paths["models"])
        ],
        "prior": {"delta": 0.1 if quick else 6.0},
        "device": device,
    }
    (folder / "kfac.yaml").write_text(yaml.safe_dump(config))
    merged = folder / "kfac-out"
    out["merge"] = run(
        gradmerge("merge", str(folder / "kfac.yaml"), str(merged), "--no-progress"), limit
    )
    record = merged / "gradmerge_merge.json"
    if record.exists():
        rec = json.loads(record.read_text())
        out["max_residual"] = rec.get("max_residual")
        out["cg_iterations"] = sum(s["iterations"] for s in rec.get("solves", {}).values())
        out["methods"] = sorted({s["method"] for s in rec.get("solves", {}).values()})
    out["returncode"] = max(v["returncode"] for v in out.values() if isinstance(v, dict))
    return out


def step_diagonal(folder: Path, device: str, quick: bool) -> dict[str, Any]:
    """A streamed diagonal merge of 2 Llama-7B-shaped decoder layers (hidden/8 per quick)."""
    import gradmerge as gm

    hidden, mlp = (64, 172) if quick else (LLAMA_7B["hidden"], LLAMA_7B["mlp"])
    shapes = {}
    for i in range(2):
        p = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{name}.weight"] = (hidden, hidden)
        shapes[f"{p}.mlp.gate_proj.weight"] = (mlp, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (mlp, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, mlp)
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
    gen = torch.Generator().manual_seed(2)
    start = time.perf_counter()

    def tensors(scale: float, positive: bool = False) -> dict[str, torch.Tensor]:
        out = {}
        for k, s in shapes.items():
            x = torch.randn(s, generator=gen) * scale
            out[k] = (x.abs() if positive else x).to(torch.bfloat16)
        return out

    base = tensors(0.02)
    save_file(base, folder / "base.safetensors")
    models = []
    for t in range(2):
        ft = {
            k: (v.float() + 0.01 * torch.randn(v.shape, generator=gen)).bfloat16()
            for k, v in base.items()
        }
        save_file(ft, folder / f"ft{t}.safetensors")
        gm.Diagonal(tensors(1.0, positive=True)).save(folder / f"ft{t}.diag.safetensors")
        models.append(
            {
                "model": str(folder / f"ft{t}.safetensors"),
                "curvature": str(folder / f"ft{t}.diag.safetensors"),
            }
        )
    build = time.perf_counter() - start
    config = {
        "method": "gradient_matching",
        "base_model": str(folder / "base.safetensors"),
        "models": models,
        "prior": {"delta": 1e-3},
        "device": device,
    }
    (folder / "diag.yaml").write_text(yaml.safe_dump(config))
    result = run(
        gradmerge("merge", str(folder / "diag.yaml"), str(folder / "diag-out"), "--no-progress"),
        300 if quick else 240,
    )
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    moved = numel * 2 * (1 + 2 + 2 + 1)  # read base, 2 models, 2 curvatures; write the result
    result.update(
        build_seconds=build,
        parameters=numel,
        hidden=hidden,
        mlp=mlp,
        gb_per_second=moved / result["wall_seconds"] / 1e9,
    )
    return result


def default_out(quick: bool) -> Path:
    """Where the record goes without ``--out``: the committed record (``RESULT``) for the full
    check; for ``--quick`` a new temporary folder, never ``benchmarks/results/`` (a toy run is
    no result; pass ``--out`` to keep it)."""
    if not quick:
        return RESULT
    return Path(tempfile.mkdtemp(prefix="device-check-quick-")) / "device-check-quick.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes on the CPU, in seconds")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the record to write (default: benchmarks/results/device-check.json; with --quick "
        "a temporary folder, never benchmarks/results/)",
    )
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    out = args.out or default_out(args.quick)
    record_run = Run("device_check", settings=vars(args))
    report: dict[str, Any] = {
        "device": device_name(device),
        "device_kind": device,
        "mode": "quick" if args.quick else "full",
        "steps": {},
    }
    steps: dict[str, Callable[[Path], dict[str, Any]]] = {
        "tests": lambda _: step_tests(args.quick),
        "kfac": lambda folder: step_kfac(folder, device, args.quick),
        "diagonal": lambda folder: step_diagonal(folder, device, args.quick),
    }
    start = time.perf_counter()
    for name, step in steps.items():
        with tempfile.TemporaryDirectory(prefix=f"device-check-{name}-") as tmp:
            try:
                result = step(Path(tmp))
            except Exception as err:  # recorded, and the next step still runs
                result = {"returncode": 1, "error": f"{type(err).__name__}: {err}"}
        report["steps"][name] = result
        print(f"{name}: returncode {result.get('returncode')}", flush=True)
        report["wall_seconds"] = time.perf_counter() - start
        report["ok"] = all(s.get("returncode") == 0 for s in report["steps"].values())
        report["complete"] = len(report["steps"]) == len(steps)
        write_result(
            out, record_run.finish(report)
        )  # after every step: a run cut short leaves evidence
    print(f"wrote {out} ({report['device']}, {report['wall_seconds']:.0f} s, ok={report['ok']})")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
