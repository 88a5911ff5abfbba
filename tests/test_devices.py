"""``--device``: where calibration, profiling and evaluation run the model. Every test runs on the CPU;
on a machine with a GPU the ``cuda`` cases run too and check a real move."""

from __future__ import annotations

import pytest
import torch

from kvconvert.arch import adapter_for
from kvconvert.calib.stats import collect_head_grams
from kvconvert.devices import compute_device, computing_on, resolve_device
from kvconvert.errors import KVConvertError
from kvconvert.io.source import open_source
from tests.conftest import build_tiny_model
from tests.helpers import run_cli

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    for bad in ("tpu", "gpu", "cuda:x"):
        with pytest.raises(KVConvertError, match="--device must be cpu, cuda, cuda:N or auto"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(KVConvertError, match="sees no CUDA GPU"):
            resolve_device("cuda")


def test_computing_on_is_scoped():
    assert compute_device() == torch.device("cpu")
    with computing_on(torch.device("meta")):
        assert compute_device() == torch.device("meta")
        with computing_on(torch.device("cpu")):
            assert compute_device() == torch.device("cpu")
        assert compute_device() == torch.device("meta")
    assert compute_device() == torch.device("cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_layer_by_layer_runs_every_layer_on_the_compute_device(tmp_path, device, monkeypatch):
    """Inside ``computing_on``, the sequential runner moves each decoder layer (and nothing bigger) to
    the device, the observers still see CPU tensors, and the statistics equal the CPU run's."""
    build_tiny_model("llama_gqa").save_pretrained(tmp_path)
    source = open_source(str(tmp_path))
    adapter = adapter_for(source.config)
    chunks = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    on_cpu = collect_head_grams(source, adapter, chunks, progress=False)
    moves: list[tuple[str, torch.device]] = []
    to = torch.nn.Module.to

    def spy(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (str, torch.device)):
            moves.append((type(self).__name__, torch.device(target)))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", spy)
    want = resolve_device(device)
    with computing_on(want):
        there = collect_head_grams(source, adapter, chunks, progress=False)
    layers = [d for name, d in moves if name.endswith("DecoderLayer") and d.type != "meta"]
    assert layers == [want] * source.config.num_hidden_layers
    assert all(d == want for name, d in moves if d.type != "meta")  # nothing went anywhere else
    for name in ("query", "key", "value"):
        a, b = getattr(there, name), getattr(on_cpu, name)
        assert a.device.type == "cpu" and torch.allclose(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max())), name


def test_conversion_and_analyze_refuse_a_missing_device(tokenized_model_dir, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    src = str(tokenized_model_dir("llama_gqa"))
    out = tmp_path / "z"
    result = run_cli("zack", "--model", src, "--out", str(out), "--removal-rate", "0.1", "--device", "cuda:0")
    assert result.exit_code == 2 and "--device cuda:0: this torch sees no CUDA GPU" in result.stderr
    assert not out.exists()
    result = run_cli("analyze", "--model", src, "--out", str(tmp_path / "a"), "--device", "npu")
    assert result.exit_code == 2 and "--device must be cpu, cuda, cuda:N or auto" in result.stderr


def test_conversion_runs_its_calibration_on_the_requested_device(tokenized_model_dir, tmp_path, monkeypatch):
    """``--device`` reaches the calibration of a conversion (ZACK's) through ``computing_on``."""
    import kvconvert.calib.sequential as sequential

    seen: list[torch.device] = []
    run = sequential.run_layer_by_layer

    def recording(*args, **kwargs):
        seen.append(compute_device())
        return run(*args, **kwargs)

    monkeypatch.setattr(sequential, "run_layer_by_layer", recording)
    result = run_cli("zack", "--model", str(tokenized_model_dir("llama_gqa")), "--out", str(tmp_path / "z"),
                     "--removal-rate", "0.1", "--calib-tokens", "1024", "--device", DEVICES[-1], "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert seen and all(d == resolve_device(DEVICES[-1]) for d in seen)


def test_lorc_refinement_fits_on_the_requested_device(tokenized_model_dir, tmp_path, monkeypatch):
    """``lorc --refine-steps`` takes its Adam steps where ``--device`` says (the captured activations
    are moved there), not on the CPU the observers see."""
    import kvconvert.methods.lorc.refine as refine

    seen: list[torch.device] = []
    fit = refine.refine_layer

    def recording(capture, *args, **kwargs):
        seen.append(capture.query.device)
        return fit(capture, *args, **kwargs)

    monkeypatch.setattr(refine, "refine_layer", recording)
    result = run_cli("lorc", "--model", str(tokenized_model_dir("llama_gqa")), "--out", str(tmp_path / "l"),
                     "--kv-budget", "0.6", "--schedule", "uniform", "--refine-steps", "3", "--calib-tokens", "1024",
                     "--device", DEVICES[-1], "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert seen and all(d.type == resolve_device(DEVICES[-1]).type for d in seen)
