"""``kvconvert plan``: every method's candidates converted and scored; the frontier and its recipes."""

from __future__ import annotations

from pathlib import Path

import click

from kvconvert.cli.common import main, silence_libraries, user_errors
from kvconvert.errors import KVConvertError
from kvconvert.io.outdir import refuse_existing
from kvconvert.plan import CANDIDATES as PLAN_CANDIDATES


@main.command()
@click.option("--model", "model", required=True, help="Source model: Hub id or local directory.")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Plan directory to write.")
@click.option("--budgets", default="0.5,0.35,0.25,0.15", show_default=True,
              help="KV budgets (bytes ÷ a 16-bit cache's) to pick a recipe for.")  # fmt: skip
@click.option("--max-dppl", type=float, default=None, help="Also: the smallest budget within this Δppl (%).")
@click.option("--methods", default=",".join(PLAN_CANDIDATES), show_default=True, help="Methods to try.")
@click.option("--calib", default=None, help="Calibration text (file or directory); default: the shipped calib_data/.")
@click.option("--data", default=None, help="Score on this text instead of the end of the calibration text.")
@click.option("--context", type=int, default=512, show_default=True, help="Tokens into the cache per window.")
@click.option("--continuation", type=int, default=128, show_default=True, help="Tokens scored through it.")
@click.option("--windows", type=int, default=2, show_default=True, help="Windows scored per candidate.")
@click.option("--tasks", default="auto", show_default=True,
              help="Long-context tasks scored at the window's length (--context + --continuation), comma-separated "
                   "(see `kvconvert eval --tasks`), or none; auto: the four needle-in-a-haystack tasks from 2048 "
                   "tokens on, none below.")  # fmt: skip
@click.option("--task-samples", type=int, default=5, show_default=True, help="Samples per task.")
@click.option("--max-task-drop", type=float, default=2.0, show_default=True,
              help="A recipe is recommended only if its average task accuracy is within this many points of the "
                   "source's.")  # fmt: skip
@click.option("--task-tries", type=int, default=3, show_default=True,
              help="Candidates task-checked per budget, best KL first (each is converted again and answers every "
                   "sample).")  # fmt: skip
@click.option("--task-seed", type=int, default=0, show_default=True, help="Which task samples.")
@click.option("--device", default="auto", show_default=True, help="Where scoring runs: cpu, cuda, cuda:N, auto.")
@click.option("--build", type=click.Path(path_type=Path), default=None,
              help="Also build the winner at --kv-budget into this directory.")  # fmt: skip
@click.option("--kv-budget", "build_budget", type=float, default=None, help="The budget --build builds for.")
@click.option("--force", is_flag=True, help="Replace an existing --out (and --build).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@user_errors
def plan(model: str, out: Path, budgets: str, max_dppl: float | None, methods: str, calib: str | None,
         data: str | None, context: int, continuation: int, windows: int, tasks: str, task_samples: int,
         max_task_drop: float, task_tries: int, task_seed: int, device: str, build: Path | None,
         build_budget: float | None, force: bool, quiet: bool) -> None:  # fmt: skip
    """Convert and score every method's candidates on this model; write the frontier and the recipe
    that wins at each budget (build it with `kvconvert run PLAN/recipes/budget-B.yaml`)."""
    from kvconvert.devices import check_kernel_setting, resolve_device
    from kvconvert.plan import PlanConfig, format_report, run_plan

    if quiet:
        silence_libraries()
    refuse_existing(out, force)  # before the source and the reference model load
    check_kernel_setting(resolve_device(device))
    try:
        budget_values = tuple(float(b) for b in budgets.split(","))
    except ValueError:
        raise KVConvertError(f"--budgets must be comma-separated numbers, got {budgets!r}") from None
    if (build is None) != (build_budget is None):
        raise KVConvertError("--build and --kv-budget go together")
    if build is not None:
        refuse_existing(build, force, "--build")
    config = PlanConfig(
        budgets=budget_values if build_budget is None else tuple(sorted({*budget_values, build_budget})),
        max_dppl=max_dppl, methods=tuple(m.strip() for m in methods.split(",") if m.strip()), calib=calib,
        data=data, context=context, continuation=continuation, windows=windows, device=device, progress=not quiet,
        tasks=_task_names(tasks), task_samples=task_samples, max_task_drop=max_task_drop, task_tries=task_tries,
        task_seed=task_seed,
    )  # fmt: skip
    result = run_plan(model, out, config, replace=force)
    click.echo(format_report(result))
    click.echo(f"wrote {out}/frontier.json, frontier.png and recipes/")
    if build is not None:
        from kvconvert.cli.jobs import run_recipe
        from kvconvert.cli.options import ConversionOptions

        recipe = out / "recipes" / f"budget-{build_budget:g}.yaml"
        if not recipe.exists():
            raise KVConvertError(f"no candidate fits --kv-budget {build_budget:g}; the plan is in {out}")
        run_recipe(recipe, ConversionOptions(model=model, out=build, device=device, force=force, quiet=quiet))
        click.echo(f"built {recipe.name} into {build}")


def _task_names(tasks: str) -> tuple[str, ...] | None:
    """``--tasks``: None for auto, () for none, else known task names (one line listing them otherwise)."""
    from kvconvert.eval.tasks import parse_task_names

    if tasks.strip() in ("auto", "none"):
        return None if tasks.strip() == "auto" else ()
    return parse_task_names(tasks, keywords=("auto", "none"))
