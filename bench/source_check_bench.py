"""What checking a source costs a conversion (#36): slim on the 1.66 GB random MHA model of
``slim_bench.py`` (40 layers), with and without ``SourceCheckpoint.check`` (shapes against the config,
float dtypes, every value finite), alternating in one process, page cache warm; best and median of
``--rounds``. Writes bench/results/source-check-<date>.{json,md}."""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.slim_bench import build_source  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from kvconvert.io.checks import check_source
    from kvconvert.io.source import open_source
    from kvconvert.methods.slim.method import SlimConfig, SlimMethod
    from kvconvert.pipeline import convert

    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as work:
        src = Path(work) / "src"
        size = build_source(src, args.layers)
        times: dict[str, list[float]] = {"checked": [], "unchecked": [], "check alone": []}
        for _ in range(args.rounds):
            for checked in (True, False):
                source = open_source(str(src))
                if not checked:
                    source._checked = True  # what the conversion would cost without the check
                start = time.perf_counter()
                convert(source, SlimMethod(SlimConfig()), Path(work) / "out", replace=True, progress=False)
                times["checked" if checked else "unchecked"].append(time.perf_counter() - start)
                shutil.rmtree(Path(work) / "out")
            start = time.perf_counter()
            check_source(open_source(str(src)))
            times["check alone"].append(time.perf_counter() - start)
    rows = [[name, f"{min(t):.2f}", f"{statistics.median(t):.2f}", f"{size / min(t) / 1e6:.0f}"]
            for name, t in times.items()]  # fmt: skip
    table = markdown_table(["slim conversion", "best s", "median s", "MB/s (best)"], rows)
    overhead = min(times["checked"]) / min(times["unchecked"]) - 1
    table += (
        f"\n\n{size / 1e9:.2f} GB source, {args.layers} layers; the check adds {overhead:+.1%} (best of {args.rounds})."
    )
    write_results("source-check", {"machine": machine(), "source_bytes": size, "timings_s": times,
                                   "overhead": overhead}, table)  # fmt: skip


if __name__ == "__main__":
    main()
