"""Quantized cache storage (``--kv-bits``) and ``kvconvert quant``, against plain-torch references."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import convert, generate_in_every_mode, left_padded, load_converted, load_reference, run_cli

import kvconvert
from kvconvert.eval.memory import kv_bytes_per_token
from kvconvert.runtime import kvconvert_common, kvconvert_minicache, kvconvert_razor, kvconvert_storage
from kvconvert.runtime.kvconvert_codec import (
    QuantSpec,
    channel_groups,
    dequantize_tokens,
    quantize_tokens,
    rotation,
)
from kvconvert.runtime.kvconvert_packing import pack, unpack
from kvconvert.runtime.kvconvert_tokenstore import TokenStore

# ----------------------------------------------------------------- plain-torch reference quantizer


def _fp16_down(x: torch.Tensor) -> torch.Tensor:
    h = x.half().float()
    return torch.where(h > x, torch.nextafter(x.half(), torch.tensor(-math.inf).half()).float(), h)


def _fp16_up(x: torch.Tensor) -> torch.Tensor:
    h = x.half().float()
    h = torch.where(h < x, torch.nextafter(x.half(), torch.tensor(math.inf).half()).float(), h)
    return torch.where(h > 0, h, torch.ones_like(h))


def _fake(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int) -> torch.Tensor:
    levels = 2**bits - 1
    zero = _fp16_down(low)
    scale = _fp16_up((high - zero) / levels)
    return zero + ((x - zero) / scale).round().clamp(0, levels) * scale


def reference_fake_quant(
    x: torch.Tensor, bits: int, group: int, per_channel: bool, rotate: bool = False
) -> torch.Tensor:
    """Group by group with explicit slices: keys per channel over ``group``-token blocks, values per
    token over equal channel groups of at most ``group`` (``rotate``: each group, padded to full size
    with its last channel, times the orthogonal ``rotation`` before and its transpose after).
    ``x [..., n, w]`` float32."""
    out = x.clone()
    if per_channel:
        for start in range(0, x.shape[-2], group):
            block = x[..., start : start + group, :]
            low, high = block.amin(-2, keepdim=True), block.amax(-2, keepdim=True)
            out[..., start : start + group, :] = _fake(block, low, high, bits)
        return out
    groups, size = channel_groups(x.shape[-1], group)
    for j in range(groups):
        cols = x[..., j * size : (j + 1) * size]
        width = cols.shape[-1]
        if rotate:
            cols = torch.cat([cols, cols[..., -1:].expand(*cols.shape[:-1], size - width)], dim=-1)
            cols = cols @ rotation(size)
        fake = _fake(cols, cols.amin(-1, keepdim=True), cols.amax(-1, keepdim=True), bits)
        if rotate:
            fake = (fake @ rotation(size).T)[..., :width]
        out[..., j * size : (j + 1) * size] = fake
    return out


class ReferenceStore:
    """Drop-in for ``TokenStore`` with the same ageing rule, in plain float: once the float tail holds
    ``residual + group`` tokens its oldest whole blocks are fake-quantized by the reference above."""

    def __init__(self, quant: QuantSpec, per_channel: bool):
        self.quant, self.per_channel = quant, per_channel
        self.dropped = False  # take_front removed the first tokens: no later token is a sink
        self.aged: torch.Tensor | None = None  # fake-quantized tokens, oldest first (a sink exact)
        self.tail: torch.Tensor | None = None
        self.aged_dropped = 0  # tokens taken from the front of ``aged`` since it was last empty

    def _parts(self) -> list[torch.Tensor]:
        return [t for t in (self.aged, self.tail) if t is not None]

    def __len__(self) -> int:
        return sum(t.shape[-2] for t in self._parts())

    def read(self) -> torch.Tensor:
        return torch.cat(self._parts(), dim=-2)

    def append(self, new: torch.Tensor) -> None:
        self.tail = new if self.tail is None else torch.cat([self.tail, new], dim=-2)
        if not self.quant.quantized:
            return
        ready = (self.tail.shape[-2] - self.quant.residual) // self.quant.group * self.quant.group
        if ready > 0:
            spec = self.quant
            exact = self.tail[..., :ready, :].float()
            first = self.aged is None and not self.dropped and spec.sink > 0
            if first:  # the sink is quantized as a copy of its successor, and kept exact
                exact = torch.cat([exact[..., spec.sink : spec.sink + 1, :].expand_as(exact[..., : spec.sink, :]),
                                   exact[..., spec.sink :, :]], dim=-2)  # fmt: skip
            # values rotated in the store, unless quant folded the rotation into W_V / W_O (they arrive rotated)
            rotate = spec.rotate and not spec.rotate_in_weights and not self.per_channel
            aged = reference_fake_quant(exact, spec.bits, spec.group, self.per_channel, rotate)
            if first:
                aged[..., : spec.sink, :] = self.tail[..., : spec.sink, :].float()
            aged = aged.to(self.tail.dtype)
            self.aged = aged if self.aged is None else torch.cat([self.aged, aged], dim=-2)
            self.tail = self.tail[..., ready:, :]

    def extend(self, new: torch.Tensor) -> torch.Tensor:
        past = None if self.tail is None else self.read()
        self.append(new)
        return new if past is None else torch.cat([past, new], dim=-2)

    def whole_front(self, count: int) -> int:
        """Razor's windows slide by whole blocks: of the ``count`` oldest tokens, those up to the last block
        boundary of the aged part, or all of them once they reach past it."""
        aged = 0 if self.aged is None else self.aged.shape[-2]
        if count >= aged:
            return count
        group = self.quant.group
        return max(0, (self.aged_dropped + count) // group * group - self.aged_dropped)

    def take_front(self, count: int) -> torch.Tensor:
        front = self.read()[..., :count, :]
        self.dropped = True
        from_aged = 0 if self.aged is None else min(count, self.aged.shape[-2])
        if self.aged is not None:
            self.aged = self.aged[..., from_aged:, :]
            self.aged_dropped = self.aged_dropped + from_aged if self.aged.shape[-2] else 0
        assert self.tail is not None
        self.tail = self.tail[..., count - from_aged :, :]
        return front

    def apply(self, fn):
        self.aged = None if self.aged is None else fn(self.aged)
        self.tail = None if self.tail is None else fn(self.tail)

    def crop(self, length: int) -> None:
        raise NotImplementedError


# ----------------------------------------------------------------- the quantizer itself


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("width", [64, 37, 100])
def test_dequantized_error_is_at_most_half_a_step(bits, per_channel, width):
    torch.manual_seed(bits + width)
    x = torch.randn(2, 3, 128, width) * torch.linspace(0.1, 8, width)  # outlier channels, as keys have
    x[0, 0, :64] = 1.5  # a constant group: scale is arbitrary, error must be 0 up to fp16 rounding of the zero
    block = quantize_tokens(x, bits, 64, per_channel)
    assert block.codes.dtype == torch.uint8 and block.scale.dtype == torch.float16
    y = dequantize_tokens(block, bits, 64, width, per_channel, torch.float32)
    if per_channel:  # scale [2, 3, 2, w] -> per element
        step = block.scale.float().repeat_interleave(64, dim=-2)
    else:
        _, size = channel_groups(width, 64)
        step = block.scale.float().repeat_interleave(size, dim=-1)[..., :width]
    assert ((y - x).abs() <= step / 2 * (1 + 1e-5) + 1e-6).all()
    assert torch.equal(y, reference_fake_quant(x, bits, 64, per_channel))
    # real packing: 4-bit two values per byte, 2-bit four, 3-bit eight per three bytes
    packed_width = block.codes.shape[-1]
    groups, size = channel_groups(width, 64)
    codes = 64 if per_channel else groups * size
    assert packed_width == (3 * math.ceil(codes / 8) if bits == 3 else math.ceil(codes * bits / 8))


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("width", [13, 64])
def test_pack_round_trip(bits, width):
    codes = torch.randint(0, 2**bits, (3, width), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == (3 * math.ceil(width / 8) if bits == 3 else
                                                                math.ceil(width * bits / 8))  # fmt: skip
    assert torch.equal(unpack(packed, bits, width), codes)


@pytest.mark.parametrize("width", [8, 24, 32, 64, 96, 128, 256])
def test_three_bit_planes_hold_every_fourth_code(width):
    """3-bit codes split into 4 planes, plane k holding codes 4j + k, by the eager split and by the formulas the
    compiled readers use (a word of high bits a plane where the width is a multiple of 32, eight shifts where not);
    every code value at every place."""
    from kvconvert.runtime.kvconvert_packing import _traced_three_bit_planes, bit_planes

    codes = torch.randint(0, 8, (5, width), dtype=torch.uint8)
    codes[0] = 7  # every high bit set: the top byte of a 32-bit word of high bits too
    codes[1] = torch.arange(width) % 8
    packed = pack(codes, 3)
    for planes in (bit_planes(packed, 3), _traced_three_bit_planes(packed)):
        assert len(planes) == 4
        for k, plane in enumerate(planes):
            assert torch.equal(plane, codes[:, k::4].float()), k


@pytest.mark.parametrize("size", [64, 58])
def test_rotation_is_orthogonal_and_spreads_an_outlier_channel(size):
    r = rotation(size)
    torch.testing.assert_close(r @ r.T, torch.eye(size), atol=1e-5, rtol=0)
    spike = torch.zeros(size)
    spike[3] = 1.0
    assert (spike @ r).abs().max() < 0.5  # one outlier channel becomes many small ones


@pytest.mark.parametrize("width", [64, 100])
def test_rotated_values_quantize_with_less_error_when_a_channel_is_an_outlier(width):
    torch.manual_seed(0)
    x = torch.randn(1, 2, 128, width)
    x[..., 5] *= 40  # one outlier channel, as values and keys of real models have
    plain = dequantize_tokens(quantize_tokens(x, 4, 64, False), 4, 64, width, False, torch.float32)
    rotated = dequantize_tokens(quantize_tokens(x, 4, 64, False, True), 4, 64, width, False, torch.float32, True)
    assert torch.equal(rotated, reference_fake_quant(x, 4, 64, False, rotate=True))
    assert (rotated - x).pow(2).mean() < 0.5 * (plain - x).pow(2).mean()


@pytest.mark.parametrize("per_channel", [True, False])
def test_sink_tokens_stay_exact_until_dropped(per_channel):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 300, 16)
    x[..., 0, :] *= 50  # the sink: an outlier token
    spec = QuantSpec(3, group=32, residual=16, sink=2, rotate=True)
    store = TokenStore(spec, per_channel)
    store.append(x[..., :1, :])  # the sink arrives over two appends
    store.append(x[..., 1:200, :])
    store.append(x[..., 200:, :])
    held = store.read()
    assert len(store) == 300 and torch.equal(held[..., :2, :], x[..., :2, :])
    assert store.blocks is not None and store.quantized_tokens == 8 * 32  # blocks stay aligned with positions
    plain = TokenStore(QuantSpec(3, group=32, residual=16, rotate=True), per_channel)
    plain.append(x)
    assert (held - x).pow(2).mean() < 0.5 * (plain.read() - x).pow(2).mean()
    # razor's window drops the oldest tokens: the sink goes first, and no later token takes its place
    front = store.take_front(40)
    torch.testing.assert_close(torch.cat([front, store.read()], dim=-2), held)
    store.append(x[..., :5, :])
    assert len(store) == 265 and store.head is None
    store.crop(100)
    assert len(store) == 100 and store.head is None


def test_store_keeps_recent_tokens_exact_and_ages_them_block_by_block():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 200, 16)
    store = TokenStore(QuantSpec(4, group=32, residual=40), per_channel=True)
    returned = store.extend(x[:, :, :50])
    assert torch.equal(returned, x[:, :, :50])  # what this step attends to is exact
    for i in range(50, 200):
        store.append(x[:, :, i : i + 1])
    assert len(store) == 200 and store.quantized_tokens == 160 and store.tail.shape[2] == 40
    read = store.read()
    assert torch.equal(read[:, :, 160:], x[:, :, 160:])
    torch.testing.assert_close(read[:, :, :160], reference_fake_quant(x[:, :, :160], 4, 32, True), rtol=0, atol=0)
    # dropping from the front (razor's window) frees whole blocks and returns what was stored
    front = store.take_front(70)
    torch.testing.assert_close(front, read[:, :, :70], rtol=0, atol=0)
    assert len(store) == 130 and store.quantized_tokens == 96 and store.offset == 6
    torch.testing.assert_close(store.read(), read[:, :, 70:], rtol=0, atol=0)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("per_channel", [True, False])
def test_dropping_a_token_at_a_time_returns_what_was_stored(bits, per_channel):
    """Razor's window drops a token or two a step: within a block only those tokens (per token) or the packing units
    holding them (per channel) are read, bit for bit what reading the whole cache gives, across block edges, with an
    exact sink and rotated values."""
    torch.manual_seed(bits)
    x = torch.randn(2, 3, 150, 40) * torch.linspace(0.1, 4, 40)
    store = TokenStore(QuantSpec(bits, group=32, residual=8, sink=2, rotate=True), per_channel)
    store.append(x)
    held = store.read()
    taken = [store.take_front(count) for count in (1, 1, 3, 1, 30, 1, 7, 2, 3)]  # within blocks and across them
    assert torch.equal(torch.cat(taken, dim=-2), held[..., :49, :])
    assert torch.equal(taken[0], x[..., :1, :])  # the sink: exact
    assert torch.equal(store.read(), held[..., 49:, :]) and len(store) == 101


@pytest.mark.parametrize("per_channel", [True, False])
def test_dropping_without_reading_leaves_what_taking_leaves(per_channel):
    """A sliding-window layer drops its oldest tokens without reading them (``drop_front``): the store left holds
    what ``take_front`` leaves, token for token, across blocks, the sink and the float tail."""
    torch.manual_seed(1)
    x = torch.randn(2, 3, 150, 40)
    spec = QuantSpec(3, group=32, residual=8, sink=2, rotate=True)
    taking, dropping = TokenStore(spec, per_channel), TokenStore(spec, per_channel)
    for store in (taking, dropping):
        store.append(x)
    for count in (1, 40, 3, 90, 10):  # across blocks, then into the float tail
        taking.take_front(count)
        dropping.drop_front(count)
        assert len(dropping) == len(taking) and dropping.offset == taking.offset
        assert torch.equal(dropping.read(), taking.read())


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("width", [64, 37])
def test_reading_the_cache_into_one_tensor_is_reading_and_concatenating(per_channel, width):
    """A decode step reads the whole cache with this step's tokens behind it into one new tensor
    (dequantized in place, no concatenated copies): the same values as dequantizing, then concatenating
    the float tail and the new tokens, with a sink, after dropping from the front, rotated or not."""
    torch.manual_seed(width)
    x = torch.randn(2, 3, 150, width) * torch.linspace(0.1, 8, width)
    new = torch.randn(2, 3, 1, width)
    for rotate, dropped in ((False, 0), (True, 0), (False, 5), (True, 5)):
        store = TokenStore(QuantSpec(4, group=32, residual=8, sink=4, rotate=rotate), per_channel=per_channel)
        store.append(x)
        store.take_front(dropped)  # razor's sliding window drops from the first block (and the sink with it)
        blocks = dequantize_tokens(store.blocks, 4, 32, width, per_channel, torch.float32, store.rotate)
        expected = torch.cat([blocks[..., store.offset :, :], store.tail, new], dim=-2)
        if not dropped:
            expected[..., :4, :] = x[..., :4, :]  # the sink, exact
        buffer = torch.full((2, 3, store.quantized_tokens + 2, width), float("nan"))
        dequantize_tokens(store.blocks, 4, 32, width, per_channel, torch.float32, store.rotate, buffer[..., 1:-1, :])
        assert torch.equal(buffer[..., 1:-1, :], blocks) and buffer[..., [0, -1], :].isnan().all()  # only its range
        assert torch.equal(store.read(then=new), expected)
        assert torch.equal(store.extend(new), expected) and len(store) == 151 - dropped


def test_bits_16_store_is_a_plain_tensor():
    store = TokenStore(QuantSpec(16), per_channel=True)
    x = torch.randn(1, 5, 8)
    store.extend(x[:, :3])
    assert store.extend(x[:, 3:]) is store.tail and torch.equal(store.read(), x) and store.blocks is None


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("per_channel", [True, False], ids=["keys", "values"])
def test_a_store_reads_single_tokens_as_it_reads_them_all(bits, per_channel):
    """``states_at`` (MiniCache's retained tokens, read beside the codes) equals ``read`` at those tokens: in the
    exact sink, inside quantized blocks, in the float tail, rows in any order."""
    torch.manual_seed(bits)
    store = TokenStore(QuantSpec(bits=bits, group=32, residual=0, sink=3, rotate=True), per_channel)
    x = torch.randn(3, 2, 100, 16)
    for part in (x[:, :, :70], x[:, :, 70:71], x[:, :, 71:]):
        store.append(part)
    assert store.blocks is not None and store.tail is not None and store.head is not None
    rows, positions = torch.tensor([0, 2, 1, 1, 0, 2, 1]), torch.tensor([0, 5, 33, 99, 64, 3, 2])
    assert torch.equal(store.states_at(rows, positions), store.read()[rows, :, positions])


def test_a_plain_store_grows_into_room_it_lets_go_of():
    """Decode steps append into spare room (no copy of the held tokens each step), at most a sixty-fourth more
    tokens, never after a prefill chunk; once the tail is cut from the front, the old buffer is not held."""
    from kvconvert.eval.memory import cache_nbytes

    store = TokenStore(QuantSpec(16), per_channel=True)
    x = torch.randn(2, 700, 8)
    store.extend(x[:, :512])
    store.extend(x[:, 512:640])
    assert store.tail is not None and cache_nbytes(store.tail) == store.tail.numel() * 4  # chunks: exact
    addresses = set()
    for i in range(640, 700):
        got = store.extend(x[:, i : i + 1])
        assert torch.equal(got, x[:, : i + 1])
        addresses.add(got.data_ptr())
        assert cache_nbytes(got) <= (i + 1 + (i + 1) // 64) * 2 * 8 * 4
    assert len(addresses) < 10  # 60 appends, a handful of buffers
    store.take_front(600)
    assert torch.equal(store.read(), x[:, 600:]) and cache_nbytes(store) == 100 * 2 * 8 * 4  # the store, all of it


# ----------------------------------------------------------------- every method's runtime

QUANT = ("--kv-bits", "4", "--kv-group", "8", "--kv-residual", "8")
MIXED = ("--kv-budget", "0.45", "--min-bits", "2", "--max-bits", "8", "--calib-tokens", "512", "--kv-group", "8",
         "--kv-residual", "8")  # fmt: skip
METHOD_ARGS = {
    "quant": ("llama_gqa", ()),
    "quant-mixed": ("llama_gqa", ()),
    "slim": ("llama", ()),
    "lorc": ("llama_gqa", ("--kv-budget", "0.75")),
    "zack": ("llama_gqa", ("--removal-rate", "0.05", "--calib-tokens", "2048")),
    "razor": (
        "llama_gqa",
        (
            "--profile-tokens",
            "16",
            "--induction-frac",
            "0.3",
            "--echo-frac",
            "0",
            "--window",
            "20",
            "--window-frac",
            "0",
            "--sink",
            "2",
        ),
    ),  # fmt: skip
    "minicache": ("llama", ("--start-layer", "1", "--gamma", "0.1")),
}
EXT = ("--kv-sink", "3", "--kv-rotate")  # the extensions: first tokens exact, values rotated
METHOD_ARGS["quant-ext"] = METHOD_ARGS["quant"]
METHOD_ARGS["razor-ext"] = METHOD_ARGS["razor"]
METHOD_ARGS["lorc-ext"] = METHOD_ARGS["lorc"]
VALUES = ("--kv-value-bits", "2")  # values at a width apart from the keys'
for _name in ("quant", "razor", "lorc", "slim", "zack", "minicache"):
    METHOD_ARGS[f"{_name}-values"] = METHOD_ARGS[_name]


def _command(method: str) -> tuple[str, ...]:
    """The conversion command and its storage options: uniform 4-bit, or widths allocated per layer."""
    if method == "quant-mixed":
        return ("quant", *MIXED)
    if method.endswith("-ext"):
        return (method.removesuffix("-ext"), *QUANT, *EXT)
    if method.endswith("-values"):
        return (method.removesuffix("-values"), *QUANT, *VALUES)
    return (method, *QUANT)


def _patched_reference_store(monkeypatch):
    for module in (kvconvert_common, kvconvert_razor, kvconvert_minicache, kvconvert_storage):
        monkeypatch.setattr(module, "TokenStore", ReferenceStore)


@torch.no_grad()
def _prefill_and_decode(model, ids, mask):
    prefill = model(input_ids=ids, attention_mask=mask).logits
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)  # fmt: skip
    return prefill, torch.stack(out.logits), out.sequences


@pytest.mark.parametrize("method", sorted(METHOD_ARGS))
def test_quantized_runtime_equals_fake_quant_reference(method, tokenized_model_dir, tmp_path, monkeypatch):
    """Each method's quantized cache = the same method with a float cache whose aged tokens are
    fake-quantized by the plain-torch reference: prefill and 32 decode steps of a left-padded batch."""
    kind, extra = METHOD_ARGS[method]
    src = tokenized_model_dir(kind)
    command, *storage = _command(method)
    convert(command, src, tmp_path / "q", *storage, *extra)
    ids, mask = left_padded()
    quantized = _prefill_and_decode(kvconvert.load(tmp_path / "q").eval(), ids, mask)
    _patched_reference_store(monkeypatch)
    expected = _prefill_and_decode(kvconvert.load(tmp_path / "q").eval(), ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(quantized[0][valid], expected[0][valid], rtol=1e-4, atol=1e-4)
    # decoding: the readers sum in another order than dequantize-then-SDPA (≤ 1e-6 per step, test_kernels), and a
    # state that lands within that of a rounding boundary takes the neighbouring code when its block is quantized:
    # from that step on one row's logits move by up to a few 1e-3 (measured: 1.8e-4 on an Intel Xeon; 6.1e-4 on an AMD
    # EPYC, row 0 from step 25 of 32; ZACK's latents read from their codes, whose leading channels span a wide range:
    # 2.3e-3 from step 25 under PYTHONHASHSEED=4, under 1e-5 before it), where a wrong reader would move every step of
    # every row
    worst = (quantized[1] - expected[1]).abs().amax(dim=-1)  # [steps, rows]
    assert (worst > 1e-4).float().mean().item() <= 0.25, worst
    torch.testing.assert_close(quantized[1], expected[1], rtol=1e-4, atol=5e-3)
    assert torch.equal(quantized[2], expected[2])
    # and the quantization is really there: the 16-bit conversion (for quant: the source) decodes differently
    if method.startswith("quant"):
        unquantized = load_reference(src)
    else:
        convert(command, src, tmp_path / "f", *extra)
        unquantized = kvconvert.load(tmp_path / "f").eval()
    assert not torch.allclose(_prefill_and_decode(unquantized, ids, mask)[1], quantized[1], rtol=1e-3, atol=1e-3)


def test_kv_bits_16_is_byte_identical(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_gqa")
    convert("lorc", src, tmp_path / "a", "--kv-budget", "0.75")
    convert("lorc", src, tmp_path / "b", "--kv-budget", "0.75", "--kv-bits", "16")
    for name in ("config.json", "model.safetensors", "recipe.yaml"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@pytest.mark.parametrize("extension", [(), ("--kv-sink", "4", "--kv-rotate")])
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_measured_bytes_equal_the_accounting(bits, extension, tiny_model_dir, tmp_path):
    """Codes, fp16 scales and zeros per group: what the live cache holds per token is what QuantSpec
    accounts (the exact sink is a constant, so it leaves the per-token slope alone — unless it keeps
    the whole prefill alive)."""
    src = tiny_model_dir("llama_gqa")  # 3 layers, 2 KV heads of 16 dims
    report = convert("quant", src, tmp_path / "q", "--kv-bits", str(bits), "--kv-group", "16", "--kv-residual", "16",
                     *extension)  # fmt: skip
    extended = {"sink": 4, "rotate": True, "rotate_in_weights": True} if extension else {}
    assert report["kv_storage"] == {"bits": bits, "group": 16, "residual": 16, **extended}
    model, reference = load_converted(tmp_path / "q"), load_reference(src)
    ids = torch.randint(3, 90, (1, 144), generator=torch.Generator().manual_seed(0))
    measured = kv_bytes_per_token(model, ids, 48, 144)  # both lengths: whole blocks + the same tail
    spec = QuantSpec(bits, 16, 16)
    values = 3 * 2 * 16  # layers × KV heads × head dim, for K and for V
    accounted = values * (spec.bytes_per_value(16, per_channel=True) + spec.bytes_per_value(16, per_channel=False))
    assert measured == pytest.approx(accounted)
    assert measured < kv_bytes_per_token(reference, ids, 48, 144) * (bits / 32 + 0.2)


@pytest.mark.parametrize(("bits", "value_bits"), [(4, 2), (8, 3), (2, 4)])
def test_values_stored_at_their_own_width(bits, value_bits, tiny_model_dir, tmp_path):
    """``--kv-value-bits``: keys at ``--kv-bits``, values at their own width, in the live cache as accounted (each
    side's codes and scales) and in the report; the recipe round-trips."""
    src = tiny_model_dir("llama_gqa")  # 3 layers, 2 KV heads of 16 dims
    report = convert("quant", src, tmp_path / "q", "--kv-bits", str(bits), "--kv-value-bits", str(value_bits),
                     "--kv-group", "16", "--kv-residual", "16")  # fmt: skip
    assert report["kv_storage"] == {"bits": bits, "group": 16, "residual": 16, "value_bits": value_bits}
    model = load_converted(tmp_path / "q")
    ids = torch.randint(3, 90, (1, 144), generator=torch.Generator().manual_seed(0))
    measured = kv_bytes_per_token(model, ids, 48, 144)
    keys, values = QuantSpec(bits, 16, 16), QuantSpec(value_bits, 16, 16)
    per_token = 3 * 2 * 16  # layers × KV heads × head dim, for K and for V
    accounted = per_token * (keys.bytes_per_value(16, per_channel=True) + values.bytes_per_value(16, per_channel=False))
    assert measured == pytest.approx(accounted)
    uniform = per_token * (keys.bytes_per_value(16, per_channel=True) + keys.bytes_per_value(16, per_channel=False))
    assert (measured < uniform) == (value_bits < bits)
    storage = QuantSpec.from_spec(json.loads((tmp_path / "q" / "config.json").read_text())["kvconvert"])
    assert storage.side(0, keys=True).bits == bits and storage.side(0, keys=False).bits == value_bits
    assert f"kv_value_bits: {value_bits}" in (tmp_path / "q" / "recipe.yaml").read_text()
    card = (tmp_path / "q" / "README.md").read_text()
    assert f"keys at {bits} bits and values at {value_bits}" in card
    from kvconvert.methods.quant.method import QuantMethod

    assert f"keys {bits}-bit, values {value_bits}-bit" in QuantMethod.headline(report)


def test_values_alone_quantized(tiny_model_dir, tmp_path):
    """``--kv-value-bits`` without ``--kv-bits``: the keys stay in the model's dtype, only the values are stored as
    integers (fewer bytes than the source's cache), and the model generates in every mode."""
    src = tiny_model_dir("llama_gqa")
    report = convert("quant", src, tmp_path / "q", "--kv-value-bits", "2", "--kv-group", "16", "--kv-residual", "16")
    assert report["kv_storage"]["bits"] == 16 and report["kv_storage"]["value_bits"] == 2
    model, reference = load_converted(tmp_path / "q"), load_reference(src)
    ids = torch.randint(3, 90, (1, 144), generator=torch.Generator().manual_seed(0))
    keys = 3 * 2 * 16 * 4  # layers × KV heads × head dim × float32 bytes: the keys as the source holds them
    measured = kv_bytes_per_token(model, ids, 48, 144)
    assert keys < measured < kv_bytes_per_token(reference, ids, 48, 144) * 0.6
    generate_in_every_mode(model)


@pytest.mark.parametrize("method", sorted(METHOD_ARGS))
def test_generate_with_quantized_storage(method, tokenized_model_dir, tmp_path):
    """Greedy, sampling, beams and several return sequences on a left-padded batch."""
    kind, extra = METHOD_ARGS[method]
    command, *storage = _command(method)
    convert(command, tokenized_model_dir(kind), tmp_path / "q", *storage, *extra)
    generate_in_every_mode(load_converted(tmp_path / "q"))


def test_quant_refuses_16_bits_and_bad_storage(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_gqa")
    result = run_cli("quant", "--model", str(src), "--out", str(tmp_path / "q"), "--quiet")
    assert result.exit_code == 2 and "needs --kv-bits 8, 4, 3 or 2" in result.output
    result = run_cli("quant", "--model", str(src), "--out", str(tmp_path / "q"), "--kv-bits", "4", "--kv-group", "0")
    assert result.exit_code == 2 and "kv group must be >= 1" in result.output
    assert not (tmp_path / "q").exists()


def test_recipe_carries_storage(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_gqa")
    convert("lorc", src, tmp_path / "a", "--kv-budget", "0.75", "--kv-bits", "4", "--kv-residual", "32")
    recipe = (tmp_path / "a" / "recipe.yaml").read_text()
    assert "kv_bits: 4" in recipe and "kv_residual: 32" in recipe
    card = (tmp_path / "a" / "README.md").read_text()
    assert "LoRC caches rank-d_c latents" in card and "stored as 4-bit integers" in card and "newest 32" in card
    assert run_cli("run", str(tmp_path / "a" / "recipe.yaml"), "--model", str(src), "--out", str(tmp_path / "b"),
                   "--quiet").exit_code == 0  # fmt: skip
    spec = json.loads((tmp_path / "b" / "config.json").read_text())["kvconvert"]["kv_quant"]
    assert spec == {"bits": 4, "group": 64, "residual": 32}
    # a command-line option wins over the recipe's
    assert run_cli("run", str(tmp_path / "a" / "recipe.yaml"), "--model", str(src), "--out", str(tmp_path / "c"),
                   "--quiet", "--kv-bits", "8").exit_code == 0  # fmt: skip
    assert json.loads((tmp_path / "c" / "config.json").read_text())["kvconvert"]["kv_quant"]["bits"] == 8


# ----------------------------------------------------------------- widths allocated by measured loss


def test_allocation_lowers_the_cheapest_store_per_byte_first():
    from kvconvert.methods.quant.bits import allocate

    # two layers of 64 values per side; layer 0's values barely care about 2 bits, layer 1's keys a lot
    sensitivity = [[{4: 0.0, 2: 0.5}, {4: 0.0, 2: 0.01}], [{4: 0.0, 2: 2.0}, {4: 0.0, 2: 0.2}]]
    layers, used = allocate(sensitivity, [64, 64], [2, 4], budget=0.22, storage=QuantSpec(4, group=64), head_dim=64)
    four, two = (0.5 + 4 / 64) / 2, (0.25 + 4 / 64) / 2  # budget of one store at 4 and 2 bits
    assert layers == ((4, 2), (4, 2)) and used == pytest.approx((2 * four + 2 * two) / 4)
    layers, _ = allocate(sensitivity, [64, 64], [2, 4], budget=0.2, storage=QuantSpec(4, group=64), head_dim=64)
    assert layers == ((2, 2), (4, 2))
    with pytest.raises(Exception, match="below what 2-bit storage"):
        allocate(sensitivity, [64, 64], [2, 4], budget=0.1, storage=QuantSpec(4, group=64), head_dim=64)


@pytest.mark.parametrize("head_dim, group", [(16, 64), (64, 64), (128, 64), (48, 32)])
def test_the_allocation_accounts_bytes_as_the_conversion_reports_them(head_dim, group):
    """The budget the allocator reaches is the one ``kvconvert.json`` then reports for those widths
    (``kv_budget_expected_vs_16bit``, the runtime's layout): heads narrower than a group pay their scale
    and zero per head (an aidreams260K head is 16 wide; the allocator once counted per 64 values of the
    layer and overshot the budget: 0.328 reported for 0.297 allocated)."""
    import dataclasses
    from types import SimpleNamespace

    from kvconvert.methods.quant.bits import allocate
    from kvconvert.pipeline import storage_factor

    heads, layers = 4, 3
    storage = QuantSpec(4, group=group)
    sensitivity = [[{8: 0.0, 4: 0.1 * i, 2: 1.0 + i}, {8: 0.0, 4: 0.05, 2: 0.5 * i}] for i in range(layers)]
    chosen, used = allocate(sensitivity, [heads * head_dim] * layers, [2, 4, 8], 0.3, storage, head_dim)
    layout_ = SimpleNamespace(num_layers=layers, local_layers=(), head_dim=head_dim)
    assert used <= 0.3 + 1e-12
    assert used == pytest.approx(storage_factor(dataclasses.replace(storage, bits=8, layers=chosen), layout_))


def test_simulated_storage_is_what_the_store_holds_after_a_prefill():
    from kvconvert.methods.quant.bits import stored_after_prefill

    x = torch.randn(1, 2, 150, 16)
    for per_channel in (True, False):
        spec = QuantSpec(2, group=32, residual=20)
        store = TokenStore(spec, per_channel)
        store.append(x)
        assert torch.equal(stored_after_prefill(x, spec, per_channel), store.read())


@pytest.mark.slow
def test_quant_with_a_budget_allocates_widths_and_the_cache_holds_them(tokenized_model_dir, tmp_path):
    src = tokenized_model_dir("llama_gqa")
    report = convert("quant", src, tmp_path / "q", *MIXED)
    plan, storage = report["plan"], report["kv_storage"]
    assert plan["kv_budget"] <= 0.45 and len(storage["layers"]) == 3 and storage["layers"] == plan["layers"]
    widths = {b for pair in storage["layers"] for b in pair}
    assert len(widths) > 1, "a budget between uniform widths needs mixed widths"
    # the measured KL of the allocation is what adding the single-store sensitivities predicted, roughly
    assert plan["calibration_kl_measured"] == pytest.approx(plan["calibration_kl_predicted"], rel=0.5)
    # live cache bytes per token = the per-layer accounting
    model = load_converted(tmp_path / "q")
    ids = torch.randint(3, 90, (1, 8 + 8 * 16), generator=torch.Generator().manual_seed(0))
    measured = kv_bytes_per_token(model, ids, 8 + 8 * 4, 8 + 8 * 16)
    spec = QuantSpec(4, 8, 8)
    accounted = sum(32 * QuantSpec(k, 8).bytes_per_value(16, True) + 32 * QuantSpec(v, 8).bytes_per_value(16, False)
                    for k, v in storage["layers"])  # fmt: skip
    assert spec.group == 8 and measured == pytest.approx(accounted)
    # the recipe repeats the plan, not its result
    again = run_cli("run", str(tmp_path / "q" / "recipe.yaml"), "--model", str(src), "--out", str(tmp_path / "r"),
                    "--quiet")  # fmt: skip
    assert again.exit_code == 0, again.output
    assert json.loads((tmp_path / "r" / "kvconvert.json").read_text())["kv_storage"] == storage
    for widths in (("--kv-bits", "4"), ("--kv-value-bits", "2")):
        both = run_cli("quant", "--model", str(src), "--out", str(tmp_path / "x"), *widths, "--kv-budget", "0.3")
        assert both.exit_code == 2 and "not both" in both.output and not (tmp_path / "x").exists()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_up_is_the_least_value_that_covers_compiled_too(dtype):
    """A quantizer's scale is rounded up to float16 / bfloat16 so that the grid covers the group's range: the result
    is the least ``dtype`` value ≥ x (subnormals, exact values and ``dtype``'s largest, for x beyond it, included),
    and Inductor computes the same (a cast down and back up, which it keeps in float32, once left half of a compiled
    step's scales below their range)."""
    from kvconvert.runtime.kvconvert_codec import round_up

    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(0)
    edges = torch.tensor([0.0, 1.0, 0.5, info.max, 3e38])
    x = torch.cat([torch.rand(4000, generator=g) * 3, torch.rand(1000, generator=g) * 1e-4,
                   torch.exp(torch.randn(4000, generator=g) * 8), edges])  # fmt: skip
    x = x[x < 3e38 if dtype == torch.bfloat16 else x >= 0]  # bfloat16 reaches float32's range: no finite x beyond
    got = round_up(x, dtype)
    assert got.dtype == dtype
    beyond = x > info.max
    covered = got.float() >= x
    below = torch.nextafter(got, torch.zeros((), dtype=dtype)).float()  # the next value down must not cover x
    assert covered[~beyond].all() and (below < x)[~beyond & (x > 0)].all()
    assert (got[beyond] == info.max).all() and (got[x == 0] == 1).all()  # a constant group: any scale
    assert torch.equal(torch.compile(round_up, fullgraph=True)(x, dtype), got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_down_is_the_greatest_value_below_compiled_too(dtype):
    """A quantizer's zero point is rounded down to float16 / bfloat16 so that it does not exceed the group's minimum:
    the result is the greatest ``dtype`` value ≤ x (negative and positive, subnormals and exact values included; x
    beyond ``dtype``'s range gives its largest finite value), and Inductor computes the same (a cast down compared
    with its cast back up, kept in float32 by Inductor, once gave a compiled step other zero points than an eager one,
    so a static quantized cache decoded compiled held other values than eagerly)."""
    from kvconvert.runtime.kvconvert_codec import _round_down

    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(4000, generator=g) * 3, torch.randn(1000, generator=g) * 1e-5,
                   torch.randn(200, generator=g).to(dtype).float(),  # exact values
                   torch.exp(torch.randn(4000, generator=g) * 6) * torch.randn(4000, generator=g).sign(),
                   torch.tensor([0.0, -0.0, info.max, -info.max, info.tiny, -info.tiny])])  # fmt: skip
    x = x[x.abs() <= info.max]
    got = _round_down(x, dtype)
    above = torch.nextafter(got, torch.full((), float("inf"), dtype=dtype)).float()  # the next value up exceeds x
    assert got.dtype == dtype and (got.float() <= x).all() and (above > x).all()
    if dtype == torch.float16:  # bfloat16 reaches float32's range: no finite x beyond
        assert (_round_down(torch.tensor([-1e30, 1e30]), dtype).float().abs() == info.max).all()
    assert torch.equal(torch.compile(_round_down, fullgraph=True)(x, dtype), got)
    # and so a block quantized in a compiled step holds what an eager step quantizes (codes, scales, zero points)
    from kvconvert.runtime.kvconvert_codec import quantize_groups

    blocks = torch.randn(64, 32, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 2)
    eager, compiled = quantize_groups(blocks, 4), torch.compile(quantize_groups, fullgraph=True)(blocks, 4)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
