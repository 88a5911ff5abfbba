"""Nothing lost, nothing silent (#36): each defect found by trying kvconvert as a new user would, and a
corpus of malformed inputs fed to every command (exit 2, one line, nothing outside a fresh --out touched)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvconvert.errors import KVConvertError
from tests.test_errors import assert_user_error, run

ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "slim": (),
    "lorc": ("--kv-budget", "0.5"),
    "zack": ("--kv-budget", "0.5"),
    "razor": (),
    "minicache": (),
    "quant": ("--kv-bits", "4"),
}


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and modification time: what "untouched" means."""
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if "__pycache__" not in p.parts
    }


def edited_copy(src: Path, dst: Path, *, config: dict | None = None, tensors=None) -> Path:
    """A copy of a tiny model with its config keys replaced and/or its tensors edited in place."""
    shutil.copytree(src, dst)
    if config:
        data = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**data, **config}))
    if tensors is not None:
        state = load_file(dst / "model.safetensors")
        tensors(state)
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _set(name: str, make):
    def edit(state):
        state[name] = make(state[name])

    return edit


K0 = "model.layers.0.self_attn.k_proj.weight"


def _with_value(value: float):
    def make(t):
        t = t.clone()
        t[0, 0] = value
        return t

    return make


# name -> how a tiny llama becomes that malformed source
BAD_MODELS = {
    "nan_in_k": dict(tensors=_set(K0, _with_value(float("nan")))),
    "inf_in_mlp": dict(tensors=_set("model.layers.1.mlp.up_proj.weight", _with_value(float("inf")))),
    "kv_heads_mismatch": dict(config={"num_key_value_heads": 2}),
    "truncated_k": dict(tensors=_set(K0, lambda t: t[:48].contiguous())),
    "int8_k": dict(tensors=_set(K0, lambda t: (t * 100).to(torch.int8))),
    "layers_mismatch": dict(config={"num_hidden_layers": 5}),
    "gptq_export": dict(
        config={"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}},
        tensors=lambda s: s.update({K0.replace(".weight", ".qweight"): s.pop(K0).to(torch.int32)}),
    ),
}


@pytest.fixture(scope="module")
def bad_models(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    return {name: edited_copy(tiny_model_dir("llama"), root / name, **edit) for name, edit in BAD_MODELS.items()}


# -------------------------------------------------------------------------- data lost


@pytest.mark.parametrize("command", ["slim", "analyze", "plan"])
def test_force_never_replaces_a_directory_kvconvert_did_not_write(command, tiny_model_dir, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("years of work")
    before = snapshot(tmp_path)
    result = run(command, "--model", str(tiny_model_dir("llama")), "--out", str(mine), "--force")
    assert_user_error(result, "was not written by kvconvert", "--force replaces only")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("added", ["notes.txt", "plots/loss.png", "link", "README.md"])
def test_force_keeps_what_a_user_added_to_an_output(added, tiny_model_dir, tmp_path):
    """A directory kvconvert wrote, with a file the user put there since: replacing the output would delete it, so
    ``--force`` refuses, naming it. What kvconvert itself adds later (an ``eval --json`` result, bytecode caches) is
    replaced with the output."""
    model, out = str(tiny_model_dir("llama")), tmp_path / "out"
    assert run("slim", "--model", model, "--out", str(out), "--quiet").exit_code == 0
    (out / "eval.json").write_text(json.dumps({"ppl": 1.0, "kv_bytes_per_token": 2, "tokens": 3, "ctx": 4}))
    (out / "__pycache__").mkdir()
    (out / "__pycache__" / "x.pyc").write_bytes(b"\0")
    path = out / added
    path.parent.mkdir(exist_ok=True)
    card = (out / "README.md").read_text()
    if added == "link":
        (tmp_path / "elsewhere.txt").write_text("mine")
        path.symlink_to(tmp_path / "elsewhere.txt")
    else:  # README.md: the model card kvconvert wrote, edited
        path.write_text("mine")
    before = snapshot(tmp_path)
    result = run("quant", "--model", model, "--out", str(out), "--kv-bits", "4", "--force")
    assert_user_error(result, "holds files kvconvert did not write", added, "--force replaces only")
    assert snapshot(tmp_path) == before
    path.write_text(card) if added == "README.md" else path.unlink()  # the card as kvconvert wrote it goes too
    result = run("quant", "--model", model, "--out", str(out), "--kv-bits", "4", "--force", "--quiet")
    assert result.exit_code == 0, result.output
    assert not (out / "eval.json").exists() and json.loads((out / "kvconvert.json").read_text())["method"] == "quant"


def test_force_never_replaces_a_file_or_the_current_directory(tiny_model_dir, tmp_path, monkeypatch):
    model = str(tiny_model_dir("llama"))
    (tmp_path / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    assert_user_error(run("slim", "--model", model, "--out", str(tmp_path / "notes.txt"), "--force"), "is a file")
    monkeypatch.chdir(tmp_path)
    assert_user_error(run("slim", "--model", model, "--out", ".", "--force"), "current directory")
    assert snapshot(tmp_path) == before


def test_force_replaces_outputs_of_older_versions_too(tiny_model_dir, tmp_path):
    """Outputs written before the marker existed are recognised by their report file."""
    out = tmp_path / "old"
    assert run("slim", "--model", str(tiny_model_dir("llama")), "--out", str(out), "--quiet").exit_code == 0
    marker = json.loads((out / ".kvconvert-output.json").read_text())
    assert marker["tool"] == "kvconvert" and "model.safetensors" in marker["files"]
    (out / ".kvconvert-output.json").unlink()
    result = run("quant", "--model", str(tiny_model_dir("llama")), "--out", str(out), "--kv-bits", "4", "--force")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "kvconvert.json").read_text())["method"] == "quant"


def test_batch_refuses_two_jobs_writing_one_output(tiny_model_dir, tmp_path):
    jobs = tmp_path / "jobs.yaml"
    model = tiny_model_dir("llama")
    jobs.write_text(f"jobs:\n  - {{model: {model}, out: o, method: slim}}\n"
                    f"  - {{model: {model}, out: ./o, method: quant, options: {{kv_bits: 4}}}}\n")  # fmt: skip
    assert_user_error(run("batch", str(jobs)), "jobs 0 and 1 have the same out")
    assert not (tmp_path / "o").exists() and not (tmp_path / "jobs.summary.json").exists()


def test_eval_json_never_overwrites_another_file(tokenized_model_dir, tmp_path):
    model = tokenized_model_dir("llama")
    src = tmp_path / "model"
    shutil.copytree(model, src)
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog " * 40)
    before = snapshot(tmp_path)
    args = ["eval", "--model", str(src), "--data", str(data), "--ctx", "32", "--no-speed", "--no-retrieval", "--quiet"]
    assert_user_error(run(*args, "--json", str(src / "config.json")), "is not a kvconvert eval result")
    assert_user_error(run(*args, "--json", str(tmp_path)), "is a directory")
    assert snapshot(tmp_path) == before
    # its own earlier result is replaced (the demo writes eval.json on every run)
    assert run(*args, "--json", str(tmp_path / "eval.json")).exit_code == 0
    assert run(*args, "--json", str(tmp_path / "eval.json")).exit_code == 0
    assert "ppl" in json.loads((tmp_path / "eval.json").read_text())


def test_atomic_text_leaves_the_old_file_on_a_full_disk(tmp_path, monkeypatch):
    from kvconvert.io import outdir

    target = tmp_path / "eval.json"
    target.write_text('{"old": true}\n')

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outdir.os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        outdir.write_text_atomic(target, '{"new": true}\n')
    assert target.read_text() == '{"old": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["eval.json"], "temporary file left behind"


# -------------------------------------------------------------------------- weights checked


@pytest.mark.parametrize("bad", list(BAD_MODELS))
@pytest.mark.parametrize("command", [*METHODS, "analyze"])
def test_malformed_weights_are_one_line_and_write_nothing(command, bad, bad_models, tmp_path):
    """NaN/inf anywhere, a config that does not match its weights, integer weights: refused before any
    method computes (before: tracebacks from lorc/zack/analyze, exit 0 with NaN decisions or an
    unloadable checkpoint from slim/quant/razor/minicache)."""
    out = tmp_path / "out"
    before = snapshot(tmp_path)
    result = run(command, "--model", str(bad_models[bad]), "--out", str(out), *METHODS.get(command, ()))
    expected = {"nan_in_k": "NaN or infinite", "inf_in_mlp": "NaN or infinite", "kv_heads_mismatch": "config implies",
                "truncated_k": "config implies", "int8_k": "not floating point",
                "layers_mismatch": "layers", "gptq_export": "quantized checkpoint"}[bad]  # fmt: skip
    if command == "slim" and bad == "kv_heads_mismatch":
        expected = "multi-head attention"  # the config now says GQA, which slim refuses first
    assert_user_error(result, expected)
    assert snapshot(tmp_path) == before


def test_the_finiteness_scan_reads_in_bounded_blocks(tiny_model_dir, tmp_path, monkeypatch):
    """A tensor larger than one block is scanned whole: NaN in its last element is found."""
    from kvconvert.io import checks
    from kvconvert.io.source import open_source

    def last_nan(t):
        t = t.clone()
        t[-1, -1] = float("nan")
        return t

    src = edited_copy(tiny_model_dir("llama"), tmp_path / "m", tensors=_set("model.embed_tokens.weight", last_nan))
    monkeypatch.setattr(checks, "_BLOCK", 256)
    source = open_source(str(src))
    assert checks.nonfinite_count(source, "model.embed_tokens.weight") == 1
    assert checks.nonfinite_count(source, K0) == 0


# -------------------------------------------------------------------------- one line, not a traceback


def test_click_usage_errors_are_one_line(tmp_path):
    assert_user_error(run("slim", "--model", "x", "--out", str(tmp_path / "o"), "--kv-bits", "5"), "--kv-bits")
    assert_user_error(run("slimm"), "No such command")
    assert_user_error(run("lorc", "--model", "x", "--out", str(tmp_path / "o")), "--kv-budget")
    assert run("slim", "--help").exit_code == 0


def test_a_bad_shard_size_is_refused_before_the_model_loads(tmp_path):
    result = run("slim", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--max-shard-size", "5XB")
    assert_user_error(result, "--max-shard-size", "5XB")


@pytest.mark.parametrize(
    "content",
    [b"method: quant\nkv_bits: 4\n# \xff\xfe latin-1 comment\n", b"a: &a [1, 1]\nb: &b [*a, *a]\nc: [*b, *b]\n"],
    ids=["not_utf8", "aliases"],
)
def test_recipes_and_jobs_files_that_cannot_be_read(content, tiny_model_dir, tmp_path):
    recipe, jobs = tmp_path / "r.yaml", tmp_path / "jobs.yaml"
    recipe.write_bytes(content)
    jobs.write_bytes(content.replace(b"method: quant", b"jobs: []"))
    expected = "not UTF-8" if b"\xff" in content else "aliases"
    assert_user_error(run("run", str(recipe), "--model", str(tiny_model_dir("llama")), "--out", str(tmp_path / "o")),
                      expected)  # fmt: skip
    assert_user_error(run("batch", str(jobs)), expected)
    assert not (tmp_path / "o").exists()


def test_error_lines_are_capped(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: quant\nkv_bits: '" + "9" * 100_000 + "'\n")
    result = run("run", str(recipe), "--model", "x", "--out", str(tmp_path / "o"))
    assert result.exit_code == 2 and len(result.stderr) < 1000, len(result.stderr)


def test_eval_options_beyond_the_model_and_bad_data(tokenized_model_dir, tmp_path):
    model = str(tokenized_model_dir("llama"))  # max_position_embeddings 256
    text = tmp_path / "t.txt"
    text.write_text("a b c d e f g " * 100)
    base = ["eval", "--model", model, "--data", str(text), "--quiet"]
    assert_user_error(run(*base, "--retrieval-lengths", "-5"), "--retrieval-lengths")
    assert_user_error(run(*base, "--no-retrieval", "--speed-contexts", "4096"), "exceeds the model's context of 256")
    assert_user_error(run(*base, "--no-speed", "--retrieval-lengths", "1024"), "exceeds the model's context of 256")
    binary = tmp_path / "b.bin"
    binary.write_bytes(bytes(range(256)) * 10)
    assert_user_error(run("eval", "--model", model, "--data", str(binary)), "looks binary")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café au lait ".encode("latin-1") * 50)
    assert_user_error(run("eval", "--model", model, "--data", str(latin)), "is not UTF-8")


def test_eval_reference_with_another_vocabulary(tokenized_model_dir, tmp_path):
    other = edited_copy(tokenized_model_dir("llama"), tmp_path / "other", config={"vocab_size": 120},
                        tensors=lambda s: s.update({"model.embed_tokens.weight": torch.randn(120, 64),
                                                    "lm_head.weight": torch.randn(120, 64)}))  # fmt: skip
    text = tmp_path / "t.txt"
    text.write_text("a b c d e f g " * 100)
    result = run("eval", "--model", str(tokenized_model_dir("llama")), "--reference", str(other), "--data", str(text),
                 "--no-speed", "--no-retrieval", "--quiet")  # fmt: skip
    assert_user_error(result, "predicts 120 tokens", "predicts 97")


def test_a_dataset_column_that_is_not_text(monkeypatch):
    import sys
    import types

    from kvconvert.eval.data import load_text

    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, config, split: {"label": [0, 1, 2]}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(KVConvertError, match="holds int values, not text"):
        load_text("imdb:test:label")


def test_import_llama2c_refuses_garbage(tmp_path):
    shared = ROOT.parent / "shared" / "models" / "aidreams260K"
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes((i * 37 + 11) % 256 for i in range(4000)))
    assert_user_error(run("import-llama2c", str(garbage), "--out", str(tmp_path / "o")), "not a llama2.c v0 checkpoint")
    if not shared.is_dir():
        pytest.skip("../shared/models/aidreams260K not present")
    result = run("import-llama2c", str(shared / "aidreams260K.bin"), "--tokenizer", str(garbage), "--out",
                 str(tmp_path / "o"))  # fmt: skip
    assert_user_error(result, "not a llama2.c tokenizer file")
    three = tmp_path / "tok3.bin"  # a well-formed tokenizer file of 3 pieces, for a 512-token model
    three.write_bytes(struct.pack("<i", 1) + b"".join(struct.pack("<fi", 0.0, 1) + c for c in (b"a", b"b", b"c")))
    result = run("import-llama2c", str(shared / "aidreams260K.bin"), "--tokenizer", str(three), "--out",
                 str(tmp_path / "o"))  # fmt: skip
    assert_user_error(result, "holds 3 tokenizer pieces", "vocabulary of 512")
    assert not (tmp_path / "o").exists()


def test_an_import_never_replaces_the_directory_its_input_lies_in(tmp_path):
    """The checkpoint to import (and its tokenizer) kept inside an earlier output: ``--force`` on that output would
    delete the input with it; refused before anything is read."""
    shared = ROOT.parent / "shared" / "models" / "stories260K"
    if not shared.is_dir():
        pytest.skip("../shared/models/stories260K not present")
    out = tmp_path / "imported"
    assert run("import-llama2c", str(shared / "stories260K.bin"), "--out", str(out)).exit_code == 0
    for name in ("stories260K.bin", "tok512.bin"):
        shutil.copy(shared / name, out / name)
    before = snapshot(tmp_path)
    result = run("import-llama2c", str(out / "stories260K.bin"), "--out", str(out), "--force")
    assert_user_error(result, "contains the input", "stories260K.bin")
    result = run("import-llama2c", str(shared / "stories260K.bin"), "--tokenizer", str(out / "tok512.bin"), "--out",
                 str(out), "--force")  # fmt: skip
    assert_user_error(result, "contains the input", "tok512.bin")
    result = run("import-gguf", str(out / "stories260K.bin"), "--out", str(out), "--force")
    assert_user_error(result, "contains the input")
    assert snapshot(tmp_path) == before


# -------------------------------------------------------------------------- silent or misleading


def test_a_quantized_recipe_reports_its_storage_in_the_budget(tiny_model_dir, tmp_path):
    out = tmp_path / "q"
    result = run("run", str(ROOT / "recipes" / "quant-4bit.yaml"), "--model", str(tiny_model_dir("llama_gqa64")),
                 "--out", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((out / "kvconvert.json").read_text())
    assert report["kv_budget_expected"] == 1.0  # the method itself keeps every token
    assert 0.25 < report["kv_budget_expected_vs_16bit"] < 0.3  # 4 bits + fp16 scale/zero per 64 values
    assert f"KV budget {report['kv_budget_expected_vs_16bit']:.3f} of a 16-bit cache" in result.output
    assert "of a 16-bit cache" in (out / "README.md").read_text() and "100.0%" not in (out / "README.md").read_text()


def test_push_uploads_only_what_kvconvert_wrote(tiny_model_dir, tmp_path):
    out = tmp_path / "d"
    assert run("slim", "--model", str(tiny_model_dir("llama")), "--out", str(out), "--quiet").exit_code == 0
    secret = tmp_path / "secret.txt"
    secret.write_text("private key")
    (out / "stray.txt").write_text("notes")
    (out / "__pycache__").mkdir()
    (out / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (out / "link.txt").symlink_to(secret)
    (out / "eval.json").write_text(json.dumps({"ppl": 1.0, "kv_bytes_per_token": 2, "tokens": 3, "ctx": 4}))
    card = (out / "README.md").read_text()
    result = run("push", str(out), "--repo-id", "org/name", "--dry-run")
    assert result.exit_code == 0, result.output
    listed = {line.split()[-1] for line in result.stdout.splitlines() if not line.startswith("dry run")}
    marker = json.loads((out / ".kvconvert-output.json").read_text())["files"]
    assert listed == {*marker, "eval.json"}
    assert "not uploading 3 file(s)" in result.stderr and "link.txt (a link)" in result.stderr
    assert (out / "README.md").read_text() == card, "a dry run changes nothing"
    assert_user_error(run("push", str(out), "--repo-id", "org/na me", "--dry-run"), "not a valid Hub repository id")


def test_push_without_network_is_one_line_and_changes_nothing(tiny_model_dir, tmp_path):
    out = tmp_path / "d"
    assert run("slim", "--model", str(tiny_model_dir("llama")), "--out", str(out), "--quiet").exit_code == 0
    before = snapshot(tmp_path)
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_x", "HF_HUB_OFFLINE": "0",
           "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}  # fmt: skip
    assert_user_error(run("push", str(out), "--repo-id", "org/name", env=env), "upload to 'org/name' failed")
    assert snapshot(tmp_path) == before, "README.md must not be rewritten before the upload succeeded"


def test_quiet_conversion_prints_nothing_on_stderr(tiny_model_dir, tmp_path):
    result = run("razor", "--model", str(tiny_model_dir("llama")), "--out", str(tmp_path / "r"), "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""


def test_quiet_run_of_a_recipe_and_batch_show_no_calibration_bars(tiny_model_dir, tmp_path):
    """Methods built from a recipe (run, batch) profiled with their bars on before."""
    recipe = tmp_path / "razor.yaml"
    recipe.write_text("method: razor\nprofile_tokens: 16\n")
    result = run("run", str(recipe), "--model", str(tiny_model_dir("llama")), "--out", str(tmp_path / "r"), "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"jobs:\n  - {{model: {tiny_model_dir('llama')}, out: b, recipe: razor.yaml}}\n")
    result = run("batch", str(jobs), "--no-measure")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""


def test_load_of_a_hub_id_offline_fails_at_once(monkeypatch):
    import kvconvert

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(KVConvertError, match="not in the local Hugging Face cache"):
        kvconvert.load("some-org/not-cached-model")
    assert time.perf_counter() - start < 20  # transformers' own path retried for ~27 s


def test_retrieval_zeros_are_explained():
    from kvconvert.eval.runner import format_table

    result = {"ppl": 5.0, "kv_bytes_per_token": 10, "tokens": 9, "ctx": 8, "window": "w", "seconds": 1.0,
              "passkey": {"128": 0.0}, "copy": {"128": 0.0}}  # fmt: skip
    assert "cannot retrieve at these lengths even uncompressed" in format_table(result)
    result["copy"] = {"128": 0.5}
    assert "cannot retrieve" not in format_table(result)


# -------------------------------------------------------------------------- batch: summaries and shards


def test_batch_summary_problems_are_found_before_any_job(tiny_model_dir, tmp_path):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"jobs:\n  - {{model: {tiny_model_dir('llama')}, out: o, method: slim}}\n")
    (tmp_path / "dir").mkdir()
    assert_user_error(run("batch", str(jobs), "--summary", str(tmp_path / "dir"), "--no-measure"), "is a directory")
    assert not (tmp_path / "o").exists()
    assert [p.name for p in (tmp_path / "dir").iterdir()] == [], "temporary file left behind"
    zero = tmp_path / "zero.yaml"
    zero.write_text("jobs: []\n")
    result = run("batch", str(zero))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "zero.summary.json").read_text())["jobs"] == []


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_shards_cover_every_job_exactly_once(count):
    import random

    from kvconvert.batch import Job, shard_jobs

    names = [f"job-{random.Random(count).randrange(10**6)}-{i}" for i in range(11)]
    jobs = [Job(name=n, model="m", out=Path(n), method="slim", config=None) for n in names]
    slices = [shard_jobs(jobs, i, count) for i in range(1, count + 1)]
    chosen = [job.name for part in slices for job in part]
    assert sorted(chosen) == sorted(names)
    assert max(map(len, slices)) - min(map(len, slices)) <= 1
    assert slices == [shard_jobs(list(reversed(jobs)), i, count)[::-1] for i in range(1, count + 1)]


def test_sharded_batch_and_merged_summaries(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("jobs:\n" + "".join(f"  - {{name: j{i}, model: {model}, out: o{i}, method: quant, "
                                        f"options: {{kv_bits: 4}}}}\n" for i in range(3)))  # fmt: skip
    summaries = []
    for shard in ("1/2", "2/2"):
        result = run("batch", str(jobs), "--shard", shard, "--no-measure")
        assert result.exit_code == 0, result.output
        summaries.append(str(jobs.with_suffix(f".shard-{shard.replace('/', '-of-')}.summary.json")))
    assert sorted(p.name for p in tmp_path.glob("o*")) == ["o0", "o1", "o2"]
    assert_user_error(run("batch", str(jobs), "--merge-summaries", summaries[0]), "in no summary", "j1")
    result = run("batch", str(jobs), "--merge-summaries", *summaries)
    assert result.exit_code == 0, result.output
    merged = json.loads((tmp_path / "jobs.summary.json").read_text())
    assert [j["name"] for j in merged["jobs"]] == ["j0", "j1", "j2"]
    assert all(j["status"] == "ok" for j in merged["jobs"])
    assert_user_error(run("batch", str(jobs), "--shard", "3/2"), "--shard takes I/N")


# -------------------------------------------------------------------------- the corpus


def _corrupt_sources(tiny: Path, root: Path) -> dict[str, Path]:
    """Malformed source directories beyond BAD_MODELS: broken files rather than wrong numbers."""
    made = {}

    def copy(name: str) -> Path:
        made[name] = shutil.copytree(tiny, root / name)
        return made[name]

    (copy("config_not_json") / "config.json").write_text("{ not json")
    (copy("config_binary") / "config.json").write_bytes(b"\xff\xfe\0\0garbage")
    (copy("unknown_type") / "config.json").write_text(json.dumps({"model_type": "nonsense"}))
    (copy("no_weights") / "model.safetensors").unlink()
    weights = copy("truncated_file") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    (copy("weights_garbage") / "model.safetensors").write_bytes(os.urandom(4096))
    (copy("no_config") / "config.json").unlink()
    made["a_file"] = root / "file.txt"
    made["a_file"].write_text("hello")
    made["missing"] = root / "missing"
    return made


def test_every_command_on_a_corpus_of_malformed_inputs(tiny_model_dir, bad_models, tmp_path):
    """exit 2, one line on stderr, no traceback, nothing outside a fresh --out touched."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    sources = {**_corrupt_sources(tiny_model_dir("llama"), inputs), **bad_models}
    recipes = {"not_mapping": b"- a\n- b\n", "unknown_key": b"method: quant\nkv_bitz: 4\n",
               "bad_method": b"method: nope\n", "bad_value": b"method: lorc\nkv_budget: 7\n",
               "aliases": b"a: &x [1]\nb: *x\n", "latin1": b"method: quant\n# \xe9\n", "empty": b""}  # fmt: skip
    for name, content in recipes.items():
        (inputs / f"{name}.yaml").write_bytes(content)
    work = tmp_path / "work"
    work.mkdir()
    (work / "user-files").mkdir()
    (work / "user-files" / "keep.txt").write_text("mine")
    out = str(work / "fresh")
    calls: list[list[str]] = []
    for source in sources.values():
        for command, extra in METHODS.items():
            calls.append([command, "--model", str(source), "--out", out, *extra])
        calls.append(["analyze", "--model", str(source), "--out", out])
        calls.append(["plan", "--model", str(source), "--out", out, "--methods", "quant"])
        calls.append(["run", str(ROOT / "recipes" / "quant-4bit.yaml"), "--model", str(source), "--out", out])
    good = str(tiny_model_dir("llama"))
    for name in recipes:
        calls.append(["run", str(inputs / f"{name}.yaml"), "--model", good, "--out", out])
        calls.append(["batch", str(inputs / f"{name}.yaml"), "--summary", str(work / "s.json")])
    for bad_out in (str(work / "user-files"), str(inputs / "file.txt")):
        calls += [["slim", "--model", good, "--out", bad_out, "--force"],
                  ["analyze", "--model", good, "--out", bad_out, "--force"],
                  ["plan", "--model", good, "--out", bad_out, "--force"],
                  ["import-llama2c", str(inputs / "file.txt"), "--out", bad_out, "--force"]]  # fmt: skip
    calls += [["eval", "--model", str(sources[k]), "--data", str(inputs / "file.txt")]
              for k in ("config_not_json", "no_config", "missing", "a_file")]  # fmt: skip
    calls.append(["push", str(work / "user-files"), "--repo-id", "org/name", "--dry-run"])
    before = snapshot(tmp_path)
    for args in calls:
        result = run(*args)
        try:
            assert_user_error(result)
        except AssertionError as exc:
            raise AssertionError(f"kvconvert {' '.join(args)}: {exc}\n{result.output}") from None
        assert snapshot(tmp_path) == before, f"kvconvert {' '.join(args)} touched files"
