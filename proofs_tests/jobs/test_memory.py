"""Peak memory of a streaming merge is bounded by a few units, not by model size × tasks.

A fresh Python process merges a base, three fine-tunes and three diagonal curvatures (7 inputs
of 40 MiB: 280 MiB) by gradient matching, while a thread samples its anonymous memory
(``RssAnon``: heap and tensors; the memory-mapped safetensors pages count in ``RssFile`` and can
be dropped by the kernel, so they are not the process's footprint). The increase over the
process's memory before the merge must stay below 6 units' worth of input (6 × 7 MiB = 42 MiB,
under a sixth of the inputs): an implementation that loaded whole models would need 280 MiB.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from safetensors.torch import save_file

import gradmerge as gm
from proofs_tests.limits import HANG_S

MiB = 2**20
TENSORS, NUMEL, TASKS = 40, MiB // 4, 3  # 40 tensors of 1 MiB (float32) per input

SCRIPT = textwrap.dedent(
    """
    import json, re, sys, threading, time
    import torch
    from gradmerge.jobs import MergeConfig, run_merge
    from gradmerge.io import writer

    torch.set_num_threads(1)

    def anon():
        with open("/proc/self/status") as f:
            return int(re.search(r"RssAnon:\\s+(\\d+) kB", f.read()).group(1)) * 1024

    config = MergeConfig.from_yaml(sys.argv[1])
    peak, done = [anon()], threading.Event()
    original = writer.ShardedWriter.write

    def write(self, name, tensor):  # sample while the unit's tensors are all alive
        peak[0] = max(peak[0], anon())
        original(self, name, tensor)

    writer.ShardedWriter.write = write

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.001)

    baseline = anon()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    report = run_merge(config, sys.argv[2], progress=False)
    done.set()
    thread.join()
    print(json.dumps({"baseline": baseline, "peak": peak[0], "bytes_read": report.bytes_read,
                      "units": report.units}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_anonymous_memory_is_a_few_units(tmp_path):
    g = torch.Generator().manual_seed(0)
    names = [f"layers.{i}.weight" for i in range(TENSORS)]

    def tensors(scale=1.0, offset=0.0):
        return {n: offset + scale * torch.rand(NUMEL, generator=g) for n in names}

    save_file(tensors(), tmp_path / "base.safetensors")
    models = []
    for t in range(TASKS):
        save_file(tensors(), tmp_path / f"ft{t}.safetensors")
        gm.Diagonal(tensors(offset=0.1)).save(tmp_path / f"ft{t}.curvature.safetensors")
        models.append({"model": f"ft{t}.safetensors", "curvature": f"ft{t}.curvature.safetensors"})
    config = {
        "method": "gradient_matching",
        "base_model": "base.safetensors",
        "models": models,
        "prior": {"delta": 1.0e-3},
    }
    (tmp_path / "merge.yaml").write_text(yaml.safe_dump(config))
    inputs = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    assert inputs > (1 + 2 * TASKS) * TENSORS * MiB

    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "merge.yaml"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    m = json.loads(result.stdout.strip().splitlines()[-1])
    assert m["units"] == TENSORS and m["bytes_read"] == (1 + 2 * TASKS) * TENSORS * MiB
    unit = (1 + 2 * TASKS) * MiB  # one tensor of every input
    growth = m["peak"] - m["baseline"]
    bound = 6 * unit
    assert inputs > 6 * bound
    assert growth < bound, (
        f"anonymous memory grew by {growth / MiB:.1f} MiB (bound {bound / MiB} MiB)"
    )
