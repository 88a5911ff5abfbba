"""Every user error: exit status 2, one line on stderr, nothing written."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from click.testing import CliRunner

from kvconvert.cli import main
from kvconvert.errors import KVConvertError
from tests.helpers import assert_equivalent, load_converted, load_reference


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, list(args), env=env)


def assert_user_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    assert len(errors) == 1 and lines[-1] == errors[0], f"expected one error line, got: {result.stderr!r}"
    assert errors[0].startswith("kvconvert: error: ")
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert "Traceback" not in result.output


def assert_nothing_written(out) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temporary dir left behind"


def test_gqa_model_is_refused(tiny_model_dir, tmp_path):
    out = tmp_path / "slim"
    result = run("slim", "--model", str(tiny_model_dir("llama_gqa")), "--out", str(out))
    assert_user_error(result, "multi-head attention", "GQA")
    assert_nothing_written(out)


def test_unsupported_architecture_lists_supported(tmp_path):
    from transformers import OPTConfig, OPTForCausalLM

    src = tmp_path / "opt"
    OPTForCausalLM(OPTConfig(hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2, vocab_size=50,
                             word_embed_proj_dim=16)).save_pretrained(src)  # fmt: skip
    result = run("slim", "--model", str(src), "--out", str(tmp_path / "out"))
    assert_user_error(result, "unsupported architecture 'opt'", "llama", "gpt_neox", "gpt2")


def test_existing_output_is_refused_and_untouched(tiny_model_dir, tmp_path):
    out = tmp_path / "slim"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run("slim", "--model", str(tiny_model_dir("llama")), "--out", str(out))
    assert_user_error(result, "already exists", "--force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_force_replaces_an_earlier_output(tiny_model_dir, tmp_path):
    """The earlier output goes whole, files the new one does not write included (its shards here); a file the user
    added is never among them (``test_force_keeps_what_a_user_added_to_an_output``)."""
    out, model = tmp_path / "slim", str(tiny_model_dir("llama"))
    assert run("slim", "--model", model, "--out", str(out), "--quiet", "--max-shard-size", "20KB").exit_code == 0
    assert len(list(out.glob("model-*.safetensors"))) > 1
    result = run("slim", "--model", model, "--out", str(out), "--force", "--quiet")
    assert result.exit_code == 0, result.output
    assert not list(out.glob("model-*")) and (out / "model.safetensors").exists()


def test_missing_local_model(tmp_path):
    result = run("slim", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert_user_error(result, "model not found")


def test_hub_id_offline_without_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    result = run("slim", "--model", "some-org/not-cached-model", "--out", str(tmp_path / "out"))
    assert_user_error(result, "not in the local Hugging Face cache", "HF_HUB_OFFLINE")


def _pickled_copy(src, dst):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    from safetensors.torch import load_file

    torch.save(load_file(src / "model.safetensors"), dst / "pytorch_model.bin")


def test_pickle_needs_flag_then_loads_weights_only(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    pickled = tmp_path / "pickled"
    _pickled_copy(src, pickled)
    result = run("slim", "--model", str(pickled), "--out", str(tmp_path / "out"))
    assert_user_error(result, "--allow-pickle")

    result = run("slim", "--model", str(pickled), "--out", str(tmp_path / "out"), "--allow-pickle", "--quiet")
    assert result.exit_code == 0, result.output
    assert_equivalent(load_reference(src), load_converted(tmp_path / "out"), torch.randint(3, 90, (1, 12)))


def test_distillation_never_unpickles_the_source(tokenized_model_dir, tmp_path):
    """--distill-steps builds the source with transformers: a pickled source (even with --allow-pickle) is refused in
    one line before any calibration, nothing written."""
    src = tokenized_model_dir("llama_gqa")
    pickled = tmp_path / "pickled"
    _pickled_copy(src, pickled)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            (pickled / name).write_text((src / name).read_text())
    out = tmp_path / "out"
    result = run("lorc", "--model", str(pickled), "--out", str(out), "--allow-pickle", "--latent", "mla",
                 "--kv-budget", "0.5", "--distill-steps", "5", "--quiet")  # fmt: skip
    assert_user_error(result, "safetensors only")
    assert not out.exists()


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/kvconvert-pwned",))


def test_malicious_pickle_is_never_executed(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_model_dir("llama") / "config.json").read_text())
    with open(bad / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Exploit()}, f)
    if os.path.exists("/tmp/kvconvert-pwned"):
        os.remove("/tmp/kvconvert-pwned")
    result = run("slim", "--model", str(bad), "--out", str(tmp_path / "out"), "--allow-pickle")
    assert_user_error(result, "not a plain tensor file")
    assert not os.path.exists("/tmp/kvconvert-pwned")
    assert_nothing_written(tmp_path / "out")


def test_refused_condition_number_leaves_nothing(tiny_model_dir, tmp_path):
    out = tmp_path / "slim"
    result = run("slim", "--model", str(tiny_model_dir("llama")), "--out", str(out), "--max-v-error", "1e-12")
    assert_user_error(result, "κ(W_K)", "--accept-v-error")
    assert_nothing_written(out)
    # --force only replaces outputs; it no longer also waves refused checks through
    assert_user_error(run("slim", "--model", str(tiny_model_dir("llama")), "--out", str(out), "--max-v-error",
                          "1e-12", "--force"), "κ(W_K)")  # fmt: skip
    accepted = run("slim", "--model", str(tiny_model_dir("llama")), "--out", str(out), "--max-v-error", "1e-12",
                   "--accept-v-error", "--quiet")  # fmt: skip
    assert accepted.exit_code == 0
    assert json.loads((out / "kvconvert.json").read_text())["params"]["accept_v_error"] is True


def test_singular_key_projection_is_refused(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "singular"
    src.mkdir()
    for item in tiny_model_dir("llama").iterdir():
        (src / item.name).write_bytes(item.read_bytes())
    weights = load_file(src / "model.safetensors")
    weights["model.layers.1.self_attn.k_proj.weight"][3] = 0.0  # one key channel reads nothing: W_K has no inverse
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "slim"
    assert_user_error(run("slim", "--model", str(src), "--out", str(out)), "layer 1: W_K is singular")
    assert_nothing_written(out)


def test_model_path_is_a_file(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    assert_user_error(run("slim", "--model", str(f), "--out", str(tmp_path / "o")), "is a file")


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_bad_max_v_error(tiny_model_dir, tmp_path, bad):
    result = run("slim", "--model", str(tiny_model_dir("llama")), "--out", str(tmp_path / "o"), "--max-v-error", bad)
    assert_user_error(result, "max_v_error")


def test_hub_id_resolves_from_the_hf_cache_offline(tiny_model_dir, tmp_path, monkeypatch):
    """A Hub id is resolved through huggingface_hub (here from its cache, offline) and the
    snapshot's commit hash is recorded as the source revision."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf-home" / "hub" / "models--some-org--tiny-llama"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_model_dir("llama"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    from huggingface_hub import constants

    # huggingface_hub reads HF_HOME when imported; point the already-imported constant at our cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "out"
    result = run("slim", "--model", "some-org/tiny-llama", "--out", str(out), "--quiet")
    assert result.exit_code == 0, result.output
    source = json.loads((out / "kvconvert.json").read_text())["source"]
    assert source["model"] == "some-org/tiny-llama" and source["revision"] == commit
    assert "base_model: some-org/tiny-llama" in (out / "README.md").read_text()


@pytest.mark.parametrize("where", ["same", "inside", "contains"])
def test_out_overlapping_the_model_is_refused_even_with_force(where, tiny_model_dir, tmp_path):
    import shutil

    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), src)
    before = sorted(p.name for p in src.iterdir())
    out = {"same": src, "inside": src / "converted", "contains": tmp_path}[where]
    result = run("slim", "--model", str(src), "--out", str(out), "--force")
    assert_user_error(result, "the input", "choose a directory outside it")
    assert sorted(p.name for p in src.iterdir()) == before


def test_a_locked_output_is_refused(tiny_model_dir, tmp_path):
    """A second conversion to an --out another live process is writing fails instead of racing it."""
    out = tmp_path / "slim"
    (tmp_path / ".slim.lock").write_text(str(os.getppid()))  # a live process that is not us
    assert_user_error(run("slim", "--model", str(tiny_model_dir("llama")), "--out", str(out)), "is writing")
    assert not out.exists()
    (tmp_path / ".slim.lock").write_text("999999999")  # a dead process: its lock is stale and taken over
    assert run("slim", "--model", str(tiny_model_dir("llama")), "--out", str(out), "--quiet").exit_code == 0
    assert not (tmp_path / ".slim.lock").exists()


@pytest.mark.slow
def test_concurrent_conversions_to_one_out_cannot_both_succeed(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "o"
    jobs = (("slim", []), ("lorc", ["--kv-budget", "0.75", "--schedule", "uniform"]))
    src = str(tiny_model_dir("llama"))
    commands = [[sys.executable, "-m", "kvconvert.cli", m, "--model", src, "--out", str(out), "--quiet", *extra]
                for m, extra in jobs]  # fmt: skip
    procs = [subprocess.Popen(c, stderr=subprocess.PIPE, text=True) for c in commands]
    results = [(p.wait(timeout=300), p.stderr.read() if p.stderr else "") for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    failed = next(err for code, err in results if code == 2)
    assert "already exists" in failed or "is writing" in failed
    assert json.loads((out / "kvconvert.json").read_text())["method"] in ("slim", "lorc")


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]), "cannot read"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64), "cannot read"),
        (lambda d: (d / "config.json").write_text("{not json"), "cannot read model config"),
    ],
    ids=["truncated", "garbage-header", "bad-config"],
)
def test_damaged_inputs_are_one_line(damage, fragment, tiny_model_dir, tmp_path):
    import shutil

    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), src)
    damage(src)
    out = tmp_path / "out"
    assert_user_error(run("slim", "--model", str(src), "--out", str(out)), fragment)
    assert_nothing_written(out)


def test_os_errors_while_writing_are_one_line(tiny_model_dir, tmp_path, monkeypatch):
    """A full disk (ENOSPC) mid-write: one line, nothing left behind."""
    import errno

    from kvconvert.io import writer

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "model.safetensors")

    monkeypatch.setattr(writer.ShardedSafetensorsWriter, "add", full)
    out = tmp_path / "out"
    assert_user_error(run("slim", "--model", str(tiny_model_dir("llama")), "--out", str(out)), "No space left")
    assert_nothing_written(out)


def test_sigterm_cleans_up_like_ctrl_c(tiny_model_dir, tmp_path, monkeypatch):
    import signal

    from kvconvert.methods.slim.method import SlimMethod

    def killed(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # what a CI runner sends on cancel, mid-conversion
        raise AssertionError("SIGTERM did not interrupt the conversion")

    monkeypatch.setattr(SlimMethod, "convert_layer", killed)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        out = tmp_path / "out"
        result = run("slim", "--model", str(tiny_model_dir("llama")), "--out", str(out))
        assert result.exit_code == 143 and "terminated" in result.stderr
        assert_nothing_written(out)
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda spec: None, "no 'kvconvert' section"),
        (lambda spec: {**spec, "method": "frobnicate"}, "cannot run method 'frobnicate'"),
        (lambda spec: {**spec, "spec_version": 99, "version": "9.9.9"}, "written by kvconvert 9.9.9) is newer"),
        (lambda spec: {k: v for k, v in spec.items() if k != "num_heads"}, "lacks num_heads"),
    ],
    ids=["no-section", "unknown-method", "newer-spec", "missing-field"],
)
def test_a_spec_the_runtime_cannot_run_is_one_line(edit, fragment, tiny_model_dir, tmp_path):
    import kvconvert
    from kvconvert.runtime.kvconvert_spec import SpecError

    out = tmp_path / "slim"
    assert run("slim", "--model", str(tiny_model_dir("llama")), "--out", str(out), "--quiet").exit_code == 0
    config = json.loads((out / "config.json").read_text())
    edited = edit(config["kvconvert"])
    if edited is None:
        del config["kvconvert"]
    else:
        config["kvconvert"] = edited
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match=fragment.replace("(", r"\(").replace(")", r"\)")) as info:
        kvconvert.load(out)
    assert "\n" not in str(info.value)
    data = tmp_path / "text.txt"
    data.write_text("one two three four five six seven eight nine ten " * 20)
    assert_user_error(run("eval", "--model", str(out), "--data", str(data), "--no-speed", "--no-retrieval"), fragment)


def test_written_spec_round_trips_through_the_typed_spec(tiny_model_dir, tmp_path):
    from kvconvert.runtime.kvconvert_spec import SPEC_VERSION, RuntimeSpec
    from kvconvert.runtime.modeling_kvconvert import METHOD_RUNTIMES

    out = tmp_path / "lorc"
    assert run("lorc", "--model", str(tiny_model_dir("llama_gqa")), "--out", str(out), "--kv-budget", "0.75",
               "--kv-bits", "4", "--quiet").exit_code == 0  # fmt: skip
    section = json.loads((out / "config.json").read_text())["kvconvert"]
    spec = RuntimeSpec.from_dict(section, METHOD_RUNTIMES)
    # version 1 is enough to describe it, so runtimes older than the token layout still load it
    assert spec.spec_version == 1 < SPEC_VERSION and spec.kv_quant == {"bits": 4, "group": 64, "residual": 128}
    assert "lorc_layers" in spec.extra and spec.to_dict() == section


def test_existing_output_is_refused_before_calibration(tokenized_model_dir, tmp_path):
    """A conversion into an existing --out stops before it plans (calibration can take minutes)."""
    from kvconvert.io.source import open_source
    from kvconvert.methods.zack.method import ZackConfig, ZackMethod
    from kvconvert.pipeline import convert

    class Unplanned(ZackMethod):
        def plan(self, *args, **kwargs):
            raise AssertionError("planned before checking --out")

    (tmp_path / "out").mkdir()
    src = tokenized_model_dir("llama_gqa")
    with pytest.raises(KVConvertError, match="already exists"):
        convert(open_source(str(src)), Unplanned(ZackConfig(kv_budget=0.5)), tmp_path / "out")


def test_help_and_an_existing_out_answer_before_torch_loads(tmp_path):
    """``kvconvert --help`` and the refusal of an existing ``--out`` import neither torch nor transformers
    (3.8 s and 8 s on 2 cores before; 0.3 s now)."""
    import subprocess
    import sys

    (tmp_path / "out").mkdir()
    code = (
        "import sys\nfrom kvconvert.cli import main\n"
        "for args in (['--help'], ['slim', '--model', 'no/model', '--out', sys.argv[1]]):\n"
        "    try:\n        main(args)\n    except SystemExit as exc:\n        print('exit', exc.code)\n"
        "print('loaded', sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True)
    assert "exit 0" in result.stdout and "exit 2" in result.stdout, result.stdout + result.stderr
    assert "already exists" in result.stderr and "loaded []" in result.stdout
