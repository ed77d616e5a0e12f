"""open_checkpoint on files and folders; the streaming writer against safetensors' own reader."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge.errors import MissingInputError, OutputExistsError, OutputWriteError
from gradmerge.io import ShardedWriter, open_checkpoint, staged_output

TENSORS = {
    "f32": torch.randn(3, 4),
    "bf16": torch.randn(5).bfloat16(),
    "f16": torch.randn(2, 2).half(),
    "f64": torch.randn(2, dtype=torch.float64),
    "i64": torch.arange(6).reshape(2, 3),
    "i8": torch.tensor([-1, 2], dtype=torch.int8),
    "u8": torch.tensor([1, 250], dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 3),
}


def test_a_file_reads_lazily_and_exactly(tmp_path):
    save_file(TENSORS, tmp_path / "m.safetensors")
    with open_checkpoint(tmp_path / "m.safetensors") as ckpt:
        assert set(ckpt.keys()) == set(TENSORS) and len(ckpt) == len(TENSORS)
        assert ckpt.bytes_read == 0  # opening reads headers only
        for k, v in TENSORS.items():
            assert ckpt.shape(k) == tuple(v.shape) and ckpt.dtype(k) == v.dtype
            assert ckpt.nbytes(k) == v.numel() * v.element_size()
            assert torch.equal(ckpt.get(k), v)
        assert ckpt.get("bf16", dtype=torch.float32).dtype == torch.float32
        assert torch.equal(ckpt.get("bf16", dtype=torch.float32), TENSORS["bf16"].float())
        assert (
            ckpt.bytes_read == sum(v.numel() * v.element_size() for v in TENSORS.values()) + 2 * 10
        )
        with pytest.raises(gm.StructureError, match="has no tensor 'nope'"):
            ckpt.get("nope")


def test_storage_order_and_fingerprint(tmp_path):
    save_file({"b": torch.ones(2), "a": torch.ones(3)}, tmp_path / "x.safetensors")
    save_file({"b": torch.zeros(2), "a": torch.zeros(3)}, tmp_path / "y.safetensors")  # same header
    save_file({"b": torch.zeros(2), "a": torch.zeros(4)}, tmp_path / "z.safetensors")
    x, y, z = (open_checkpoint(tmp_path / f"{n}.safetensors") for n in "xyz")
    offsets = [x._entries[k] for k in x]
    assert offsets == sorted(offsets, key=lambda e: e[0])  # one file: sorted by offset below
    assert x.fingerprint == y.fingerprint != z.fingerprint  # a header fingerprint, not the values


def test_folders(tmp_path):
    (tmp_path / "single").mkdir()
    save_file({"w": torch.ones(2)}, tmp_path / "single" / "weights.safetensors")
    assert open_checkpoint(tmp_path / "single").files[0].name == "weights.safetensors"

    (tmp_path / "two").mkdir()
    for n in ("a", "b"):
        save_file({n: torch.ones(1)}, tmp_path / "two" / f"{n}.safetensors")
    with pytest.raises(gm.FileFormatError, match=r"no \*.safetensors.index.json"):
        open_checkpoint(tmp_path / "two")
    index = {"weight_map": {"a": "a.safetensors", "b": "b.safetensors"}}
    (tmp_path / "two" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(open_checkpoint(tmp_path / "two").keys()) == ["a", "b"]

    index["weight_map"]["b"] = "a.safetensors"
    (tmp_path / "two" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        gm.FileFormatError, match=r"puts 'b' in a.safetensors, but it is in no shard"
    ):
        open_checkpoint(tmp_path / "two")
    index["weight_map"] = {"a": "a.safetensors", "b": "c.safetensors"}
    (tmp_path / "two" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MissingInputError, match=r"names shard c.safetensors"):
        open_checkpoint(tmp_path / "two")
    save_file({"a": torch.ones(1), "c": torch.ones(1)}, tmp_path / "two" / "a.safetensors")
    index["weight_map"] = {"a": "a.safetensors", "b": "b.safetensors"}
    (tmp_path / "two" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        gm.FileFormatError, match=r"1 tensor\(s\) the index does not list, e.g. \['c'\]"
    ):
        open_checkpoint(tmp_path / "two")

    (tmp_path / "pickles").mkdir()
    torch.save({"w": torch.ones(1)}, tmp_path / "pickles" / "pytorch_model.bin")
    with pytest.raises(gm.FileFormatError, match=r"PyTorch pickle weights.*save_pretrained"):
        open_checkpoint(tmp_path / "pickles")
    (tmp_path / "empty").mkdir()
    with pytest.raises(gm.FileFormatError, match=r"no .safetensors weights"):
        open_checkpoint(tmp_path / "empty")
    with pytest.raises(MissingInputError, match="no checkpoint at"):
        open_checkpoint(tmp_path / "absent")


def test_a_tensor_stored_twice_is_refused(tmp_path):
    save_file({"w": torch.ones(1)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(1)}, tmp_path / "b.safetensors")
    index = {"weight_map": {"w": "a.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    from gradmerge.io.reader import Checkpoint

    with pytest.raises(gm.FileFormatError, match="'w' is stored twice"):
        Checkpoint(tmp_path, [tmp_path / "a.safetensors", tmp_path / "b.safetensors"], tmp_path)


@pytest.mark.parametrize("max_shard_size", [10**9, 40])
def test_the_writer_matches_safetensors(tmp_path, max_shard_size):
    entries = [(k, tuple(v.shape), v.dtype) for k, v in TENSORS.items()]
    w = ShardedWriter(tmp_path, entries, max_shard_size)
    for k, v in TENSORS.items():
        w.write(k, v)
    files = w.finish()
    loaded = {}
    for f in (p for p in files if p.suffix == ".safetensors"):
        loaded.update(load_file(f))  # safetensors' own parser validates the headers and offsets
    assert set(loaded) == set(TENSORS)
    for k, v in TENSORS.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    if len(files) > 1:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(TENSORS)
        assert index["metadata"]["total_size"] == sum(
            v.numel() * v.element_size() for v in TENSORS.values()
        )
    assert w.bytes_written == sum(f.stat().st_size for f in files if f.suffix == ".safetensors")


def test_the_writer_refuses_unplanned_tensors(tmp_path):
    w = ShardedWriter(tmp_path, [("a", (2,), torch.float32)], 100)
    with pytest.raises(gm.ArgumentError, match="expected 'a'"):
        w.write("b", torch.ones(2))
    with pytest.raises(gm.ArgumentError, match=r"expected 'a' \(2,\) torch.float32"):
        w.write("a", torch.ones(2, dtype=torch.float64))
    with pytest.raises(gm.ArgumentError, match="not written"):
        w.finish()


def test_staged_output_is_atomic(tmp_path):
    out = tmp_path / "deep" / "out"
    with pytest.raises(RuntimeError), staged_output(out) as stage:
        (stage / "half.bin").write_bytes(b"x")
        raise RuntimeError("failed half-way")
    assert not (tmp_path / "deep").exists()  # the parents it created are gone too
    with staged_output(out) as stage:
        (stage / "done.txt").write_text("ok")
        assert not out.exists()  # nothing at OUT_DIR until the end
    assert (out / "done.txt").read_text() == "ok"
    with pytest.raises(OutputExistsError), staged_output(out):
        pass
    (tmp_path / "file").write_text("")
    with (
        pytest.raises(OutputWriteError, match="is a file; give a folder name"),
        staged_output(tmp_path / "file", overwrite=True),
    ):
        pass


def test_outputs_get_the_permissions_of_ordinary_new_files(tmp_path):
    """Atomic writes go through temporary files/folders (0600/0700); the renamed outputs must be
    readable like files made with open()/mkdir() under the current umask."""
    import os
    import stat

    import torch

    import gradmerge as gm
    from gradmerge.io.writer import staged_output

    mask = os.umask(0o022)
    try:
        path = gm.Diagonal({"w": torch.ones(2)}).save(tmp_path / "c.safetensors")
        with staged_output(tmp_path / "out", overwrite=False) as stage:
            (stage / "x.txt").write_text("x")
    finally:
        os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
