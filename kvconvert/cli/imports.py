"""``kvconvert import-llama2c`` and ``import-gguf``: other formats into Hugging Face directories."""

from __future__ import annotations

from pathlib import Path

import click

from kvconvert.cli.common import main, silence_libraries, user_errors
from kvconvert.io.outdir import refuse_existing, refuse_overlap


@main.command("import-llama2c")
@click.argument("checkpoint", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--out", "out", required=True, type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Replace an existing --out.")
@user_errors
def import_llama2c(checkpoint: Path, tokenizer: Path | None, out: Path, force: bool) -> None:
    """Import a llama2.c (v0 .bin) model, and optionally its tok*.bin vocab, as an HF Llama directory."""
    from kvconvert.io.llama2c import import_llama2c as run_import

    refuse_overlap(out, [checkpoint, *([tokenizer] if tokenizer else [])])  # the input's own message first
    refuse_existing(out, force)
    run_import(checkpoint, out, tokenizer=tokenizer, replace=force)
    click.echo(f"wrote {out}")


@main.command("import-gguf")
@click.argument("gguf_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", "out", required=True, type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Replace an existing --out.")
@user_errors
def import_gguf(gguf_file: Path, out: Path, force: bool) -> None:
    """Import a GGUF file (what transformers' GGUF loader reads: Llama, Qwen2, Gemma 3, …) as a float32
    safetensors HF directory: weights dequantized, tokenizer included. Needs `pip install 'kvconvert[gguf]'`."""
    from kvconvert.io.gguf_import import import_gguf as run_import

    refuse_overlap(out, [gguf_file])
    refuse_existing(out, force)
    silence_libraries()
    run_import(gguf_file, out, replace=force)
    click.echo(f"wrote {out}")
