"""KIVI's layout with its 4-bit values in torch's int4 rows (``KiviInt4Values``): the same codes as KIVI's own
packing, to the bit; a decode step weighs them with the int4 kernel where the torch reader widens them to float32.
Checked against ``TokenStore`` (KIVI's packing, the plain store) and against the folded reader over that store."""

from __future__ import annotations

import pytest
import torch
from helpers import convert, generate_in_every_mode, left_padded

import kvconvert
from kvconvert.eval.memory import cache_nbytes
from kvconvert.runtime import kvconvert_quant, kvconvert_tokenlayout
from kvconvert.runtime.kvconvert_codec import QuantSpec
from kvconvert.runtime.kvconvert_quant import kivi_decode
from kvconvert.runtime.kvconvert_tokenlayout import Int4Rows, KiviInt4Values, cpu_int4_rows, kivi_int4_fits
from kvconvert.runtime.kvconvert_tokenstore import TokenStore

pytestmark = pytest.mark.skipif(cpu_int4_rows() is None, reason="no CPU int4 kernel of a known layout")


def _stores(width: int, group: int, sink: int, rotate: bool, seed: int, lengths=(150, 1, 1, 33, 1)):
    """The same values appended, in the same pieces, to KIVI's plain store and to ``KiviInt4Values``."""
    spec = QuantSpec(4, group, residual=8, sink=sink, rotate=rotate)
    plain, int4 = TokenStore(spec, per_channel=False), KiviInt4Values(spec)
    generator = torch.Generator().manual_seed(seed)
    for length in lengths:
        chunk = torch.randn(2, 3, length, width, generator=generator)
        chunk[..., 7] += 5.0  # an outlier channel
        plain.append(chunk)
        int4.append(chunk)
    return plain, int4


@pytest.mark.parametrize("width, group", [(64, 64), (64, 32), (128, 64), (256, 128)])
@pytest.mark.parametrize("rotate", [False, True])
def test_int4_values_hold_kivis_codes(width, group, rotate):
    """Reads equal KIVI's plain store's after appends of any size, a reorder of the rows (beams), row selection and a
    crop: exactly where nothing is rotated (the same codes, scales and zeros), up to float32 rounding of the rotation
    undone over another batch shape where values are rotated; the codes, scales and zeros take the same bytes."""
    assert kivi_int4_fits(QuantSpec(4, group), width)
    plain, int4 = _stores(width, group, sink=3, rotate=rotate, seed=width + group)
    assert int4.blocks is not None and int4.quantized_tokens == plain.quantized_tokens > 0
    same = dict(rtol=0, atol=1e-5 if rotate else 0)

    def check():
        torch.testing.assert_close(int4.read(), plain.read(), **same)

    check()
    assert cache_nbytes(int4) == cache_nbytes(plain)
    for store in (plain, int4):
        store.apply(lambda t: t[[1, 0, 1]])
    check()
    if not rotate:  # a crop re-quantizes what it reads back: rotated, a value 1e-6 off a rounding edge changes code
        for store in (plain, int4):
            store.crop(140)
        check()
    extra = torch.randn(3, 3, 40, width)
    plain.append(extra)
    int4.append(extra)
    check()


@pytest.mark.parametrize("width, group", [(64, 64), (128, 64)])
@pytest.mark.parametrize("rotate", [False, True])
def test_int4_values_give_up_their_oldest_tokens_as_kivis_store_does(width, group, rotate):
    """Razor's windows drop a token or two of values a step: ``KiviInt4Values`` dequantizes them from its int4 rows
    directly, and what it gives up equals what KIVI's plain store gives for the same tokens (the codec's own packing
    and dequantization), within blocks, across their edges and with the sink, as is the rest it keeps."""
    plain, int4 = _stores(width, group, sink=3, rotate=rotate, seed=width + 7)
    same = dict(rtol=0, atol=1e-5 if rotate else 0)
    for count in (1, 1, 3, 1, 30, 1, 70, 2):
        torch.testing.assert_close(int4.take_front(count), plain.take_front(count), **same)
    torch.testing.assert_close(int4.read(), plain.read(), **same)


@pytest.mark.parametrize("machine", [Int4Rows(64, True), Int4Rows(32, True), Int4Rows(32, False)])
def test_groups_fit_the_machines_row_blocks(monkeypatch, machine):
    """96-channel groups are one and a half AVX-512 row blocks: that packing is none the kernel reads, so such values
    stay in KIVI's packing there; AVX2's 32-row blocks hold them."""
    monkeypatch.setattr(kvconvert_tokenlayout, "cpu_int4_rows", lambda: machine)
    assert kivi_int4_fits(QuantSpec(4, 96), 96) == (machine.block == 32)
    assert kivi_int4_fits(QuantSpec(4, 64), 128)
    assert kivi_int4_fits(QuantSpec(4, 32), 64)  # a group shorter than a block: one pairwise block


def test_only_widths_of_whole_int4_matrices_fit():
    assert not kivi_int4_fits(QuantSpec(4, 16), 64)  # 16-channel groups: no int4 matrix
    assert not kivi_int4_fits(QuantSpec(4, 32), 48)  # padded groups
    assert not kivi_int4_fits(QuantSpec(2, 64), 64)  # 2-bit codes
    assert not kivi_int4_fits(QuantSpec(4, 40), 64)  # 32-channel groups, but blocks of 40 tokens
    assert kivi_int4_fits(QuantSpec(4, 32), 96)


@pytest.mark.parametrize("width, group, sink, rotate", [(64, 64, 0, False), (64, 32, 3, True), (128, 64, 4, True)])
@pytest.mark.parametrize("padded", [False, True])
def test_decode_over_int4_values_is_the_folded_readers(width, group, sink, rotate, padded):
    """``kivi_decode`` with the values in int4 rows against the same step over KIVI's packing (``kivi_decode_folded``
    widening every code): the same attention up to the kernel's bfloat16 inputs."""
    keys_spec = QuantSpec(4, group, residual=8, sink=sink)
    keys = TokenStore(keys_spec, per_channel=True)
    plain, int4 = _stores(width, group, sink, rotate, seed=width + sink, lengths=(5 * group + 9,))
    generator = torch.Generator().manual_seed(1)
    keys.append(torch.randn(2, 3, 5 * group + 9, width, generator=generator) * 2)
    query = torch.randn(2, 6, 1, width, generator=generator)
    key, value = torch.randn(2, 3, 1, width, generator=generator), torch.randn(2, 3, 1, width, generator=generator)
    bias = None
    if padded:  # row 1 left-padded by 5 tokens
        bias = torch.zeros(2, 1, 1, 5 * group + 10)
        bias[1, ..., :5] = torch.finfo(torch.float32).min
    expected = kivi_decode(query, key, value, bias, keys, plain, width**-0.5, kernel=False)
    calls = []
    original = kvconvert_quant.kivi_int4_values
    try:
        kvconvert_quant.kivi_int4_values = lambda *a: calls.append(a[1]) or original(*a)
        got = kivi_decode(query, key, value, bias, keys, int4, width**-0.5, kernel=False)
    finally:
        kvconvert_quant.kivi_int4_values = original
    assert calls
    # what the int4 kernel reads, the weights times the values' scales in bfloat16, holds no subnormal number: a
    # padded row's masked weights once made them so, and the kernel reads those 15x more slowly
    held = int4.blocks
    assert held is not None
    weighted = (calls[0][..., None, :] * held.scale.float()[:, :, None]).to(torch.bfloat16).float()
    tiny = torch.finfo(torch.bfloat16).tiny
    assert not ((weighted != 0) & (weighted.abs() < tiny)).any()
    torch.testing.assert_close(got, expected, rtol=0, atol=3e-2)  # probability-weighted scales in bfloat16
    assert (got - expected).abs().mean() < 4e-3


KIVI = ("--kv-bits", "4", "--kv-group", "32", "--kv-residual", "8", "--kv-sink", "2", "--kv-rotate")
RAZOR = ("--kv-budget", "0.5", "--profile-tokens", "16", "--window", "40")
EXTRA = {"quant": (), "razor": RAZOR, "minicache": ("--start-layer", "1", "--gamma", "0.1")}


def _value_stores(layer) -> list:
    """The value stores of a cache layer: quant's, razor's retrieval heads' and windows', MiniCache's merged pair's
    (its first member holds none) or unpaired layer's."""
    if hasattr(layer, "full_v"):
        return [layer.full_v, layer.recent_v]
    if hasattr(layer, "values_merged"):
        return [layer.values_merged.direction]
    return [layer.value_store] if hasattr(layer, "value_store") else []


@pytest.mark.parametrize("method", sorted(EXTRA))
def test_a_converted_model_decodes_through_int4_values(method, tokenized_model_dir, tmp_path, monkeypatch):
    """A KIVI-layout checkpoint of 64-wide heads keeps its values in int4 rows on a CPU and decodes through the int4
    kernel: the tokens of the same model whose values stay in KIVI's packing, logits within bfloat16's rounding;
    razor's windows (40 tokens) slide a token a step out of the int4 rows, freeing whole blocks; MiniCache's merged
    directions weigh the norms in and read their retained tokens from the rows; every generation mode runs (beams
    reorder the rows)."""
    src = tokenized_model_dir("llama_gqa64")
    convert(method, src, tmp_path / "q", *KIVI, *EXTRA[method])
    ids, mask = left_padded(100)
    calls = []
    original = kvconvert_tokenlayout.code_outputs
    monkeypatch.setattr(kvconvert_tokenlayout, "code_outputs", lambda *a: calls.append(1) or original(*a))

    def run():
        model = kvconvert.load(tmp_path / "q").eval()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40,
                             do_sample=False, return_dict_in_generate=True, output_logits=True,
                             pad_token_id=0)  # fmt: skip
        stores = [store for layer in out.past_key_values.layers for store in _value_stores(layer)]
        return torch.stack(out.logits), out.sequences, stores  # fmt: skip

    logits, tokens, stores = run()
    assert calls and {type(store).__name__ for store in stores} == {"KiviInt4Values"}
    if method == "razor":  # the windows slid out of their quantized blocks and freed the first ones
        assert any(store.offset > 0 or store.front_dropped and store.quantized_tokens for store in stores[1::2])
    monkeypatch.setattr(kvconvert_quant, "int4_values_read", lambda quant, values: False)  # every layer asks it
    calls.clear()
    plain_logits, plain_tokens, stores = run()
    assert not calls and {type(store).__name__ for store in stores} == {"TokenStore"}
    assert torch.equal(tokens, plain_tokens)
    assert (logits - plain_logits).abs().max() < 2e-2 * plain_logits.abs().max()
    monkeypatch.undo()
    generate_in_every_mode(kvconvert.load(tmp_path / "q").eval())
