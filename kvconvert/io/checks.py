"""Checks of a source checkpoint against itself, before any method computes on it.

A config that does not match its weights (``num_key_value_heads`` against ``k_proj``, a truncated
tensor), integer weights where the model has floats (a quantized export), and NaN or inf anywhere
would otherwise surface as a shape error deep inside a method, a ``LinAlgError``, or, worse, a
checkpoint written with NaN decisions. Each is one ``KVConvertError`` line naming the tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvconvert.errors import KVConvertError

if TYPE_CHECKING:
    from kvconvert.io.source import SourceCheckpoint

_SAFETENSORS_FLOATS = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_BLOCK = 1 << 26  # bytes read per step of the finiteness scan: bounded memory whatever the tensor's size


def expected_shapes(config: Any) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], str]:
    """(shape, dtype) of every parameter and buffer transformers' own model of ``config`` has, built on
    the meta device (no memory, no weights): the independent statement of what the config implies; and
    that model's base prefix (``model``, ``transformer``…), which some checkpoints leave out of names."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # transformers raises many types for a config it cannot build
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise KVConvertError(f"transformers cannot build a model from this config.json: {reason}") from None
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    return shapes, str(getattr(model, "base_model_prefix", "model"))


def check_shapes(source: SourceCheckpoint) -> None:
    """Every checkpoint tensor the model of its config also has must have the model's shape, and
    floating-point parameters must be stored as floats. Names the model does not have (tied heads,
    old buffers, renamed MoE experts) are left to the loader: they are not a mismatch of sizes."""
    expected, prefix = expected_shapes(source.config)
    for name in source.tensor_names():
        match = next((expected[n] for n in (name, f"{prefix}.{name}") if n in expected), None)
        if match is None:
            continue
        shape, dtype = match
        stored, stored_dtype = source.header(name)
        if tuple(stored) != shape:
            raise KVConvertError(
                f"{source.path}: tensor {name!r} has shape {list(stored)} but the config implies {list(shape)} "
                "(does config.json belong to these weights?)"
            )
        if dtype.is_floating_point and stored_dtype not in _SAFETENSORS_FLOATS:
            raise KVConvertError(
                f"{source.path}: tensor {name!r} is stored as {stored_dtype}, not floating point; kvconvert "
                "converts float checkpoints (dequantize a quantized export first)"
            )


def nonfinite_count(source: SourceCheckpoint, name: str) -> int:
    """NaN and ±inf values in tensor ``name``, read in bounded blocks straight from its file (no whole
    tensor in memory, no mapping whose pages would count as resident)."""
    stored = source.stored(name)
    if stored is None:  # pickled: the tensor is already a (memory-mapped) torch tensor
        tensor = source.get(name)
        return int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0
    dtype = _SAFETENSORS_FLOATS.get(stored.dtype)
    if dtype is None:
        return 0
    block = _BLOCK - _BLOCK % dtype.itemsize
    count = 0
    buffer = bytearray(min(block, stored.nbytes))  # zero-filled on allocation: never more than the tensor
    with open(stored.path, "rb") as f:
        f.seek(stored.start)
        left = stored.nbytes
        while left > 0:
            view = memoryview(buffer)[: min(block, left)]
            got = f.readinto(view)
            if got != len(view):
                raise KVConvertError(f"{stored.path}: tensor {name!r} is truncated (short read)")
            count += _nonfinite(torch.frombuffer(view, dtype=dtype))
            left -= got
    return count


def _nonfinite(values: torch.Tensor) -> int:
    """NaN and ±inf among ``values``. A sum is finite exactly when no term is NaN or inf, barring an
    overflow of the sum itself, and it runs at memory speed where ``isfinite`` is 15-40× slower here;
    so only a block whose sum is not finite is counted element by element (which an overflow passes)."""
    if values.dtype.itemsize == 1:  # float8: no native sum
        values = values.float()
    if bool(values.sum().isfinite()):
        return 0
    return int(values.numel() - torch.isfinite(values).sum())


def check_finite(source: SourceCheckpoint) -> None:
    """Refuse a checkpoint holding NaN or ±inf in any floating-point tensor: no method's decisions
    (κ, SVDs, head scores, rotations) mean anything on them, and copied through they make a model that
    generates garbage."""
    for name in source.tensor_names():
        bad = nonfinite_count(source, name)
        if bad:
            raise KVConvertError(
                f"{source.path}: tensor {name!r} holds {bad} NaN or infinite value(s); kvconvert converts only "
                "finite weights"
            )


def check_layers(source: SourceCheckpoint) -> None:
    """Attention weights for exactly the layers the config has (a checkpoint cut short, or a config
    from a deeper model)."""
    from kvconvert.arch import adapter_for

    adapter = adapter_for(source.config)
    layers = sorted(adapter.attention_names_by_layer(source.tensor_names()))
    expected = adapter.layout().num_layers
    if layers != list(range(expected)):
        raise KVConvertError(
            f"checkpoint has attention weights for layers {layers} but config says {expected} layers; is the "
            "checkpoint complete?"
        )


def check_not_quantized(source: SourceCheckpoint) -> None:
    """A quantized export (GPTQ, AWQ, bitsandbytes, compressed-tensors…) stores packed integers under other
    names (``qweight``, ``scales``): nothing a method could factor or fold."""
    quantization = getattr(source.config, "quantization_config", None)
    if quantization:
        method = (
            quantization.get("quant_method", "?") if isinstance(quantization, dict) else type(quantization).__name__
        )
        raise KVConvertError(
            f"{source.path} is a quantized checkpoint (quantization_config: {method}); kvconvert converts float "
            "checkpoints: use the unquantized model or dequantize it first"
        )


def check_source(source: SourceCheckpoint) -> None:
    """Not a quantized export; layers, shapes and dtypes against the config; then finiteness (the full
    read) last."""
    check_not_quantized(source)
    check_layers(source)
    check_shapes(source)
    check_finite(source)
