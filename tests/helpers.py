"""Shared test helpers: run the CLI, load the independent reference, compare two models."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from click.testing import CliRunner, Result
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from kvconvert.cli import main
from kvconvert.eval.memory import kv_bytes_per_token

# float32 stores K with relative rounding 6e-8; V = K·W_KV amplifies it by at most κ(W_K)
# (≤ 1e4 for the models tested), so 1e-4 of the logit scale is a bound that still catches any
# real algebra mistake (those show up at 1e-1 and above).
LOGIT_TOLERANCE = 1e-4


def run_cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def convert(command: str, src: Path, dst: Path, *extra: str) -> dict:
    """Run ``kvconvert COMMAND --model SRC --out DST --quiet EXTRA…``; return its kvconvert.json."""
    result = run_cli(command, "--model", str(src), "--out", str(dst), "--quiet", *extra)
    assert result.exit_code == 0, result.output
    return json.loads((Path(dst) / "kvconvert.json").read_text())


def generate_in_every_mode(model, new_tokens: int = 12) -> None:
    """Greedy, sampling, beams and several return sequences on a left-padded batch: each gives the
    expected shape (the cache's batch edits — repeat, reorder, select — all ran)."""
    ids, mask = left_padded()
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  pad_token_id=0)  # fmt: skip
    for kwargs in ({"do_sample": False}, {"do_sample": True, "top_k": 20}, {"num_beams": 2, "do_sample": False},
                   {"num_beams": 2, "num_return_sequences": 2, "do_sample": False}):  # fmt: skip
        out = model.generate(**common, **kwargs)
        assert out.shape == (2 * kwargs.get("num_return_sequences", 1), ids.shape[1] + new_tokens), kwargs


def left_padded(length: int = 24, pad: int = 7, seed: int = 5, high: int = 90) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of random token ids ``[2, length]``; the second is left-padded by ``pad`` tokens."""
    ids = torch.randint(3, high, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


def convert_slim(src: Path, dst: Path, *extra: str) -> None:
    result = run_cli("slim", "--model", str(src), "--out", str(dst), "--quiet", *extra)
    assert result.exit_code == 0, result.output


def load_reference(src: Path):
    """The stock transformers class, named explicitly (remote-code loading re-registers the auto
    mapping for the same config class, so AutoModel is not an independent reference)."""
    config = transformers.AutoConfig.from_pretrained(src)
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type])
    return cls.from_pretrained(src, dtype=torch.float32).eval()


def load_converted(dst: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True).eval()


def assert_same_logits(reference: torch.Tensor, candidate: torch.Tensor, where: str) -> None:
    scale = reference.abs().max().item()
    diff = (reference - candidate).abs().max().item()
    assert diff <= LOGIT_TOLERANCE * scale, f"{where}: max |Δlogit| {diff:.3g} > {LOGIT_TOLERANCE} × {scale:.3g}"


@torch.no_grad()
def assert_equivalent(reference, converted, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """Prefill logits (valid positions), 32 greedy decode steps' logits and tokens, and sampled
    tokens under the same seed, all equal to the reference."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    ref_logits = reference(input_ids=input_ids, attention_mask=mask).logits
    new_logits = converted(input_ids=input_ids, attention_mask=mask).logits
    valid = mask.bool()
    assert_same_logits(ref_logits[valid], new_logits[valid], "prefill")

    kwargs = dict(
        input_ids=input_ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32,
        return_dict_in_generate=True, output_logits=True, pad_token_id=0,
    )  # fmt: skip
    ref_out = reference.generate(do_sample=False, **kwargs)
    new_out = converted.generate(do_sample=False, **kwargs)
    for step, (a, b) in enumerate(zip(ref_out.logits, new_out.logits, strict=True)):
        assert_same_logits(a, b, f"decode step {step}")
    assert torch.equal(ref_out.sequences, new_out.sequences), "greedy generations differ"

    torch.manual_seed(1234)
    ref_sampled = reference.generate(do_sample=True, top_k=20, **kwargs).sequences
    torch.manual_seed(1234)
    new_sampled = converted.generate(do_sample=True, top_k=20, **kwargs).sequences
    assert torch.equal(ref_sampled, new_sampled), "sampled generations differ under the same seed"
    return new_out


def kv_budget(reference, converted, input_ids: torch.Tensor) -> float:
    """Measured bytes-per-token ratio converted / reference, from the cache objects."""
    short, long = input_ids.shape[1] // 4, input_ids.shape[1]
    return kv_bytes_per_token(converted, input_ids, short, long) / kv_bytes_per_token(reference, input_ids, short, long)


def step_mask(valid: torch.Tensor, first: int, count: int, length: int) -> torch.Tensor:
    """transformers' boolean mask ``[b, 1, count, length]`` for tokens ``first..first+count-1``: causal over the
    slots, padding (``valid [b, ·]`` False) hidden; slots past the sequence hidden too."""
    query = torch.arange(first, first + count)[:, None]
    slots = torch.arange(length)[None, :]
    padded = torch.zeros(valid.shape[0], length, dtype=torch.bool)
    padded[:, : min(length, valid.shape[1])] = valid[:, :length]
    return ((slots <= query)[None] & padded[:, None, :])[:, None]


RAZOR_CHUNKS = [1, 1, 5, *[1] * 12, 9, *[1] * 30]


def razor_static_steps(sink: int, window: int, frac: float, retrieval: list[int], tolerance: float,
                       device: str = "cpu", quant: Any = None, chunks: list[int] = RAZOR_CHUNKS,
                       dim: int = 8, sums_atol: float = 1e-5) -> None:  # fmt: skip
    """Feed the same chunks (several tokens, then single ones; a left-padded row whose padding outlasts the sink)
    to razor's growing and static cache layers: each step's outputs of the real tokens agree within ``tolerance``
    (relative to the largest), and the compensation sums end equal (``test_static_cache``; with the head-wise
    kernel, ``test_kernels``). ``quant``: a ``QuantSpec`` for both (``StaticRazorKiviLayer``, or in the token layout
    ``StaticRazorTokenLayer``, whose head width ``dim`` is a multiple of 32); ``sums_atol``: the sums' tolerance."""
    from kvconvert.runtime.kvconvert_razor import RazorLayer
    from kvconvert.runtime.kvconvert_razor_kivi import StaticRazorKiviLayer
    from kvconvert.runtime.kvconvert_razor_static import StaticRazorLayer
    from kvconvert.runtime.kvconvert_razor_token import StaticRazorTokenLayer

    others = [g for g in range(3) if g not in retrieval]
    total, generator = sum(chunks), torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, total, dim, generator=generator).to(device)
    k = torch.randn(2, 3, total, dim, generator=generator).to(device)
    v = torch.randn(2, 3, total, dim, generator=generator).to(device)
    valid = torch.ones(2, total, dtype=torch.bool)
    valid[1, :13] = False
    growing = RazorLayer(retrieval, others, sink, window, frac, quant)
    kind = StaticRazorTokenLayer if quant is not None and quant.layout == "token" else StaticRazorKiviLayer
    static = StaticRazorLayer(retrieval, others, sink, window, frac, total + 3) if quant is None else (
        kind(retrieval, others, sink, window, frac, total + 3, quant, 0))  # fmt: skip
    first = 0
    for count in chunks:
        step = slice(first, first + count)
        expected, _ = growing.attend(q[:, :, step], k[:, :, step], v[:, :, step],
                                     step_mask(valid, first, count, first + count).to(device), None)  # fmt: skip
        got, _ = static.attend(q[:, :, step], k[:, :, step], v[:, :, step],
                               step_mask(valid, first, count, total + 3).to(device), None)  # fmt: skip
        first += count
        real = valid[:, first - count : first].to(device)  # a padding query's output is garbage in both
        scale = max(1.0, expected[real].abs().max().item())
        torch.testing.assert_close(got[real], expected[real], rtol=tolerance, atol=tolerance * scale,
                                   msg=f"after {first} tokens")  # fmt: skip
    assert int(static.filled) == growing.seen == total
    if others:
        assert growing.comp_count.tolist() == static.comp_count.tolist() and growing.comp_count[0] > 0
        torch.testing.assert_close(static.comp_k_sum, growing.comp_k_sum, rtol=1.3e-6, atol=sums_atol)
        torch.testing.assert_close(static.comp_v_sum, growing.comp_v_sum, rtol=1.3e-6, atol=sums_atol)


# a prefill, single decode tokens, chunks: how tokens reach a cache's store (``static_store_steps``)
STORE_CHUNKS = [37, 1, 1, 90, *[1] * 100, 70, *[1] * 40]


def static_store_steps(growing, static, width: int = 64):
    """Feed the same tokens ``[2, 3, n, width]`` (channels of growing scale, sink-like outliers first) in
    ``STORE_CHUNKS`` to a growing store (``extend(new)``) and a static one (``extend(new, filled)``, room for
    ``sum(STORE_CHUNKS)`` or more); yield ``(tokens so far, the static store's, the growing store's, all tokens)``
    after each chunk."""
    x = torch.randn(2, 3, sum(STORE_CHUNKS), width, generator=torch.Generator().manual_seed(0))
    x = x * torch.linspace(0.5, 4, width)
    x[..., :4, :] *= 10  # sink-like outliers
    filled = 0
    for count in STORE_CHUNKS:
        new = x[..., filled : filled + count, :]
        expected = growing.extend(new)
        got = static.extend(new, torch.tensor(filled))[..., : filled + count, :]
        filled += count
        yield filled, got, expected, x


# The runtime's tables kept per shape and device (built on first use; a compiled step in a fresh process is the first
# to ask, so it must build them inside the trace). Module attribute names, per runtime module.
RUNTIME_TABLES = {"kvconvert_codec": ("_ROTATIONS", "_rotation_cached"), "kvconvert_packing": ("_HIGH_BITS",
                  "_COLUMN_GROUPS"), "kvconvert_tokenlayout": ("_UNIT_SCALES",)}  # fmt: skip


def forget_runtime_tables() -> None:
    """Every runtime table of ``RUNTIME_TABLES`` emptied, in the installed package's runtime and in every output
    directory's copy loaded as remote code: what a fresh process holds."""
    for name, module in list(sys.modules.items()):
        for attr in RUNTIME_TABLES.get(name.rsplit(".", 1)[-1], ()):
            table = getattr(module, attr)
            table.cache_clear() if hasattr(table, "cache_clear") else table.clear()


def compiled_generate(model, generate: Any, backend: str = "inductor") -> Any:
    """``generate(model, cache_implementation="static", compile_config=…)`` through generate's own compiled decode
    step (fullgraph) on whatever device the model is on, asserting that generate really took that path."""
    config = transformers.CompileConfig(fullgraph=True, mode="default", backend=backend)
    config._compile_all_devices = True  # transformers' switch to compile on CPU (its tests use it too)
    torch._dynamo.reset()
    forget_runtime_tables()
    out = generate(model, cache_implementation="static", compile_config=config)
    assert getattr(model, "_compiled_call", None) is not None  # generate really took the compiled path
    return out


def replays_as_a_cuda_graph(model, method: str, length: int) -> None:
    """One decode step captured as a CUDA graph (``bench/kernels_bench.py``'s ``captured_decode``) and replayed gives
    the logits and tokens of eager steps from a twin cache (on a CPU the same loop runs uncaptured)."""
    from bench.kernels_bench import captured_decode
    from kvconvert.eval.speed import _prefill

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device)
    ids = torch.randint(3, 90, (2, length), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        eager, logits = _prefill(model, ids, None, None, length + 16), []
        for _ in range(6):
            logits.append(model(eager["token"], past_key_values=eager["cache"], use_cache=True).logits)
            eager["token"] = logits[-1][:, -1:].argmax(-1)
        state = _prefill(model, ids, None, None, length + 16)
        run, last = captured_decode(model, state["cache"], state["token"])  # two steps run before the capture
        for step in range(2, 6):
            run(1)
            assert_same_logits(logits[step].cpu(), last["logits"].cpu(), f"{method} step {step}")
            assert torch.equal(last["token"], logits[step][:, -1:].argmax(-1))
