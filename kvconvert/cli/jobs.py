"""``kvconvert run`` (a recipe), ``batch`` (many, for CI) and ``push`` (to the Hub)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from kvconvert.cli.common import main, run_conversion, silence_libraries, user_errors, wrote
from kvconvert.cli.options import ConversionOptions, conversion_options
from kvconvert.errors import KVConvertError


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@conversion_options
@user_errors
def run(
    recipe: Path,
    options: ConversionOptions,
) -> None:
    """Convert with a recipe (YAML: method + options); the recipe is saved as DST/recipe.yaml."""
    report = run_recipe(recipe, options)
    wrote(options.out, report)


def run_recipe(recipe: Path, options: ConversionOptions) -> dict[str, Any]:
    """``kvconvert run``'s conversion (``plan --build`` goes through it too): the recipe's method, with
    storage options given on the command line winning over the recipe's."""
    from kvconvert.methods import build_method
    from kvconvert.recipe import load_recipe

    name, config, storage = load_recipe(recipe)
    return run_conversion(build_method(name, config, storage), options)


@main.command()
@click.argument("jobs_file", type=click.Path(path_type=Path))
@click.argument("summaries", nargs=-1, type=click.Path(path_type=Path))
@click.option("--summary", type=click.Path(path_type=Path), default=None, help="JSON summary (default: next to JOBS).")
@click.option("--no-measure", is_flag=True, help="Skip measuring each output's KV budget from its cache.")
@click.option(
    "--shard", default=None,
    help="I/N: run only the I-th of N slices of the jobs (sorted by name, dealt round-robin), for a CI matrix of N "
         "machines; each writes its own summary.",
)  # fmt: skip
@click.option(
    "--merge-summaries", is_flag=True,
    help="Run nothing: join the SUMMARIES of a sharded run into --summary, checking every job of JOBS appears once.",
)  # fmt: skip
@user_errors
def batch(
    jobs_file: Path, summaries: tuple[Path, ...], summary: Path | None, no_measure: bool, shard: str | None,
    merge_summaries: bool,
) -> None:  # fmt: skip
    """Run every job of JOBS.yaml in order; skip up-to-date outputs; exit 1 if any job failed."""
    from kvconvert.batch import merge_summaries as merge
    from kvconvert.batch import parse_shard, run_batch

    if summaries and not merge_summaries:
        raise KVConvertError("summary files are arguments of --merge-summaries only")
    if merge_summaries:
        if shard is not None or not summaries:
            raise KVConvertError("--merge-summaries takes the shards' summary files (and no --shard)")
        summary = summary or jobs_file.with_suffix(".summary.json")
        result = merge(jobs_file, list(summaries), summary)
    else:
        parsed = None if shard is None else parse_shard(shard)
        default = ".summary.json" if parsed is None else f".shard-{parsed[0]}-of-{parsed[1]}.summary.json"
        summary = summary or jobs_file.with_suffix(default)
        silence_libraries()  # a CI log: one line per job
        result = run_batch(jobs_file, summary, measure=not no_measure, echo=click.echo, shard=parsed)
    click.echo(f"{len(result.jobs) - result.failed} of {len(result.jobs)} jobs succeeded; summary: {summary}")
    if result.failed:
        sys.exit(1)


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--repo-id", required=True, help="ORG/NAME on the Hub.")
@click.option("--private", is_flag=True, help="Create the repository as private.")
@click.option("--revision", default=None, help="Branch to push to (created if missing).")
@click.option("--dry-run", is_flag=True, help="List what would be uploaded; contact nobody.")
@user_errors
def push(directory: Path, repo_id: str, private: bool, revision: str | None, dry_run: bool) -> None:
    """Upload a converted directory to the Hub: the files kvconvert wrote there, with the model card
    refreshed from kvconvert.json / eval.json (written locally too once the upload succeeded); a card you edited
    goes up as it is."""
    from kvconvert.io.hub import publish
    from kvconvert.io.outdir import card_edited

    url, files, skipped = publish(directory, repo_id, private=private, revision=revision, dry_run=dry_run)
    if card_edited(directory):
        click.echo("README.md was edited since kvconvert wrote it: it goes up as it is (not refreshed from "
                   "kvconvert.json / eval.json)", err=True)  # fmt: skip
    if skipped:
        shown = ", ".join(skipped[:8]) + (f" and {len(skipped) - 8} more" if len(skipped) > 8 else "")
        click.echo(f"not uploading {len(skipped)} file(s) kvconvert did not write: {shown}", err=True)
    if url is None:
        for name, size in files:
            click.echo(f"{size:>14,}  {name}")
        target = f"{repo_id}{'@' + revision if revision else ''}{' (private)' if private else ''}"
        click.echo(f"dry run: {len(files)} files, {sum(size for _, size in files):,} bytes would go to {target}")
        return
    click.echo(f"pushed {len(files)} files: {url}")
