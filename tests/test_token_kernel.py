"""The token layout's GPU decode kernel (``kvconvert_token_kernel``) against attention over what the stores read back
(dequantized in plain torch), and inside converted checkpoints against the torch runtime; on a CPU through
TRITON_INTERPRET=1 (set in conftest), natively on a GPU."""

from __future__ import annotations

import pytest
import torch

import kvconvert.runtime.kvconvert_token_kernel as token_kernel
from kvconvert.runtime.kvconvert_codec import QuantSpec
from kvconvert.runtime.kvconvert_tokenlayout import KERNEL_ROWS, Int4Rows, TokenLayoutStore

pytestmark = pytest.mark.slow  # Triton's interpreter: `make test-fast` skips it

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEG = torch.finfo(torch.float32).min


def stores(quant: QuantSpec, rows: Int4Rows | None, past: int, dim: int, kv_heads: int, seed: int):
    """Key and value stores holding ``past`` random tokens for 2 rows (``rows``: the packing forced, else chosen)."""
    torch.manual_seed(seed)
    keys, values = TokenLayoutStore(quant, keys=True), TokenLayoutStore(quant, keys=False)
    keys.rows = values.rows = rows
    # keys with per-channel offsets (what the block means take out), values plain
    keys.append(torch.randn(2, kv_heads, past, dim, device=DEVICE) + 3 * torch.randn(dim, device=DEVICE))
    values.append(torch.randn(2, kv_heads, past, dim, device=DEVICE))
    return keys, values


@pytest.mark.parametrize("tile", [32, 128], ids=["tile32-splits", "tile128"])
@pytest.mark.parametrize(
    ("dim", "group", "kv_heads", "heads", "sink", "rows"),
    [
        (64, 64, 2, 6, 0, None),  # one channel group, 3 query rows a KV head
        (128, 64, 1, 4, 3, None),  # two channel groups (Llama's heads), the sink exact
        (64, 32, 2, 2, 4, None),  # key blocks of 32 tokens (one packing block each), MHA
        (64, 64, 2, 6, 2, Int4Rows(64, True)),  # AVX-512's rows: 64-token blocks, 64-channel value blocks
        (64, 64, 2, 6, 0, Int4Rows(32, False)),  # the plain loop's pairwise rows
    ],
    ids=["d64", "d128-groups2-sink", "group32-mha", "rows64", "rows-pairwise"],
)
@torch.no_grad()
def test_token_decode_step_is_attention_over_the_stores(dim, group, kv_heads, heads, sink, rows, tile, monkeypatch):
    """One decode step through the kernel (the quantized blocks read from their codes; sink, float tail and this
    step's token exact, merged) equals SDPA over what the stores read back, with left padding that reaches into the
    quantized blocks; long enough caches split over several programs (tile 32)."""
    monkeypatch.setenv("KVCONVERT_KERNELS", "triton")
    monkeypatch.setattr(token_kernel, "TOKEN_TILE", tile)
    quant = QuantSpec(bits=4, group=group, residual=8, sink=sink)
    keys, values = stores(quant, rows, 8 * group + 13, dim, kv_heads, seed=dim + group + sink)
    assert keys.rows == (rows or KERNEL_ROWS) and keys.quantized_tokens == 8 * group
    query = torch.randn(2, heads, 1, dim, device=DEVICE)
    key, value = torch.randn(2, 2, kv_heads, 1, dim, device=DEVICE)
    total = len(keys) + 1
    bias = torch.zeros(2, 1, 1, total, device=DEVICE)
    bias[1, ..., : group + 5] = NEG  # left padding past the sink and into the second block
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys.read(then=key), values.read(then=value), attn_mask=bias, scale=dim**-0.5, enable_gqa=True
    )
    launches = []
    real = token_kernel.token_decode_triton
    monkeypatch.setattr(token_kernel, "token_decode_triton", lambda *a, **k: launches.append(1) or real(*a, **k))
    got = token_kernel.token_decode_kernel(query, key, value, bias, keys, values, dim**-0.5)
    assert launches == [1]
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize(("value_bits", "dim", "group"), [(2, 64, 64), (4, 64, 32), (2, 128, 64)],
                         ids=["2bit-d64", "4bit-d64-groups2", "2bit-d128-groups2"])  # fmt: skip
@torch.no_grad()
def test_token_keys_with_value_bits_decode_step_is_attention_over_the_stores(value_bits, dim, group, rotate,
                                                                             monkeypatch):  # fmt: skip
    """``--kv-value-bits``: token-layout keys beside values per token in KIVI's packing (2 or 4 bits, one or two
    channel groups, rotated or not). One decode step through the kernel equals SDPA over what the stores read back,
    with left padding into the quantized blocks and the sink exact."""
    from kvconvert.runtime.kvconvert_tokenstore import TokenStore

    monkeypatch.setenv("KVCONVERT_KERNELS", "triton")
    monkeypatch.setattr(token_kernel, "TOKEN_TILE", 32)  # several splits
    torch.manual_seed(value_bits + dim)
    keys = TokenLayoutStore(QuantSpec(bits=4, group=group, residual=8, sink=3), keys=True)
    # (channel groups of at most ``group``, as ``quant.side`` gives a layer's values)
    values = TokenStore(QuantSpec(bits=value_bits, group=group, residual=8, sink=3, rotate=rotate), False)
    keys.append(torch.randn(2, 2, 301, dim, device=DEVICE) + 3 * torch.randn(dim, device=DEVICE))
    values.append(torch.randn(2, 2, 301, dim, device=DEVICE))
    assert keys.rows == KERNEL_ROWS and values.quantized_tokens == keys.quantized_tokens == 293 // group * group
    assert token_kernel.token_kernel_reads(keys, values, dim) and values.rotate == rotate
    query = torch.randn(2, 4, 1, dim, device=DEVICE)
    key, value = torch.randn(2, 2, 2, 1, dim, device=DEVICE)
    bias = torch.zeros(2, 1, 1, len(keys) + 1, device=DEVICE)
    bias[0, ..., :50] = NEG
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys.read(then=key), values.read(then=value), attn_mask=bias, scale=dim**-0.5, enable_gqa=True
    )
    got = token_kernel.token_decode_kernel(query, key, value, bias, keys, values, dim**-0.5)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@torch.no_grad()
def test_the_kernel_reads_only_the_stores_it_was_built_for(monkeypatch):
    """``token_kernel_reads``: keys packed in ``KERNEL_ROWS`` with a quantized block, not a CPU's other packings;
    values of their own width (``--kv-value-bits``) per token at 2 or 4 bits, not 3, not per channel."""
    from kvconvert.runtime.kvconvert_tokenstore import TokenStore

    monkeypatch.setenv("KVCONVERT_KERNELS", "triton")
    quant = QuantSpec(bits=4, group=32, residual=0)
    keys, values = stores(quant, None, 64, 64, 2, seed=0)
    assert token_kernel.token_kernel_reads(keys, values, 64)
    other, _ = stores(quant, Int4Rows(64, True), 64, 64, 2, seed=0)
    assert not token_kernel.token_kernel_reads(other, values, 64)
    for bits, per_channel, read in ((4, False, True), (2, False, True), (3, False, False), (4, True, False)):
        kivi_values = TokenStore(QuantSpec(bits=bits, group=32, residual=0), per_channel=per_channel)
        kivi_values.append(torch.randn(2, 2, 64, 64, device=DEVICE))
        assert token_kernel.token_kernel_reads(keys, kivi_values, 64) == read, (bits, per_channel)
    monkeypatch.setenv("KVCONVERT_KERNELS", "torch")  # a store made where the kernel may not read keeps the CPU's rows
    cpu_keys, _ = stores(quant, None, 64, 64, 2, seed=0)
    assert DEVICE != "cpu" or cpu_keys.rows != KERNEL_ROWS or cpu_keys.kernel_reads()


def without_int4_kernel(monkeypatch) -> None:
    """The reference reads the stores back dequantized, not through torch's CPU int4 kernel (bfloat16 operands: 3e-3
    of the logits' scale off the float32 kernel). Where the CPU's int4 packing is the kernel's (``KERNEL_ROWS``: AVX2
    machines, ``ATEN_CPU_CAPABILITY=avx2``) the torch runtime would otherwise read the kernel's stores through it."""
    import kvconvert.runtime.kvconvert_quant as runtime
    import kvconvert.runtime.kvconvert_tokenlayout as layout

    monkeypatch.setattr(layout, "cpu_int4_rows", lambda: None)
    monkeypatch.setattr(runtime, "cpu_int4_rows", lambda: None)


@pytest.mark.parametrize("value_bits", [None, 2], ids=["token-values", "value-bits-2"])
@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@torch.no_grad()
def test_decode_with_the_token_kernel_matches_the_torch_runtime(static, value_bits, tokenized_model_dir, tmp_path,
                                                                monkeypatch):  # fmt: skip
    """A 4-bit token-layout checkpoint (values in the layout too, or 2-bit per token: ``--kv-value-bits``) with
    KVCONVERT_KERNELS=triton: every decode step of every layer is one kernel launch, from a growing cache or a
    static one (blocks filling while it decodes, the count read on the device), and greedy decoding of a left-padded
    batch gives the tokens and logits of the torch runtime reading the same stores dequantized."""
    import kvconvert
    import kvconvert.runtime.kvconvert_quant as runtime
    import kvconvert.runtime.kvconvert_tokenstatic as static_runtime
    from tests.helpers import convert
    from tests.test_kernels import assert_same_generation, greedy_twelve

    out = tmp_path / "m"
    bits = () if value_bits is None else ("--kv-value-bits", str(value_bits))
    convert("quant", tokenized_model_dir("llama_gqa64"), out, "--kv-bits", "4", "--kv-group", "32", "--kv-residual",
            "8", "--kv-sink", "4", "--kv-layout", "token", *bits)  # fmt: skip
    model = kvconvert.load(out).eval().to(DEVICE)
    layers = model.config.num_hidden_layers
    launches = []
    real = token_kernel.token_decode_triton
    monkeypatch.setattr(token_kernel, "token_decode_triton", lambda *a, **k: launches.append(1) or real(*a, **k))
    # (on a GPU generate would compile a static step, its wrapper then traced once: eager steps, counted)
    options = {"cache_implementation": "static", "disable_compile": True} if static else {}
    monkeypatch.setenv("KVCONVERT_KERNELS", "triton")  # stores packed for the kernel, then read by it
    with_kernel = greedy_twelve(model, **options)
    assert len(launches) == 11 * layers
    # the same stores (packed for the kernel) dequantized for SDPA
    monkeypatch.setattr(runtime, "token_kernel_reads", lambda *a: False)
    monkeypatch.setattr(static_runtime, "static_token_kernel_reads", lambda *a: False)
    without_int4_kernel(monkeypatch)
    launches.clear()
    dequantized = greedy_twelve(model, **options)
    assert not launches
    assert_same_generation(dequantized, with_kernel, "token layout, static" if static else "token layout")


@torch.no_grad()
@pytest.mark.parametrize("value_bits", [[], ["--kv-value-bits", "2"]], ids=["4-bit values", "2-bit values"])
def test_razor_in_the_token_layout_decodes_through_the_kernel(value_bits, tokenized_model_dir, tmp_path, monkeypatch):
    """Razor with token-layout storage and windows of 40 tokens in 32-token blocks: its retrieval heads' stores and,
    once they hold a quantized block, its windows (with razor's sink and compensation token as exact extras, the
    front they dropped masked) are read through the kernel; greedy decoding of a left-padded batch gives the tokens
    and logits of reading the same stores dequantized. With ``--kv-value-bits 2`` the values are KIVI's per-token
    codes beside the token layout's keys (the kernel's VBITS=2)."""
    import kvconvert
    import kvconvert.runtime.kvconvert_quant as runtime
    import kvconvert.runtime.kvconvert_razor as razor_runtime
    from tests.helpers import convert
    from tests.test_kernels import assert_same_generation, greedy_twelve

    out = tmp_path / "r"
    convert("razor", tokenized_model_dir("llama_gqa64"), out, "--kv-budget", "0.5", "--profile-tokens", "16",
            "--window", "40", "--kv-bits", "4", "--kv-group", "32", "--kv-residual", "8", "--kv-layout", "token",
            "--kv-sink", "2", *value_bits)  # fmt: skip
    model = kvconvert.load(out).eval().to(DEVICE)
    extras = []
    real = token_kernel.token_decode_kernel

    def counted(*args, **kwargs):
        extras.append(len(args) > 7 or "extra" in kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "token_decode_kernel", counted)  # what ``token_reader`` hands out
    monkeypatch.setenv("KVCONVERT_KERNELS", "triton")
    with_kernel = greedy_twelve(model)
    assert any(extras) and not all(extras), "retrieval heads and windows both through the kernel"
    monkeypatch.setattr(razor_runtime, "token_reader", lambda *a: None)
    extras.clear()
    dequantized = greedy_twelve(model)
    assert not extras
    assert_same_generation(dequantized, with_kernel, "razor, token layout")


@torch.no_grad()
def test_razor_in_the_token_layout_decodes_its_static_cache_through_the_kernel(tokenized_model_dir, tmp_path,
                                                                               monkeypatch):  # fmt: skip
    """Razor's static cache in the token layout (``StaticRazorTokenLayer``) with KVCONVERT_KERNELS=triton: its retrieval
    heads' stores, packed for the kernel, are read by it at every decode step of every layer (its windows' ring is
    dequantized: no kernel reads it), a unit leaving the window while it decodes; greedy decoding of a left-padded
    batch gives the tokens and logits of reading the same stores dequantized."""
    import kvconvert
    import kvconvert.runtime.kvconvert_razor_token as razor_token
    from tests.helpers import convert
    from tests.test_kernels import assert_same_generation, greedy_twelve

    out = tmp_path / "r"
    convert("razor", tokenized_model_dir("llama_gqa64"), out, "--kv-budget", "0.5", "--profile-tokens", "16",
            "--window", "40", "--kv-bits", "4", "--kv-group", "32", "--kv-residual", "8", "--kv-layout", "token",
            "--kv-sink", "2")  # fmt: skip
    model = kvconvert.load(out).eval().to(DEVICE)
    with_retrieval = sum(bool(heads) for heads in model.config.kvconvert["razor"]["retrieval_kv_heads"])
    launches = []
    real = token_kernel.token_decode_triton
    monkeypatch.setattr(token_kernel, "token_decode_triton", lambda *a, **k: launches.append(1) or real(*a, **k))
    options = {"cache_implementation": "static", "disable_compile": True}
    monkeypatch.setenv("KVCONVERT_KERNELS", "triton")
    without_int4_kernel(monkeypatch)  # the windows' ring: dequantized in both runs, whatever the CPU
    with_kernel = greedy_twelve(model, **options)
    kinds = {type(layer).__name__ for layer in with_kernel.past_key_values.layers}
    assert kinds == {"StaticRazorTokenLayer"} and with_retrieval and len(launches) == 11 * with_retrieval
    counts = [layer.comp_count for layer in with_kernel.past_key_values.layers if layer.comp_count is not None]
    assert counts and all(count.sum() > 0 for count in counts)  # every window lost a unit into its sums
    monkeypatch.setattr(razor_token, "static_token_kernel_reads", lambda *a: False)
    launches.clear()
    dequantized = greedy_twelve(model, **options)
    assert not launches
    assert_same_generation(dequantized, with_kernel, "razor, token layout, static")
