"""The decode loop the speed measurements time (``kvconvert.eval.speed``): a batch of left-padded rows of
different lengths, prefilled in chunks, decodes what ``generate`` decodes, for the source and for every
method at its lossless setting (so a speed figure times real work on every row)."""

from __future__ import annotations

import os

import pytest
import torch
from default_methods import LOSSLESS
from helpers import load_converted, load_reference

from kvconvert.eval.speed import (
    PACKED_DECODE,
    _decode,
    _prefill,
    packed_decode,
    ragged_batch,
    side_by_side,
    timed_packed,
)


def test_a_ragged_batch_is_left_padded_rows_of_different_lengths():
    ids, mask = ragged_batch(97, 64, 4)
    assert ids.shape == mask.shape == (4, 64)
    assert mask.sum(1).tolist() == [64, 56, 48, 40] and bool((ids[mask == 0] == 0).all())
    assert bool((mask[:, -1] == 1).all()) and bool((mask.diff(dim=1) >= 0).all())  # left padding


def _greedy_by_the_loop(model, ids, mask, steps: int, chunk: int) -> torch.Tensor:
    state = _prefill(model, ids, chunk, mask)
    tokens = [state["token"]]
    for _ in range(steps - 1):
        _decode(model, state, 1)
        tokens.append(state["token"])
    return torch.cat(tokens, dim=1)


@torch.no_grad()
@pytest.mark.parametrize("method", ["source", *sorted(LOSSLESS)])
def test_the_timed_loop_decodes_a_ragged_batch_as_generate_does(method, converted, tokenized_model_dir):
    if method == "source":
        model = load_reference(tokenized_model_dir("llama_gqa"))
    else:
        model = load_converted(converted(method, "lossless")[1])
    ids, mask = ragged_batch(model.config.vocab_size, 40, 4, seed=3)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                              do_sample=False, pad_token_id=0)[:, ids.shape[1]:]  # fmt: skip
    assert torch.equal(_greedy_by_the_loop(model, ids, mask, 6, chunk=16), expected)


def test_side_by_side_counts_every_row(tokenized_model_dir):
    model = load_reference(tokenized_model_dir("llama_gqa"))
    one = side_by_side({"m": model}, 32, steps=2, rounds=1)["m"]
    four = side_by_side({"m": model}, 32, steps=2, rounds=1, batch=4)["m"]
    assert four["cache_bytes"] > 2 * one["cache_bytes"]  # four rows of 16 to 32 tokens
    assert four["decode_tokens_per_s"] > 0 and one["decode_tokens_per_s"] > 0


@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 4])
def test_the_packed_source_decodes_as_the_source_reading_each_kv_head_once(rows, tokenized_model_dir, monkeypatch):
    """The reference the benches also time a converted model against (``packed_decode``): the same logits at every
    step, batch 1 without a mask and left-padded rows, its steps' attention on ``[b, Hkv, G, d]`` queries."""
    source = load_reference(tokenized_model_dir("llama_gqa"))
    packed = packed_decode(load_reference(tokenized_model_dir("llama_gqa")))
    assert packed.config._attn_implementation == PACKED_DECODE
    assert source.config.num_key_value_heads < source.config.num_attention_heads  # a GQA model: heads to pack
    shapes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **k: shapes.append(tuple(q.shape)) or sdpa(q, *a, **k))  # fmt: skip
    ids, mask = ragged_batch(source.config.vocab_size, 24, rows, seed=5)
    mask = mask if rows > 1 else None
    states = [_prefill(model, ids, 8, mask) for model in (source, packed)]
    token, position = states[0]["token"], states[0].get("next")
    config = packed.config
    stacked = (rows, config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads,
               config.head_dim)  # fmt: skip
    for _ in range(3):
        padded = {}
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
            padded, position = {"attention_mask": mask, "position_ids": position}, position + 1
        logits = []
        for model, state in zip((source, packed), states, strict=True):
            shapes.clear()
            out = model(token, past_key_values=state["cache"], use_cache=True, **padded)
            logits.append(out.logits)
        assert shapes and all(shape == stacked for shape in shapes)  # the packed model's step
        assert torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4)
        token = logits[0][:, -1:].argmax(-1)


def test_eval_times_an_sdpa_reference_packed_and_gives_it_back_its_attention(tokenized_model_dir):
    """``kvconvert eval``'s reference is timed through ``packed_decode`` (``timed_packed``) and leaves the block on its
    own attention, for the forwards after it; a reference on another attention is timed as it is."""
    model = load_reference(tokenized_model_dir("llama_gqa"))
    assert model.config._attn_implementation == "sdpa"
    with timed_packed(model) as timed:
        assert timed is model and model.config._attn_implementation == PACKED_DECODE
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    with timed_packed(model):
        assert model.config._attn_implementation == "eager"


def test_speed_is_timed_with_the_readers_built_unless_the_user_chose(monkeypatch):
    """``KVCONVERT_COMPILE=auto`` builds the compiled CPU readers only after minutes of decoding, so a timed run of a
    few steps would time the eager ops: ``measure_speed`` and ``side_by_side`` ask for ``on`` and put it back; a
    setting the user chose stays."""
    from kvconvert.eval.speed import readers_built

    monkeypatch.delenv("KVCONVERT_COMPILE")
    with readers_built():
        assert os.environ["KVCONVERT_COMPILE"] == "on"
    assert "KVCONVERT_COMPILE" not in os.environ
    for chosen in ("off", "auto"):
        monkeypatch.setenv("KVCONVERT_COMPILE", chosen)
        with readers_built():
            assert os.environ["KVCONVERT_COMPILE"] == chosen
        assert os.environ["KVCONVERT_COMPILE"] == chosen
