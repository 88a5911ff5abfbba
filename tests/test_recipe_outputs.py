"""Every recipe in recipes/ on the two real llama2.c models of ../shared (MHA aidreams260K, GQA
stories260K): the bytes a conversion writes — weights, config, recipe, and the report (the source's
local path set aside) — equal the digests recorded before the method-as-package redesign (#37), or the
one-line refusal recorded then. A refactor that changes one output byte fails here.

The bytes of float results differ between CPU families (their BLAS kernels sum in other orders: SVDs, Grams and
calibration passes end in other last bits), so each recipe and model keeps one set of digests per family it was
recorded on — AMD EPYC (AVX-512) on 2026-11-25, Intel Xeon (AMX) on 2026-11-26, both with the code of b707c38;
AVX2 (CI's host of 2026-12-05) on 2026-12-06, on an AVX-512 EPYC whose outputs equal the first set, with
``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``: the digests CI printed — and an
output must equal one of them, byte for byte. The two quant recipes with ``kv_rotate`` were recorded again
(once: a quant conversion computes nothing else in floats) when their rotation moved into W_V / W_O (2026-11-26);
every quant recipe's report and recipe digests when ``quant`` gained ``recall_context`` / ``recall_prompts``
(2026-11-29: two more options spelled out; every other file's digest asserted unchanged).

Record this machine's digests with ``python -m tests.test_recipe_outputs`` (added beside the others: run it on the
code whose outputs are the reference); ``--replace`` starts over (a change of output on purpose)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import kvconvert
from kvconvert.cli import main

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "models"
GOLDEN = Path(__file__).parent / "golden" / "recipe_outputs.json"
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
MODELS = {"aidreams260K": "tok512.bin", "stories260K": "tok512.bin"}


def digests(out: Path) -> dict[str, str]:
    """sha256 of what a conversion decides: every file but the runtime code, the card and the marker
    (they change with the package's own code), and the report and config without the source's local path."""
    found = {}
    for path in sorted(out.iterdir()):
        if path.suffix == ".py" or path.name in ("README.md", ".kvconvert-output.json"):
            continue
        data = path.read_bytes()
        if path.name == "kvconvert.json":  # the shipped calibration text is recorded where it is installed
            data = data.replace(str(Path(kvconvert.__file__).parent).encode(), b"<package>")
            report = json.loads(data)
            report["source"]["model"] = "<source>"
            data = json.dumps(report, sort_keys=True).encode()
        if path.name == "config.json":
            config = json.loads(data)
            config.pop("_name_or_path", None)  # where the source was loaded from
            data = json.dumps(config, sort_keys=True).encode()
        found[path.name] = hashlib.sha256(data).hexdigest()
    return found


# the digests were recorded on 2-core machines with torch's default of one thread per core: a BLAS call splits its
# sums by thread count, so a worker of `make test`'s parallel run (one thread each) would end in other last bits
RECORDED_THREADS = 2


def convert(recipe: str, source: Path, out: Path) -> dict[str, str] | str:
    threads = torch.get_num_threads()
    torch.set_num_threads(RECORDED_THREADS)
    try:
        result = CliRunner().invoke(main, ["run", str(ROOT / "recipes" / recipe), "--model", str(source), "--out",
                                           str(out), "--quiet"])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    if result.exit_code != 0:
        assert result.exit_code == 2, result.output
        return result.stderr.strip()
    return digests(out)


@pytest.fixture(scope="module")
def llama2c_models(tmp_path_factory):
    from kvconvert.io.llama2c import import_llama2c

    if not all((SHARED / name).is_dir() for name in MODELS):
        pytest.skip("../shared/models/{aidreams,stories}260K are not present")
    root = tmp_path_factory.mktemp("llama2c")
    return {name: import_llama2c(SHARED / name / f"{name}.bin", root / name, SHARED / name / tok)
            for name, tok in MODELS.items()}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_outputs_are_byte_identical(recipe, llama2c_models, tmp_path):
    golden = json.loads(GOLDEN.read_text())
    for name, source in llama2c_models.items():
        got = convert(recipe, source, tmp_path / name)
        assert got in accepted(golden[recipe][name]), f"{recipe} on {name}"


def accepted(recorded: Any) -> list[Any]:
    """The outputs recorded for one recipe and model: one per CPU family (a list), or the one (older files)."""
    return recorded if isinstance(recorded, list) else [recorded]


if __name__ == "__main__":
    import sys
    import tempfile

    from kvconvert.io.llama2c import import_llama2c

    with tempfile.TemporaryDirectory() as work:
        models = {name: import_llama2c(SHARED / name / f"{name}.bin", Path(work) / name, SHARED / name / tok)
                  for name, tok in MODELS.items()}  # fmt: skip
        table = {recipe: {name: convert(recipe, source, Path(work) / f"{recipe}-{name}")
                          for name, source in models.items()} for recipe in RECIPES}  # fmt: skip
    if "--replace" not in sys.argv and GOLDEN.exists():  # this machine's outputs beside those recorded elsewhere
        before = json.loads(GOLDEN.read_text())
        for recipe, outputs in table.items():
            for name, got in outputs.items():
                known = accepted(before.get(recipe, {}).get(name, []))
                outputs[name] = known if got in known else [*known, got]
                outputs[name] = outputs[name][0] if len(outputs[name]) == 1 else outputs[name]
    GOLDEN.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
