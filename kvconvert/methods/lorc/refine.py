"""Layer-wise output refinement of truncated K/V projections (``lorc --refine-steps``, an extension).

The closed form (``linalg.weighted_truncation``) minimises the error of the keys and of the values,
each weighted by what reads it, but a layer's output reads keys through a softmax. Here each layer's
truncation, written as ``Π = A·B`` acting on the source's pre-RoPE keys and on its values
(``linalg.truncation_factors``), takes a few Adam steps on the error of the attention output after
W_O — softmax included — against the same layer uncompressed, on calibration activations: GPTQ-style
local reconstruction, no backward pass through the model, one layer's activations in memory. Layers
are fitted in order on the stream of the already refined layers (``run_layer_by_layer(repeat=…)``),
so each fits the inputs it will see. A fit that ends above the closed form's loss on the captured
chunks is retried at a smaller step, then dropped: refinement never worsens the calibration loss.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvconvert.calib.hooks import observed_attention
from kvconvert.calib.projection import flat_heads, normalise_keys, split_heads
from kvconvert.runtime.kvconvert_rope import apply_rotary

# side "k" / "v" -> (A [e, r], B [r, e]), Π = A·B; "kv" (a latent shared by both): on [k; v], e = 2·Hkv·dk
Factors = dict[str, tuple[torch.Tensor, torch.Tensor]]
# What to fit at a layer: (factors, offsets {side: bias [e] or zeros}, W_O [D, H·dk]); None: leave it
Job = tuple[Factors, dict[str, torch.Tensor], torch.Tensor]

STEP_SIZE = 1e-2  # Adam's step as a share of each factor's RMS entry (factors differ in scale by 1e3)
BATCH = 2  # chunks per step


@dataclass
class Capture:
    """One layer's attention inputs on the calibration chunks (float32)."""

    query: torch.Tensor  # [n, H, T, dk] after RoPE
    key: torch.Tensor  # [n, Hkv, T, dk] before RoPE (and before the QK-norm, if the model has one)
    value: torch.Tensor  # [n, Hkv, T, dk]
    cos: torch.Tensor | None  # [1, T, r] rotary tables; None: no RoPE
    sin: torch.Tensor | None
    scaling: float
    norm: tuple[torch.Tensor, float] | None = None  # the QK-norm on keys: (weight, eps)


def project(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor], offset: torch.Tensor) -> torch.Tensor:
    """``Π·(x − b) + b`` per token on the concatenated heads of ``x [n, Hkv, T, dk]``, ``Π = A·B``: what a
    truncated projection with its bias b kept computes from the source's ``x = Wx + b``."""
    a, b = factors
    flat = flat_heads(x) - offset  # [n, T, Hkv·dk]
    return split_heads(flat @ b.T @ a.T + offset, x.shape[1])


def attend(capture: Capture, key: torch.Tensor, value: torch.Tensor, rows: Any = slice(None)) -> torch.Tensor:
    """Causal attention of ``capture``'s queries (chunks ``rows``) over pre-RoPE ``key`` and ``value``:
    ``[n, T, H·dk]``, the input of W_O."""
    query = capture.query[rows]
    if capture.norm is not None:  # as the model (and the checkpoint) normalise keys: after the projection
        key = split_heads(normalise_keys(flat_heads(key), *capture.norm), key.shape[1])
    if capture.cos is not None and capture.sin is not None:
        key = apply_rotary(key, capture.cos, capture.sin)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=capture.scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])  # fmt: skip
    n, heads, t, dk = out.shape
    return out.transpose(1, 2).reshape(n, t, heads * dk)


def refine_layer(capture: Capture, job: Job, steps: int, seed: int = 0) -> tuple[Factors, dict[str, float]]:
    """Adam on ``job``'s factors to minimise ``‖(Ô − O)·W_Oᵀ‖² / ‖O·W_Oᵀ‖²`` over the captured chunks
    (O: attention with the source's keys and values, Ô: with the truncated ones), with a cosine-decayed
    step; a run that ends above the closed form is retried once at a quarter of the step. Returns the
    factors to keep (float64) and the loss before and after on every captured chunk (``fit_by_adam``)."""
    factors, offsets, o_weight = job
    device = capture.query.device
    o_weight = o_weight.to(device, torch.float32)
    offset = {side: offsets[side].to(device, torch.float32) for side in factors}
    n = capture.query.shape[0]
    with torch.no_grad():
        target = attend(capture, capture.key, capture.value) @ o_weight.T  # [n, T, D]
        norm = target.pow(2).sum(dim=(1, 2))  # [n]

    def loss(params: dict[str, torch.Tensor], rows: Any) -> torch.Tensor:
        key, value = capture.key[rows], capture.value[rows]
        if "kv.a" in params:  # one latent for both: Π on the stacked [k; v]
            both = project(torch.cat([key, value], dim=1), (params["kv.a"], params["kv.b"]), offset["kv"])
            key, value = both[:, : key.shape[1]], both[:, key.shape[1] :]
        if "k.a" in params:
            key = project(key, (params["k.a"], params["k.b"]), offset["k"])
        if "v.a" in params:
            value = project(value, (params["v.a"], params["v.b"]), offset["v"])
        error = attend(capture, key, value, rows) @ o_weight.T - target[rows]
        return error.pow(2).sum() / norm[rows].sum()

    initial = {f"{side}.{part}": f for side, pair in factors.items() for part, f in zip("ab", pair, strict=True)}
    fitted, log = fit_by_adam(initial, loss, n, steps, seed)
    return {side: (fitted[f"{side}.a"], fitted[f"{side}.b"]) for side in factors}, log


def fit_by_adam(
    initial: dict[str, torch.Tensor], loss: Callable[[dict[str, torch.Tensor], Any], torch.Tensor], n: int,
    steps: int, seed: int = 0, step_size: float = STEP_SIZE, progress: str | None = None, batch: int = BATCH,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:  # fmt: skip
    """Adam on the tensors ``initial`` (float64 or float32, any device: fitted in float32 on the compute device)
    to minimise ``loss(params, rows)`` over ``n`` captured chunks (``rows``: a batch of chunk indices, or every
    chunk), ``batch`` chunks per step, each tensor's step ``step_size`` × its RMS entry, cosine-decayed. A run
    that ends above the start's loss on every chunk is retried once at a quarter of the step, then dropped:
    the result never has a higher loss than the start. Returns the tensors to keep (float64, CPU; the
    start's own when dropped) and the loss before and after on every chunk. ``progress``: a bar over the steps,
    with this title."""
    from kvconvert.devices import compute_device

    device = compute_device()
    start = {name: t.to(device, torch.float32) for name, t in initial.items()}

    def fit(step_size: float) -> tuple[dict[str, torch.Tensor], float]:
        params = {name: t.clone().requires_grad_(True) for name, t in start.items()}
        groups = [{"params": [p], "lr": step_size * float(p.detach().pow(2).mean().sqrt())} for p in params.values()]
        optimizer = torch.optim.Adam(groups)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
        generator = torch.Generator().manual_seed(seed)
        bar = tqdm(range(steps), desc=progress, unit="step", disable=progress is None, file=sys.stderr)
        with torch.enable_grad():  # the layer-by-layer pass runs under no_grad
            for _ in bar:
                rows = torch.randperm(n, generator=generator)[: min(batch, n)].to(device)
                optimizer.zero_grad(set_to_none=True)
                loss(params, rows).backward()
                optimizer.step()
                schedule.step()
        with torch.no_grad():
            return params, float(loss(params, slice(None)))

    with torch.no_grad():
        before = float(loss(start, slice(None)))
    if before <= 1e-10:  # exact already (full rank): Adam's normalised steps would only add noise
        return dict(initial), {"loss_before": before, "loss_after": before}
    params, after = fit(step_size)
    if not after < before:
        params, after = fit(step_size / 4)
    if not after < before:
        return dict(initial), {"loss_before": before, "loss_after": before}
    return {name: p.detach().double().cpu() for name, p in params.items()}, {"loss_before": before,
                                                                              "loss_after": after}  # fmt: skip


def refine_layers(
    source: Any, adapter: Any, chunks: torch.Tensor, job_for: Callable[[int], Job | None],
    rotary_module: str | None, steps: int, progress: bool = True,
) -> tuple[dict[int, Factors], dict[int, dict[str, float]]]:  # fmt: skip
    """Refine every layer ``job_for`` gives a job, in order, over ``chunks [n, T]`` (one unpadded
    sequence per row): each layer runs once to capture its attention inputs, is fitted against its own
    uncompressed attention on those inputs, then runs again with the fitted truncation so the next
    layer sees the compressed stream. (Fitting to the source stream's outputs instead, so that later
    layers make up for earlier ones' drift, measured no better on SmolLM2: +74.3 % vs +73.8 % at 0.5.)
    Returns the factors and the losses (plus seconds) per refined layer."""
    from kvconvert.calib.projection import key_projections, project_kv, rotary_tables
    from kvconvert.calib.sequential import run_layer_by_layer
    from kvconvert.devices import compute_device

    fitted: dict[int, Factors] = {}
    log: dict[int, dict[str, float]] = {}
    seen: dict[int, list[tuple[Any, ...]]] = {}  # layer -> (query, key, value, scaling, key norm) per chunk
    applying: list[int | None] = [None]
    model_box: list[Any] = []
    normed_box: list[Any] = []  # ``key_projections``' lookup: QK-norm models' keys before the norm
    jobs: dict[int, Job | None] = {}
    affines: dict[int, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}  # for the second run

    def observer(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: Any) -> Any:
        layer = int(module.layer_idx)
        if applying[0] != layer:  # the first run: capture what the layer attends with
            if layer not in jobs:
                jobs[layer] = job_for(layer)
            if jobs[layer] is not None:
                normed = normed_box[0](module)
                norm = None
                if normed is not None:  # fit on the key projection's output: the norm comes after the truncation
                    key, norm = split_heads(normed[0], key.shape[1]), normed[1:]
                seen.setdefault(layer, []).append((query.float(), key.float(), value.float(), scaling, norm))
            return None
        # the second run: attend with the fitted truncation (float32, as it was fitted)
        return query, *project_kv(model_box[0], rotary_module, layer, key, value, affines[layer],
                                  normed_box[0](module))  # fmt: skip

    def captured(layer: int) -> Capture:
        rows = seen.pop(layer)
        keys, norm = torch.cat([r[1] for r in rows]), rows[0][4]
        cos, sin = rotary_tables(model_box[0], rotary_module, keys)
        if cos is not None and sin is not None and norm is None:
            keys = apply_rotary(keys, cos, -sin)  # back to the pre-RoPE keys the truncation acts on
        device, scaling = compute_device(), rows[0][3]
        return Capture(
            query=torch.cat([r[0] for r in rows]).to(device), key=keys.to(device),
            value=torch.cat([r[2] for r in rows]).to(device),
            cos=None if cos is None else cos.to(device), sin=None if sin is None else sin.to(device),
            scaling=float(scaling) if scaling is not None else rows[0][0].shape[-1] ** -0.5,
            norm=None if norm is None else (norm[0].to(device), norm[1]),
        )  # fmt: skip

    def repeat(layer: int) -> bool:
        job = jobs.pop(layer, None)  # the fitted layer's W_O is not kept: one layer's worth in memory
        if job is None:
            return False
        started = time.perf_counter()
        fitted[layer], log[layer] = refine_layer(captured(layer), job, steps, seed=layer)
        log[layer]["seconds"] = time.perf_counter() - started
        affines[layer] = {(layer, side): _affine(pair, job[1][side]) for side, pair in fitted[layer].items()}
        applying[0] = layer
        return True

    @contextlib.contextmanager
    def observe(model: Any) -> Iterator[None]:
        model_box.append(model)
        with key_projections(model) as normed, observed_attention(model, observer):
            normed_box.append(normed)
            yield

    run_layer_by_layer(source, adapter, chunks, observe, progress=progress, repeat=repeat)
    return fitted, log


def _affine(factors: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Π, c)`` float32 for ``calib.projection.project_kv``: ``Π·x + c = Π·(x − b) + b`` with ``Π = A·B``."""
    projector = (factors[0] @ factors[1]).float()
    return projector, bias.float() - projector @ bias.float()


@dataclass
class MlaJob:
    """What ``refine_mla_layers`` fits at one layer: the closed form's ``mla.mla_parts`` (the start) and what
    ``mla.mla_forward`` holds fixed: ``kv_a_layernorm``'s weight and epsilon, W_O, the shared RoPE key's
    frequencies and the softmax scale."""

    parts: dict[str, torch.Tensor]
    norm_weight: torch.Tensor
    o_weight: torch.Tensor
    frequencies: torch.Tensor
    scaling: float
    norm_eps: float

    def forward(self, parts: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        from kvconvert.methods.lorc.mla import mla_forward

        fixed = (self.norm_weight.to(x), self.o_weight.to(x))
        return mla_forward(parts, *fixed, x, self.frequencies, self.scaling, self.norm_eps)


def refine_mla_layers(
    source: Any, adapter: Any, chunks: torch.Tensor, job_for: Callable[[int], MlaJob], steps: int,
    progress: bool = True,
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, dict[str, float]]]:  # fmt: skip
    """``lorc --latent mla --refine-steps``: each layer's DeepSeek-V3 attention (``job_for(layer)``, the closed
    form) fitted like ``refine_layers`` fits a truncation — Adam on ``‖Ô − O‖² / ‖O‖²``, O the source layer's
    attention output (after W_O) and Ô the MLA layer's, on the same inputs, layer by layer on the stream of
    the refined layers before it — but over every tensor the format lets differ from the closed form: the
    queries (both parts), the latent's projection, the shared RoPE key, and ``kv_b_proj`` per query head (the
    closed form repeats it across a GQA group; the format stores it per head, so untying costs no cache), with
    ``kv_a_layernorm`` in the loop. ``chunks [n, T]``: unpadded sequences, positions from 0. Returns the refined
    ``mla_parts`` (float32) of the layers whose loss fell, and every layer's losses and seconds."""
    from kvconvert.calib.hooks import attention_io
    from kvconvert.calib.sequential import run_layer_by_layer

    fitted: dict[int, dict[str, torch.Tensor]] = {}
    log: dict[int, dict[str, float]] = {}
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # layer -> (input, output) per chunk
    applying: list[tuple[int, MlaJob, dict[str, torch.Tensor]] | None] = [None]

    def hook(layer: int, hidden: torch.Tensor, output: torch.Tensor) -> torch.Tensor | None:
        if applying[0] is not None and applying[0][0] == layer:  # the second run: the fitted layer's output
            job, parts = applying[0][1], applying[0][2]
            return job.forward({k: v.to(hidden.device) for k, v in parts.items()}, hidden.float())
        seen.setdefault(layer, []).append((hidden.detach().float(), output.detach().float()))
        return None

    def repeat(layer: int) -> bool:
        started = time.perf_counter()
        job = job_for(layer)
        rows = seen.pop(layer)
        inputs, target = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        norm = target.pow(2).sum(dim=(1, 2))

        def loss(parts: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
            x = inputs[batch]
            return (job.forward(parts, x) - target[batch]).pow(2).sum() / norm[batch].sum()

        parts, log[layer] = fit_by_adam(job.parts, loss, int(inputs.shape[0]), steps, seed=layer)
        parts = {name: t.float() for name, t in parts.items()}
        if log[layer]["loss_after"] < log[layer]["loss_before"]:
            fitted[layer] = parts
        # the closed form puts it at mla.LATENT_MEAN_SQUARE: far below 1, the norm is still linear (engines that pad
        # the latent, as vLLM's CPU kernel needs, then compute the same model)
        latent = inputs @ parts["latent_down"].to(inputs).T
        log[layer]["latent_mean_square_over_eps"] = float(latent.pow(2).mean()) / job.norm_eps
        log[layer]["seconds"] = time.perf_counter() - started
        applying[0] = (layer, job, parts)
        return True

    @contextlib.contextmanager
    def observe(model: Any) -> Iterator[None]:
        with attention_io(model, adapter.attention_module_paths(), hook):
            yield

    run_layer_by_layer(source, adapter, chunks, observe, progress=progress, repeat=repeat)
    return fitted, log
