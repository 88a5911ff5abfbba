"""``kvconvert analyze``: numbers against direct computation, files a person can open."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from tests.helpers import run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_analyze_writes_json_and_plots(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_gqa")
    out = tmp_path / "analysis"
    result = run_cli("analyze", "--model", str(src), "--out", str(out))
    assert result.exit_code == 0, result.output
    for name in ("spectra.png", "condition.png", "ranks.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    analysis = json.loads((out / "analysis.json").read_text())
    assert analysis["kv_width"] == 2 * 16 and len(analysis["layers"]) == 3

    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for row in analysis["layers"]:
            wk = f.get_tensor(f"model.layers.{row['layer']}.self_attn.k_proj.weight").double()
            svals = torch.linalg.svdvals(wk)  # the full [n_kv·d, D] matrix (appendix D)
            assert row["kappa_k"] == pytest.approx(float(svals[0] / svals[-1]), rel=1e-9)
            assert row["singular_values_k"] == pytest.approx(svals.tolist(), rel=1e-9)
            tail = svals[round(0.5 * 32) :]
            assert row["rel_error_k"]["0.5"] == pytest.approx(float(tail.norm() / svals.norm()), rel=1e-9)
    logs = [math.log10(r["kappa_k"]) + math.log10(r["kappa_v"]) for r in analysis["layers"]]
    assert [r["log10_kappa_cum"] for r in analysis["layers"]] == pytest.approx([sum(logs[i:]) for i in range(3)])
    assert "progressive@0.9" in analysis["lorc_rank_plans"] and "uniform@0.5" in analysis["lorc_rank_plans"]
    assert "κ(W_K)" in result.output


def test_analyze_refuses_existing_out(tiny_model_dir, tmp_path, monkeypatch):
    """Before the analysis runs (with --heads or --allocation it takes minutes), not after."""
    import kvconvert.cli

    monkeypatch.setattr(kvconvert.cli.analyze, "_analysis", lambda *args: pytest.fail("analysed before refusing"))
    (tmp_path / "a").mkdir()
    result = run_cli("analyze", "--model", str(tiny_model_dir("llama")), "--out", str(tmp_path / "a"), "--heads")
    assert result.exit_code == 2 and "already exists" in result.stderr


@pytest.mark.slow
def test_analyze_heads_heat_map(tiny_model_dir, tmp_path):
    out = tmp_path / "analysis"
    result = run_cli("analyze", "--model", str(tiny_model_dir("llama_gqa")), "--out", str(out), "--heads",
                     "--profile-tokens", "16")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (out / "heads.png").read_bytes().startswith(PNG_MAGIC)
    heads = json.loads((out / "analysis.json").read_text())["heads"]
    assert len(heads["echo"]) == 3 and len(heads["echo"][0]) == 4  # layers × query heads
    assert all(0 <= x <= 1 for row in heads["induction"] for x in row)


def analyze_then_convert(src, tmp_path, allocation: list[str], command: list[str]):
    """``kvconvert analyze --allocation 0.6 ALLOCATION`` then the conversion ``COMMAND`` at the same budget
    (both on 2048 calibration tokens): (analyze's result, analysis.json, the conversion's output folder)."""
    out = tmp_path / "analysis"
    result = run_cli("analyze", "--model", str(src), "--out", str(out), "--allocation", "0.6", *allocation,
                     "--calib-tokens", "2048")  # fmt: skip
    assert result.exit_code == 0, result.output
    dst = tmp_path / command[0]
    converted = run_cli(command[0], "--model", str(src), "--out", str(dst), "--kv-budget", "0.6", *command[1:],
                        "--calib-tokens", "2048", "--quiet")  # fmt: skip
    assert converted.exit_code == 0, converted.output
    return result, json.loads((out / "analysis.json").read_text()), dst


@pytest.mark.slow
def test_analyze_draws_the_auto_allocation_lorc_writes(tokenized_model_dir, tmp_path):
    """--allocation: the ranks analyze reports are the ones `lorc --schedule auto` writes at that budget."""
    result, analysis, dst = analyze_then_convert(tokenized_model_dir("llama_gqa"), tmp_path, [],
                                                 ["lorc", "--schedule", "auto"])  # fmt: skip
    plan = analysis["lorc_auto"]["0.6"]
    assert (tmp_path / "analysis" / "ranks.png").read_bytes().startswith(PNG_MAGIC) and "budget 0.6" in result.output
    layers = json.loads((dst / "kvconvert.json").read_text())["layers"]
    assert plan["rank_k"] == [r["rank_k"] for r in layers] and plan["rank_v"] == [r["rank_v"] for r in layers]
    assert plan["probe_kl_k"] == pytest.approx([r["k_probe_kl"] for r in layers])


@pytest.mark.slow
def test_analyze_draws_the_joint_latent_lorc_writes(tokenized_model_dir, tmp_path):
    """--allocation-method lorc-joint: the one latent's rank per layer that analyze reports (and draws) is
    the one `lorc --schedule auto --latent joint` writes at that budget, with the same error weights."""
    result, analysis, dst = analyze_then_convert(tokenized_model_dir("llama_gqa"), tmp_path,
                                                 ["--allocation-method", "lorc-joint"],
                                                 ["lorc", "--schedule", "auto", "--latent", "joint"])  # fmt: skip
    assert "lorc_auto" not in analysis and "LoRC --latent joint" in result.output
    plan = analysis["lorc_joint"]["0.6"]
    written = json.loads((dst / "kvconvert.json").read_text())
    assert plan["rank_k"] == [r["rank_k"] for r in written["layers"]] == plan["rank_v"]
    scales = [c for layer in plan["joint_scales"] for c in layer]
    assert scales == pytest.approx([c for r in written["layers"] for c in r["kv_scales"]])
    assert (tmp_path / "analysis" / "ranks.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow
def test_analyze_draws_the_widths_zack_auto_writes(tokenized_model_dir, tmp_path):
    """--allocation-method zack: the widths per KV head analyze reports (and draws) are the ones
    `zack --schedule auto` writes at that budget, with the same probe KLs."""
    result, analysis, dst = analyze_then_convert(tokenized_model_dir("llama_gqa"), tmp_path,
                                                 ["--allocation-method", "zack"],
                                                 ["zack", "--schedule", "auto"])  # fmt: skip
    zack_png = tmp_path / "analysis" / "zack_allocation.png"
    assert "lorc_auto" not in analysis and zack_png.read_bytes().startswith(PNG_MAGIC)
    plan = analysis["zack_auto"]["0.6"]
    assert "ZACK --schedule auto" in result.output and "budget 0.6" in result.output
    written = json.loads((dst / "config.json").read_text())["kvconvert"]["zack_layers"]
    assert plan["rank_k"] == [layer["rank_k"] for layer in written]
    assert plan["rank_v"] == [layer["rank_v"] for layer in written]
    assert len(set(map(tuple, plan["rank_k"]))) > 1 or len(set(map(tuple, plan["rank_v"]))) > 1  # not uniform


def test_analyze_refuses_a_bad_allocation(tiny_model_dir, tmp_path):
    result = run_cli("analyze", "--model", str(tiny_model_dir("llama")), "--out", str(tmp_path / "a"),
                     "--allocation", "0.5,1.5")  # fmt: skip
    assert result.exit_code == 2 and "--allocation takes comma-separated budgets in (0, 1]" in result.stderr
    assert not (tmp_path / "a").exists()
