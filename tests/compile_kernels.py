"""Compile the Triton kernels for real GPUs (PTX + cubin through the ptxas bundled with Triton), no GPU
needed. Run in a fresh process by test_kernels.py: the test process interprets kernels instead."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
# the working tree's kernels, whatever kvconvert is installed (a script's own folder, tests/, heads sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kvconvert.runtime.kvconvert_fp8_kernel as fp8_kernel  # noqa: E402
import kvconvert.runtime.kvconvert_kernels as kernels  # noqa: E402
import kvconvert.runtime.kvconvert_kivi_kernel as kivi_kernel  # noqa: E402
import kvconvert.runtime.kvconvert_token_kernel as token_kernel  # noqa: E402

# lengths and strides; everything else not listed is a pointer to the input dtype
INTS = {"n", "n_full", "n_short", "sqb", "skb", "skn", "svb", "svn", "sbb", "sob", "sqh", "sfb", "sfh", "sfn", "sfbb",
        "ssb", "ssh", "ssn", "ssbb", "scb", "sch", "split_len", "n_splits", "spb", "sps", "sph", "smb",
        "sms"}  # fmt: skip
TABLES = {"q_off", "k_off", "wk_tab", "v_off", "wv_tab", "o_off", "order", "kind_tab", "slot_tab"}
FLOAT32 = {"bias", "part_acc", "part_ml", "full_bias", "short_bias", "comp_logit"}


def signature(kernel: object, dtype: str, constexprs: dict[str, object]) -> dict[str, str]:
    names = kernel.arg_names  # type: ignore[attr-defined]
    types = {}
    for name in names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name == "scale":
            types[name] = "fp32"
        elif name in INTS:
            types[name] = "i32"
        elif name in TABLES:
            types[name] = "*i32"
        else:
            types[name] = "*fp32" if name in FLOAT32 else f"*{dtype}"
    return types


def typed_signature(kernel: object, constexprs: dict[str, object], pointers: dict[str, str]) -> dict[str, str]:
    """Every argument of ``kernel``: a constexpr, the float ``scale``, a pointer typed by ``pointers`` (name -> the
    type it points to), else an int32 (head counts, lengths, strides)."""
    types = {}
    for name in kernel.arg_names:  # type: ignore[attr-defined]
        if name in constexprs:
            types[name] = "constexpr"
        elif name == "scale":
            types[name] = "fp32"
        else:
            types[name] = f"*{pointers[name]}" if name in pointers else "i32"
    return types


def kivi_signature(kernel: object, constexprs: dict[str, object]) -> dict[str, str]:
    """KIVI's layout: uint8 codes, float16 scales and zeros, float32 queries, bias and partials."""
    pointers = {"key_codes": "u8", "value_codes": "u8", "length": "i64", **dict.fromkeys(("key_scale", "key_zero",
                "value_scale", "value_zero"), "fp16"), **dict.fromkeys(("query", "bias", "part_acc", "part_ml"),
                "fp32")}  # fmt: skip
    return typed_signature(kernel, constexprs, pointers)


def fp8_signature(kernel: object, query: str, constexprs: dict[str, object]) -> dict[str, str]:
    """fp8: uint8 codes, the query in the model's dtype, an int64 length, float32 scales, bias and partials."""
    pointers = {"keys": "u8", "values": "u8", "query": query, "length": "i64", **dict.fromkeys(("key_scale",
                "value_scale", "bias", "part_acc", "part_ml"), "fp32")}  # fmt: skip
    return typed_signature(kernel, constexprs, pointers)


def main() -> None:
    packed, razor = kernels._packed_decode_kernel, kernels._razor_decode_kernel
    for capability in (80, 90):
        target = GPUTarget("cuda", capability, 32)
        for dtype in ("fp32", "fp16", "bf16"):
            for has_bias in (True, False):
                consts = {"HAS_BIAS": has_bias, "SINGLE": has_bias, "BLOCK_N": 32, "BLOCK_K": 128, "BLOCK_V": 128}
                source = ASTSource(packed, signature(packed, dtype, consts), constexprs=consts)
                assert triton.compile(source, target=target).asm["cubin"]
            consts = {"D": 128, "SINGLE": dtype == "fp32", "BLOCK_N": 32, "BLOCK_D": 128}
            source = ASTSource(razor, signature(razor, dtype, consts), constexprs=consts)
            assert triton.compile(source, target=target).asm["cubin"]
        # KIVI's layout: uint8 codes, float16 scales and zeros, float32 queries and partials; heads of 128, blocks
        # of 64 tokens (the default group), Llama 3's 4 query heads per KV head padded to a 16-row dot
        kivi = kivi_kernel._kivi_decode_kernel
        for has_bias, dot, has_length in ((True, "ieee", False), (False, "tf32", False), (True, "tf32", True)):
            consts = {"G": 4, "D": 128, "HALF": 32, "HAS_BIAS": has_bias, "G_PAD": 16, "D_HALF": 64, "DOT": dot,
                      "HAS_LENGTH": has_length}  # fmt: skip
            source = ASTSource(kivi, kivi_signature(kivi, consts), constexprs=consts)
            assert triton.compile(source, target=target).asm["cubin"]
        # fp8: uint8 codes (e4m3 converted on sm_90, moved bit by bit on sm_80), the query in the model's dtype
        fp8 = fp8_kernel._fp8_decode_kernel
        for query in ("fp32", "bf16", "fp16"):
            half = query != "fp32"
            consts = {"G": 4, "D": 128, "G_PAD": 16, "TILE": 64, "HAS_BIAS": True, "HAS_LENGTH": half, "HALF": half,
                      "DOT": "tf32" if half else "ieee", "NATIVE": capability >= 89}  # fmt: skip
            source = ASTSource(fp8, fp8_signature(fp8, query, consts), constexprs=consts)
            assert triton.compile(source, target=target).asm["cubin"]
        # the token layout: uint8 codes, bfloat16 key (scale, zero) pairs, float16 value scales, float32 offsets,
        # bias and partials, the query in the model's dtype; Llama 3's heads (two channel groups of 64)
        token = token_kernel._token_decode_kernel
        # values in the layout (VBITS 0) or per token in KIVI's packing at 2 and 4 bits (``--kv-value-bits``)
        for query, vbits in (("fp32", 0), ("bf16", 0), ("fp16", 0), ("bf16", 2), ("fp32", 4)):
            consts = {"G": 4, "G_PAD": 16, "D": 128, "SIZE": 64, "BLK": 32, "NB": 4, "HALVES": True, "CENTER": 64,
                      "R": 32, "HAS_BIAS": True, "HAS_LENGTH": query != "fp32",
                      "DOT": "ieee" if query == "fp32" else "tf32", "VBITS": vbits, "GS": 64}  # fmt: skip
            pointers = {"query": query, "key_codes": "u8", "value_codes": "u8", "key_pairs": "bf16", "length": "i64",
                        **dict.fromkeys(("value_scale", "value_zero"), "fp16"),
                        **dict.fromkeys(("offsets", "bias", "part_acc", "part_ml"), "fp32")}  # fmt: skip
            source = ASTSource(token, typed_signature(token, consts, pointers), constexprs=consts)
            assert triton.compile(source, target=target).asm["cubin"]
    print("compiled")


if __name__ == "__main__":
    sys.exit(main())
