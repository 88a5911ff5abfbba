"""What every command shares: one-line errors, the command group, running a conversion."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from kvconvert import __version__
from kvconvert.errors import KVConvertError
from kvconvert.io.outdir import parse_size

if TYPE_CHECKING:
    from kvconvert.cli.options import ConversionOptions


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn KVConvertError into one line on stderr and exit status 2, without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KVConvertError as exc:
            fail(str(exc))
        except Terminated:  # SIGTERM (see ``main``): outputs were already cleaned up
            click.echo("kvconvert: error: terminated; no output was written", err=True)
            sys.exit(143)  # 128 + SIGTERM, what shells and CI runners expect
        except KeyboardInterrupt:  # Ctrl-C: outputs were already cleaned up
            click.echo("kvconvert: error: interrupted; no output was written", err=True)
            sys.exit(130)
        except OSError as exc:  # a full disk, a permission, a vanished file: the OS's words, one line
            where = f" ({exc.filename})" if exc.filename else ""
            fail(f"{exc.strerror or exc}{where}")

    return wrapper


MAX_ERROR_CHARS = 600  # an error quotes user input (a recipe value, a path): never let it flood the terminal


def fail(message: str) -> NoReturn:
    """Print ``message`` as the one error line (newlines folded, length capped) and exit 2."""
    line = " ".join(message.split())
    if len(line) > MAX_ERROR_CHARS:
        line = line[: MAX_ERROR_CHARS - 1] + "…"
    click.echo(f"kvconvert: error: {line}", err=True)
    sys.exit(2)


class Terminated(KeyboardInterrupt):
    """SIGTERM, unwound like Ctrl-C (``finally`` blocks remove partial outputs) but reported as 143."""


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM (what CI runners send on cancel) unwinds like Ctrl-C, so partial outputs are removed."""
    raise Terminated


class _Commands(click.Group):
    """Click, with its usage errors (a missing option, a bad choice, a typo) as kvconvert's one line on
    stderr and exit status 2, like every other user error, instead of a usage block."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        run = super().main
        if not standalone_mode:
            return run(*args, standalone_mode=False, **kwargs)  # type: ignore[call-overload]
        try:
            status = run(*args, standalone_mode=False, **kwargs)  # type: ignore[call-overload]  # int: --help/exit
        except click.exceptions.NoArgsIsHelpError as exc:  # bare `kvconvert`: the help, as click prints it
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            command = exc.ctx.command_path if exc.ctx is not None else "kvconvert"
            fail(f"{exc.format_message()} (see {command} --help)")
        except click.ClickException as exc:
            fail(exc.format_message())
        except click.Abort:  # Ctrl-C while click itself was reading
            click.echo("kvconvert: error: interrupted", err=True)
            sys.exit(130)
        sys.exit(status if isinstance(status, int) else 0)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvconvert")
def main() -> None:
    """Convert Hugging Face causal LMs into checkpoints with a smaller KV cache."""
    import signal

    signal.signal(signal.SIGTERM, _terminate)


def silence_libraries() -> None:
    """--quiet (and batch): transformers' "Loading weights" and the Hub's download bars off too."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    disable_progress_bars()


def run_conversion(method: Any, options: ConversionOptions) -> dict[str, Any]:
    if options.quiet:
        silence_libraries()
    from kvconvert.devices import computing_on, resolve_device
    from kvconvert.io.source import open_source
    from kvconvert.pipeline import convert

    method.storage = options.storage(method.storage)  # options given on the command line win over a recipe's
    device = resolve_device(options.device)
    source = open_source(options.model, revision=options.revision, allow_pickle=options.allow_pickle)
    with computing_on(device):
        result = convert(
            source,
            method,
            options.out,
            dtype=options.dtype,
            replace=options.force,
            max_shard_bytes=parse_size(options.max_shard_size),
            progress=not options.quiet,
        )
    if not options.quiet and (table := type(method).report_table(result.report)):
        click.echo(table)
    return result.report


def wrote(out: Path, report: dict[str, Any]) -> None:
    """The line a conversion ends with: where, and what the method made of the model."""
    from kvconvert.methods import METHODS

    click.echo(f"wrote {out} ({METHODS[report['method']].method.headline(report)})")
