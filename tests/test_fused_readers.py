"""The CPU readers Inductor compiles (``kvconvert_folded.fused_call``) against the eager ops they stand in for and
against plain products with the dequantized codes; their fall-back where Inductor cannot build; inside a converted
model, the same tokens and logits as the eager readers."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from kvconvert.runtime import kvconvert_compiled, kvconvert_folded
from kvconvert.runtime.kvconvert_codec import dequantize_tokens, quantize_tokens
from kvconvert.runtime.kvconvert_folded import folded_scores

# Inductor compiles C++ on first use: seconds each, a minute cold on 2 cores; the one module whose tests read through
# the compiled readers (conftest's other tests set KVCONVERT_COMPILE=off)
pytestmark = [pytest.mark.slow, pytest.mark.compiled_readers]


@pytest.fixture
def fused(monkeypatch):
    """Every read compiled, whatever its size, from a fresh table of compiled readers."""
    monkeypatch.setattr(kvconvert_folded, "FUSE_MIN_CODES", 0)
    monkeypatch.setattr(kvconvert_folded, "WHOLE_MIN_CODES", 0)
    monkeypatch.setattr(kvconvert_compiled, "_FUSED", {})
    monkeypatch.setenv("KVCONVERT_COMPILE", "on")
    return kvconvert_compiled._FUSED


def quantized_keys(batch: int, blocks: int, bits: int, dim: int = 48, block: int = 32):
    torch.manual_seed(batch * 10 + bits)
    keys = torch.randn(batch, 2, blocks * block, dim)
    stored = quantize_tokens(keys, bits, block, True)
    return stored, dequantize_tokens(stored, bits, block, dim, True, torch.float32)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize(("batch", "blocks", "rows"), [(1, 1, 1), (3, 5, 4)])
def test_compiled_scores_are_the_eager_scores(bits, batch, blocks, rows, fused, monkeypatch):
    """``folded_scores`` compiled (one loop over the codes, a sum per query row of a KV head) against its eager matrix
    products and against the query times the dequantized keys: the same scores but for the order of float32 sums;
    one query row a head (MHA) or several (GQA)."""
    stored, plain = quantized_keys(batch, blocks, bits)
    query = torch.randn(batch, 2, rows, plain.shape[-1])
    compiled = folded_scores(query, stored.codes, stored.scale, stored.zero, bits)
    assert fused.get("folded_scores") not in (None, False)  # the compiled reader ran
    monkeypatch.setenv("KVCONVERT_COMPILE", "off")
    eager = folded_scores(query, stored.codes, stored.scale, stored.zero, bits)
    sums = dict(atol=1e-4, rtol=1e-5)  # scores of magnitude ~10 summed over 48 channels in another order
    torch.testing.assert_close(compiled, eager, **sums)
    torch.testing.assert_close(compiled, query @ plain.transpose(-1, -2), **sums)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize(("batch", "tokens", "group", "rows"), [(1, 8, 48, 1), (3, 40, 16, 4)])
def test_compiled_value_sums_are_the_eager_sums(bits, batch, tokens, group, rows, fused, monkeypatch):
    """``folded_value_sum`` compiled against its eager products and against the weights times the dequantized
    values, one channel group or several, one query row a head or several."""
    torch.manual_seed(tokens + bits)
    values = torch.randn(batch, 2, tokens, 48)
    stored = quantize_tokens(values, bits, group, False)
    plain = dequantize_tokens(stored, bits, group, 48, False, torch.float32)
    weights = torch.rand(batch, 2, rows, tokens)
    compiled = kvconvert_folded.folded_value_sum(weights, stored.codes, stored.scale, stored.zero, bits)[..., :48]
    assert fused.get("folded_value_sum") not in (None, False)
    monkeypatch.setenv("KVCONVERT_COMPILE", "off")
    eager = kvconvert_folded.folded_value_sum(weights, stored.codes, stored.scale, stored.zero, bits)[..., :48]
    sums = dict(atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(compiled, eager, **sums)
    torch.testing.assert_close(compiled, weights @ plain, **sums)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize(("width", "group"), [(93, 64), (26, 8)])
def test_compiled_value_sums_take_groups_that_end_inside_a_byte(bits, width, group, fused, monkeypatch):
    """Values whose channel groups end inside a packed byte (ZACK's packed columns: 93 channels in 2 groups of 47,
    26 in 4 of 7): compiled group by group over the bytes holding each group's channels (``_values_by_group``), at 3
    bits, whose bytes mix channels, each column's group looked up (``_values_by_index``), against the eager products
    over each plane's runs of columns and against the weights times the dequantized values."""
    torch.manual_seed(width + bits)
    values = torch.randn(2, 1, 40, width)
    stored = quantize_tokens(values, bits, group, False)
    plain = dequantize_tokens(stored, bits, group, width, False, torch.float32)
    weights = torch.rand(2, 1, 5, 40)
    args = (weights, stored.codes, stored.scale, stored.zero, bits, width)
    compiled = kvconvert_folded.folded_value_sum(*args)[..., :width]
    names = [name for name, built in fused.items() if built is not False]
    assert names == ["folded_value_sum_spans" if bits == 3 else "folded_value_sum"]
    monkeypatch.setenv("KVCONVERT_COMPILE", "off")
    eager = kvconvert_folded.folded_value_sum(*args)[..., :width]
    sums = dict(atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(compiled, eager, **sums)
    torch.testing.assert_close(compiled, weights @ plain, **sums)


@pytest.mark.parametrize(("bits", "width", "group", "rotate"),
                         [(2, 93, 64, True), (3, 93, 64, True), (4, 93, 64, True), (8, 93, 64, True), (4, 26, 8, False),
                          (3, 26, 8, False)])  # fmt: skip
def test_value_sums_over_one_head_s_columns(bits, width, group, rotate, fused, monkeypatch):
    """``folded_value_span`` (ZACK's decode step, one KV head's columns of the packed values at a time: spans that
    start and end inside packed bytes and channel groups, one channel, the whole row), compiled and eager, against the
    whole row's sum (``folded_value_sum``, rotated back by ``value_channels``) cut to the span, and without a rotation
    against the weights times the dequantized values."""
    torch.manual_seed(width + bits + rotate)
    groups = -(-width // group)
    size = -(-width // groups)
    # as the codec stores rotated values: padded to whole channel groups
    stored = quantize_tokens(torch.randn(2, 1, 40, groups * size if rotate else width), bits, group, False)
    plain = dequantize_tokens(stored, bits, group, width, False, torch.float32)
    weights = torch.rand(2, 1, 5, 40)
    rotation = torch.linalg.qr(torch.randn(size, size, dtype=torch.float64))[0].float() if rotate else None
    args = (weights, stored.codes, stored.scale, stored.zero, bits)
    spans = [(0, width), (0, 25), (25, 61), (61, width), (47, 48), (3, 4), (width - 1, width)]
    spans = [(lo, min(hi, width)) for lo, hi in spans if lo < width]
    for compiled in (True, False):
        monkeypatch.setenv("KVCONVERT_COMPILE", "on" if compiled else "off")
        whole = kvconvert_folded.value_channels(kvconvert_folded.folded_value_sum(*args, width), rotation, width)
        for lo, hi in spans:
            part = kvconvert_folded.folded_value_span(*args, width, (lo, hi), rotation)
            torch.testing.assert_close(part, whole[..., lo:hi], atol=1e-4, rtol=1e-5)
            if rotation is None:
                torch.testing.assert_close(part, (weights @ plain)[..., lo:hi], atol=1e-4, rtol=1e-5)
    # group by group, one scale a token (at 3 bits the whole row, each column's group looked up)
    assert fused.get("folded_value_sum_spans" if bits == 3 else "folded_value_sum") not in (None, False)


@pytest.mark.parametrize("block", [24, 64, 128, 256])
def test_compiled_three_bit_reads_at_every_word_size(block, fused, monkeypatch):
    """3-bit keys and values whose packed rows hold 24 codes (high bits by eight shifts), 64, 128 (a 16- or 32-bit
    word of high bits a plane) or 256 (two words a plane): compiled against eager and against the dequantized cache."""
    torch.manual_seed(block)
    keys = torch.randn(2, 2, 2 * block, block)
    stored = quantize_tokens(keys, 3, block, True)
    plain = dequantize_tokens(stored, 3, block, block, True, torch.float32)
    values = quantize_tokens(keys, 3, block, False)
    plain_values = dequantize_tokens(values, 3, block, block, False, torch.float32)
    query, weights = torch.randn(2, 2, 3, block), torch.randn(2, 2, 3, 2 * block).softmax(-1)  # as attention's
    scores = folded_scores(query, stored.codes, stored.scale, stored.zero, 3)
    summed = kvconvert_folded.folded_value_sum(weights, values.codes, values.scale, values.zero, 3)
    assert fused.get("folded_scores") not in (None, False) and fused.get("folded_value_sum") not in (None, False)
    monkeypatch.setenv("KVCONVERT_COMPILE", "off")
    sums = dict(atol=2e-4, rtol=1e-5)  # up to 256 channels or tokens summed in another order
    torch.testing.assert_close(scores, folded_scores(query, stored.codes, stored.scale, stored.zero, 3), **sums)
    torch.testing.assert_close(scores, query @ plain.transpose(-1, -2), **sums)
    eager = kvconvert_folded.folded_value_sum(weights, values.codes, values.scale, values.zero, 3)
    torch.testing.assert_close(summed, eager, **sums)
    torch.testing.assert_close(summed, weights @ plain_values, **sums)


@pytest.mark.parametrize(("bits", "extras"), [(2, True), (3, False), (4, False), (8, True)])  # a C++ build each
def test_the_whole_read_compiled_is_the_eager_read(bits, extras, fused, monkeypatch):
    """``kivi_decode_folded`` compiled whole (one call: both readers, the bias, exact tokens beside the codes, the
    softmax) against the same step in torch's eager ops; with ``extras`` also a window's skipped first tokens,
    MiniCache's per-token factors and values stored rotated."""
    from kvconvert.runtime.kvconvert_codec import rotation
    from kvconvert.runtime.kvconvert_folded import kivi_decode_folded

    torch.manual_seed(bits)
    block, dim, n, skip = 32, 64, 96, 5 if extras else 0
    keys, values = (torch.randn(2, 2, n, dim) for _ in range(2))
    k, v = quantize_tokens(keys, bits, block, True), quantize_tokens(values, bits, dim, False, extras)
    query, bias = torch.randn(2, 2, 3, dim), torch.zeros(2, n - skip)
    bias[-1, :7] = torch.finfo(torch.float32).min  # a left-padded row
    exact = (torch.randn(2, 2, 4, dim), torch.randn(2, 2, 4, dim), torch.randn(2, 1, 1, 4))
    options = {"exact": exact, "skip": skip, "value_width": dim}
    if extras:
        factors = (torch.rand(2, n - skip) + 0.5 for _ in range(2))
        options |= dict(zip(("key_factor", "value_factor"), factors, strict=True), value_rotation=rotation(dim))
    args = (query, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, bias, 0.3, bits, bits)
    whole = kivi_decode_folded(*args, **options)
    assert fused.get("kivi_decode_folded") not in (None, False)
    monkeypatch.setenv("KVCONVERT_COMPILE", "off")
    eager = kivi_decode_folded(*args, **options)
    for got, expected in zip(whole, eager, strict=True):  # the weighted sums, then (max, sum of weights)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_values_of_another_width_stay_out_of_the_whole_read(fused):
    """ZACK's packed columns (values of another width than the keys, in groups that end inside a packed byte) would
    make each layer's widths a graph of its own, all looked up at every call: their step reads through the two
    compiled readers instead."""
    from kvconvert.runtime.kvconvert_folded import kivi_decode_folded

    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 64, 48), torch.randn(1, 2, 64, 93)
    k, v = quantize_tokens(keys, 4, 32, True), quantize_tokens(values, 4, 64, False)
    kivi_decode_folded(torch.randn(1, 2, 3, 48), k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, None, 0.3,
                       value_width=93)  # fmt: skip
    assert "kivi_decode_folded" not in fused and fused.get("folded_scores") not in (None, False)


def test_small_reads_and_the_off_setting_stay_eager(monkeypatch):
    """Below ``FUSE_MIN_CODES`` (a call's guards would cost what the loop saves) nothing is compiled, nor with
    ``KVCONVERT_COMPILE=off``."""
    monkeypatch.setattr(kvconvert_compiled, "_FUSED", {})
    stored, _ = quantized_keys(1, 2, 4)
    assert stored.codes.numel() < kvconvert_folded.FUSE_MIN_CODES
    folded_scores(torch.randn(1, 2, 3, 48), stored.codes, stored.scale, stored.zero, 4)
    monkeypatch.setattr(kvconvert_folded, "FUSE_MIN_CODES", 0)
    monkeypatch.setenv("KVCONVERT_COMPILE", "off")
    folded_scores(torch.randn(1, 2, 3, 48), stored.codes, stored.scale, stored.zero, 4)
    assert kvconvert_compiled._FUSED == {}


def test_the_bound_counts_codes_not_bytes():
    """``FUSE_MIN_CODES`` is a count of codes (in bytes of 4-bit ones): 2-bit codes reach it from half the bytes, 8-bit
    from twice; 3-bit codes always compile; unpacked tensors (``bits`` 0) count their elements."""
    least = kvconvert_folded.FUSE_MIN_CODES
    for bits, nbytes in ((4, least), (2, least // 2), (8, 2 * least)):
        assert kvconvert_folded.fuses(torch.zeros(nbytes, dtype=torch.uint8), bits), bits
        assert not kvconvert_folded.fuses(torch.zeros(nbytes - 1, dtype=torch.uint8), bits), bits
    assert kvconvert_folded.fuses(torch.zeros(3, dtype=torch.uint8), 3)
    assert kvconvert_folded.fuses(torch.zeros(least)) and not kvconvert_folded.fuses(torch.zeros(least - 1))


def dynamo_settings() -> tuple:
    return (torch.fx.experimental._config.use_duck_shape, torch._dynamo.config.recompile_limit,
            torch._dynamo.config.fail_on_recompile_limit_hit)  # fmt: skip


def test_a_compiled_read_leaves_the_user_s_dynamo_settings_as_they_were(fused, monkeypatch):
    """A reader sets dynamo's duck sizing and recompile limit for its own calls only (a process's own
    ``torch.compile`` keeps its settings), after a compiled read and after one that failed to build."""
    before = dynamo_settings()
    stored, _ = quantized_keys(1, 2, 4)
    query = torch.randn(1, 2, 3, 48)
    folded_scores(query, stored.codes, stored.scale, stored.zero, 4)
    assert fused.get("folded_scores") not in (None, False)
    assert dynamo_settings() == before
    inside = []

    def broken(fn, **options):
        def run(*args):
            inside.append(dynamo_settings())  # what the call runs under
            raise RuntimeError("InductorError: no working C++ compiler found")

        return run

    monkeypatch.setattr(kvconvert_compiled, "_FUSED", {})
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(UserWarning, match="could not build"):
        folded_scores(query, stored.codes, stored.scale, stored.zero, 4)
    assert inside == [(False, 64, True)]
    assert dynamo_settings() == before


def test_a_reader_inductor_cannot_build_falls_back_once_and_says_so(fused, monkeypatch):
    """Where Inductor fails (no C++ compiler), the step is read by the eager ops, one warning says why and how to
    skip the attempt, and later reads neither retry nor warn."""
    stored, plain = quantized_keys(2, 3, 4)
    query = torch.randn(2, 2, 3, 48)

    def broken(fn, **options):
        def run(*args):
            raise RuntimeError("InductorError: no working C++ compiler found\n(the details)")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(UserWarning, match=r"could not build the CPU reader 'folded_scores' \(InductorError: no "
                                         r"working C\+\+ compiler found\).*KVCONVERT_COMPILE=off"):  # fmt: skip
        scores = folded_scores(query, stored.codes, stored.scale, stored.zero, 4)
    torch.testing.assert_close(scores, query @ plain.transpose(-1, -2), atol=1e-4, rtol=1e-5)
    assert fused["folded_scores"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = folded_scores(query, stored.codes, stored.scale, stored.zero, 4)
    torch.testing.assert_close(again, scores, rtol=0, atol=0)


def test_auto_builds_a_reader_once_the_process_has_decoded_long_enough(monkeypatch):
    """``KVCONVERT_COMPILE=auto`` reads eagerly until the time between a reader's calls sums to ``COMPILE_AFTER_S``
    (a pause longer than ``IDLE_S`` counted as ``IDLE_S``), then builds it; the scores the same either way."""
    clock = [0.0]
    monkeypatch.setattr(kvconvert_compiled, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(kvconvert_compiled, "COMPILE_AFTER_S", 3.0)
    monkeypatch.setattr(kvconvert_compiled, "_FUSED", {})
    monkeypatch.setattr(kvconvert_compiled, "_DECODED", {})
    monkeypatch.setattr(kvconvert_folded, "FUSE_MIN_CODES", 0)
    monkeypatch.setenv("KVCONVERT_COMPILE", "auto")
    stored, plain = quantized_keys(1, 2, 4)
    query = torch.randn(1, 2, 3, 48)
    built = []
    for gap in (0.0, 0.5, 1.0, 60.0, 0.4, 0.5, 0.5):  # summed 0, 0.5, 1.5, 2.5 (a minute's pause: 1 s), 2.9, 3.4, 3.9
        clock[0] += gap
        scores = folded_scores(query, stored.codes, stored.scale, stored.zero, 4)
        torch.testing.assert_close(scores, query @ plain.transpose(-1, -2), atol=1e-4, rtol=1e-5)
        built.append(bool(kvconvert_compiled._FUSED.get("folded_scores")))
    assert built == [False] * 5 + [True] * 2


def test_a_misspelt_setting_is_an_error(monkeypatch):
    monkeypatch.setenv("KVCONVERT_COMPILE", "yes")
    with pytest.raises(ValueError, match="KVCONVERT_COMPILE='yes' is not one of auto, on, off"):
        kvconvert_compiled.compile_requested()


# the token layout's keys beside 2-bit values: only its values are read by a compiled reader
TOKEN_MIX = ["quant", "--kv-bits", "4", "--kv-layout", "token", "--kv-value-bits", "2", "--kv-residual", "0",
             "--kv-sink", "4"]  # fmt: skip


CONVERTED = [("quant-sink-rotated-residual", False), ("quant-sink-rotated-residual", True), ("quant-3bit", False),
             ("razor-4bit", False), ("token-mix", False)]  # fmt: skip


@pytest.mark.parametrize(("name", "static"), CONVERTED)
@torch.no_grad()
def test_a_converted_model_decodes_the_same_through_the_compiled_readers(name, static, fused, tokenized_model_dir,
                                                                         tmp_path, monkeypatch):  # fmt: skip
    """A checkpoint whose CPU decode reads codes (KIVI's layout, the token layout's 2-bit values): its greedy batch
    (left padding, blocks filling while it decodes; ``static``: from a static cache decoded eagerly, every block's
    room read) through the compiled readers gives the eager readers' tokens and logits."""
    import kvconvert
    from tests.helpers import run_cli
    from tests.test_kernels import assert_same_generation, greedy_twelve, kivi_checkpoint, kivi_packed_values

    monkeypatch.setenv("KVCONVERT_KERNELS", "torch")
    if name == "token-mix":
        model_dir = str(tokenized_model_dir("llama_gqa64"))
        result = run_cli(TOKEN_MIX[0], "--model", model_dir, "--out", str(tmp_path / "m"), "--quiet", *TOKEN_MIX[1:])
        assert result.exit_code == 0, result.output
    else:
        kivi_checkpoint(name, tokenized_model_dir, tmp_path / "m")
    model = kvconvert.load(tmp_path / "m").eval()
    kivi_packed_values(monkeypatch)
    options = {"cache_implementation": "static"} if static else {}
    compiled = greedy_twelve(model, **options)
    reader = "folded_value_sum" if name == "token-mix" else "kivi_decode_folded"  # KIVI's: the whole read compiled
    assert fused.get(reader) not in (None, False)
    monkeypatch.setenv("KVCONVERT_COMPILE", "off")
    eager = greedy_twelve(model, **options)
    if name != "token-mix":
        assert_same_generation(eager, compiled, name)
        return
    # the token layout's keys meet the query in bfloat16 (torch's int4 kernel): a float32 sum in another order
    # upstream can round a query element the other way, 2⁻⁸ of it, so the logits agree to that scale, not to float32's
    for step, (a, b) in enumerate(zip(eager.logits, compiled.logits, strict=True)):
        assert (a - b).abs().max() <= 1e-2 * a.abs().max(), f"decode step {step}"
    assert torch.equal(eager.sequences, compiled.sequences)


@pytest.mark.parametrize("paired", [False, True])
def test_compiled_scores_of_half_precision_keys_turned_on_the_query_side(paired, fused):
    """In bfloat16 (no complex pairs, so the other way turns every key and writes it back in bfloat16 first) the
    compiled ``turned_scores`` is as close to float64's turned keys times the query as that other way is."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvconvert.runtime.kvconvert_rope import pair_order, rotate_in_pairs, turned_scores

    torch.manual_seed(1)
    b, n, heads, kv_heads, dk = 2, 300, 4, 2, 64
    keys, query = torch.randn(b, n, kv_heads * dk), torch.randn(b, heads, 1, dk)
    angles = torch.arange(n)[:, None] * 10000.0 ** (-torch.arange(dk // 2) / (dk // 2))
    cos, sin = torch.cat([angles.cos()] * 2, -1)[None], torch.cat([angles.sin()] * 2, -1)[None]
    head_major = keys.double().view(b, n, kv_heads, dk).transpose(1, 2)
    turned = apply_rotary_pos_emb(head_major, head_major, cos.double(), sin.double())[0]
    expected = query.double() @ turned.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2)
    order = pair_order(dk, dk) if paired else torch.arange(dk)
    half = [t.bfloat16() for t in (query[..., order], keys.view(b, n, kv_heads, dk)[..., order].reshape(b, n, -1),
                                   cos, sin)]  # fmt: skip
    compiled = kvconvert_compiled.compiled_call("turned_scores", turned_scores, *half, paired)
    assert fused.get("turned_scores") not in (None, False) and compiled is not None
    assert compiled.dtype == torch.bfloat16 and compiled.shape == (b, heads, 1, n)
    if paired:  # slim's way: every key turned in bfloat16, then the product
        other = half[0] @ rotate_in_pairs(half[1], half[2], half[3], kv_heads).repeat_interleave(2, 1).transpose(-1, -2)
    else:  # LoRC's way
        grouped = half[1].view(b, n, kv_heads, dk).transpose(1, 2)
        other = half[0] @ apply_rotary_pos_emb(grouped, grouped, half[2], half[3])[0].repeat_interleave(2, 1).mT
    # mean errors: the largest is the result's own rounding to bfloat16 (half a unit at |score| ~ 30), alike in both
    error, other_error = ((t.double() - expected).abs().mean().item() for t in (compiled, other))
    assert error <= other_error
    torch.testing.assert_close(compiled.double(), expected, atol=2**-8 * expected.abs().max().item(), rtol=2**-8)


def _unturned_checkpoint(method: str, source, out, *extra: str):
    """``source`` converted by slim, or by LoRC at 0.5 (uniform), through the CLI; loaded."""
    import kvconvert
    from tests.helpers import run_cli

    options = ("--kv-budget", "0.5", "--schedule", "uniform") if method == "lorc" else ()
    result = run_cli(method, "--model", str(source), "--out", str(out), "--quiet", *options, *extra)
    assert result.exit_code == 0, result.output
    return kvconvert.load(out).eval()


@pytest.mark.parametrize(("method", "kind"), [("slim", "llama"), ("slim", "gpt_neox"), ("slim", "olmo2"),
                                              ("lorc", "llama_gqa"), ("lorc", "qwen3")])  # fmt: skip
@torch.no_grad()
def test_unturned_keys_scored_through_the_compiled_reader_as_eagerly(method, kind, fused, tokenized_model_dir, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    """Slim's and LoRC's eager CPU steps score their unturned keys through ``turned_scores`` compiled (RoPE on the
    query side, one pass over the cache): a left-padded greedy batch gives the tokens and logits of turning and
    scoring a piece at a time, partial rotary (GPT-NeoX), a key norm over all heads (OLMo 2) or per head (Qwen3) and
    GQA (LoRC's rebuilt keys) included."""
    from tests.test_kernels import assert_same_generation, greedy_twelve

    monkeypatch.setenv("KVCONVERT_REBUILD", "exact")
    model = _unturned_checkpoint(method, tokenized_model_dir(kind), tmp_path / "m")
    compiled = greedy_twelve(model)
    assert fused.get("turned_scores" if method == "slim" else "turned_scores_rebuilt") not in (None, False)
    monkeypatch.setenv("KVCONVERT_COMPILE", "off")
    assert_same_generation(greedy_twelve(model), compiled, f"{method} on {kind}")


@pytest.mark.parametrize("method", ["slim", "lorc"])
@torch.no_grad()
def test_half_precision_checkpoints_take_the_compiled_reader(method, fused, tokenized_model_dir, tmp_path):
    """A bfloat16 checkpoint (no complex pairs) decodes through the compiled ``turned_scores`` too; its accuracy is
    the function's test above (a whole random model in bfloat16 flips greedy tokens on any change of rounding)."""
    from tests.test_kernels import greedy_twelve

    extra = ("--dtype", "bfloat16") + (("--accept-v-error",) if method == "slim" else ())
    model = _unturned_checkpoint(method, tokenized_model_dir("llama_gqa" if method == "lorc" else "llama"),
                                 tmp_path / "m", *extra)  # fmt: skip
    assert model.dtype == torch.bfloat16
    logits = greedy_twelve(model).logits
    assert fused.get("turned_scores" if method == "slim" else "turned_scores_rebuilt") not in (None, False)
    assert all(torch.isfinite(step).all() for step in logits)
