"""``kvconvert batch``: many conversions from one jobs file, for CI.

Jobs run in order; a failing job is recorded and the rest still run. A job whose output already
holds the same source weights (sha256), recipe and tool version is skipped, so an interrupted run
can simply be started again: outputs are atomic, so only finished jobs exist.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kvconvert
from kvconvert.errors import KVConvertError
from kvconvert.methods import build_method
from kvconvert.methods.base import Method
from kvconvert.recipe import load_recipe, parse_recipe, read_yaml, recipe_text
from kvconvert.runtime.kvconvert_codec import QuantSpec


@dataclass(frozen=True)
class Job:
    name: str  # unique in its file; what --shard slices by (default: the job's out, as written)
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
    """Typed jobs; every mistake is one line naming the file and the job. Two jobs may not share a name
    or an output (the second would silently replace the first)."""
    jobs = _parse_jobs(path)
    for what, key in (("out", lambda j: str(j.out.resolve())), ("name", lambda j: j.name)):
        seen: dict[str, int] = {}
        for index, job in enumerate(jobs):
            other = seen.setdefault(key(job), index)
            if other != index:
                raise KVConvertError(f"{path}: jobs {other} and {index} have the same {what} ({key(job)}); "
                                     f"every job needs its own")  # fmt: skip
    return jobs


def _parse_jobs(path: Path) -> list[Job]:
    data = read_yaml(path, "jobs file")
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
            if not isinstance(entry.get(required), str) or not entry[required]:
                raise KVConvertError(f"{where}: {required!r} is required and must be a string")
        for key in ("name", "push", "revision", "push_revision", "dtype"):
            if key in entry and not isinstance(entry[key], str):
                raise KVConvertError(f"{where}: {key!r} must be a string")
        if "push" in entry:
            from kvconvert.io.hub import check_repo_id

            try:
                check_repo_id(entry["push"])
            except KVConvertError as exc:
                raise KVConvertError(f"{where}: {exc}") from None
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
                name=str(entry.get("name", entry["out"])),
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
    recipe = out / "recipe.yaml"  # what was asked for: method, options, storage (a plan's widths are its result)
    return (
        report.get("method") == method.name
        and report.get("params") == method.params()
        and recipe.is_file()
        and recipe.read_text() == recipe_text(method)
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
    from kvconvert.io.hub import publish
    from kvconvert.io.source import open_source
    from kvconvert.pipeline import convert

    method = build_method(job.method, job.config, job.storage)
    source = open_source(job.model, revision=job.revision, allow_pickle=job.allow_pickle)
    source_sha256 = source.sha256()
    result: dict[str, Any] = {"name": job.name, "model": job.model, "out": str(job.out), "method": job.method}
    if _is_up_to_date(job.out, method, source_sha256):
        result["status"] = "skipped"
    else:
        convert(source, method, job.out, dtype=job.dtype, replace=True, progress=False)
        result["status"] = "ok"
    if measure:
        result["kv_budget_measured"] = measured_kv_budget(source.path, job.out)
    result["output_sha256"] = output_sha256(job.out)
    if job.push:
        result["pushed"] = publish(job.out, job.push, private=job.private, revision=job.push_revision)[0]
    return result


def _is_summary(data: Any) -> bool:
    return isinstance(data, dict) and "jobs" in data and "tool_version" in data


def check_summary_path(path: Path) -> None:
    """Before any job runs: the summary must be writable and may replace only an earlier summary."""
    from kvconvert.io.outdir import refuse_foreign_file

    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
    refuse_foreign_file(path, "--summary", _is_summary, "a kvconvert batch summary")


def _write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Atomically, after every job, so a killed run still leaves a readable summary."""
    from kvconvert.io.outdir import write_text_atomic

    write_text_atomic(path, json.dumps(summary, indent=2) + "\n")


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` (1 ≤ I ≤ N) → (I, N)."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise KVConvertError(f"--shard takes I/N with 1 <= I <= N (e.g. 2/4), got {text!r}")
    return int(index), int(count)


def shard_jobs(jobs: list[Job], index: int, count: int) -> list[Job]:
    """The ``index``-th of ``count`` slices (1-based): jobs sorted by name, dealt round-robin, so slices
    differ in size by at most one and each machine of a CI matrix computes the same split."""
    chosen = {job.name for k, job in enumerate(sorted(jobs, key=lambda j: j.name)) if k % count == index - 1}
    return [job for job in jobs if job.name in chosen]


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class BatchResult:
    jobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return sum(j["status"] == "failed" for j in self.jobs)


def run_batch(
    jobs_file: Path, summary_path: Path, measure: bool = True, echo: Any = print, shard: tuple[int, int] | None = None
) -> BatchResult:
    """Run the jobs (``shard``: only slice I of N) in order; the summary is written before the first job
    and after every one."""
    all_jobs = parse_jobs(jobs_file)
    check_summary_path(summary_path)
    jobs = all_jobs if shard is None else shard_jobs(all_jobs, *shard)
    result = BatchResult()
    header = {"tool_version": kvconvert.__version__, "jobs_file": str(jobs_file),
              "jobs_file_sha256": _file_sha256(jobs_file), "shard": None if shard is None else f"{shard[0]}/{shard[1]}",
              "job_names": [job.name for job in jobs]}  # fmt: skip
    _write_summary(summary_path, {**header, "jobs": result.jobs})
    for index, job in enumerate(jobs):
        start = time.perf_counter()
        try:
            entry = run_job(job, measure)
        except Exception as exc:  # a user error, a bug or an environment problem: record it, keep going
            first = (str(exc).strip().splitlines() or [""])[0][:1000]
            error = first if isinstance(exc, KVConvertError) else f"{type(exc).__name__}: {first}"
            entry = {"name": job.name, "model": job.model, "out": str(job.out), "method": job.method,
                     "status": "failed", "error": error}  # fmt: skip
        entry["seconds"] = time.perf_counter() - start
        result.jobs.append(entry)
        echo(f"[{index + 1}/{len(jobs)}] {entry['status']:>7}  {job.method:<5} {job.model} -> {job.out}"
             + (f"  ({entry['error']})" if entry["status"] == "failed" else ""))  # fmt: skip
        _write_summary(summary_path, {**header, "jobs": result.jobs})
    return result


def merge_summaries(jobs_file: Path, summaries: list[Path], out: Path) -> BatchResult:
    """Join the summaries of a sharded run into one, in the jobs file's order. Every job of the file
    must appear in exactly one summary, and every summary must come from this very jobs file."""
    from kvconvert.io.source import read_json

    jobs = parse_jobs(jobs_file)
    check_summary_path(out)
    digest = _file_sha256(jobs_file)
    found: dict[str, dict[str, Any]] = {}
    for path in summaries:
        data = read_json(path, "batch summary")
        if not _is_summary(data):
            raise KVConvertError(f"{path} is not a kvconvert batch summary")
        if data.get("jobs_file_sha256") != digest:
            raise KVConvertError(f"{path} was written for another version of {jobs_file} (sha256 differs)")
        for entry in data["jobs"]:
            if entry.get("name") in found:
                raise KVConvertError(f"job {entry.get('name')!r} appears in two summaries (the second: {path})")
            found[entry.get("name")] = entry
    missing = [job.name for job in jobs if job.name not in found]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise KVConvertError(f"{len(missing)} job(s) of {jobs_file} are in no summary: {shown}")
    result = BatchResult([found[job.name] for job in jobs])
    _write_summary(out, {"tool_version": kvconvert.__version__, "jobs_file": str(jobs_file),
                         "jobs_file_sha256": digest, "shard": None, "merged_from": [str(p) for p in summaries],
                         "job_names": [job.name for job in jobs], "jobs": result.jobs})  # fmt: skip
    return result
