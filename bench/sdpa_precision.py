"""How exact is PyTorch's SDPA in float32 on this device? One decode step's shape (a masked row of left padding),
every SDPA backend this device runs, each output's error against the same attention in float64.

Why: on an NVIDIA H200 (2026-11-27) an fp8 checkpoint's logits through kvconvert's fp8 kernel (float32 products)
and through its torch path (the codes read back, then SDPA) differed by 2.5e-4 of their scale in a float32 model,
while the kernel alone matched a float32 reference to 2e-5. If SDPA's float32 backends multiply in TF32 (10-bit
mantissas), the torch path is the side that moved. ``python bench/sdpa_precision.py`` (seconds; CPU too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    batch, heads, n, dim = 8, 4, 112, 64
    q, k, v = (torch.randn(batch, heads, m, dim, device=device, dtype=torch.float64) for m in (1, n, n))
    mask = torch.zeros(batch, 1, 1, n, device=device, dtype=torch.float64)
    mask[-1, ..., :37] = torch.finfo(torch.float32).min  # one row's left padding
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    plain = ((q.float() @ k.float().transpose(-1, -2)).double() - q @ k.transpose(-1, -2)).abs().max().item()
    print(f"{name}: torch {torch.__version__}, float32 matmul precision {torch.get_float32_matmul_precision()!r}, "
          f"cuda.matmul.allow_tf32 {torch.backends.cuda.matmul.allow_tf32}; a plain float32 q·kᵀ is off by "
          f"{plain:.1e} at most")  # fmt: skip
    backends = {"default": None, "math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}  # fmt: skip
    for label, backend in backends.items():
        args = (q.float(), k.float(), v.float())
        try:
            if backend is None:
                got = F.scaled_dot_product_attention(*args, attn_mask=mask.float())
            else:
                with sdpa_kernel(backend):
                    got = F.scaled_dot_product_attention(*args, attn_mask=mask.float())
        except RuntimeError as exc:  # a backend this device or shape does not run
            print(f"  {label:9s} not run: {str(exc).splitlines()[0][:100]}")
            continue
        error = (got.double() - expected).norm() / expected.norm()
        print(f"  {label:9s} ‖err‖/‖ref‖ {error.item():.2e}")


if __name__ == "__main__":
    main()
