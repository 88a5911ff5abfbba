"""Recipes through `run`, CI batches (resume after SIGKILL), and Hub push against a local stand-in."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_run_recipe_writes_repeatable_recipe(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_gqa")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: lorc\nkv_budget: 0.75\nschedule: uniform\n")
    first = run_cli("run", str(recipe), "--model", str(src), "--out", str(tmp_path / "a"), "--quiet")
    assert first.exit_code == 0, first.output
    saved = yaml.safe_load((tmp_path / "a" / "recipe.yaml").read_text())
    assert saved == {"method": "lorc", "kv_budget": 0.75, "schedule": "uniform", "threshold": None, "compress": "kv",
                     "calibrate": False, "calib": None, "calib_tokens": 16384, "chunk_len": 512, "seed": 0,
                     "probe_chunks": 4, "probe_rounds": 1, "refine_steps": 0, "refine_chunks": 8,
                     "latent": "separate"}  # fmt: skip
    again = run_cli("run", str(tmp_path / "a" / "recipe.yaml"), "--model", str(src), "--out", str(tmp_path / "b"))
    assert again.exit_code == 0, again.output
    assert sha(tmp_path / "a" / "model.safetensors") == sha(tmp_path / "b" / "model.safetensors")


def test_run_bad_recipe_is_one_line(tiny_model_dir, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("method: lorc\nkv_budget: 0.5\nranks: 3\n")
    result = run_cli("run", str(recipe), "--model", str(tiny_model_dir("llama")), "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"kvconvert: error: {recipe}: unknown key 'ranks' for lorc; allowed: calib, calib_tokens, calibrate, "
        "chunk_len, compress, distill_chunks, distill_len, distill_steps, kv_bits, kv_budget, kv_format, kv_group, "
        "kv_include_local, kv_layout, kv_local_bits, "
        "kv_residual, "
        "kv_rotate, kv_scale_strategy, kv_sink, kv_value_bits, latent, mla_distance, mla_rope_dim, mla_sizes, "
        "probe_chunks, probe_rounds, "
        "refine_chunks, refine_steps, schedule, seed, threshold"
    )


def write_jobs(path: Path, jobs: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"jobs": jobs}))
    return path


def test_batch_runs_all_jobs_reports_failures_and_skips_done_work(tiny_model_dir, tokenized_model_dir, tmp_path):
    (tmp_path / "lorc.yaml").write_text("method: lorc\nkv_budget: 0.6\n")
    jobs = write_jobs(tmp_path / "jobs.yaml", [
        {"model": str(tiny_model_dir("llama")), "method": "slim", "out": "out/slim"},
        {"model": str(tiny_model_dir("llama_gqa")), "method": "slim", "out": "out/gqa"},  # GQA: must fail
        {"model": str(tiny_model_dir("gpt2")), "recipe": "lorc.yaml", "out": "out/lorc"},
        # widths allocated by its plan: the output's storage is not the job's, and still up to date
        {"model": str(tokenized_model_dir("llama_gqa")), "method": "quant", "out": "out/quant",
         "options": {"kv_budget": 0.3, "calib_tokens": 512}},
    ])  # fmt: skip
    result = run_cli("batch", str(jobs))
    assert result.exit_code == 1
    summary = json.loads((tmp_path / "jobs.summary.json").read_text())
    assert [j["status"] for j in summary["jobs"]] == ["ok", "failed", "ok", "ok"]
    assert "GQA" in summary["jobs"][1]["error"] and not (tmp_path / "out" / "gqa").exists()
    assert summary["jobs"][0]["kv_budget_measured"] == pytest.approx(0.5, abs=0.01)
    assert summary["jobs"][2]["kv_budget_measured"] == pytest.approx(0.6, abs=0.02)
    assert summary["jobs"][0]["output_sha256"] == {"model.safetensors": sha(tmp_path / "out/slim/model.safetensors")}
    assert all(j["seconds"] > 0 for j in summary["jobs"])

    before = (tmp_path / "out/slim/model.safetensors").stat().st_mtime_ns
    rerun = run_cli("batch", str(jobs), "--no-measure")
    assert [j["status"] for j in json.loads((tmp_path / "jobs.summary.json").read_text())["jobs"]] == [
        "skipped", "failed", "skipped", "skipped",
    ]  # fmt: skip
    assert rerun.exit_code == 1 and (tmp_path / "out/slim/model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize(
    ("job", "fragment"),
    [
        ({"model": "m", "out": "o", "method": "slim", "colour": 1}, "unknown key(s) colour"),
        ({"model": "m", "out": "o"}, "either 'recipe' or 'method'"),
        ({"model": "m", "method": "slim"}, "'out' is required"),
        ({"model": "m", "out": "o", "method": "lorc", "options": {"kv_budget": "x"}}, "'kv_budget' must be float"),
    ],
)
def test_bad_jobs_files(tmp_path, job, fragment):
    result = run_cli("batch", str(write_jobs(tmp_path / "jobs.yaml", [job])))
    assert result.exit_code == 2 and fragment in result.stderr and "job 0" in result.stderr


@pytest.mark.slow
def test_batch_killed_mid_job_resumes(tiny_model_dir, tmp_path):
    """SIGKILL while the second job converts: no half-written output; the rerun does only job 2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    big = tmp_path / "big"
    LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
                                 num_key_value_heads=8, vocab_size=2000)).save_pretrained(big)  # fmt: skip
    jobs = write_jobs(tmp_path / "jobs.yaml", [
        {"model": str(tiny_model_dir("llama")), "method": "slim", "out": "out/first"},
        {"model": str(big), "method": "lorc", "options": {"kv_budget": 0.7}, "out": "out/second"},
    ])  # fmt: skip
    cmd = [sys.executable, "-m", "kvconvert.cli", "batch", str(jobs), "--no-measure"]
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # kill once job 2 is observably mid-write (its temporary directory holds part of a shard), not after a sleep
    deadline = time.time() + 120
    while time.time() < deadline and not any(
        part.stat().st_size > 0 for part in (tmp_path / "out").glob(".second.tmp-*/.shard-*")
    ):
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    summary = json.loads((tmp_path / "jobs.summary.json").read_text())
    assert [j["status"] for j in summary["jobs"]] == ["ok"], "job 2 finished before the kill; make it slower"
    assert not (tmp_path / "out/second").exists()
    assert [p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")] == ["first"]

    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads((tmp_path / "jobs.summary.json").read_text())
    assert [j["status"] for j in summary["jobs"]] == ["skipped", "ok"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["first", "second"], "stale temp dir left"


class HubStandIn(BaseHTTPRequestHandler):
    """Just enough of the Hub's HTTP API for create_repo, create_branch and upload_folder."""

    requests: list[tuple[str, str, str | None, bytes]] = []
    deny = False

    def _reply(self, payload: dict, status: int = 200) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.requests.append(("POST", self.path, self.headers.get("Authorization"), body))
        host = f"http://{self.headers['Host']}"
        if self.deny:
            self._reply({"error": "Invalid credentials"}, 401)
        elif self.path == "/api/repos/create":
            self._reply({"url": f"{host}/org/name", "name": "org/name"})
        elif "/preupload/" in self.path:
            files = json.loads(body)["files"]
            self._reply({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
        elif "/commit/" in self.path:
            self._reply({"commitUrl": f"{host}/org/name/commit/{'a' * 40}", "commitOid": "a" * 40, "success": True})
        else:
            self._reply({})

    def do_GET(self) -> None:  # noqa: N802
        self.requests.append(("GET", self.path, self.headers.get("Authorization"), b""))
        self._reply({"error": "Invalid credentials"}, 401) if self.deny else self._reply({})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hub(monkeypatch):
    HubStandIn.requests, HubStandIn.deny = [], False
    server = ThreadingHTTPServer(("127.0.0.1", 0), HubStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def push_cmd(endpoint: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_TOKEN": "hf_SECRETtoken0123456789", "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "kvconvert.cli", "push", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.slow
def test_push_uploads_directory_with_model_card(tiny_model_dir, tmp_path, hub):
    dst = tmp_path / "tiny-slim"
    assert run_cli("slim", "--model", str(tiny_model_dir("llama")), "--out", str(dst), "--quiet").exit_code == 0
    result = push_cmd(hub, str(dst), "--repo-id", "org/name", "--private", "--revision", "v1")
    assert result.returncode == 0, result.stderr
    assert "SECRET" not in result.stdout + result.stderr

    posts = {path: (auth, body) for method, path, auth, body in HubStandIn.requests if method == "POST"}
    created = json.loads(posts["/api/repos/create"][1])
    assert (created["organization"], created["name"], created["visibility"]) == ("org", "name", "private")
    assert "/api/models/org/name/branch/v1" in posts
    auth, body = posts["/api/models/org/name/commit/v1"]
    assert auth == "Bearer hf_SECRETtoken0123456789"
    lines = [json.loads(line) for line in body.decode().splitlines()]
    uploaded = {e["value"]["path"]: base64.b64decode(e["value"]["content"]) for e in lines if e["key"] == "file"}
    local = {p.name for p in dst.iterdir() if not p.name.startswith(".")}
    assert set(uploaded) == local
    assert uploaded["model.safetensors"] == (dst / "model.safetensors").read_bytes()
    card = uploaded["README.md"].decode()
    assert "library_name: transformers" in card and "- kvconvert" in card and "- slim" in card
    assert 'from_pretrained("org/name", trust_remote_code=True)' in card and "kvconvert.load" in card


def _uploaded_card() -> str:
    body = [b for method, path, _, b in HubStandIn.requests if method == "POST" and "/commit/" in path][-1]
    lines = [json.loads(line) for line in body.decode().splitlines()]
    return next(base64.b64decode(e["value"]["content"]).decode() for e in lines
                if e["key"] == "file" and e["value"]["path"] == "README.md")  # fmt: skip


@pytest.mark.slow
def test_push_uploads_an_edited_model_card_as_it_is(tiny_model_dir, tmp_path, hub):
    """push refreshes kvconvert's own card (here and on the Hub) but never replaces a card the user edited."""
    dst = tmp_path / "d"
    assert run_cli("slim", "--model", str(tiny_model_dir("llama")), "--out", str(dst), "--quiet").exit_code == 0
    for _ in range(2):  # the refreshed card is kvconvert's too: the second push refreshes it again, silently
        result = push_cmd(hub, str(dst), "--repo-id", "org/name")
        assert result.returncode == 0 and "edited" not in result.stderr, result.stderr
        assert _uploaded_card() == (dst / "README.md").read_text() and "org/name" in _uploaded_card()
    edited = (dst / "README.md").read_text() + "\n## My own notes\n"
    (dst / "README.md").write_text(edited)
    result = push_cmd(hub, str(dst), "--repo-id", "org/other")
    assert result.returncode == 0, result.stderr
    assert "README.md was edited since kvconvert wrote it: it goes up as it is" in result.stderr
    assert _uploaded_card() == edited and (dst / "README.md").read_text() == edited


@pytest.mark.slow
def test_push_dry_run_contacts_nobody(tiny_model_dir, tmp_path, hub):
    dst = tmp_path / "d"
    run_cli("slim", "--model", str(tiny_model_dir("llama")), "--out", str(dst), "--quiet")
    result = push_cmd(hub, str(dst), "--repo-id", "org/name", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "model.safetensors" in result.stdout and "would go to org/name" in result.stdout
    assert HubStandIn.requests == []


@pytest.mark.slow
def test_push_without_rights_is_one_line(tiny_model_dir, tmp_path, hub):
    dst = tmp_path / "d"
    run_cli("slim", "--model", str(tiny_model_dir("llama")), "--out", str(dst), "--quiet")
    HubStandIn.deny = True
    result = push_cmd(hub, str(dst), "--repo-id", "org/name")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "kvconvert: error: the Hub refused access to 'org/name' (HTTP 401); log in with `hf auth login` or set "
        "HF_TOKEN to a token with write access"
    ]
