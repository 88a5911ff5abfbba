"""Streaming safetensors writer, atomic directories, determinism."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from kvconvert.io.outdir import atomic_output_dir
from kvconvert.io.writer import ShardedSafetensorsWriter
from tests.helpers import convert_slim


def sample_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a.f32": torch.randn(3, 5),
        "b.bf16": torch.randn(7).to(torch.bfloat16),
        "c.f16": torch.randn(2, 2, 2).to(torch.float16),
        "d.i64": torch.arange(9).view(3, 3),
        "e.bool": torch.tensor([True, False, True]),
        "f.scalar": torch.tensor(3.5),
        "g.empty": torch.zeros(0, 4),
        "h.noncontig": torch.randn(4, 6).T,
    }


def read_all(directory) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    out = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_single_file_roundtrip(tmp_path):
    tensors = sample_tensors()
    writer = ShardedSafetensorsWriter(tmp_path)
    for name, t in tensors.items():
        writer.add(name, t)
    assert writer.close() == ["model.safetensors"]
    loaded = read_all(tmp_path)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    assert not list(tmp_path.glob(".shard-*")), "scratch files left behind"


def test_sharded_roundtrip_with_index(tmp_path):
    tensors = sample_tensors()
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=64)
    for name, t in tensors.items():
        writer.add(name, t)
    names = writer.close()
    assert len(names) > 1 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    loaded = read_all(tmp_path)
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t), name
        with safe_open(str(tmp_path / index["weight_map"][name]), "pt") as f:
            assert name in f.keys()


def _file_ranges(path):
    """Every tensor's (dtype, shape, start, nbytes) in a safetensors file, from its header."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], 8 + length + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in header.items()}  # fmt: skip


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_file_ranges_write_the_same_bytes_as_tensors(tmp_path, monkeypatch, kernel_copy):
    """Copying a tensor's stored bytes (kernel copy, or the block loop where copy_file_range is missing)
    gives the file that adding the loaded tensors gives, sharded or not."""
    tensors = sample_tensors()
    src = tmp_path / "src"
    src.mkdir()
    writer = ShardedSafetensorsWriter(src)
    for name, t in tensors.items():
        writer.add(name, t)
    writer.close()
    if not kernel_copy:
        monkeypatch.delattr("os.copy_file_range")
    for shard_bytes in (1 << 30, 64):
        by_tensor, by_range = tmp_path / f"t{shard_bytes}", tmp_path / f"r{shard_bytes}"
        by_tensor.mkdir()
        by_range.mkdir()
        plain = ShardedSafetensorsWriter(by_tensor, max_shard_bytes=shard_bytes)
        copied = ShardedSafetensorsWriter(by_range, max_shard_bytes=shard_bytes)
        ranges = _file_ranges(src / "model.safetensors")
        for name, t in tensors.items():
            plain.add(name, t)
            dtype, shape, start, nbytes = ranges[name]
            copied.add_file_range(name, dtype, shape, src / "model.safetensors", start, nbytes)
        assert plain.close() == copied.close()
        for path in by_tensor.iterdir():
            assert path.read_bytes() == (by_range / path.name).read_bytes(), path.name


def test_reserved_header_writes_each_byte_once(tmp_path, monkeypatch):
    """With room reserved for the header, data streams into the shard file and is never moved; the
    header is the minimal one padded with spaces. Too little room falls back to moving the data, which
    gives the minimal file, byte for byte."""
    import kvconvert.io.writer as writer_module

    def write(directory, header_bytes, shard_bytes):
        directory.mkdir()
        writer = ShardedSafetensorsWriter(directory, max_shard_bytes=shard_bytes, header_bytes=header_bytes)
        for name, t in sample_tensors().items():
            writer.add(name, t)
        return writer.close()

    for shard_bytes in (1 << 30, 64):
        minimal = tmp_path / f"minimal-{shard_bytes}"
        names = write(minimal, 0, shard_bytes)
        assert write(tmp_path / f"small-{shard_bytes}", 8, shard_bytes) == names  # outgrown: moved
        for name in names:
            assert (minimal / name).read_bytes() == (tmp_path / f"small-{shard_bytes}" / name).read_bytes()
        with monkeypatch.context() as patch:
            patch.setattr(writer_module, "copy_range", lambda *a: pytest.fail("data moved despite the reservation"))
            assert write(tmp_path / f"reserved-{shard_bytes}", 1000, shard_bytes) == names
        for name in names:
            reserved = (tmp_path / f"reserved-{shard_bytes}" / name).read_bytes()
            small = (minimal / name).read_bytes()
            assert int.from_bytes(reserved[:8], "little") == 1000  # 1000 is already a multiple of 8
            assert reserved[8:1008].rstrip(b" ") == small[8 : 8 + int.from_bytes(small[:8], "little")].rstrip(b" ")
            assert reserved[1008:] == small[8 + int.from_bytes(small[:8], "little") :]
        loaded = read_all(tmp_path / f"reserved-{shard_bytes}")
        assert all(torch.equal(loaded[k], t) for k, t in sample_tensors().items())


def test_file_range_past_the_end_or_of_the_wrong_size_is_an_error(tmp_path):
    from kvconvert.errors import KVConvertError

    src = tmp_path / "blob.bin"
    src.write_bytes(bytes(range(64)))
    writer = ShardedSafetensorsWriter(tmp_path)
    with pytest.raises(KVConvertError, match="declares 12 bytes"):
        writer.add_file_range("x", "F32", [4], src, 0, 12)
    with pytest.raises(KVConvertError, match="ends 16 bytes before"):
        writer.add_file_range("y", "F32", [8], src, 48, 32)  # 16 bytes short
    with pytest.raises(KVConvertError, match="'F3', which safetensors does not define"):
        writer.add_file_range("z", "F3", [8], src, 0, 32)


def test_duplicate_tensor_name_is_an_error(tmp_path):
    writer = ShardedSafetensorsWriter(tmp_path)
    writer.add("x", torch.zeros(1))
    with pytest.raises(ValueError):
        writer.add("x", torch.zeros(1))


def test_atomic_dir_removes_partial_output_on_failure(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_output_dir(out, replace=False) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("boom")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_conversion_is_byte_deterministic(tiny_model_dir, tmp_path):
    src = tiny_model_dir("gpt_neox")
    convert_slim(src, tmp_path / "one")
    convert_slim(src, tmp_path / "two")
    for name in ("model.safetensors", "config.json", "kvconvert.json"):  # README names the output dir
        a, b = ((tmp_path / d / name).read_bytes() for d in ("one", "two"))
        assert hashlib.sha256(a).digest() == hashlib.sha256(b).digest(), name


def test_sharded_conversion_loads(tiny_model_dir, tmp_path):
    from tests.helpers import assert_equivalent, load_converted, load_reference

    src = tiny_model_dir("llama")
    convert_slim(src, tmp_path / "sharded", "--max-shard-size", "20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert_equivalent(load_reference(src), load_converted(tmp_path / "sharded"), torch.randint(3, 90, (1, 10)))


@pytest.mark.parametrize("extra", [(), ("--dtype", "float16")])
@pytest.mark.parametrize("sharded_source", [False, True])
def test_conversion_copies_untouched_tensors_to_the_same_bytes(tiny_model_dir, tmp_path, monkeypatch, extra,
                                                               sharded_source):  # fmt: skip
    """Source tensors the method leaves alone are kernel-copied from the source file (never loaded) and
    layers are written on a background thread: the files equal those of loading and writing each tensor
    in turn. With --dtype the untouched floats are converted, so they are loaded as before."""
    from kvconvert.io.source import SourceCheckpoint

    src = tiny_model_dir("llama")
    if sharded_source:  # tensors spread over several input files
        from transformers import LlamaForCausalLM

        LlamaForCausalLM.from_pretrained(src).save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
        src = tmp_path / "sharded"
        assert len(list(src.glob("*.safetensors"))) > 1
    convert_slim(src, tmp_path / "copied", *extra)
    monkeypatch.setattr(SourceCheckpoint, "stored", lambda self, name: None)
    convert_slim(src, tmp_path / "loaded", *extra)
    for name in ("model.safetensors", "config.json", "kvconvert.json"):
        assert (tmp_path / "copied" / name).read_bytes() == (tmp_path / "loaded" / name).read_bytes(), name
    report = json.loads((tmp_path / "copied" / "kvconvert.json").read_text())
    digests = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in src.glob("*.safetensors")}
    assert report["source"]["sha256"] == digests  # hashed on its own thread


def test_a_failed_background_write_fails_the_conversion_and_leaves_nothing(tiny_model_dir, tmp_path, monkeypatch):
    from tests.helpers import run_cli

    original = ShardedSafetensorsWriter.add

    def failing_add(self, name, tensor):
        if ".layers.1." in name:
            raise OSError(28, "No space left on device")
        original(self, name, tensor)

    monkeypatch.setattr(ShardedSafetensorsWriter, "add", failing_add)
    out = tmp_path / "out"
    result = run_cli("slim", "--model", str(tiny_model_dir("llama")), "--out", str(out), "--quiet")
    assert result.exit_code != 0 and "No space left on device" in result.output
    assert not out.exists() and not list(tmp_path.glob(".out*"))
