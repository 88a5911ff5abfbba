"""``kvconvert eval``: quality, KV memory, speed and long-context retrieval of a model vs its source."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvconvert.devices import resolve_device
from kvconvert.errors import KVConvertError
from kvconvert.eval.data import load_text
from kvconvert.eval.memory import cache_nbytes, deployed_nbytes, kv_bytes_growth
from kvconvert.eval.quality import evaluate_quality, prefill
from kvconvert.eval.retrieval import copy_accuracy, ordinary_token_ids, passkey_accuracy
from kvconvert.eval.speed import measure_speed, side_by_side, timed_packed
from kvconvert.io.source import read_json


@dataclass(frozen=True)
class EvalConfig:
    data: str
    ctx: int = 1024
    max_tokens: int | None = None
    chunk: int | None = None  # feed each window through the cache this many tokens at a time
    # context-compression protocol: ``context`` tokens into the cache in one forward, the next
    # ``continuation`` scored in one forward through it (windows of context + continuation tokens)
    context: int | None = None
    continuation: int | None = None
    speed_context: int = 512
    # decode speed side by side with the reference after each of these contexts (random tokens; any length)
    speed_contexts: tuple[int, ...] | None = None
    new_tokens: int = 32
    retrieval_lengths: tuple[int, ...] | None = None  # None: 256, 512, … up to min(context, 2048)
    retrieval: bool = True
    speed: bool = True
    progress: bool = True
    # speed and retrieval of the reference too (off when a caller already has them, e.g. benchmarks)
    reference_extras: bool = True
    device: str = "cpu"  # cpu | cuda | cuda:N | auto: where both models run (``resolve_device``)


def load_model(path: str, dtype: torch.dtype | None = None, device: torch.device | None = None) -> Any:
    """kvconvert checkpoints load through the installed runtime, so no code from the directory is
    executed; plain checkpoints load as stock transformers models. ``dtype``: override the checkpoint's;
    ``device``: move the model there (default: where it loads, the CPU)."""
    model = _load_model(path, dtype)
    return model if device is None else model.to(device)


def _load_model(path: str, dtype: torch.dtype | None) -> Any:
    import transformers

    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.exists():
        raise KVConvertError(f"{path} has no config.json; eval takes a local model directory")
    config = read_json(config_file, "model config")
    if config.get("model_type") == "kvconvert" or "kvconvert" in config:  # engine exports keep their model_type
        import kvconvert
        from kvconvert.runtime.kvconvert_spec import SpecError

        try:
            return kvconvert.load(directory, **({} if dtype is None else {"dtype": dtype})).eval()
        except SpecError as exc:
            raise KVConvertError(f"{path}: {exc}") from None
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, trust_remote_code=False, **({} if dtype is None else {"dtype": dtype})
    ).eval()


def load_for_eval(path: str, device: torch.device | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of a local directory, the model on ``device``."""
    import transformers

    directory = Path(path)
    model = load_model(path, device=device)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, config=model.config, trust_remote_code=False)
    except (OSError, ValueError):
        raise KVConvertError(f"{path} has no tokenizer files; eval needs them to tokenize --data") from None
    return model.eval(), tokenizer


def model_context(model: Any) -> int:
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(model.config, name, None)
        if value:
            return int(value)
    return 2048


def default_retrieval_lengths(context: int) -> tuple[int, ...]:
    """256, 512, … up to min(context, 2048); just the context for models shorter than 256."""
    lengths, n = [], 256
    while n <= min(context, 2048):
        lengths.append(n)
        n *= 2
    return tuple(lengths) or (context,)


@torch.no_grad()
def cache_after_context(model: Any, ids: torch.Tensor, chunk: int | None = None, past: Any = None) -> Any:
    """The cache once ``ids [1, n]`` went in (after ``past``, a cache, if given): all but the last token in one
    forward (or ``chunk`` tokens at a time), the last as one decode step. (transformers' sliding-window layers keep
    a view of a whole prefill until their next update; the decode step releases it, so every cache is measured in
    its steady state.)"""
    if ids.shape[1] > 1:
        past = prefill(model, ids[:, :-1], chunk, past=past)[0]
    return model(ids[:, -1:], past_key_values=past, use_cache=True).past_key_values


def bytes_after_context(model: Any, ids: torch.Tensor, chunk: int | None = None, as_16bit: bool = False) -> int:
    """Bytes the cache holds once ``ids [1, n]`` went in (``cache_after_context``); ``as_16bit``: as deployed in
    16 bits (``deployed_nbytes``)."""
    cache = cache_after_context(model, ids, chunk)
    return deployed_nbytes(cache, model) if as_16bit else cache_nbytes(cache)


class ContextBytes:
    """``bytes_after_context(model, window[:, :context], chunk, as_16bit=True)`` taken during the prefill that
    scores the same window (``evaluate_quality(context_bytes=)``), not by a second pass over its context: just
    before the prefill's last chunk, the cache is copied and the copy takes the rest of the context as
    ``cache_after_context`` feeds it (the chunks before are the same forwards), then is measured and dropped. At 8K
    tokens on 2 cores the second pass cost 36 s of each planner candidate's 74. The copy raises that window's peak
    memory by a cache: used where no peak is reported (``kvconvert plan``). ``bytes``: the first window's."""

    def __init__(self, model: Any):
        self.model = model
        self.bytes: int | None = None

    @torch.no_grad()
    def __call__(self, cache: Any, last: torch.Tensor) -> None:
        """``cache`` (None before a first chunk) holds the context but ``last [1, t]``, its last chunk."""
        if self.bytes is not None:
            return
        fork = cache_after_context(self.model, last, past=copy.deepcopy(cache))  # the last chunk: one forward
        self.bytes = deployed_nbytes(fork, self.model)


def measure_kv(model: Any, ids: torch.Tensor, config: EvalConfig, ctx: int) -> tuple[float, float, dict[str, Any]]:
    """(KV bytes per token, the same as deployed in 16 bits, how it was measured) on the evaluation text
    ``ids [n]``: with the context protocol, bytes held after the context ÷ its tokens; otherwise the cache's growth
    per token between two prompt lengths (fixed overheads cancel)."""
    if config.context is not None:
        sample = ids[None, : config.context]
        state, tokens = cache_after_context(model, sample, config.chunk), sample.shape[1]
        return cache_nbytes(state) / tokens, deployed_nbytes(state, model) / tokens, {"kv_measured_after": tokens}
    long = min(ctx, ids.numel(), 512)
    short = max(1, long // 4)
    per_token, deployed = kv_bytes_growth(model, ids[None, :long], short, long)
    return per_token, deployed, {"kv_measured_between": [short, long]}


def bytes_16bit(model: Any, ids: torch.Tensor, config: EvalConfig, ctx: int) -> float:
    """KV bytes per token of ``model`` as deployed in 16 bits (``measure_kv``, ``deployed_nbytes``): quantized
    storage is quoted against a 16-bit cache, every float part of either cache (a method's 16-bit storage, a
    quantized cache's exact recent tokens) at what it would really cost, its float16 scales and deliberate float32
    norms as they are."""
    return measure_kv(model, ids, config, ctx)[1]


def run_eval(model_path: str, reference_path: str | None, config: EvalConfig) -> dict[str, Any]:
    start = time.perf_counter()
    protocol = config.context is not None
    if protocol != (config.continuation is not None):
        raise KVConvertError("--context and --continuation go together")
    device = resolve_device(config.device)
    text = load_text(config.data)  # checked before any model is loaded
    model, tokenizer = load_for_eval(model_path, device)
    context = model_context(model)
    ctx = min(config.ctx, context)
    if protocol:
        assert config.context is not None and config.continuation is not None
        ctx = config.context + config.continuation
        if ctx > context:
            raise KVConvertError(f"--context + --continuation = {ctx} exceeds the model's context of {context}")
    _check_lengths(config, context)
    reference = load_for_eval(reference_path, device)[0] if reference_path else None
    if reference is not None and vocabulary_size(reference) != vocabulary_size(model):
        raise KVConvertError(
            f"--reference {reference_path} predicts {vocabulary_size(reference)} tokens but --model predicts "
            f"{vocabulary_size(model)}: KL and agreement need the same vocabulary; give the model's source"
        )
    ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, device=device)
    if config.max_tokens:
        ids = ids[: config.max_tokens]
    if ids.numel() < 2:
        raise KVConvertError(f"--data {config.data!r} has fewer than 2 tokens")
    if protocol and ids.numel() < ctx:
        raise KVConvertError(f"--data {config.data!r} has {ids.numel()} tokens, fewer than one window of {ctx}")

    quality = evaluate_quality(
        model, ids, ctx, reference, progress=config.progress, chunk=config.chunk, context=config.context
    )
    result: dict[str, Any] = {
        "model": model_path,
        "reference": reference_path,
        "device": str(device),
        "data": config.data,
        "ctx": ctx,
        "window": (
            f"{config.context} context tokens in the cache, {config.continuation} scored through it"
            + ("" if config.chunk is None else f" ({config.chunk} tokens per prefill forward)")
            if protocol
            else "non-overlapping"
            if config.chunk is None
            else f"non-overlapping, fed in chunks of {config.chunk}"
        ),
        "tokens": quality.tokens,
        "ppl": quality.ppl,
    }
    if reference is not None:
        result.update(
            reference_ppl=quality.reference_ppl, kl_mean=quality.kl_mean, top1_agreement=quality.top1_agreement
        )
    for name, costs in quality.costs.items():  # the context protocol: what a long prompt costs to take in
        prefix = "" if name == "model" else "reference_"
        result[f"{prefix}prefill_seconds_per_window"] = costs.prefill_seconds / costs.windows
        result[f"{prefix}prefill_tokens_per_s"] = costs.prefill_tokens / costs.prefill_seconds
        result[f"{prefix}peak_memory_bytes"] = costs.peak_bytes

    result["kv_bytes_per_token"], deployed, how = measure_kv(model, ids, config, ctx)
    result.update(how)
    if reference is not None:
        result["reference_kv_bytes_per_token"], reference_deployed, _ = measure_kv(reference, ids, config, ctx)
        result["kv_budget_measured"] = result["kv_bytes_per_token"] / result["reference_kv_bytes_per_token"]
        result["kv_budget_vs_16bit"] = deployed / reference_deployed  # both as deployed in 16 bits

    if config.speed:
        speed_context = min(config.speed_context, context - config.new_tokens - 1)
        result["speed_context"] = speed_context
        result.update(measure_speed(model, speed_context, config.new_tokens))
        if reference is not None and config.reference_extras:
            with timed_packed(reference):  # the source at its fastest (its decode heads packed per KV head)
                ref_speed = measure_speed(reference, speed_context, config.new_tokens)
            result.update({f"reference_{k}": v for k, v in ref_speed.items()})
            result["decode_speed_ratio"] = result["decode_tokens_per_s"] / ref_speed["decode_tokens_per_s"]
    if config.speed_contexts:
        models = {"model": model} if reference is None else {"model": model, "reference": reference}
        result["speed_at"] = []
        for length in config.speed_contexts:
            with timed_packed(reference):
                measured = side_by_side(models, length, config.new_tokens)
            row = {"context": length, **measured["model"]}
            if reference is not None:
                row["reference_decode_tokens_per_s"] = measured["reference"]["decode_tokens_per_s"]
                row["reference_cache_bytes"] = measured["reference"]["cache_bytes"]
                row["decode_speed_ratio"] = row["decode_tokens_per_s"] / row["reference_decode_tokens_per_s"]
            result["speed_at"].append(row)

    if config.retrieval:
        lengths = config.retrieval_lengths or default_retrieval_lengths(context)
        vocab = ordinary_token_ids(tokenizer, model.config.vocab_size)
        for name, m in (("", model), ("reference_", reference if config.reference_extras else None)):
            if m is None:
                continue
            result[f"{name}passkey"] = {str(n): passkey_accuracy(m, tokenizer, n) for n in lengths}
            result[f"{name}copy"] = {str(n): copy_accuracy(m, n, vocab) for n in lengths}
    warning = _meaningless_context_warning(model_path, result)
    if warning:
        result["warning"] = warning
    result["seconds"] = time.perf_counter() - start
    return result


def vocabulary_size(model: Any) -> int:
    """Width of the model's logits (its output embedding's rows; the config's vocab_size without one)."""
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


def _check_lengths(config: EvalConfig, context: int) -> None:
    """Speed and retrieval lengths must fit the model's positions, as --context must."""
    for length in config.speed_contexts or ():
        if length + config.new_tokens > context:
            raise KVConvertError(f"--speed-contexts {length} + {config.new_tokens} decoded tokens exceeds the "
                                 f"model's context of {context}")  # fmt: skip
    for length in config.retrieval_lengths or ():
        if length > context:
            raise KVConvertError(f"--retrieval-lengths {length} exceeds the model's context of {context}")


def _meaningless_context_warning(model_path: str, result: dict[str, Any]) -> str | None:
    """A warning when the cache held everything although the method compresses: the evaluation
    context is too short for what it measures (e.g. razor's window is wider than --ctx)."""
    report_file = Path(model_path) / "kvconvert.json"
    measured = result.get("kv_budget_measured")
    if measured is None or not report_file.exists():
        return None
    report = read_json(report_file, "conversion report")
    expected = report.get("kv_budget_expected")
    if not isinstance(expected, (int, float)) or expected > 0.95 or measured < 0.99:
        return None
    window = (report.get("plan") or {}).get("window") or report.get("params", {}).get("window")
    hint = f" ({report['method']} keeps the newest {window} tokens)" if window else ""
    return (
        f"the cache kept every token at this context (measured budget {measured:.3f}, the method expects "
        f"{expected:.3f} at long context){hint}: evaluate with a longer --ctx or --context"
    )


def _megabytes(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f}"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def format_table(result: dict[str, Any]) -> str:
    """Two-column human-readable summary (model vs reference)."""
    has_ref = result.get("reference") is not None
    rows: list[tuple[str, str, str]] = [
        ("perplexity", f"{result['ppl']:.3f}", f"{result['reference_ppl']:.3f}" if has_ref else ""),
        ("KV bytes/token", f"{result['kv_bytes_per_token']:.0f}",
         f"{result['reference_kv_bytes_per_token']:.0f}" if has_ref else ""),
    ]  # fmt: skip
    if "prefill_seconds_per_window" in result:
        ref_prefill = result.get("reference_prefill_seconds_per_window")
        rows.append(("context prefill s", f"{result['prefill_seconds_per_window']:.2f}",
                     "" if ref_prefill is None else f"{ref_prefill:.2f}"))  # fmt: skip
        rows.append(("peak memory MB", _megabytes(result["peak_memory_bytes"]),
                     _megabytes(result.get("reference_peak_memory_bytes")) if has_ref else ""))  # fmt: skip
    if "decode_tokens_per_s" in result:
        rows.append(("prefill tok/s", f"{result['prefill_tokens_per_s']:.1f}",
                     f"{result['reference_prefill_tokens_per_s']:.1f}" if has_ref else ""))  # fmt: skip
        rows.append(("decode tok/s", f"{result['decode_tokens_per_s']:.1f}",
                     f"{result['reference_decode_tokens_per_s']:.1f}" if has_ref else ""))  # fmt: skip
    for row in result.get("speed_at", []):
        rows.append((f"decode tok/s @{row['context']}", f"{row['decode_tokens_per_s']:.1f}",
                     f"{row['reference_decode_tokens_per_s']:.1f}" if has_ref else ""))  # fmt: skip
    for key, label in (("passkey", "passkey"), ("copy", "copy acc.")):
        for length, value in result.get(key, {}).items():
            ref = result.get(f"reference_{key}", {}).get(length)
            rows.append(
                (
                    f"{label} @{length}",
                    _fmt(value),
                    "" if length not in result.get(f"reference_{key}", {}) else _fmt(ref),
                )
            )
    lines = [f"{'':<18} {'model':>12} {'reference':>12}"]
    lines += [f"{a:<18} {b:>12} {c:>12}" for a, b, c in rows]
    if has_ref:
        lines.append(
            f"KL(ref‖model) {result['kl_mean']:.3g} nats/token · top-1 agreement {result['top1_agreement']:.4f} · "
            f"measured KV budget {result['kv_budget_measured']:.3f} "
            f"({result['kv_budget_vs_16bit']:.3f} of a 16-bit cache)"
        )
    retrieval = [v for key in ("passkey", "copy", "reference_passkey", "reference_copy")
                 for v in result.get(key, {}).values()]  # fmt: skip
    if retrieval and max(retrieval) == 0:
        lines.append("note: passkey and copy score 0 everywhere: this model cannot retrieve at these lengths even "
                     "uncompressed (tiny models cannot), so the tests show no loss here; they matter on models that "
                     "score above 0 uncompressed")  # fmt: skip
    if result.get("warning"):
        lines.append(f"warning: {result['warning']}")
    lines.append(f"{result['tokens']} tokens scored; windows of {result['ctx']}: {result['window']} · "
                 f"{result['seconds']:.1f} s")  # fmt: skip
    return "\n".join(lines)


@dataclass(frozen=True)
class TaskEvalConfig:
    """``kvconvert eval --tasks``: RULER-style tasks (``kvconvert.eval.tasks``) at each length."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int = 15
    seed: int = 0
    allow_extrapolation: bool = False
    device: str = "auto"
    progress: bool = True
    chunk: int = 512  # prompt tokens per prefill forward: memory stays bounded at any length

    @classmethod
    def parse(cls, tasks: str, lengths: str, samples: int, seed: int, allow_extrapolation: bool, device: str,
              progress: bool) -> TaskEvalConfig:  # fmt: skip
        from kvconvert.eval.tasks import parse_task_names

        names = parse_task_names(tasks)
        try:
            sizes = tuple(int(n) for n in lengths.split(","))
        except ValueError:
            raise KVConvertError(f"--lengths must be comma-separated integers, got {lengths!r}") from None
        if min(sizes) < 64 or samples < 1:
            raise KVConvertError(f"--lengths must be at least 64 tokens and --samples at least 1, got {lengths!r}, "
                                 f"{samples}")  # fmt: skip
        return cls(names, sizes, samples, seed, allow_extrapolation, device, progress)


def run_task_eval(model_path: str, reference_path: str | None, config: TaskEvalConfig) -> dict[str, Any]:
    """Accuracy per task and length of the model and (same samples) its reference; peak prompt lengths
    are checked against the model's positions first."""
    from kvconvert.eval.tasks import run_tasks

    start = time.perf_counter()
    device = resolve_device(config.device)
    model, tokenizer = load_for_eval(model_path, device)
    limit = model_context(model)
    if max(config.lengths) > limit and not config.allow_extrapolation:
        raise KVConvertError(f"--lengths {max(config.lengths)} exceeds the model's {limit} positions "
                             "(max_position_embeddings); --allow-extrapolation runs it anyway")  # fmt: skip
    models = {"model": model}
    if reference_path:
        models["reference"] = load_for_eval(reference_path, device)[0]
    result = run_tasks(models, tokenizer, config.tasks, config.lengths, config.samples, config.seed, config.chunk,
                       config.progress)  # fmt: skip
    result.update(model=model_path, reference=reference_path, device=str(device),
                  seconds=round(time.perf_counter() - start, 1))  # fmt: skip
    return result


def format_task_table(result: dict[str, Any]) -> str:
    """Accuracy per task (rows) and length (columns), the reference's beside the model's."""
    names = [n for n in ("model", "reference") if n in result["accuracy"]]
    header = ["task"] + [f"{n} {length}" for length in result["lengths"] for n in names]
    rows = [[task] + [f"{result['accuracy'][n][task][str(length)]:.1f}" for length in result["lengths"] for n in names]
            for task in result["tasks"]]  # fmt: skip
    rows.append(["average"] + [f"{result['average'][n][str(length)]:.1f}" for length in result["lengths"]
                               for n in names])  # fmt: skip
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)) for row in [header, *rows]]
    note = f"{result['samples']} samples per task and length (seed {result['seed']}), accuracy in %"
    return "\n".join(lines) + "\n" + note
