"""Calibration machinery: text sources, chunking, hooks that always come off, layer-by-layer statistics."""

from __future__ import annotations

import pytest
import torch
from conftest import CALIB_DATA, build_tiny_model

from kvconvert.arch import adapter_for
from kvconvert.calib.stats import accumulating_grams, collect_head_grams
from kvconvert.calib.text import read_calibration_text, tokenize_chunks
from kvconvert.errors import KVConvertError
from kvconvert.io.source import open_source


def test_chunks_are_seeded_disjoint_and_carry_bos():
    ids = list(range(1000))
    first = tokenize_chunks(ids, tokens=300, chunk_len=100, seed=7, source="x", bos=-1)
    again = tokenize_chunks(ids, tokens=300, chunk_len=100, seed=7, source="x", bos=-1)
    other = tokenize_chunks(ids, tokens=300, chunk_len=100, seed=8, source="x", bos=-1)
    assert first.chunks.shape == (3, 100) and torch.equal(first.chunks, again.chunks)
    assert not torch.equal(first.chunks, other.chunks)
    assert torch.all(first.chunks[:, 0] == -1)
    used = {tuple(r[1:].tolist()) for r in first.chunks}
    held = {tuple(r[1:].tolist()) for r in first.held_out}
    assert len(used) + len(held) == 1000 // 99 and not used & held


def test_too_little_text_is_an_actionable_error():
    with pytest.raises(KVConvertError, match="--calib-tokens"):
        tokenize_chunks(list(range(50)), tokens=100, chunk_len=20, seed=0, source="x")


def test_fewer_chunks_where_the_text_is_shorter_when_asked():
    """``fewer`` (LoRC's distillation: up to ``distill_chunks``): a short text gives the chunks it holds, none
    still refuses, and a text long enough gives exactly what is asked for."""
    short = tokenize_chunks(list(range(50)), tokens=100, chunk_len=20, seed=0, source="x", fewer=True)
    assert short.chunks.shape == (2, 20) and short.held_out.shape[0] == 0
    enough = tokenize_chunks(list(range(500)), tokens=100, chunk_len=20, seed=0, source="x", fewer=True)
    assert enough.chunks.shape == (5, 20)
    with pytest.raises(KVConvertError, match="gives 0 tokens"):
        tokenize_chunks(list(range(10)), tokens=100, chunk_len=20, seed=0, source="x", fewer=True)


def test_calibration_sources(tmp_path):
    text, source = read_calibration_text(None)
    assert source == str(CALIB_DATA) and len(text.split()) > 16000  # ZACK §6.6: > 16K tokens
    (tmp_path / "a.txt").write_text("alpha\r\nbeta")
    assert read_calibration_text(str(tmp_path))[0] == "alpha\nbeta"
    with pytest.raises(KVConvertError, match="^--calib '.*' is neither a file"):
        read_calibration_text(str(tmp_path / "missing.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(KVConvertError, match="no \\*.txt"):
        read_calibration_text(str(tmp_path / "empty"))


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt2", "gpt_neox"])
def test_layer_by_layer_statistics_match_the_whole_model(tmp_path, kind):
    """The sequential runner (one layer materialised at a time) sees exactly the activations of the
    full transformers model."""
    model = build_tiny_model(kind)
    model.save_pretrained(tmp_path)
    source = open_source(str(tmp_path))
    adapter = adapter_for(source.config)
    layout = adapter.layout()
    chunks = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(0))
    sequential = collect_head_grams(source, adapter, chunks, progress=False)
    with torch.no_grad(), accumulating_grams(model, layout.num_kv_heads, layout.head_dim) as whole:
        for row in chunks:
            model(row[None], use_cache=False)
    for name in ("query", "key", "value"):
        a, b = getattr(sequential, name), getattr(whole, name)
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-8 * float(b.abs().max())), name
    assert sequential.tokens.tolist() == [120] * layout.num_layers


def test_hooks_come_off_even_when_the_block_raises():
    from transformers import AttentionInterface

    model = build_tiny_model("llama")
    before = model.config._attn_implementation
    with pytest.raises(RuntimeError), accumulating_grams(model, 4, 16):
        assert model.config._attn_implementation != before
        raise RuntimeError("boom")
    assert model.config._attn_implementation == before
    assert not [name for name in AttentionInterface._global_mapping if name.startswith("kvconvert_observe_")]
