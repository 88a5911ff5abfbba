"""``kvconvert batch``: many conversions from one jobs file, for CI.

Jobs run in order; a failing job is recorded and the rest still run. A job whose output already
holds the same source weights (sha256), recipe and tool version is skipped, so an interrupted run
can simply be started again: outputs are atomic, so only finished jobs exist.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import kvconvert
from kvconvert.errors import KVConvertError
from kvconvert.methods import Method, build_method
from kvconvert.pipeline import storage_report
from kvconvert.recipe import load_recipe, parse_recipe
from kvconvert.runtime.kvconvert_storage import QuantSpec


@dataclass(frozen=True)
class Job:
    model: str
    out: Path
    method: str
    config: Any
    storage: QuantSpec = QuantSpec()
    revision: str | None = None
    dtype: str = "auto"
    allow_pickle: bool = False
    push: str | None = None
    private: bool = False
    push_revision: str | None = None


_JOB_KEYS = {f.name for f in dataclasses.fields(Job)} - {"config", "storage"} | {"recipe", "options"}


def parse_jobs(path: Path) -> list[Job]:
    """Typed jobs; every mistake is one line naming the file and the job."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise KVConvertError(f"{path}: cannot read jobs file ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list) or set(data) != {"jobs"}:
        raise KVConvertError(f"{path}: a jobs file is a mapping with one key, 'jobs', holding a list")
    base = path.parent
    jobs = []
    for index, entry in enumerate(data["jobs"]):
        where = f"{path} job {index}"
        if not isinstance(entry, dict):
            raise KVConvertError(f"{where}: each job is a mapping")
        unknown = set(entry) - _JOB_KEYS
        if unknown:
            raise KVConvertError(
                f"{where}: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(_JOB_KEYS))}"
            )
        for required in ("model", "out"):
            if not isinstance(entry.get(required), str):
                raise KVConvertError(f"{where}: {required!r} is required and must be a string")
        if ("recipe" in entry) == ("method" in entry):
            raise KVConvertError(f"{where}: give either 'recipe' or 'method' (+ 'options')")
        if "recipe" in entry:
            if "options" in entry:
                raise KVConvertError(f"{where}: 'options' go with 'method', not with 'recipe'")
            method, config, storage = load_recipe(base / entry["recipe"])
        else:
            options = entry.get("options") or {}
            method, config, storage = parse_recipe({"method": entry["method"], **options}, where)
        for key in ("private", "allow_pickle"):
            if not isinstance(entry.get(key, False), bool):
                raise KVConvertError(f"{where}: {key!r} must be true or false")
        model = entry["model"]
        local = base / model
        jobs.append(
            Job(
                model=str(local) if local.exists() else model,
                out=base / entry["out"],
                method=method,
                config=config,
                storage=storage,
                revision=entry.get("revision"),
                dtype=entry.get("dtype", "auto"),
                allow_pickle=entry.get("allow_pickle", False),
                push=entry.get("push"),
                private=entry.get("private", False),
                push_revision=entry.get("push_revision"),
            )
        )
    return jobs


def _is_up_to_date(out: Path, method: Method, source_sha256: dict[str, str]) -> bool:
    report_file = out / "kvconvert.json"
    if not report_file.exists():
        return False
    report = json.loads(report_file.read_text())
    return (
        report.get("method") == method.name
        and report.get("params") == method.params()
        and report.get("kv_storage") == storage_report(method.storage)
        and report.get("tool_version") == kvconvert.__version__
        and report.get("source", {}).get("sha256") == source_sha256
    )


def output_sha256(out: Path) -> dict[str, str]:
    from kvconvert.io.source import sha256_file

    return {path.name: sha256_file(path) for path in sorted(out.glob("*.safetensors"))}


def measured_kv_budget(source_dir: Path, out: Path, tokens: int = 64) -> float:
    """Cache bytes per token of the converted model ÷ the source's, from live caches."""
    import torch

    from kvconvert.eval.memory import kv_bytes_per_token
    from kvconvert.eval.runner import load_model

    converted, source = load_model(str(out)), load_model(str(source_dir))
    ids = torch.randint(3, source.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    short = tokens // 4
    return kv_bytes_per_token(converted, ids, short, tokens) / kv_bytes_per_token(source, ids, short, tokens)


def run_job(job: Job, measure: bool) -> dict[str, Any]:
    from kvconvert.io.hub import push
    from kvconvert.io.source import open_source
    from kvconvert.pipeline import convert

    method = build_method(job.method, job.config, job.storage)
    source = open_source(job.model, revision=job.revision, allow_pickle=job.allow_pickle)
    source_sha256 = source.sha256()
    result: dict[str, Any] = {"model": job.model, "out": str(job.out), "method": job.method}
    if _is_up_to_date(job.out, method, source_sha256):
        result["status"] = "skipped"
    else:
        if job.out.exists() and not (job.out / "kvconvert.json").exists():
            raise KVConvertError(f"{job.out} exists and is not a kvconvert output; refusing to replace it")
        convert(source, method, job.out, dtype=job.dtype, replace=True, progress=False)
        result["status"] = "ok"
    if measure:
        result["kv_budget_measured"] = measured_kv_budget(source.path, job.out)
    result["output_sha256"] = output_sha256(job.out)
    if job.push:
        result["pushed"] = push(job.out, job.push, private=job.private, revision=job.push_revision)
    return result


def _write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Atomically, after every job, so a killed run still leaves a readable summary."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


@dataclass
class BatchResult:
    jobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return sum(j["status"] == "failed" for j in self.jobs)


def run_batch(jobs_file: Path, summary_path: Path, measure: bool = True, echo: Any = print) -> BatchResult:
    jobs = parse_jobs(jobs_file)
    result = BatchResult()
    for index, job in enumerate(jobs):
        start = time.perf_counter()
        try:
            entry = run_job(job, measure)
        except KVConvertError as exc:
            entry = {"model": job.model, "out": str(job.out), "method": job.method, "status": "failed",
                     "error": str(exc)}  # fmt: skip
        except Exception as exc:  # a bug or an environment problem: record it, keep going
            entry = {"model": job.model, "out": str(job.out), "method": job.method, "status": "failed",
                     "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}  # fmt: skip
        entry["seconds"] = time.perf_counter() - start
        result.jobs.append(entry)
        echo(f"[{index + 1}/{len(jobs)}] {entry['status']:>7}  {job.method:<5} {job.model} -> {job.out}"
             + (f"  ({entry['error']})" if entry["status"] == "failed" else ""))  # fmt: skip
        _write_summary(summary_path, {"tool_version": kvconvert.__version__, "jobs_file": str(jobs_file),
                                      "jobs": result.jobs})  # fmt: skip
    return result
