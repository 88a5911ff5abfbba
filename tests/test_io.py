"""Streaming safetensors writer, atomic directories, determinism."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from kvconvert.io.writer import ShardedSafetensorsWriter, atomic_output_dir
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
