"""One cache protocol for every method: generate() edits the batch (beam reordering, batch selection,
repetition for several return sequences) through ``KVLayer.select_rows``. At lossless settings every
method's beams and return sequences equal the stock model's."""

from __future__ import annotations

import sys

import pytest
import torch
from default_methods import COMPRESSING, CONTEXT, LOSSLESS
from helpers import left_padded, load_converted, load_reference

SEARCHES = {
    "greedy": {"do_sample": False},
    "beams": {"num_beams": 2, "do_sample": False},
    "beams, 2 returned": {"num_beams": 2, "num_return_sequences": 2, "do_sample": False},
    "sampling, 2 returned": {"do_sample": True, "top_k": 20, "num_return_sequences": 2},
}


@pytest.mark.parametrize("method", sorted(LOSSLESS))
@torch.no_grad()
def test_every_search_matches_the_stock_model(method, converted):
    src, out = converted(method, "lossless")
    model, reference = load_converted(out), load_reference(src)
    ids, mask = left_padded()
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
    for name, kwargs in SEARCHES.items():
        torch.manual_seed(7)
        expected = reference.generate(**common, **kwargs)
        torch.manual_seed(7)
        got = model.generate(**common, **kwargs)
        assert torch.equal(got, expected), f"{method}, {name}"


@pytest.mark.parametrize("method", sorted(LOSSLESS))
def test_every_cache_layer_speaks_the_protocol(method, converted):
    """Beam reordering of a filled cache reorders what every layer holds (rows swapped, not mixed)."""
    model = load_converted(converted(method, "lossless")[1])
    ids, mask = left_padded()
    cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
    swapped = model(input_ids=ids.flip(0), attention_mask=mask.flip(0), use_cache=True).past_key_values
    cache.reorder_cache(torch.tensor([1, 0]))
    step = torch.tensor([[5], [6]])
    a = model(input_ids=step.flip(0), attention_mask=torch.cat([mask.flip(0), torch.ones(2, 1, dtype=mask.dtype)], 1),
              past_key_values=cache).logits  # fmt: skip
    b = model(input_ids=step.flip(0), attention_mask=torch.cat([mask.flip(0), torch.ones(2, 1, dtype=mask.dtype)], 1),
              past_key_values=swapped).logits  # fmt: skip
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # remote code brings its own copy of the runtime classes: check the protocol by name, not isinstance
    names = {type(layer).__name__ for layer in cache.layers}
    assert names - {"DynamicLayer"} and all(
        hasattr(layer, "select_rows") or type(layer).__name__ == "DynamicLayer" for layer in cache.layers
    ), names


def _cache_of(output):
    """A forward's cache: ``output.cache`` from transformers 5.24 on, ``past_key_values`` before."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


@pytest.mark.parametrize("method", sorted(COMPRESSING))
@torch.no_grad()
def test_the_cache_goes_by_either_name(method, converted):
    """transformers 5.24 renamed the models' ``past_key_values`` argument ``cache``, and its ``generate`` hands the
    model an empty stock cache under the new name: a converted model takes its cache by either name, swaps an empty
    stock cache for its own, and gives the stock forward the name it takes (under 5.24-5.25 before this, every method
    decoded from the stock cache in silence, or crashed: ``make test-transformers`` runs these tests there); what
    ``generate`` returns is its own cache. Both names at once is an error."""
    from transformers import DynamicCache

    model = load_converted(converted(method, "compressing")[1])
    ids, mask = left_padded()
    step, longer = torch.tensor([[5], [6]]), torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    logits = []
    for name in ("past_key_values", "cache"):
        held = _cache_of(model(input_ids=ids, attention_mask=mask, use_cache=True, **{name: DynamicCache()}))
        assert getattr(held, "is_kvconvert_cache", False), f"{method}: {name}= left a {type(held).__name__}"
        logits.append(model(input_ids=step, attention_mask=longer, **{name: held}).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="not both"):
        model(input_ids=step, attention_mask=longer, cache=held, past_key_values=held)
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                               return_dict_in_generate=True)  # fmt: skip
    assert getattr(_cache_of(generated), "is_kvconvert_cache", False), f"{method}: generate decoded from a stock cache"


@pytest.mark.parametrize("method", sorted(COMPRESSING))
@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@torch.no_grad()
def test_half_precision_masks_reach_sdpa_in_the_query_dtype(method, static, converted, monkeypatch):
    """In bfloat16, every SDPA call gets a boolean mask or one of its query's dtype: CUDA's SDPA refuses any other
    (found on an H200: razor's chunk mask came out float32), while the CPU's takes it, so CPU tests check the
    dtypes here instead. A left-padded batch prefilled in chunks past the compressing settings' windows, then
    decoded, from the growing cache and from the static one where the method has it."""
    from kvconvert.eval.speed import _decode, _prefill

    sdpa, seen = torch.nn.functional.scaled_dot_product_attention, []

    def checked(query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            assert attn_mask.dtype == query.dtype, f"{method}: a {attn_mask.dtype} mask for {query.dtype} queries"
        seen.append(attn_mask is not None)
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", checked)
    model = load_converted(converted(method, "compressing")[1]).to(torch.bfloat16)
    ids, mask = left_padded(length=CONTEXT)
    state = _prefill(model, ids, 64, mask, CONTEXT + 16 if static else None)
    _decode(model, state, 4)
    if not any(seen):  # lorc and ZACK attend with their own products (no SDPA, so nothing for CUDA to refuse)
        pytest.skip(f"{method} sends no mask through SDPA")


@pytest.mark.parametrize("method", sorted(COMPRESSING))
@torch.no_grad()
def test_a_prompt_in_one_forward_builds_its_bias_a_block_of_rows_at_a_time(method, converted, monkeypatch):
    """A prompt that goes in as one forward (``generate``'s prefill) never hands SDPA a bias built for every query
    row: whole, in float32, ``[b, 1, n, n]`` is 4 GB at 32K tokens, where the source's SDPA takes ``is_causal`` and
    holds none. With ``BIAS_BYTES`` at 16 rows' worth, every float mask SDPA gets (the boolean ones are
    transformers' own, the source's too) has at most 16 rows; an unpadded prompt passes none at all. A prompt of
    128 tokens, a chunk of 64 after it (past razor's windows, which have dropped tokens by then) and a decode step
    give the same logits as with one block."""
    model = load_converted(converted(method, "compressing")[1])
    prefill = sys.modules[type(model).__module__.rsplit(".", 1)[0] + ".kvconvert_prefill"]
    sdpa, rows = torch.nn.functional.scaled_dot_product_attention, []

    def recorded(query, key, value, attn_mask=None, *args, **kwargs):
        if query.shape[-2] > 1:
            rows.append(0 if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.shape[-2])
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)

    def run(bias_bytes: int, ids: torch.Tensor, mask: torch.Tensor) -> tuple[list[torch.Tensor], int, int]:
        monkeypatch.setattr(prefill, "BIAS_BYTES", bias_bytes)
        rows.clear()
        unpadded = bool(mask.all())
        first = model(input_ids=ids[:, :128], attention_mask=None if unpadded else mask[:, :128], use_cache=True)
        first_rows = max(rows, default=0)
        cache = first.past_key_values
        second = model(input_ids=ids[:, 128:], attention_mask=mask, past_key_values=cache)
        step = torch.full((ids.shape[0], 1), 5)
        step_mask = torch.cat([mask, torch.ones_like(step)], dim=1)
        last = model(input_ids=step, attention_mask=step_mask, past_key_values=cache).logits
        return [first.logits, second.logits, last], first_rows, max(rows, default=0)

    ids, mask = left_padded(length=CONTEXT)
    for batch, batch_mask in ((ids, mask), (ids[:1], mask[:1])):
        whole, _, _ = run(1 << 40, batch, batch_mask)
        blocks, first_rows, most_rows = run(4 * 128 * len(batch) * 16, batch, batch_mask)  # 16 rows over 128 keys
        assert most_rows <= 16, f"{method}: a {most_rows}-row bias"
        if batch_mask.all():
            assert first_rows == 0, f"{method}: an unpadded prompt with no past took a {first_rows}-row bias"
        for a, b in zip(whole, blocks, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
