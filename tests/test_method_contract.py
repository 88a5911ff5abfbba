"""The contract every registered method keeps, checked for each one at the settings of
``default_methods.py`` (outputs converted once per session by the ``converted`` fixture): both loaders
load it and agree, it generates in every mode, its cache holds fewer bytes, its plan is decided once and
layers convert in any order, its saved recipe reproduces it, and its report reads back. A method's own
tests check what is particular to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from default_methods import COMPRESSING, CONTEXT, LOSSLESS
from helpers import generate_in_every_mode, load_converted, load_reference, run_cli

import kvconvert
from kvconvert.methods import METHODS, build_method

ALL = sorted(METHODS)


def test_the_default_settings_cover_the_registry():
    assert set(LOSSLESS) == set(COMPRESSING) == set(METHODS), "add the new method to tests/default_methods.py"


def _ids(length: int, rows: int = 2, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 90, (rows, length), generator=generator)


@pytest.mark.parametrize("method", ALL)
@torch.no_grad()
def test_both_loaders_load_it_and_agree(method, converted):
    """``from_pretrained(..., trust_remote_code=True)`` runs the runtime copied into the output,
    ``kvconvert.load`` the installed one: the same code, so the same logits, prefill and decode."""
    out = converted(method, "compressing")[1]
    remote, installed = load_converted(out), kvconvert.load(out).eval()
    ids = _ids(40)
    a = remote.generate(input_ids=ids, max_new_tokens=8, do_sample=False, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    b = installed.generate(input_ids=ids, max_new_tokens=8, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("method", ALL)
@torch.no_grad()
def test_it_generates_in_every_mode(method, converted):
    """Greedy, sampling, beams, several return sequences, on a left-padded batch."""
    generate_in_every_mode(load_converted(converted(method, "compressing")[1]))


def _steady_lengths(report: dict[str, Any]) -> tuple[int, int]:
    """Two prefix lengths whose difference costs what the report promises at long context: past every
    transient (a window reaching its share, the unquantized residual), and with quantized storage an
    equal unquantized tail in both (whole key blocks between them)."""
    storage = report.get("kv_storage") or {}
    if storage.get("bits", 16) < 16:
        start = storage["residual"] + storage.get("sink", 0) + storage["group"]
        return start, start + 2 * storage["group"]
    return CONTEXT // 2, CONTEXT


@pytest.mark.parametrize("method", ALL)
@torch.no_grad()
def test_its_cache_holds_fewer_bytes(method, converted):
    """Measured on the cache objects (the bytes each token adds): below the source's, and no more than
    the report promised at long context, give or take 1 % of the source's cache (the positions some
    runtimes keep, 4 bytes a token; MiniCache promises the paper's retention and retains fewer tokens
    here). The tiny models are float32: a quantized cache's promise (against a 16-bit cache) is halved."""
    from kvconvert.eval.memory import kv_bytes_per_token

    src, out = converted(method, "compressing")
    report = json.loads((out / "kvconvert.json").read_text())
    short, long = _steady_lengths(report)
    ids = _ids(long, rows=1)
    measured = kv_bytes_per_token(load_converted(out), ids, short, long)
    measured /= kv_bytes_per_token(load_reference(src), ids, short, long)
    expected = report.get("kv_budget_expected_vs_16bit", report["kv_budget_expected"])
    if "kv_budget_expected_vs_16bit" in report:
        expected /= 2  # the source here caches float32
    assert measured < 0.95, f"{method}: the cache holds {measured:.3f} of the source's"
    assert measured <= expected + 0.01, f"{method}: measured {measured:.4f} > promised {expected:.4f}"


@pytest.mark.parametrize(("method", "kind", "options"), [
    ("lorc", "llama_gqa", ("--kv-budget", "0.75", "--schedule", "uniform", "--compress", "k")),
    ("lorc", "llama_gqa", ("--kv-budget", "0.5", "--schedule", "auto", "--latent", "joint", "--calib-tokens", "2048")),
    ("slim", "llama", ()),
])  # fmt: skip
@torch.no_grad()
def test_storage_of_unequal_sides_is_accounted_side_by_side(method, kind, options, tokenized_model_dir, tmp_path):
    """Keys factored and values kept, one joint latent held in the keys' store, or keys alone (slim), with 8-bit
    keys and 4-bit values (``--kv-value-bits``): the budget the report promises weighs each side's share by its
    own width and is what the cache holds per token. A uniform budget times the two widths' mean misstated it
    both ways (0.281 promised for 0.242 held by SmolLM2's keys at rank 0.5, 8 / 3 bits; too little for slim)."""
    from kvconvert.eval.memory import kv_bytes_per_token

    src = tokenized_model_dir(kind)
    storage = ("--kv-bits", "8", "--kv-value-bits", "4", "--kv-group", "16", "--kv-residual", "0")
    result = run_cli(method, "--model", str(src), "--out", str(tmp_path / "out"), *options, *storage, "--quiet")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "kvconvert.json").read_text())
    ids = _ids(96, rows=1)
    converted, reference = load_converted(tmp_path / "out"), load_reference(src)
    measured = kv_bytes_per_token(converted, ids, 32, 96) / kv_bytes_per_token(reference, ids, 32, 96)
    promised = report["kv_budget_expected_vs_16bit"] / 2  # the tiny source caches float32
    assert promised - 0.005 <= measured <= promised + 0.01, (measured, promised)  # (+ positions, a few bytes)
    uniform = report["kv_budget_expected"] * (10 + 6) / 32  # 8 + 32/16 and 4 + 32/16 bits a value
    assert abs(promised * 2 - uniform) > 0.02


def _comparable(value: Any) -> Any:
    """``value`` as plain data, tensors by their contents: what ``==`` can compare before and after."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.detach().float().flatten().tolist())
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return (type(value).__name__, _comparable(vars(value)))
    return value


@pytest.mark.parametrize("method", ALL)
def test_its_plan_is_decided_once_and_layers_convert_in_any_order(method, converted):
    """Everything is decided by ``plan`` and returned as the plan object: converting the layers (forwards,
    then backwards) changes neither the plan nor the method, and gives the same tensors and reports either
    way."""
    from kvconvert.io.source import open_source
    from kvconvert.pipeline import plan_conversion
    from kvconvert.recipe import load_recipe

    src, out = converted(method, "compressing")
    name, config, storage = load_recipe(out / "recipe.yaml")
    converter = build_method(name, config, storage)
    checkpoint, plan = plan_conversion(open_source(str(src)), converter, progress=False)
    decided = _comparable(plan), _comparable(vars(converter))

    def layer(i: int) -> Any:
        weights = checkpoint.adapter.read_attention(checkpoint.read_layer(i))
        result = converter.convert_layer(plan, i, weights, checkpoint.target)
        return _comparable({"tensors": result.tensors, "report": result.report, "passthrough": result.passthrough})

    layers = range(checkpoint.layout.num_layers)
    forwards = [layer(i) for i in layers]
    backwards = [layer(i) for i in reversed(layers)][::-1]
    assert forwards == backwards
    assert (_comparable(plan), _comparable(vars(converter))) == decided, "convert_layer changed a decision"


def _tensors(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.mark.parametrize("method", ALL)
def test_its_saved_recipe_reproduces_it(method, converted, tmp_path):
    """``kvconvert run OUT/recipe.yaml`` on the same source writes the same weights and the same plan."""
    src, out = converted(method, "compressing")
    result = run_cli("run", str(out / "recipe.yaml"), "--model", str(src), "--out", str(tmp_path / "again"), "--quiet")
    assert result.exit_code == 0, result.output
    assert _tensors(tmp_path / "again") == _tensors(out)
    first, again = (json.loads((d / "kvconvert.json").read_text()) for d in (out, tmp_path / "again"))
    for key in ("method", "params", "plan", "layers", "kv_budget_expected"):
        assert again.get(key) == first.get(key), key


@pytest.mark.parametrize("method", ALL)
def test_its_report_reads_back(method, converted):
    """The report names the method and its options; the method turns it into the command's last line,
    the model card's paragraph and (optionally) a table."""
    out = converted(method, "compressing")[1]
    report = json.loads((out / "kvconvert.json").read_text())
    cls = METHODS[method].method
    assert report["method"] == method
    fields = METHODS[method].config.__dataclass_fields__
    # every option, but for ones added later while they stay at their defaults (None, or lorc's --distill-steps 0 and
    # its chunk sizes): left out so that older outputs keep their bytes
    assert set(report["params"]) <= set(fields)
    config = METHODS[method].config(**{k: v for k, v in report["params"].items() if fields[k].init})
    assert all(getattr(config, name) == fields[name].default for name in set(fields) - set(report["params"]))
    assert cls.headline(report).startswith(method) and "KV budget" in cls.headline(report)
    assert cls.describe(report).strip()
    assert isinstance(cls.report_table(report), str)


@pytest.mark.parametrize("method", ALL)
@torch.no_grad()
def test_its_16bit_bytes_counted_on_a_float32_run_equal_a_bfloat16_run(method, converted):
    """A budget is quoted against a 16-bit cache: ``deployed_nbytes`` counts a float32 run's cache as the model
    loaded in bfloat16 would hold it, which holds only if every float32 state a runtime keeps in any dtype is
    declared (``_keep_in_fp32``). Both tables: MiniCache's lossless setting retains every token (at its default γ
    what it retains depends on the values, which bfloat16 changes)."""
    from kvconvert.eval.memory import deployed_nbytes
    from kvconvert.eval.runner import bytes_after_context, cache_after_context

    ids = _ids(CONTEXT, rows=1)
    for table in ("lossless", "compressing"):
        if method == "minicache" and table == "compressing":
            continue
        out = converted(method, table)[1]
        wide, half = kvconvert.load(out).eval(), kvconvert.load(out, dtype=torch.bfloat16).eval()
        counted = deployed_nbytes(cache_after_context(wide, ids, 64), wide)
        assert counted == bytes_after_context(half, ids, 64), table
        assert counted < bytes_after_context(wide, ids, 64), table  # something was float32 and counted at 16 bits


@pytest.mark.parametrize("method", ALL)
@pytest.mark.parametrize("chunk", [64, 191, None])
@torch.no_grad()
def test_its_bytes_measured_during_a_prefill_equal_a_second_pass(method, chunk, converted):
    """``ContextBytes`` measures a copy of the cache taken before the prefill's last chunk (one token, or many,
    or the whole context): the same bytes as ``bytes_after_context``'s own pass, and the prefill it rode along
    with computes what it computes without it."""
    from kvconvert.eval.quality import prefill
    from kvconvert.eval.runner import ContextBytes, bytes_after_context

    model = kvconvert.load(converted(method, "compressing")[1]).eval()
    ids = _ids(CONTEXT, rows=1)
    held = ContextBytes(model)
    logits = prefill(model, ids, chunk, held)[1]
    assert held.bytes == bytes_after_context(model, ids, chunk, as_16bit=True)
    torch.testing.assert_close(logits, prefill(model, ids, chunk)[1], rtol=0, atol=0)


@pytest.mark.parametrize("method", ALL)
@torch.no_grad()
def test_prompts_sharing_a_prefix_prefill_it_once_with_the_same_caches(method, converted):
    """``SharedPrefixes`` (how a model answers RULER-style samples that share their haystack's start): each
    prompt starts from a copy of an earlier one's cache at a chunk boundary, and gives the last logits and the
    cache (three decode steps through it) a prefill from scratch gives, bit for bit."""
    from kvconvert.eval.quality import prefill
    from kvconvert.eval.tasks import SharedPrefixes

    model = kvconvert.load(converted(method, "compressing")[1]).eval()
    trunk = _ids(CONTEXT, rows=1)[0].tolist()
    branch = _ids(CONTEXT, rows=3, seed=1).tolist()
    # with chunks of 32: the second starts from the first's cache at 96 tokens, the third and the fifth at 128 (of
    # 150 shared), the fourth shares nothing
    prompts = [trunk, trunk[:96] + branch[0], trunk[:150] + branch[1][:40], branch[2], trunk[:150] + branch[0][:20]]
    shared = SharedPrefixes(prompts, chunk=32)
    steps = torch.tensor([[5], [7], [11]])
    for j, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        caches, logits = zip(shared.prefill(model, ids, j), prefill(model, ids, 32), strict=True)
        torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
        for step in steps:
            out = [model(step[None], past_key_values=c, use_cache=True).logits for c in caches]
            torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)
    assert shared.prefilled == sum(map(len, prompts)) - 96 - 128 - 128
    assert not shared.kept  # nothing held once no prompt is left to start from it
