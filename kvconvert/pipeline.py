"""load → method.convert_layer per layer → write, streaming, into an atomic output directory."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import kvconvert
from kvconvert.arch import adapter_for
from kvconvert.errors import KVConvertError
from kvconvert.io.model_card import write_model_card
from kvconvert.io.outdir import atomic_output_dir, refuse_existing
from kvconvert.io.source import TOKENIZER_FILES, SourceCheckpoint, StoredTensor
from kvconvert.io.writer import FLOAT_NAMES, ShardedSafetensorsWriter
from kvconvert.methods.base import Method, PlanContext
from kvconvert.recipe import recipe_text
from kvconvert.runtime.kvconvert_codec import QuantSpec
from kvconvert.runtime.kvconvert_spec import RuntimeSpec, minimum_spec_version

RUNTIME_DIR = Path(__file__).parent / "runtime"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def header_reserve(source: SourceCheckpoint, max_shard_bytes: int) -> int:
    """Bytes to reserve for each output shard's safetensors header, so the data is written once (see
    ``ShardedSafetensorsWriter``). An entry is its name plus ≈ 90 bytes (dtype, shape, offsets); methods
    rename and add tensors, hence 1.5× the source's entries; a shard holds about its share of them
    (twice that: --dtype float16 halves the bytes per tensor). Too small only costs the old copy."""
    whole = sum(len(name) + 96 for name in source.tensor_names()) * 3 // 2 + 1024
    model_bytes = max(1, sum(path.stat().st_size for path in source.weight_files))
    return int(whole * min(1.0, 2 * max_shard_bytes / model_bytes)) + 1024


@contextlib.contextmanager
def _source_digests(source: SourceCheckpoint) -> Iterator[Future[dict[str, str]]]:
    """``source.sha256()`` on a background thread: it reads the whole source once more, so it runs
    while the conversion does; a conversion that fails abandons it within one 16 MiB block."""
    stop = threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="kvconvert-sha256") as pool:
        try:
            yield pool.submit(source.sha256, stop)
        finally:
            stop.set()


class _BackgroundWrites:
    """The writer's work on one background thread, in order, one job at a time: a layer is written
    (and untouched source tensors copied) while the next one is converted. ``submit`` first waits for
    the job before, so memory holds at most the layer being written and the one being computed, and a
    failed write surfaces at the next submit or on leaving the block."""

    def __init__(self, writer: ShardedSafetensorsWriter):
        self._writer = writer
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvconvert-write")
        self._pending: Future[None] | None = None

    def submit(self, items: list[tuple[str, torch.Tensor | StoredTensor]]) -> None:
        self.wait()
        if items:
            self._pending = self._pool.submit(self._write, list(items))

    def _write(self, items: list[tuple[str, torch.Tensor | StoredTensor]]) -> None:
        for name, item in items:
            if isinstance(item, StoredTensor):
                self._writer.add_file_range(name, *item)
            else:
                self._writer.add(name, item)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self) -> _BackgroundWrites:
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            if exc_info[0] is None:
                self.wait()
        finally:
            self._pool.shutdown(wait=True)  # never leave a write running into a directory being removed


@dataclass
class ConversionResult:
    out: Path
    report: dict[str, Any]
    plan: Any = None  # what the method decided (its frozen plan object)


def _source_dtype(source: SourceCheckpoint, names: list[str]) -> torch.dtype:
    for name in names:
        tensor = source.get(name)
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def storage_report(storage: QuantSpec) -> dict[str, int] | None:
    """``kv_quant`` of the runtime spec and ``kv_storage`` of kvconvert.json; None (nothing written)
    at 16 bits, so an unquantized conversion is byte-identical to one made before quantized storage."""
    return storage.to_spec() if storage.quantized else None


def storage_factor(
    storage: QuantSpec, layout: Any, tokens: int | None = None, compressed: float | Sequence[tuple[float, float]] = 1.0
) -> float:  # fmt: skip
    """The bytes a converted cache holds ÷ a 16-bit stock cache's: accounted bytes per stored value ÷ 2 for every
    layer's keys and values (local layers stay 16-bit unless included), the global layers' times ``compressed``
    (the method's own budget: local layers keep a stock window with every method that supports them), or per
    layer (keys' share, values' share) where a method's sides differ (``Method.side_budgets``).

    Each layer weighs the tokens it holds, in both caches alike: at ``tokens`` a sliding-window layer holds at
    most its window. Without ``tokens``, the long-context limit (the sink's and the newest unquantized tokens'
    share vanishes, and so do the bounded windows beside the global layers that grow with the context): what
    the cache adds per token once it is longer than its windows."""
    window = layout.sliding_window if layout.local_layers else None
    factors, weights = [], []
    for layer in range(layout.num_layers):
        local = layer in layout.local_layers
        if not local:
            held = 1.0
        elif tokens is None:
            held = 0.0 if window else 1.0
        else:
            held = float(min(tokens, window or tokens)) / tokens
        for keys in (True, False):
            stock = local and not storage.include_local
            side = (storage.for_local() if local else storage).side(layer, keys)
            factor = 1.0 if stock else side.bytes_per_value(layout.head_dim, per_channel=keys) / 2
            share = compressed if isinstance(compressed, float | int) else compressed[layer][0 if keys else 1]
            factors.append(held * factor * (1.0 if local else share))
            weights.append(held)
    return sum(factors) / sum(weights)


def report_lengths(layout: Any) -> list[int]:
    """Where a report quotes the budget of a model with sliding-window layers (a budget that depends on the
    length): 4K and 16K tokens, and the model's own context."""
    return sorted({n for n in (4096, 16384) if n < layout.context} | {layout.context})


@dataclass
class _Checkpoint:
    """Where a source's attention tensors are, per layer, and what the conversion writes them as."""

    source: SourceCheckpoint
    adapter: Any
    layout: Any
    attention: dict[int, dict[str, str]]  # layer -> local name -> checkpoint name
    prefixes: dict[int, str]
    passthrough: list[str]
    target: torch.dtype

    def read_layer(self, layer: int) -> dict[str, torch.Tensor]:
        return {k: self.source.get(v) for k, v in self.attention[layer].items()}


def _open(source: SourceCheckpoint, method: Method, dtype: str) -> _Checkpoint:
    """Check that ``method`` applies to ``source`` and index its attention tensors."""
    adapter = adapter_for(source.config)
    layout = adapter.layout()
    method.check_features(layout)
    method.check_storage(layout)
    method.check(layout)
    source.check()  # config against weights, float dtypes, no NaN/inf: before any method computes on them
    if dtype != "auto" and dtype not in DTYPES:
        raise KVConvertError(f"--dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    attention: dict[int, dict[str, str]] = {}
    prefixes: dict[int, str] = {}
    passthrough: list[str] = []
    for name in source.tensor_names():
        match = adapter.match_attention_tensor(name)
        if match is None:
            passthrough.append(name)
        else:
            attention.setdefault(match.layer, {})[match.local] = name
            prefixes[match.layer] = match.prefix
    target = (
        DTYPES[dtype] if dtype != "auto" else _source_dtype(source, [n for m in attention.values() for n in m.values()])
    )
    return _Checkpoint(source, adapter, layout, attention, prefixes, passthrough, target)


def plan_conversion(
    source: SourceCheckpoint, method: Method[Any], dtype: str = "auto", progress: bool = True
) -> tuple[_Checkpoint, Any]:
    """Run ``method``'s whole-model decisions (``method.plan``: spectra, calibration, rank search)
    on ``source`` without writing anything: (the indexed checkpoint, the method's plan); ``kvconvert
    analyze`` draws them."""
    checkpoint = _open(source, method, dtype)
    adapter, layout = checkpoint.adapter, checkpoint.layout
    layers = (adapter.read_attention(checkpoint.read_layer(layer)) for layer in range(layout.num_layers))
    return checkpoint, method.plan(PlanContext(layout, layers, source, checkpoint.target, progress))


def convert(
    source: SourceCheckpoint,
    method: Method,
    out: Path,
    *,
    dtype: str = "auto",
    replace: bool = False,
    max_shard_bytes: int = 5 * 1000**3,
    progress: bool = True,
) -> ConversionResult:
    """Convert ``source`` with ``method`` into ``out`` (written atomically).

    Peak memory: one layer's attention tensors plus the largest single non-attention tensor.
    """
    refuse_existing(out, replace)  # before calibration, which can take minutes
    checkpoint, plan = plan_conversion(source, method, dtype, progress)
    adapter, layout, target = checkpoint.adapter, checkpoint.layout, checkpoint.target
    passthrough, prefixes, read_layer = checkpoint.passthrough, checkpoint.prefixes, checkpoint.read_layer

    with atomic_output_dir(out, replace, sources=[source.path]) as tmp, _source_digests(source) as digests:
        header_bytes = header_reserve(source, max_shard_bytes)
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes=max_shard_bytes, header_bytes=header_bytes)
        with _BackgroundWrites(writer) as writes:
            # tensors the method does not touch, in order (then those an export copies under another name): byte
            # ranges batched into one job, each loaded (dtype-converted) tensor closing a batch so that at most one
            # of them waits in memory
            batch: list[tuple[str, torch.Tensor | StoredTensor]] = []
            copies = [(name, name) for name in passthrough] + list(method.added_tensors(plan).items())
            for out_name, name in copies:
                stored = source.stored(name)
                if stored is not None and (dtype == "auto" or stored.dtype not in FLOAT_NAMES):
                    batch.append((out_name, stored))  # unchanged bytes: a kernel copy, never loaded
                    continue
                tensor = source.get(name)
                batch.append(
                    (out_name, tensor.to(target) if tensor.is_floating_point() and dtype != "auto" else tensor)
                )
                writes.submit(batch)
                batch = []
                del tensor
                source.release()
            writes.submit(batch)

            reports: list[dict[str, Any]] = []
            tensor_names: list[list[str]] = []  # per layer; the tensors themselves are already on disk
            layers = tqdm(range(layout.num_layers), desc=method.name, unit="layer", disable=not progress,
                          file=sys.stderr)  # fmt: skip
            for layer in layers:
                local = read_layer(layer)
                result = method.convert_layer(plan, layer, adapter.read_attention(local), target)
                produced = {**local, **result.tensors} if result.passthrough else result.tensors
                items: list[tuple[str, torch.Tensor | StoredTensor]] = []
                for local_name in sorted(produced):
                    tensor = produced[local_name]
                    if result.passthrough and local_name in local and tensor.is_floating_point() and dtype != "auto":
                        tensor = tensor.to(target)
                    items.append((prefixes[layer] + local_name, tensor))
                writes.submit(items)  # written while the next layer is converted
                reports.append(result.report)
                tensor_names.append(sorted(produced))
                del local, result, produced, items
                source.release()
        method.finish(plan, reports)
        weight_files = writer.close()

        planned_storage = method.planned_storage(plan)
        storage = storage_report(planned_storage)
        # an engine export may be another architecture (lorc --latent mla: DeepSeek-V3); the runtime builds that one
        engine = method.engine_config(plan)
        base_model_type = engine.get("model_type", source.config.model_type)
        base_architecture = (engine.get("architectures") or [adapter.causal_lm_class_name()])[0]
        extra = method.runtime_spec(plan, layout, tensor_names)
        spec = RuntimeSpec(
            method=method.name,
            version=kvconvert.__version__,
            base_model_type=base_model_type,
            base_architecture=base_architecture,
            attention_modules=adapter.attention_module_paths(),
            rotary_module=layout.rotary_module if layout.rotary else None,
            num_heads=layout.num_heads,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            hidden_size=layout.hidden_size,
            scaling=list(layout.scaling),
            kv_quant=storage,
            spec_version=minimum_spec_version(storage, extra),
            local_layers=list(layout.local_layers) or None,
            sliding_window=layout.sliding_window if layout.local_layers else None,
            extra=extra,
        ).to_dict()
        config = source.config.to_dict()
        config.update(
            model_type="kvconvert",
            architectures=["KVConvertForCausalLM"],
            auto_map={
                "AutoConfig": "modeling_kvconvert.KVConvertConfig",
                "AutoModelForCausalLM": "modeling_kvconvert.KVConvertForCausalLM",
            },
            kvconvert=spec,
            dtype=str(target).removeprefix("torch."),
        )
        if engine:
            # engines (and transformers without remote code) load the architecture the export names (the source's,
            # or the one it was rewritten into), and trust_remote_code=True still reaches kvconvert's runtime (auto_map)
            config.update({"model_type": base_model_type, "architectures": [base_architecture], **engine})
        config.pop("torch_dtype", None)
        config.pop("transformers_version", None)  # keeps output byte-identical across installs
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

        for runtime_file in sorted(RUNTIME_DIR.glob("*.py")):
            if runtime_file.name != "__init__.py":
                shutil.copyfile(runtime_file, tmp / runtime_file.name)
        for name in TOKENIZER_FILES:
            if (source.path / name).exists():
                shutil.copyfile(source.path / name, tmp / name)
        refit = method.refit(plan, tmp, source, progress)  # the whole model as it will be loaded

        report = {
            "method": method.name,
            "params": method.params(),
            "tool_version": kvconvert.__version__,
            "source": {
                "model": source.model_id,
                "revision": source.revision,
                "sha256": digests.result(),
            },
            "dtype": str(target).removeprefix("torch."),
            "kv_budget_expected": method.expected_kv_budget(plan, layout),
            "weight_files": weight_files,
            "layers": reports,
        }
        if summary := method.summary(plan):
            report["plan"] = summary
        if refit:
            report["refit"] = refit
        compressed = method.side_budgets(plan, layout) or method.expected_kv_budget(plan, layout)
        if storage is not None:
            report["kv_storage"] = storage
            # what the user asked for: the method's budget with the storage on top, against a 16-bit cache
            report["kv_budget_expected_vs_16bit"] = storage_factor(planned_storage, layout, compressed=compressed)
        if layout.local_layers and layout.sliding_window:
            # the windows' share shrinks as the context grows: the long-context figure alone would flatter a
            # model whose global layers are few (Gemma 3: 1 in 6)
            report["kv_budget_at_tokens"] = {
                str(n): storage_factor(planned_storage, layout, n, compressed) for n in report_lengths(layout)
            }
        (tmp / "kvconvert.json").write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "recipe.yaml").write_text(recipe_text(method))  # `kvconvert run` repeats the conversion
        write_model_card(tmp, report, name=out.name)
    return ConversionResult(out=out, report=report, plan=plan)
