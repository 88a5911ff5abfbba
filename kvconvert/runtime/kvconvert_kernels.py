"""Decode-attention kernels over compressed caches: a plain-torch reference and a Triton kernel for each.

``packed_decode`` covers every cache whose heads read column ranges of shared token-major tensors: ZACK (per-KV-head
widths, packed side by side), LoRC (one latent shared by all heads), slim (scores on RoPE'd keys, weighted sum of the
full pre-RoPE key rows, then W_KV) and plain GQA. Query head h reads ``query[:, q_off[h] : q_off[h] + wk[h]]`` and the
key columns ``k_off[h] : k_off[h] + wk[h]``, and writes the attention-weighted value columns ``v_off[h] : v_off[h] +
wv[h]`` at ``o_off[h]``; the full keys or values are never rebuilt. ``razor_decode`` gives each head its own length:
retrieval heads attend over their full cache, the others over sink + recent tokens plus the compensation token.

Runtimes decode through a kernel where ``use_kernels`` says (asked for, or measured faster on a GPU), else through
their own torch code, which CPU users and CI run. The references (per-head loops, float32) are the kernels'
specification: tests compare each kernel with its reference under ``TRITON_INTERPRET=1``, and every runtime's kernel
path with its torch path. Also the launch plumbing the other kernel files share (splits, partials). Copied verbatim
into every output directory; Triton is optional.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the references need only torch
    triton = None


@dataclass(frozen=True)
class HeadColumns:
    """Where each query head's query, key, value and output columns are (all ``[H]`` int32, on the
    tensors' device), and ``order``: the heads by descending work (wk + wv), so that the widest heads
    start first and narrow ones fill in behind them (ZACK §5.3's longest-task-first balancing)."""

    q_off: torch.Tensor
    k_off: torch.Tensor
    wk: torch.Tensor
    v_off: torch.Tensor
    wv: torch.Tensor
    o_off: torch.Tensor
    order: torch.Tensor
    out_head: torch.Tensor  # [Σ wv] int64: the head each output column belongs to (split combination)
    max_wk: int
    max_wv: int
    out_width: int

    @classmethod
    def build(cls, k_off: list[int], wk: list[int], v_off: list[int], wv: list[int], device: Any) -> HeadColumns:
        """Queries and outputs are packed head after head: head h's start is the sum of the widths before it."""
        q_off = [sum(wk[:h]) for h in range(len(wk))]
        o_off = [sum(wv[:h]) for h in range(len(wv))]
        order = sorted(range(len(wk)), key=lambda h: -(wk[h] + wv[h]))

        def table(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        out_head = torch.tensor([h for h in range(len(wv)) for _ in range(wv[h])], dtype=torch.long, device=device)
        return cls(table(q_off), table(k_off), table(wk), table(v_off), table(wv), table(o_off), table(order),
                   out_head, max(wk), max(wv), sum(wv))  # fmt: skip


def packed_decode_reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
    heads: HeadColumns, scale: float,
) -> torch.Tensor:  # fmt: skip
    """One decode query per row. ``query [b, Wq]``, ``keys [b, n, Wk]``, ``values [b, n, Wv]``,
    ``bias [b, n]`` additive (float32) or None. Returns ``[b, Σ wv]`` float32: head after head,
    softmax(q·kᵀ·scale + bias)·v over its own columns."""
    out = torch.empty(query.shape[0], heads.out_width, dtype=torch.float32, device=query.device)
    for h in range(heads.q_off.numel()):
        q0, k0, wk = int(heads.q_off[h]), int(heads.k_off[h]), int(heads.wk[h])
        v0, wv, o0 = int(heads.v_off[h]), int(heads.wv[h]), int(heads.o_off[h])
        q = query[:, q0 : q0 + wk].float()
        scores = torch.einsum("br,bnr->bn", q, keys[:, :, k0 : k0 + wk].float()) * scale
        if bias is not None:
            scores = scores + bias.float()
        probs = torch.softmax(scores, dim=-1)
        out[:, o0 : o0 + wv] = torch.einsum("bn,bnr->br", probs, values[:, :, v0 : v0 + wv].float())
    return out


def razor_decode_reference(
    query: torch.Tensor, full_k: torch.Tensor, full_v: torch.Tensor, full_bias: torch.Tensor,
    short_k: torch.Tensor, short_v: torch.Tensor, short_bias: torch.Tensor, comp_k: torch.Tensor,
    comp_v: torch.Tensor, comp_logit: torch.Tensor, kind: torch.Tensor, slot: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Head-wise lengths in one call. ``query [b, H, d]``; retrieval KV heads ``full_k/v [b, R, n, d]``
    with ``full_bias [b, n]``; the others ``short_k/v [b, O, m, d]`` (sink + recent + new tokens) with
    ``short_bias [b, m]``, compensation tokens ``comp_k/v [b, O, d]`` and their logit offsets
    ``comp_logit [b]`` (ln N_d, or a large negative number when nothing was dropped). Query head h
    reads ``full[:, slot[h]]`` when ``kind[h] == 0`` and ``short[:, slot[h]]`` + compensation when 1.
    Returns ``[b, H, d]`` float32."""
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    for h in range(query.shape[1]):
        q, s = query[:, h].float(), int(slot[h])
        if int(kind[h]) == 0:
            scores = torch.einsum("bd,bnd->bn", q, full_k[:, s].float()) * scale + full_bias.float()
            out[:, h] = torch.einsum("bn,bnd->bd", torch.softmax(scores, -1), full_v[:, s].float())
            continue
        scores = torch.einsum("bd,bnd->bn", q, short_k[:, s].float()) * scale + short_bias.float()
        comp = (q * comp_k[:, s].float()).sum(-1, keepdim=True) * scale + comp_logit.float()[:, None]
        probs = torch.softmax(torch.cat([scores, comp], dim=-1), -1)
        out[:, h] = (
            torch.einsum("bn,bnd->bd", probs[:, :-1], short_v[:, s].float()) + probs[:, -1:] * comp_v[:, s].float()
        )
    return out


def triton_available() -> bool:
    return triton is not None


KERNEL_CHOICES = ("auto", "torch", "triton")
KERNEL_DEVICES = ("cuda", "xpu")  # where compiled Triton kernels run (ROCm GPUs are "cuda" to torch)


def env_choice(variable: str, choices: tuple[str, ...]) -> str:
    """The runtime setting ``variable`` among ``choices`` (unset: the first); a misspelt one is a one-line error."""
    choice = os.environ.get(variable, "").strip().lower() or choices[0]
    if choice not in choices:
        raise ValueError(f"{variable}={choice!r} is not one of {', '.join(choices)}")
    return choice


def kernels_requested() -> str:
    """``KVCONVERT_KERNELS``, checked (``env_choice``); ``triton`` where Triton is not installed is a one-line error
    too: asking for the kernels and silently getting the torch path would make a kernel measurement another one's."""
    choice = env_choice("KVCONVERT_KERNELS", KERNEL_CHOICES)
    if choice == "triton" and triton is None:
        raise ValueError("KVCONVERT_KERNELS=triton, but Triton is not installed (pip install triton); "
                         "KVCONVERT_KERNELS=torch runs the torch path")  # fmt: skip
    return choice


def check_kernel_device(device: torch.device) -> None:
    """The kernels run on ``device`` (a GPU, any under ``TRITON_INTERPRET=1``), else a one-line ``ValueError``."""
    if device.type not in KERNEL_DEVICES and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"KVCONVERT_KERNELS=triton: the Triton kernels run on a GPU, this model runs on {device}; "
                         "set KVCONVERT_KERNELS=torch (the default path) or TRITON_INTERPRET=1 to interpret "
                         "them")  # fmt: skip


def check_requested_kernels(model: Any) -> None:
    """``KVCONVERT_KERNELS=triton`` where the model's device cannot run the kernels: ``check_kernel_device``'s one-line
    error at every forward, whichever path the method's layers take. Checked in ``use_kernels`` alone, a prefill (which
    never asks for a kernel) and every storage with no kernel of its own (3-bit codes, a head width the kernels do not
    take) ran through torch in silence."""
    if kernels_requested() == "triton":
        check_kernel_device(next(model.parameters()).device)


def kernels_by_default_on(device: torch.device) -> bool:
    """Where ``KVCONVERT_KERNELS=auto`` may run a kernel: NVIDIA from Ampere on (compiled for sm_80/90), Triton in."""
    nvidia = triton is not None and device.type == "cuda" and torch.version.hip is None
    return nvidia and torch.cuda.get_device_capability(device) >= (8, 0)


def use_kernels(tensor: torch.Tensor, default: str = "off") -> bool:
    """Whether decode runs the Triton kernels on ``tensor``'s device: when asked, ``KVCONVERT_KERNELS=triton`` (on a
    CPU only with ``TRITON_INTERPRET=1``: tests); ``torch``: never; under ``auto`` (the default), where
    ``kernels_by_default_on``, what the caller's kernel measured: ``default`` "gpu" (faster than its torch path in
    every step), "graphs" (faster only in steps captured as CUDA graphs: while one is captured, and in a step
    ``torch.compile`` traces, as transformers' ``generate`` compiles it), "off": not by default. Asked for where they
    cannot run: a ``ValueError`` (``kernels_requested``, ``check_kernel_device``), never a silent fall-back.

    Measured on an H200 (× the original's static cache, 16 × 8K; docs/gpu.md has every figure): "gpu", fp8's kernel
    (0.27× → 0.50× eagerly, 0.25× → 2.23× captured, kernels-h200-fp8-kivi-razor-2026-11-27.md) and the token layout's
    (0.10× → 0.18×, 0.085× → 0.64×, compiled 0.19× → 1.12×, kernels-h200-token-2026-11-29.md); "graphs", the 4-bit KIVI
    kernel (0.19× → 0.59× captured, 0.20× → 0.17× eagerly; compiled 0.36× → 1.00×). Each reads codes the torch path
    reads back whole in 16 bits first. "off" for the others: their torch paths decoded faster than their kernels on an
    H100 (kernels-h100-2026-11-23.md) and through CUDA graphs on an H200 (slim 0.48× vs 0.11×, LoRC 0.43× vs 0.17×,
    razor 1.44× vs 1.35×: kernels-h200-graphs-2026-11-26.md)."""
    choice = kernels_requested()
    if choice == "auto":
        if default == "off" or not kernels_by_default_on(tensor.device):
            return False
        return default == "gpu" or torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling()
    if choice == "torch":
        return False
    check_kernel_device(tensor.device)
    return True


BLOCK_N = 32  # tokens per tile: a multiple of 16 for tensor-core dots, small enough for the interpreter


if triton is not None:

    @triton.jit
    def split_bounds(n, length, split_len, HAS_LENGTH: tl.constexpr):
        """This split's tokens ``[start, stop)`` (``program_id(1)``): ``split_len``, cut at ``n`` or ``length``."""
        end = n
        if HAS_LENGTH:
            end = tl.minimum(end, tl.load(length))
        start = tl.program_id(1) * split_len
        return start, tl.minimum(start + split_len, end)

    @triton.jit
    def _packed_decode_kernel(
        query, keys, values, bias, part_acc, part_ml,
        q_off, k_off, wk_tab, v_off, wv_tab, o_off, order,
        n, split_len, n_splits, scale,
        sqb, skb, skn, svb, svn, sbb, spb, sps, smb, sms,
        HAS_BIAS: tl.constexpr, SINGLE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        """Program (row b, task t, value chunk c × split j): head h = order[t]; online softmax over the
        tokens of split j, accumulating BLOCK_V value columns (chunk c of the head's wv). Writes the
        split's unnormalised sums and its (max, denominator), which ``_combine_splits`` merges, or with
        ``SINGLE`` (one split) the normalised output itself."""
        b = tl.program_id(0)
        h = tl.load(order + tl.program_id(1))
        chunk = tl.program_id(2) // n_splits
        split = tl.program_id(2) % n_splits
        wk = tl.load(wk_tab + h)
        wv = tl.load(wv_tab + h)
        cols_k = tl.arange(0, BLOCK_K)
        cols_v = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
        if chunk * BLOCK_V < wv:
            q = tl.load(query + b * sqb + tl.load(q_off + h) + cols_k, mask=cols_k < wk, other=0.0).to(tl.float32)
            key_base = keys + b * skb + tl.load(k_off + h)
            value_base = values + b * svb + tl.load(v_off + h)
            m_i = tl.full((), float("-inf"), tl.float32)
            l_i = tl.full((), 0.0, tl.float32)
            acc = tl.zeros((BLOCK_V,), tl.float32)
            first = split * split_len
            last = tl.minimum(n, first + split_len)
            for start in range(first, last, BLOCK_N):
                rows = start + tl.arange(0, BLOCK_N)
                valid = rows < last
                k = tl.load(key_base + rows[:, None] * skn + cols_k[None, :],
                            mask=valid[:, None] & (cols_k < wk)[None, :], other=0.0).to(tl.float32)  # fmt: skip
                s = tl.sum(k * q[None, :], axis=1) * scale
                if HAS_BIAS:
                    s += tl.load(bias + b * sbb + rows, mask=valid, other=0.0).to(tl.float32)
                s = tl.where(valid, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=0))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new)
                v = tl.load(value_base + rows[:, None] * svn + cols_v[None, :],
                            mask=valid[:, None] & (cols_v < wv)[None, :], other=0.0).to(tl.float32)  # fmt: skip
                acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
                l_i = l_i * alpha + tl.sum(p, axis=0)
                m_i = m_new
            if SINGLE:
                acc = acc / l_i
            tl.store(part_acc + b * spb + split * sps + tl.load(o_off + h) + cols_v, acc, mask=cols_v < wv)
            if chunk == 0 and not SINGLE:
                tl.store(part_ml + b * smb + split * sms + 2 * h, m_i)
                tl.store(part_ml + b * smb + split * sms + 2 * h + 1, l_i)

    @triton.jit
    def _razor_decode_kernel(
        query, full_k, full_v, full_bias, short_k, short_v, short_bias, comp_k, comp_v, comp_logit,
        kind_tab, slot_tab, part_acc, part_ml, n_full, n_short, split_len, scale,
        sqb, sqh, sfb, sfh, sfn, sfbb, ssb, ssh, ssn, ssbb, scb, sch, spb, sps, sph, smb, sms,
        D: tl.constexpr, SINGLE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Program (row b, query head h, split j): a retrieval head reads split j of its n_full tokens,
        any other head split j of its n_short tokens, and split 0 adds the compensation token with its
        ln N_d logit offset. Writes unnormalised sums and (max, denominator) as the packed kernel."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        cols = tl.arange(0, BLOCK_D)
        in_head = cols < D
        q = tl.load(query + b * sqb + h * sqh + cols, mask=in_head, other=0.0).to(tl.float32)
        s_slot = tl.load(slot_tab + h)
        is_other = tl.load(kind_tab + h) == 1
        if is_other:
            base_k = short_k + b * ssb + s_slot * ssh
            base_v = short_v + b * ssb + s_slot * ssh
            bias_base = short_bias + b * ssbb
            n = n_short
            step = ssn
        else:
            base_k = full_k + b * sfb + s_slot * sfh
            base_v = full_v + b * sfb + s_slot * sfh
            bias_base = full_bias + b * sfbb
            n = n_full
            step = sfn
        m_i = tl.full((), float("-inf"), tl.float32)
        l_i = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        first = split * split_len
        last = tl.minimum(n, first + split_len)
        for start in range(first, last, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            valid = rows < last
            tile = valid[:, None] & in_head[None, :]
            k = tl.load(base_k + rows[:, None] * step + cols[None, :], mask=tile, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            s += tl.load(bias_base + rows, mask=valid, other=0.0).to(tl.float32)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(base_v + rows[:, None] * step + cols[None, :], mask=tile, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        if is_other and split == 0:
            ck = tl.load(comp_k + b * scb + s_slot * sch + cols, mask=in_head, other=0.0).to(tl.float32)
            cv = tl.load(comp_v + b * scb + s_slot * sch + cols, mask=in_head, other=0.0).to(tl.float32)
            s_c = tl.sum(ck * q, axis=0) * scale + tl.load(comp_logit + b).to(tl.float32)
            m_new = tl.maximum(m_i, s_c)
            alpha = tl.exp(m_i - m_new)
            p_c = tl.exp(s_c - m_new)
            acc = acc * alpha + p_c * cv
            l_i = l_i * alpha + p_c
            m_i = m_new
        if SINGLE:
            acc = acc / l_i
        tl.store(part_acc + b * spb + split * sps + h * sph + cols, acc, mask=in_head)
        if not SINGLE:
            tl.store(part_ml + b * smb + split * sms + 2 * h, m_i)
            tl.store(part_ml + b * smb + split * sms + 2 * h + 1, l_i)


def _pow2(width: int) -> int:
    return max(16, 1 << max(0, math.ceil(math.log2(max(width, 1)))))


def _split_len(n: int, programs: int, device: torch.device, block_n: int, splits: int | None) -> int:
    """Tokens per split (a multiple of ``block_n``). Flash-decoding: one decode query has too few (row, head) programs
    to fill a GPU, so long caches are cut into splits merged afterwards, about four programs per multiprocessor, never
    under 64 tiles (H100: splitting a 1K cache cost 73 → 291 µs, a 32K cache gained 6×). ``splits`` forces a count."""
    if splits is None:
        splits = split_count(programs, n // (64 * block_n), device, 4)
    per_split = triton.cdiv(n, max(1, splits))
    return max(block_n, triton.cdiv(per_split, block_n) * block_n)


def interpreted() -> bool:
    """Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``: the tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def sixteen_bit_products(query: torch.Tensor) -> bool:
    """A decode kernel multiplies in ``query``'s own float16 / bfloat16: not in Triton's interpreter, which multiplies
    bfloat16 operands wrongly (3.9: any bfloat16 ``tl.dot``, seen), so there a bfloat16 query takes float32 products."""
    return query.dtype == torch.float16 or (query.dtype == torch.bfloat16 and not interpreted())


def split_count(programs: int, most: int, device: torch.device, per_sm: int) -> int:
    """Token splits for a decode launch of ``programs`` (rows × heads) programs: about ``per_sm`` programs per
    multiprocessor in all (a CPU, under the interpreter, counts as 4), at most ``most`` (each split long enough to be
    worth its merge), at least one."""
    units = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(triton.cdiv(per_sm * units, max(1, programs)), most))


def split_partials(rows: int, splits: int, group: int, dim: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A split decode launch's output, float32: sums ``[rows × Hkv, splits, G, d]``, (max, denominator) ``[.., 2]``."""
    return tuple(torch.empty(rows, splits, group, width, dtype=torch.float32, device=device) for width in (dim, 2))


def merged_splits(part_acc: torch.Tensor, part_ml: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``split_partials``' buffers after the launch -> the partial over every split, ``[b, Hkv, G, d | 2]``."""
    acc, ml = part_acc.unflatten(0, (batch, -1)), part_ml.unflatten(0, (batch, -1))
    return (acc[:, :, 0], ml[:, :, 0]) if acc.shape[2] == 1 else combine_partials(acc, ml, dim=2)


def combine_partials(acc: torch.Tensor, ml: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials of disjoint token sets stacked along ``dim`` (``acc [..., d]``, ``ml [..., 2]``: unnormalised sums
    and (max, denominator), as the kernels' splits and ``kivi_decode_reference`` return them) -> the partial of
    their union: ``Σ acc_i·e^{m_i − M}`` and ``(M, Σ l_i·e^{m_i − M})``, ``M = max m_i``."""
    top = ml[..., 0].amax(dim, keepdim=True)
    weight = torch.exp(ml[..., 0] - top)
    total = (ml[..., 1] * weight).sum(dim)
    return (acc * weight[..., None]).sum(dim), torch.stack([top.squeeze(dim), total], dim=-1)


def _combine_splits(part_acc: torch.Tensor, part_ml: torch.Tensor, out_head: torch.Tensor | None) -> torch.Tensor:
    """Merge split partials: ``part_acc [b, S, C]`` unnormalised sums, ``part_ml [b, S, H, 2]`` each
    split's running max and denominator; column c belongs to head ``out_head[c]`` (None: C = H × d,
    head-major). Splits without tokens carry max −inf and weigh exp(−inf) = 0."""
    if out_head is None:
        b, splits, heads, _ = part_ml.shape
        acc, ml = combine_partials(part_acc.view(b, splits, heads, -1), part_ml, dim=1)
        return acc / ml[..., 1:]  # [b, H, d]
    m, l = part_ml[..., 0], part_ml[..., 1]  # [b, S, H]
    weight = torch.exp(m - m.amax(dim=1, keepdim=True))  # [b, S, H]
    denominator = (l * weight).sum(dim=1)  # [b, H]
    return (part_acc * weight[..., out_head]).sum(dim=1) / denominator[..., out_head]  # [b, C]


def packed_decode_triton(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
    heads: HeadColumns, scale: float, value_block: int = 128, splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``packed_decode_reference`` in one launch, grid (rows, heads by descending work, value chunks ×
    token splits), then the splits merged in torch."""
    assert triton is not None, "Triton is not installed (pip install 'kvconvert[kernels]')"
    query, keys, values = query.contiguous(), keys.contiguous(), values.contiguous()
    batch, n = keys.shape[0], keys.shape[1]
    block_v = min(_pow2(heads.max_wv), value_block)
    chunks = triton.cdiv(heads.max_wv, block_v)
    tasks = heads.order.numel()
    split_len = _split_len(n, batch * tasks * chunks, keys.device, BLOCK_N, splits)
    n_splits = triton.cdiv(n, split_len)
    part_acc = torch.empty(batch, n_splits, heads.out_width, dtype=torch.float32, device=query.device)
    part_ml = torch.empty(batch, n_splits, tasks, 2, dtype=torch.float32, device=query.device)
    bias_t = bias.float().contiguous() if bias is not None else part_acc  # any pointer when HAS_BIAS is off
    _packed_decode_kernel[(batch, tasks, chunks * n_splits)](
        query, keys, values, bias_t, part_acc, part_ml,
        heads.q_off, heads.k_off, heads.wk, heads.v_off, heads.wv, heads.o_off, heads.order,
        n, split_len, n_splits, scale,
        query.stride(0), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        bias_t.stride(0), part_acc.stride(0), part_acc.stride(1), part_ml.stride(0), part_ml.stride(1),
        HAS_BIAS=bias is not None, SINGLE=n_splits == 1, BLOCK_N=BLOCK_N, BLOCK_K=_pow2(heads.max_wk),
        BLOCK_V=block_v,
    )  # fmt: skip
    return part_acc[:, 0] if n_splits == 1 else _combine_splits(part_acc, part_ml, heads.out_head)


def razor_decode_triton(
    query: torch.Tensor, full_k: torch.Tensor, full_v: torch.Tensor, full_bias: torch.Tensor,
    short_k: torch.Tensor, short_v: torch.Tensor, short_bias: torch.Tensor, comp_k: torch.Tensor,
    comp_v: torch.Tensor, comp_logit: torch.Tensor, kind: torch.Tensor, slot: torch.Tensor, scale: float,
    splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``razor_decode_reference`` in one launch, grid (rows, query heads, token splits of the longest
    head), then the splits merged in torch."""
    assert triton is not None, "Triton is not installed (pip install 'kvconvert[kernels]')"
    tensors = [t.contiguous() for t in (query, full_k, full_v, short_k, short_v, comp_k, comp_v)]
    query, full_k, full_v, short_k, short_v, comp_k, comp_v = tensors
    full_bias, short_bias = full_bias.float().contiguous(), short_bias.float().contiguous()
    comp_logit = comp_logit.float().contiguous()
    batch, heads, dim = query.shape
    n = max(full_k.shape[2], short_k.shape[2])
    split_len = _split_len(n, batch * heads, query.device, BLOCK_N, splits)
    n_splits = triton.cdiv(n, split_len)
    part_acc = torch.empty(batch, n_splits, heads, dim, dtype=torch.float32, device=query.device)
    part_ml = torch.empty(batch, n_splits, heads, 2, dtype=torch.float32, device=query.device)
    _razor_decode_kernel[(batch, heads, n_splits)](
        query, full_k, full_v, full_bias, short_k, short_v, short_bias, comp_k, comp_v, comp_logit,
        kind.to(torch.int32).contiguous(), slot.to(torch.int32).contiguous(), part_acc, part_ml,
        full_k.shape[2], short_k.shape[2], split_len, scale,
        query.stride(0), query.stride(1), full_k.stride(0), full_k.stride(1), full_k.stride(2),
        full_bias.stride(0), short_k.stride(0), short_k.stride(1), short_k.stride(2), short_bias.stride(0),
        comp_k.stride(0), comp_k.stride(1), part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_ml.stride(0), part_ml.stride(1),
        D=dim, SINGLE=n_splits == 1, BLOCK_N=BLOCK_N, BLOCK_D=_pow2(dim),
    )  # fmt: skip
    if n_splits == 1:
        return part_acc[:, 0]
    return _combine_splits(part_acc.view(batch, n_splits, heads * dim), part_ml, None)
