"""Compile the Triton kernels for real GPUs (PTX + cubin through the ptxas bundled with Triton), no GPU
needed. Run in a fresh process by test_kernels.py: the test process interprets kernels instead."""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kvconvert.runtime.kvconvert_kernels as kernels  # noqa: E402

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
    print("compiled")


if __name__ == "__main__":
    sys.exit(main())
