"""Whole-model distillation of a DeepSeek-V3 export (``lorc --latent mla --distill-steps``, an extension).

``--refine-steps`` fits each layer's attention output on its own; what is left after it is not reachable one layer
at a time (docs/lorc.md: the layers' own losses keep falling while the model's KL barely moves). Here the export
itself, as stock transformers builds it (``DeepseekV3ForCausalLM``), takes Adam steps on the KL divergence from the
source's next-token distribution over calibration chunks, backpropagated through every layer. Only the attention's
projections move: each layer's ``q_proj``, ``kv_a_proj_with_mqa`` (the latent's and the RoPE key's projections),
``kv_b_proj`` and ``o_proj`` (W_O reads what the latent gives back: fitting it too measured +50.4 % instead of
+51.3 % on SmolLM2 at 0.5 after 120 steps, docs/lorc.md); embeddings, norms and MLPs stay the source's. Each weight is
fitted as ``diag(s)·X`` with ``s`` its rows' RMS held fixed, so that Adam's steps are relative to each row:
``kv_a_proj_with_mqa`` stacks the latent's rows, scaled into ``kv_a_layernorm``'s linear range (~1e-3 of the
others), with the RoPE key's. Unlike the layer-wise passes this loads the source and the export whole.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# the export's tensors the distillation fits (per decoder layer, under ``self_attn``)
FITTED = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
STEP_SIZE = 1e-3  # Adam's step per row, as a share of the row's RMS (the layer-wise fits take 1e-2: one layer moves)


def distill_export(
    directory: Path, source_path: Path, chunks: torch.Tensor, steps: int, seed: int = 0, progress: bool = True
) -> dict[str, Any]:
    """Fit the DeepSeek-V3 checkpoint in ``directory`` (its weight files rewritten in place) to the source model at
    ``source_path`` on ``chunks [n, T]`` (token ids, one unpadded sequence per row) for ``steps`` Adam steps of one
    chunk each. Kept only if the mean KL over every chunk fell (``refine.fit_by_adam``). Returns the
    report: steps, chunks, KL before and after (nats per token), the latent's largest mean square over
    ``kv_a_layernorm``'s epsilon, seconds."""
    from torch.func import functional_call
    from transformers import AutoModelForCausalLM

    from kvconvert.devices import compute_device
    from kvconvert.methods.lorc.refine import fit_by_adam

    started = time.perf_counter()
    device = compute_device()
    # safetensors only: nothing of a checkpoint is unpickled; the export is stock DeepSeek-V3 (no remote code)
    teacher: Any = AutoModelForCausalLM.from_pretrained(source_path, dtype="auto", use_safetensors=True)
    student: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, use_safetensors=True)
    teacher, student = teacher.to(device).eval(), student.to(device).eval()
    weights = dict(student.named_parameters())
    names = [n for n in weights if n.endswith(".weight") and n.split(".")[-2] in FITTED and ".self_attn." in n]
    for parameter in student.parameters():
        parameter.requires_grad_(False)
    # rows of zeros (none in practice) keep a scale of 1: their steps are then absolute, as Adam's are
    scales = {n: _row_rms(weights[n].detach()) for n in names}
    ids = chunks.to(device)

    def kl(fitted: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """Mean KL(source ‖ export) per token over the chunks ``rows``."""
        with torch.no_grad():
            target = F.log_softmax(teacher(ids[rows]).logits.float(), dim=-1)
        tensors = {n: fitted[n] * scales[n] for n in names}
        logits = functional_call(student, tensors, (ids[rows],)).logits.float()
        return (target.exp() * (target - F.log_softmax(logits, dim=-1))).sum(-1).mean()

    def loss(fitted: dict[str, torch.Tensor], rows: Any) -> torch.Tensor:
        if isinstance(rows, slice):  # every chunk (before and after): one at a time, no graph is kept
            return torch.stack([kl(fitted, torch.tensor([i], device=device)) for i in range(ids.shape[0])]).mean()
        return kl(fitted, rows)

    initial = {n: weights[n].detach() / scales[n] for n in names}
    fitted, log = fit_by_adam(initial, loss, int(ids.shape[0]), steps, seed, step_size=STEP_SIZE,
                              progress="distilling" if progress else None, batch=1)  # fmt: skip
    tensors = {n: (fitted[n].to(device, torch.float32) * scales[n]).cpu() for n in names}
    latent = _latent_mean_square_over_eps(student, tensors, ids[:1])
    if log["loss_after"] < log["loss_before"]:
        _rewrite_weights(directory, tensors)
    return {"steps": steps, "chunks": int(ids.shape[0]), "chunk_len": int(ids.shape[1]),
            "kl_before": log["loss_before"], "kl_after": log["loss_after"],
            "kept": log["loss_after"] < log["loss_before"], "latent_mean_square_over_eps": latent,
            "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip


def _row_rms(weight: torch.Tensor) -> torch.Tensor:
    rms = weight.float().pow(2).mean(dim=1, keepdim=True).sqrt()
    return torch.where(rms > 0, rms, torch.ones_like(rms))


def _latent_mean_square_over_eps(student: Any, tensors: dict[str, torch.Tensor], ids: torch.Tensor) -> float:
    """The largest mean square, over layers, of what ``kv_a_layernorm`` normalises on ``ids`` with the fitted
    ``tensors``, in units of its epsilon: far below 1 the norm is still linear, so a latent zero-padded for an
    engine (vLLM's CPU kernel takes one width) is still the same model."""
    from torch.func import functional_call

    squares: list[float] = []
    handles = [m.register_forward_pre_hook(lambda m, args: squares.append(float(args[0].float().pow(2).mean())
                                                                              / m.variance_epsilon))
               for name, m in student.named_modules() if name.endswith("kv_a_layernorm")]  # fmt: skip
    try:
        with torch.no_grad():
            functional_call(student, {n: t.to(ids.device) for n, t in tensors.items()}, (ids,))
    finally:
        for handle in handles:
            handle.remove()
    return max(squares) if squares else 0.0


def _rewrite_weights(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace ``tensors`` (same names and shapes; cast to the stored dtypes) in the safetensors files of
    ``directory``: each file holding one of them is rewritten whole and renamed over the old one."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]  # fmt: skip
    for file in files:
        path = directory / file
        with safe_open(str(path), "pt") as reader:
            if not any(name in tensors for name in reader.keys()):  # noqa: SIM118 (a safetensors reader)
                continue
            metadata = reader.metadata()
            data = {name: reader.get_tensor(name) for name in reader.keys()}  # noqa: SIM118
        for name in data.keys() & tensors.keys():
            data[name] = tensors[name].to(data[name].dtype)
        partial = path.with_name(path.name + ".partial")
        save_file({name: t.contiguous() for name, t in data.items()}, str(partial), metadata=metadata)
        os.replace(partial, path)
