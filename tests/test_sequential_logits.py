"""The layer-by-layer runner's logits (``run_layer_by_layer(..., logits=)``) are the whole model's:
the searches that score the source with simulated compression (ZACK's agreement search, quant's
width allocation) run on it so that conversion memory stays at about one layer."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import load_reference

from kvconvert.arch import adapter_for
from kvconvert.calib.probes import top1
from kvconvert.calib.sequential import run_layer_by_layer
from kvconvert.io.source import open_source
from kvconvert.methods.quant.bits import log_probs, mean_kl, simulated_storage
from kvconvert.runtime.kvconvert_codec import QuantSpec


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt2", "gemma3", "qwen2", "gpt_neox"])
def test_layer_by_layer_logits_equal_the_whole_model(kind, tiny_model_dir):
    src = tiny_model_dir(kind)
    chunks = torch.randint(3, 90, (3, 40), generator=torch.Generator().manual_seed(1))
    whole = load_reference(src)
    source = open_source(str(src))
    got: dict[int, torch.Tensor] = {}
    run_layer_by_layer(source, adapter_for(source.config), chunks, contextlib.nullcontext, progress=False,
                       logits=lambda c, logits: got.__setitem__(c, logits))  # fmt: skip
    for c, row in enumerate(chunks):
        torch.testing.assert_close(got[c], whole(row[None], use_cache=False).logits[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(top1(source, chunks), torch.stack([whole(r[None]).logits[0].argmax(-1) for r in chunks]))


def test_simulated_storage_kl_is_measured_layer_by_layer(tiny_model_dir):
    """KL of 2-bit storage through the layer-by-layer runner equals the whole model's with the same
    simulation, and 16 bits is lossless."""
    source = open_source(str(tiny_model_dir("llama_gqa")))
    chunks = torch.randint(3, 90, (2, 64), generator=torch.Generator().manual_seed(2))
    reference = log_probs(source, chunks)
    spec = QuantSpec(2, group=16, residual=0)
    kl = mean_kl(source, chunks, reference, lambda model: simulated_storage(model, spec))
    whole = load_reference(tiny_model_dir("llama_gqa"))
    with torch.no_grad(), simulated_storage(whole, spec):
        expected = sum(
            (ref.exp() * (ref - torch.log_softmax(whole(row[None], use_cache=False).logits[0], -1))).sum().item()
            for row, ref in zip(chunks, reference, strict=True)
        ) / chunks.numel()  # fmt: skip
    assert kl > 1e-4 and kl == pytest.approx(expected, rel=1e-4)
    assert mean_kl(source, chunks, reference, lambda model: simulated_storage(model, QuantSpec())) < 1e-9


def test_repeat_reruns_a_layer_and_passes_the_second_run_on(tiny_model_dir):
    """``repeat(l)`` True: layer l runs every chunk again and the later layers see that run's outputs
    (``lorc --refine-steps`` fits on the first run and applies in the second). Here the second run of
    layer 0 halves its values: the logits must equal the whole model's with that change, and layer 0
    must have been observed twice per chunk."""
    from kvconvert.calib.hooks import observed_attention

    src = tiny_model_dir("llama_gqa")
    chunks = torch.randint(3, 90, (2, 32), generator=torch.Generator().manual_seed(3))
    calls: dict[int, int] = {}

    def halve_on_rerun(module, query, key, value, scaling):
        layer = int(module.layer_idx)
        calls[layer] = calls.get(layer, 0) + 1
        if layer == 0 and calls[0] > len(chunks):
            return query, key, value / 2
        return None

    source = open_source(str(src))
    asked: list[int] = []
    got: dict[int, torch.Tensor] = {}
    run_layer_by_layer(source, adapter_for(source.config), chunks,
                       lambda model: observed_attention(model, halve_on_rerun), progress=False,
                       logits=lambda c, logits: got.__setitem__(c, logits),
                       repeat=lambda layer: asked.append(layer) or layer == 0)  # fmt: skip
    whole = load_reference(src)
    assert asked == list(range(whole.config.num_hidden_layers))
    assert calls[0] == 2 * len(chunks) and calls[1] == len(chunks)

    def halve(module, query, key, value, scaling):
        return (query, key, value / 2) if module.layer_idx == 0 else None

    with torch.no_grad(), observed_attention(whole, halve):
        for c, row in enumerate(chunks):
            torch.testing.assert_close(got[c], whole(row[None], use_cache=False).logits[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert (got[0] - whole(chunks[:1], use_cache=False).logits[0]).abs().max() > 1e-3  # the change mattered


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt2", "gemma3", "gpt_neox"])
def test_tail_branches_read_the_prefix_as_a_decode_reads_its_cache(kind, tiny_model_dir):
    """``tail``: a branch re-runs only the last positions, attending to the unmodified stream's keys and values
    before them. Reference: the whole model prefilled on the prefix with transformers' own cache, one layer's
    cached keys halved, then the tail forwarded through that cache. A branch that changes nothing gives the
    whole model's logits; Gemma 3's sliding-window layers (window 8, prefix 40) see their window only."""
    from transformers import DynamicCache

    from kvconvert.calib.hooks import observed_attention
    from kvconvert.calib.sequential import active_branch

    src = tiny_model_dir(kind)
    tail, changed = 6, 1  # layer 1: global in the tiny Gemma 3 (sliding, full, sliding)
    chunks = torch.randint(3, 90, (2, 46), generator=torch.Generator().manual_seed(4))
    starts = [0, changed, 0]  # unchanged; prefix keys of layer 1 halved; prefix keys of layer 0 halved

    def halve_prefix(module, query, key, value, scaling):
        branch = active_branch()
        if branch in (1, 2) and module.layer_idx == (changed if branch == 1 else 0):
            assert key.shape[-2] == chunks.shape[1] and query.shape[-2] == tail
            key = key.clone()
            key[..., :-tail, :] /= 2
            return query, key, value
        return None

    source = open_source(str(src))
    main: dict[int, torch.Tensor] = {}
    got: dict[tuple[int, int], torch.Tensor] = {}
    run_layer_by_layer(source, adapter_for(source.config), chunks,
                       lambda model: observed_attention(model, halve_prefix), progress=False,
                       logits=lambda c, logits: main.__setitem__(c, logits), branches=starts,
                       branch_logits=lambda b, c, logits: got.__setitem__((b, c), logits), tail=tail)  # fmt: skip
    whole = load_reference(src)
    with torch.no_grad():
        for c, row in enumerate(chunks):
            full = whole(row[None], use_cache=False).logits[0, -tail:]
            torch.testing.assert_close(main[c], full, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got[0, c], full, rtol=1e-4, atol=1e-4)
            for branch, layer in ((1, changed), (2, 0)):
                cache = DynamicCache(config=whole.config)
                whole(row[None, :-tail], past_key_values=cache, use_cache=True)
                cache.layers[layer].keys /= 2
                expected = whole(row[None, -tail:], past_key_values=cache, use_cache=True).logits[0]
                torch.testing.assert_close(got[branch, c], expected, rtol=1e-4, atol=1e-4)
                assert (expected - full).abs().max() > 1e-3  # the change mattered
