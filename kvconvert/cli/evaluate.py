"""``kvconvert eval``: quality through the cache, measured KV bytes, speed, retrieval."""

from __future__ import annotations

from pathlib import Path

import click

from kvconvert.cli.common import main, silence_libraries, user_errors
from kvconvert.errors import KVConvertError


@main.command("eval")
@click.option("--model", "model", required=True, help="Local model directory (converted or not).")
@click.option("--reference", default=None, help="Source model directory to compare against.")
@click.option("--data", default=None, help="Text file, or dataset spec name[:config]:split:column (not with --tasks).")
@click.option("--ctx", type=int, default=1024, show_default=True, help="Window length (capped at the model's).")
@click.option("--max-tokens", type=int, default=None, help="Score only the first N tokens of --data.")
@click.option(
    "--chunk", type=int, default=None,
    help="Feed each window through the cache N tokens at a time; with --context, the context (chunked prefill: "
         "bounded memory at long contexts; prefill time and peak memory reported beside --reference's).",
)  # fmt: skip
@click.option("--context", type=int, default=None, help="Context protocol: N tokens into the cache in one forward…")
@click.option("--continuation", type=int, default=None, help="…then the next M scored in one forward through it.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Also write results here.")
@click.option("--retrieval-lengths", default=None, help="Comma-separated prompt lengths for passkey/copy.")
@click.option("--no-retrieval", is_flag=True, help="Skip passkey and copy tests.")
@click.option("--no-speed", is_flag=True, help="Skip throughput measurement.")
@click.option(
    "--speed-contexts", default=None,
    help="Comma-separated context lengths (e.g. 1024,4096,16384): decode speed side by side with --reference "
         "after each, interleaved, best of 2.",
)  # fmt: skip
@click.option(
    "--device", default="auto", show_default=True,
    help="Where both models run: cpu, cuda, cuda:N, or auto (the first GPU if there is one).",
)  # fmt: skip
@click.option(
    "--tasks", default=None,
    help="RULER-style long-context tasks instead of perplexity, comma-separated: niah_single, niah_multikey, "
         "niah_multivalue, niah_multiquery, vt, cwe, fwe (or all); accuracy per task and length vs --reference.",
)  # fmt: skip
@click.option("--lengths", "task_lengths", default="4096", show_default=True, help="With --tasks: prompt lengths.")
@click.option("--samples", type=int, default=15, show_default=True, help="With --tasks: samples per task and length.")
@click.option("--seed", type=int, default=0, show_default=True, help="With --tasks: which samples.")
@click.option("--allow-extrapolation", is_flag=True, help="With --tasks: lengths past the model's positions.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@user_errors
def eval_command(
    model: str,
    reference: str | None,
    data: str,
    ctx: int,
    max_tokens: int | None,
    chunk: int | None,
    context: int | None,
    continuation: int | None,
    json_out: Path | None,
    retrieval_lengths: str | None,
    no_retrieval: bool,
    no_speed: bool,
    speed_contexts: str | None,
    device: str,
    tasks: str | None,
    task_lengths: str,
    samples: int,
    seed: int,
    allow_extrapolation: bool,
    quiet: bool,
) -> None:
    """Perplexity, KL/top-1 vs --reference, measured KV bytes/token, speed, passkey and copy tests."""
    import json

    from kvconvert.devices import check_kernel_setting, resolve_device
    from kvconvert.eval.runner import EvalConfig, format_table, run_eval
    from kvconvert.io.model_card import is_eval_result
    from kvconvert.io.outdir import refuse_foreign_file, write_text_atomic

    if (tasks is None) == (data is None):
        raise KVConvertError("give --data (perplexity, KV bytes, speed) or --tasks (long-context tasks)")
    check_kernel_setting(resolve_device(device))
    if tasks is not None:
        from kvconvert.eval.runner import TaskEvalConfig, format_task_table, run_task_eval

        if json_out is not None:
            refuse_foreign_file(json_out, "--json", is_eval_result, "a kvconvert eval result")
        if quiet:
            silence_libraries()
        task_config = TaskEvalConfig.parse(tasks, task_lengths, samples, seed, allow_extrapolation, device, not quiet)
        task_result = run_task_eval(model, reference, task_config)
        click.echo(format_task_table(task_result))
        if json_out is not None:
            write_text_atomic(json_out, json.dumps(task_result, indent=2) + "\n")
        return
    try:
        lengths = tuple(int(n) for n in retrieval_lengths.split(",")) if retrieval_lengths else None
    except ValueError:
        raise KVConvertError(
            f"--retrieval-lengths must be comma-separated integers, got {retrieval_lengths!r}"
        ) from None
    try:
        contexts = tuple(int(n) for n in speed_contexts.split(",")) if speed_contexts else None
    except ValueError:
        raise KVConvertError(f"--speed-contexts must be comma-separated integers, got {speed_contexts!r}") from None
    if contexts is not None and (min(contexts) < 1 or no_speed):
        raise KVConvertError("--speed-contexts takes positive lengths and measures speed: not with --no-speed")
    if ctx < 2:
        raise KVConvertError(f"--ctx must be at least 2, got {ctx}")
    if chunk is not None and chunk < 1:
        raise KVConvertError(f"--chunk must be at least 1, got {chunk}")
    if (context is not None and context < 1) or (continuation is not None and continuation < 2):
        raise KVConvertError("--context must be at least 1 and --continuation at least 2")
    if lengths is not None and min(lengths) < 2:
        raise KVConvertError(f"--retrieval-lengths takes lengths of at least 2 tokens, got {retrieval_lengths!r}")
    if json_out is not None:  # before minutes of evaluation, not after
        refuse_foreign_file(json_out, "--json", is_eval_result, "a kvconvert eval result")
    if quiet:
        silence_libraries()
    config = EvalConfig(
        data=data, ctx=ctx, max_tokens=max_tokens, chunk=chunk, context=context, continuation=continuation,
        retrieval_lengths=lengths, retrieval=not no_retrieval,
        speed=not no_speed, speed_contexts=contexts, progress=not quiet, device=device,
    )  # fmt: skip
    result = run_eval(model, reference, config)
    click.echo(format_table(result))
    if json_out is not None:
        write_text_atomic(json_out, json.dumps(result, indent=2) + "\n")
