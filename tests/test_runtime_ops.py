"""Runtime building blocks against plain-torch / transformers references."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_rope
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

from kvconvert.runtime.kvconvert_prefill import additive_mask
from kvconvert.runtime.kvconvert_rope import (
    apply_rotary,
    from_pairs,
    pair_order,
    rotary_pairs,
    rotate_in_pairs,
    rotate_pairs,
    to_pairs,
    turned_scores,
)


@pytest.mark.parametrize("rotary_dim", [16, 4])  # full and partial (GPT-NeoX style) rotary
def test_apply_rotary_matches_transformers(rotary_dim):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 16)
    angles = torch.randn(2, 5, rotary_dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    reference = (llama_rope if rotary_dim == 16 else neox_rope)(x, x, cos, sin)[0]
    torch.testing.assert_close(apply_rotary(x, cos, sin), reference)


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("room", [0, 5])
def test_apply_rotary_on_a_token_major_cache(head_major, room):
    """LoRC and slim rotate their rebuilt keys as ``[b, n, h, dk]`` viewed per head: the same rotation either way,
    laid out per head (contiguous, what a score product reads without copying) when asked; also where each row is
    the front of a longer buffer (a store with room to grow)."""
    torch.manual_seed(0)
    tokens = torch.randn(2, 7 + room, 3, 16)[:, :7]  # [b, n, h, dk]
    angles = torch.randn(2, 7, 8)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x = tokens.transpose(1, 2)
    got = apply_rotary(x, cos, sin, head_major=head_major)
    torch.testing.assert_close(got, llama_rope(x.contiguous(), x.contiguous(), cos, sin)[0])
    assert got.is_contiguous() == head_major


@pytest.mark.parametrize(("rotary_dim", "grad"), [(16, False), (4, False), (16, True)])
def test_rotating_keys_in_pairs_scores_as_transformers(rotary_dim, grad):
    """LoRC's decode rebuilds keys with each head's channels in ``pair_order`` and rotates them by one complex
    product (``rotate_pairs``): with the queries in the same order, every score equals transformers' RoPE'd
    ``q·k`` (partial rotary: the channels past ``rotary_dim`` left as they are; with autograd: no ``out=``)."""
    torch.manual_seed(0)
    heads, dk = 3, 16
    keys = torch.randn(2, 7, heads * dk, requires_grad=grad)  # [b, n, heads·dk]
    query = torch.randn(2, heads, 1, dk)
    angles = torch.randn(2, 7, rotary_dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rope = llama_rope if rotary_dim == 16 else neox_rope
    head_major = keys.view(2, 7, heads, dk).transpose(1, 2)
    reference_keys = rope(head_major, head_major, cos, sin)[0]
    order = pair_order(dk, rotary_dim)
    pairs = rotary_pairs(cos, sin)
    assert pairs is not None
    got = rotate_pairs(keys.view(2, 7, heads, dk)[..., order].reshape(2, 7, -1), pairs, heads)
    torch.testing.assert_close(got, reference_keys[..., order])
    torch.testing.assert_close(query[..., order] @ got.transpose(-1, -2), query @ reference_keys.transpose(-1, -2))
    assert got.requires_grad == grad


@pytest.mark.parametrize("rotary_dim", [16, 4])
@pytest.mark.parametrize("form", ["complex", "real", "variant", "bfloat16"])
def test_rotating_a_pair_ordered_cache_as_transformers(rotary_dim, form):
    """Slim caches its keys in ``pair_order`` (``to_pairs``; ``from_pairs`` gives the model's order back) and rotates
    them with ``rotate_in_pairs``: transformers' rotate-half RoPE, channel for channel, whether the complex product
    applies or the real arithmetic stands in (no ``rotary_pairs``; halves with different angles; bfloat16)."""
    torch.manual_seed(0)
    heads, dk = 3, 16
    dtype = torch.bfloat16 if form == "bfloat16" else torch.float32
    keys = torch.randn(2, 7, heads * dk).to(dtype)
    order = pair_order(dk, rotary_dim)
    paired = to_pairs(keys, heads, rotary_dim)
    assert torch.equal(paired.view(2, 7, heads, dk), keys.view(2, 7, heads, dk)[..., order])
    assert torch.equal(from_pairs(paired, heads, rotary_dim), keys)
    angles = torch.randn(2, 7, rotary_dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    if form == "variant":  # rotate-half with its own angle per channel: not a rotation, still what transformers does
        cos, sin = torch.cat([angles.cos(), (2 * angles).cos()], -1), torch.cat([angles.sin(), (3 * angles).sin()], -1)
    cos, sin = cos.to(dtype), sin.to(dtype)
    rope = llama_rope if rotary_dim == 16 else neox_rope
    head_major = keys.view(2, 7, heads, dk).transpose(1, 2)
    reference = rope(head_major, head_major, cos, sin)[0]
    pairs = rotary_pairs(cos, sin) if form == "complex" else None
    assert (pairs is not None) == (form == "complex")
    got = rotate_in_pairs(paired, cos, sin, heads, pairs)
    assert got.shape == (2, heads, 7, dk) and got.dtype == dtype
    torch.testing.assert_close(got, reference[..., order])


@pytest.mark.parametrize("rotary_dim", [16, 4])
@pytest.mark.parametrize("variant", [False, True])
@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("kv_heads", [3, 1])
def test_scores_with_rope_on_the_query_side_are_transformers_scores(rotary_dim, variant, paired, kv_heads):
    """``turned_scores`` (a compiled CPU step's scores of unturned keys: RoPE moved onto the query side) equals the
    turned query times transformers' RoPE'd keys: keys in the model's order or in ``pair_order``, partial rotary,
    halves with their own angles, one KV head read by a group of query heads."""
    torch.manual_seed(0)
    b, n, heads, dk = 2, 7, 3, 16
    keys, query = torch.randn(b, n, kv_heads * dk), torch.randn(b, heads, 1, dk)
    angles = torch.randn(b, n, rotary_dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    if variant:
        cos, sin = torch.cat([angles.cos(), (2 * angles).cos()], -1), torch.cat([angles.sin(), (3 * angles).sin()], -1)
    head_major = keys.view(b, n, kv_heads, dk).transpose(1, 2)
    turned = (llama_rope if rotary_dim == dk else neox_rope)(head_major, head_major, cos, sin)[0]
    expected = query @ turned.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2)
    order = pair_order(dk, rotary_dim) if paired else torch.arange(dk)
    got = turned_scores(query[..., order], keys.view(b, n, kv_heads, dk)[..., order].reshape(b, n, -1), cos, sin,
                        paired=paired)  # fmt: skip
    assert got.shape == (b, heads, 1, n)
    torch.testing.assert_close(got, expected)


def test_rotary_pairs_only_where_one_angle_turns_each_pair():
    """Halves with different angles (a RoPE variant this form cannot express) or a half-precision dtype: None,
    so the caller rotates as ``apply_rotary`` does."""
    angles = torch.randn(1, 5, 8)
    assert rotary_pairs(torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)) is not None
    assert rotary_pairs(torch.cat([angles.cos(), angles.cos() + 1], -1), torch.cat([angles.sin()] * 2, -1)) is None
    half = torch.cat([angles.cos()] * 2, -1).half()
    assert rotary_pairs(half, half) is None


def test_additive_mask_forms_agree():
    causal = additive_mask(None, 3, 5, torch.float32, torch.device("cpu"))
    allowed = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    from_bool = additive_mask(allowed[None, None], 3, 5, torch.float32, torch.device("cpu"))
    assert torch.equal(causal, from_bool)
    assert torch.isfinite(from_bool).all(), "fully masked rows must not produce -inf (NaN after softmax)"
    assert additive_mask(None, 1, 5, torch.float32, torch.device("cpu")) is None


@pytest.mark.parametrize(("kv_heads", "key_width", "value_width"),
                         [(3, 64, 64), (1, 64, 96), (3, 96, 40), (9, 32, 32)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_attention_is_softmax_attention(kv_heads, key_width, value_width, dtype):
    """``chunk_attention`` (LoRC's and ZACK's prefill through SDPA's fused kernel) against scores, softmax and
    product in plain torch: grouped query heads, a shared latent on either side, keys and values of different
    widths (zero-padded for the kernel), a causal bias over a past."""
    from kvconvert.runtime.kvconvert_prefill import chunk_attention

    generator = torch.Generator().manual_seed(kv_heads + key_width)
    heads, q_len, kv_len = 9, 24, 80
    query = torch.randn(2, heads, q_len, key_width, generator=generator)
    keys = torch.randn(2, kv_heads, kv_len, key_width, generator=generator)
    values = torch.randn(2, 1 if kv_heads == 3 and value_width != key_width else kv_heads, kv_len, value_width,
                         generator=generator)  # fmt: skip
    bias = additive_mask(None, q_len, kv_len, dtype, query.device)
    group = heads // keys.shape[1]
    scores = query @ keys.repeat_interleave(group, dim=1).transpose(-1, -2) * 0.125 + bias.float()
    expected = torch.softmax(scores, -1) @ values.repeat_interleave(heads // values.shape[1], dim=1)
    got = chunk_attention(query.to(dtype), keys.to(dtype), values.to(dtype), bias, 0.125)
    assert got.shape == expected.shape and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


PIECE_CASES = [("lorc", "llama_gqa"), ("lorc", "qwen2_gqa"), ("lorc", "qwen3"), ("lorc", "olmo2"),
               ("slim", "llama_bias"), ("slim", "gpt_neox"), ("slim", "qwen3_mha"), ("slim", "olmo2")]  # fmt: skip


@pytest.mark.parametrize(("method", "kind"), PIECE_CASES)
def test_keys_turned_a_piece_at_a_time_score_as_the_whole(method, kind, tiny_model_dir, tmp_path, monkeypatch):
    """LoRC's and slim's decode steps rebuild and/or turn their cached keys a piece at a time (``scores_by_piece``:
    about ``KEY_PIECE_BYTES``): greedy decoding of a left-padded batch with pieces of one and of three tokens gives
    the logits of all keys at once (to float32's rounding: only the order of the sums may differ), key biases (Qwen2, a
    biased Llama), QK-norm models (per head, over all heads) and partial rotary (GPT-NeoX) included."""
    import sys

    from tests.helpers import assert_same_logits, convert, left_padded, load_converted

    monkeypatch.setenv("KVCONVERT_REBUILD", "exact")
    options = ("--kv-budget", "0.5", "--schedule", "uniform") if method == "lorc" else ()
    convert(method, tiny_model_dir(kind), tmp_path / method, *options)
    converted = load_converted(tmp_path / method)
    attention = next(m for m in converted.modules() if hasattr(m, "attend") and hasattr(m, "head_dim"))
    rope = sys.modules[type(attention).__module__.replace(f"kvconvert_{method}", "kvconvert_rope")]  # the copy loaded
    per_token = 4 * 2 * converted.config.num_attention_heads * attention.head_dim  # at most, 2 rows in float32
    ids, mask = left_padded(length=20, pad=6, seed=7, high=converted.config.vocab_size)
    runs = []
    for piece in (1 << 40, 1, 3 * per_token):
        monkeypatch.setattr(rope, "KEY_PIECE_BYTES", piece)
        with torch.no_grad():
            runs.append(converted.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10,
                                           do_sample=False, pad_token_id=0, output_logits=True,
                                           return_dict_in_generate=True))  # fmt: skip
    for piece, run in zip(("one token", "three tokens"), runs[1:], strict=True):
        assert torch.equal(run.sequences, runs[0].sequences), piece
        assert_same_logits(torch.stack(runs[0].logits), torch.stack(run.logits), f"pieces of {piece}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("length", [5, 64, 130, 192])
def test_products_with_a_cache_split_its_length_as_the_plain_products(dtype, length):
    """``cache_scores`` / ``cache_mix`` (whole 64-token blocks in the cache's dtype, the rest in float32, so that a
    growing half-precision cache does not make oneDNN build a kernel every step): the plain products' values to the
    dtype's rounding, against float64, in batched and broadcast shapes; float32 is the plain product itself."""
    from kvconvert.runtime.kvconvert_products import cache_mix, cache_scores

    torch.manual_seed(length)
    cache = torch.randn(2, 3, 200, 48)[:, :, :length]  # a view of a longer buffer, as a growing store's is
    query, weights = torch.randn(2, 3, 4, 48), torch.softmax(torch.randn(2, 3, 4, length), -1)
    half = cache.to(dtype)
    for got, expected in ((cache_scores(query.to(dtype), half), query.double() @ cache.double().mT),
                          (cache_mix(weights.to(dtype), half), weights.double() @ cache.double())):  # fmt: skip
        assert got.dtype == dtype and got.shape == expected.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected.float())
        else:  # operands rounded to the dtype, sums in float32, the result rounded once more
            torch.testing.assert_close(got.double(), expected, atol=0.05, rtol=0.02)
    flat = cache[0].to(dtype)  # [b, n, w], as torch.bmm takes it
    torch.testing.assert_close(cache_scores(query[0].to(dtype), flat), query[0].to(dtype) @ flat.mT)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_products_with_a_half_cache_widen_where_onednn_has_no_half_kernels(dtype, monkeypatch):
    """On a CPU whose oneDNN has no products in the cache's dtype (AVX2-only: ``onednn_half`` false) ``cache_scores``,
    ``cache_mix`` and ``keys_first`` are float32 products of the widened operands, rounded once to the dtype; where it
    has them, half products (the whole 64-token blocks)."""
    from kvconvert.runtime import kvconvert_products as products

    torch.manual_seed(7)
    cache = torch.randn(2, 3, 200, 48)[:, :, :130].to(dtype)
    query, weights = torch.randn(2, 3, 4, 48).to(dtype), torch.softmax(torch.randn(2, 3, 4, 130), -1).to(dtype)
    monkeypatch.setattr(products, "onednn_half", lambda dtype: False)
    assert products.widened(cache) and not products.widened(cache.float())
    scores = (query.float() @ cache.float().mT).to(dtype)
    assert torch.equal(products.cache_scores(query, cache), scores)
    assert torch.equal(products.keys_first(query, cache), scores)
    assert torch.equal(products.cache_mix(weights, cache), (weights.float() @ cache.float()).to(dtype))
    monkeypatch.setattr(products, "onednn_half", lambda dtype: True)
    assert not products.widened(cache)


class _HalfProducts(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the operand shapes of every matrix product (mm, bmm, addmm, baddbmm) with a bfloat16 operand."""

    PRODUCTS = ("mm", "bmm", "addmm", "baddbmm")

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func.overloadpacket.__name__ in self.PRODUCTS and any(t.dtype == torch.bfloat16 for t in tensors):
            self.shapes.append(tuple(tuple(t.shape) for t in tensors))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["lorc", "slim"])
def test_lorc_and_slim_steps_take_no_half_cache_products_where_onednn_has_none(method, tiny_model_dir, tmp_path,
                                                                               monkeypatch):  # fmt: skip
    """A bfloat16 LoRC / slim checkpoint on a CPU whose oneDNN has no bfloat16 products (``onednn_half`` false, as on
    AVX2 CPUs, where oneDNN would convert every operand element by element): a decode step's products over the cache
    (LoRC's key rebuild, scores and latent values; slim's scores and weighted key rows) are float32 ones; with oneDNN's
    bfloat16 kernels they stay bfloat16 (so the check below sees them when they are there). A cache of 200 tokens,
    then one step: 201 tokens, a size no weight of the model has."""
    from tests.helpers import convert_slim, load_converted
    from tests.test_lorc import convert_lorc

    if method == "lorc":
        convert_lorc(tiny_model_dir("llama_gqa"), tmp_path / "out", "--kv-budget", "0.5", "--schedule", "uniform")
    else:
        convert_slim(tiny_model_dir("llama"), tmp_path / "out")
    model = load_converted(tmp_path / "out").to(torch.bfloat16)
    # the products module the checkpoint's own runtime imports (its copy in the output directory, not kvconvert's)
    products = importlib.import_module(type(model).__module__.rsplit(".", 1)[0] + ".kvconvert_products")
    ids = torch.randint(3, 97, (1, 201), generator=torch.Generator().manual_seed(3))
    for has_half in (True, False):
        monkeypatch.setattr(products, "onednn_half", lambda dtype, has_half=has_half: has_half)
        with torch.no_grad():
            cache = model(input_ids=ids[:, :200], use_cache=True).past_key_values
            with _HalfProducts() as recorded:
                model(input_ids=ids[:, 200:], past_key_values=cache, use_cache=True)
        over_cache = [shapes for shapes in recorded.shapes if any(201 in shape for shape in shapes)]
        assert bool(over_cache) == has_half, (has_half, over_cache)


@pytest.mark.parametrize("form", ["causal", "causal over a past", "padded", "additive"])
def test_prefill_attention_by_query_blocks_equals_one_bias(form, monkeypatch):
    """``prefill_attention`` builds the bias a block of query rows at a time (``BIAS_BYTES``; here 5 rows' worth)
    and takes ``is_causal`` with no bias where nothing is masked or past: the same attention as ``chunk_attention``
    under the whole bias, for every form of mask transformers hands over (None, boolean with padded rows that see
    nothing, additive float), and ``additive_mask``'s rows and columns are the whole bias's."""
    from kvconvert.runtime import kvconvert_prefill as prefill

    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, q_len, dim = 6, 2, 23, 16
    kv_len = q_len + (9 if form == "causal over a past" else 0)
    query = torch.randn(2, heads, q_len, dim, generator=generator)
    keys, values = (torch.randn(2, kv_heads, kv_len, dim, generator=generator) for _ in range(2))
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    mask = {"causal": None, "causal over a past": None, "padded": causal.expand(2, 1, -1, -1).clone(),
            "additive": torch.where(causal, 0.0, float("-inf")).expand(2, 1, -1, -1).clone()}[form]  # fmt: skip
    if form == "padded":
        mask[1, :, :, :4] = False  # the second row's first 4 tokens are padding: its first 4 queries see nothing
    whole = prefill.additive_mask(mask, q_len, kv_len, torch.float32, query.device)
    expected = prefill.chunk_attention(query, keys, values, whole, 0.25)
    monkeypatch.setattr(prefill, "BIAS_BYTES", 4 * kv_len * (1 if mask is None else 2) * 5)  # float32 × batch
    blocks = list(prefill.query_blocks(mask, 2, q_len, kv_len))
    assert len(blocks) == 5 and all(rows.stop - rows.start <= 5 for rows in blocks)
    kept = torch.tensor([0, 1, 2, 3, kv_len - 7, kv_len - 3, kv_len - 1])  # razor's windows: a sink and the last few
    for rows in blocks:
        assert torch.equal(prefill.additive_mask(mask, q_len, kv_len, torch.float32, query.device, rows=rows),
                           whole[..., rows, :])  # fmt: skip
        picked = prefill.additive_mask(mask, q_len, kv_len, torch.float32, query.device, rows=rows, columns=kept)
        assert torch.equal(picked, whole[..., rows, :][..., kept])
    torch.testing.assert_close(prefill.prefill_attention(query, keys, values, mask, 0.25), expected)
    assert torch.equal(prefill.last_row_valid(mask, q_len, kv_len, query.device), whole[:, 0, -1] == 0)
