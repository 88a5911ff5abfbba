"""Decode speed of KIVI-layout storage with rotated values, the rotation folded into W_V / W_O (what ``quant
--kv-rotate`` writes since 2026-11-26) against the same checkpoint whose stores rotate values in and out (what it
wrote before: the source's W_V / W_O, the spec's ``rotate_in_weights`` removed), beside the source, in one process.

    python bench/kivi_rotation_bench.py --runs 4096x1 1024x8 [--bits 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.models import prepare_models  # noqa: E402


def _unfolded_copy(folded: Path, source: Path, out: Path) -> None:
    """``folded`` as the stores-rotate runtime reads it: the source's W_V / W_O and no ``rotate_in_weights``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folded, out)
    config = json.loads((out / "config.json").read_text())
    del config["kvconvert"]["kv_quant"]["rotate_in_weights"]
    (out / "config.json").write_text(json.dumps(config))
    tensors, stock = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    tensors.update({name: stock[name] for name in tensors if ".v_proj." in name or ".o_proj." in name})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["4096x1", "1024x8"], help="CONTEXTxBATCH")
    parser.add_argument("--bits", type=int, default=4)
    args = parser.parse_args()
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    import kvconvert
    from kvconvert.cli import main as cli
    from kvconvert.eval.speed import side_by_side

    source = prepare_models()["smollm2-135m"]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        folded, unfolded = Path(work) / "folded", Path(work) / "unfolded"
        result = CliRunner().invoke(cli, ["quant", "--model", str(source), "--out", str(folded), "--kv-bits",
                                          str(args.bits), "--kv-residual", "0", "--kv-sink", "4", "--kv-rotate",
                                          "--quiet", "--device", "cpu"])  # fmt: skip
        assert result.exit_code == 0, result.output
        _unfolded_copy(folded, source, unfolded)
        models = {"source": AutoModelForCausalLM.from_pretrained(source).eval(),
                  "rotation in W_V / W_O": kvconvert.load(folded).eval(),
                  "stores rotate (before)": kvconvert.load(unfolded).eval()}  # fmt: skip
        measured = {}
        for run in args.runs:
            context, batch = (int(x) for x in run.split("x"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                measured[run] = side_by_side(models, context=context, steps=16, rounds=3, batch=batch)
    rows = [[run, label, f"{m['decode_tokens_per_s']:.2f}",
             f"{m['decode_tokens_per_s'] / by_model['source']['decode_tokens_per_s']:.2f}"]
            for run, by_model in measured.items() for label, m in by_model.items()]  # fmt: skip
    table = markdown_table(["context × batch", "model", "decode tok/s", "× source"], rows)
    payload = {"machine": machine(), "bits": args.bits, "runs": measured, "seconds": time.perf_counter() - started}
    write_results("speed-kivi-rotation", payload, table)


if __name__ == "__main__":
    main()
