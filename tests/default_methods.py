"""Every registered method at two settings on tiny models, for the contract tests every method must pass
(``test_method_contract.py``, ``test_cache_protocol.py``), as kvpress's ``tests/default_presses.py`` does
for its presses. A new method adds one line to each table; ``test_method_contract`` checks they cover the
registry. Entries: method -> (tiny model kind, extra CLI arguments)."""

from __future__ import annotations

# Settings at which the converted model must compute exactly what the source does.
LOSSLESS = {
    "slim": ("llama", ()),
    "lorc": ("llama_gqa", ("--kv-budget", "1.0")),
    "zack": ("llama_gqa", ("--removal-rate", "0", "--calib-tokens", "2048")),
    "razor": ("llama_gqa", ("--profile-tokens", "16", "--induction-frac", "1")),
    "minicache": ("llama", ("--start-layer", "0", "--gamma", "1")),
    "quant": ("llama_gqa", ("--kv-bits", "8", "--kv-residual", "256")),  # nothing old enough to quantize
}

# Settings at which the cache must hold measurably fewer bytes than the source's at CONTEXT tokens.
COMPRESSING = {
    "slim": ("llama", ()),
    "lorc": ("llama_gqa", ("--kv-budget", "0.5", "--schedule", "uniform")),  # 3 layers: too few for eq. 13
    "zack": ("llama_gqa", ("--kv-budget", "0.5", "--calib-tokens", "2048")),
    # one retrieval head of 12: its KV head is 1/6 of the cache, the windows take the rest of the budget
    "razor": (
        "llama_gqa",
        ("--profile-tokens", "16", "--induction-frac", "0.1", "--echo-frac", "0", "--kv-budget", "0.5"),
    ),  # fmt: skip
    "minicache": ("llama", ("--start-layer", "0")),
    "quant": ("llama_gqa", ("--kv-bits", "4", "--kv-residual", "16")),
}
CONTEXT = 192  # tokens: past razor's window and quant's residual on the tiny models (256 positions)
