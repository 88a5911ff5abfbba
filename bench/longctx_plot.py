"""Needle accuracy against KV budget, one line per method, one panel per model and length (issue #40's figure), drawn
from ``longctx_bench.py``'s JSON files.

A panel's files must share the seed (samples depend only on seed, task, length and index), and each task is scored on
its first ``--samples`` samples (files that keep per-sample answers; older ones only with exactly that many), so runs
of 5 and of 15 samples per task compare on the very same prompts; a recipe's tasks may come from several files. Every
file recorded with the source (or kvpress without a press) must give it the same accuracy per task, which catches runs
made before a change of sample generator.
Writes NAME.png, NAME.json and NAME.md (``--out`` without the suffix):

    python bench/longctx_plot.py --out bench/results/longctx-accuracy-2026-11-30 \\
        --panel "SmolLM2-135M, 8K" bench/results/longctx-8k-kvpress-2026-11-29.json ... \\
        --panel "Gemma 3 270M, 16K" bench/results/longctx-gemma3-16k-token-keys-v2-2026-11-29.json ...
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import markdown_table  # noqa: E402

SOURCES = ("source", "kvpress, no press@1")


def method_of(label: str, recipe: dict[str, Any] | None) -> str:
    """The line a row belongs to: the source, a kvpress press, or a kvconvert method (composed with storage or not)."""
    if label in SOURCES:
        return "source"
    if label.startswith("kvpress "):
        return label.split("@")[0]
    method = (recipe or {}).get("method", label.split()[0])
    stored = method != "quant" and any(key in (recipe or {}) for key in ("kv_bits", "kv_format"))
    return f"kvconvert {method}" + (" + quantized storage" if stored else "")


def panel_points(files: list[Path], samples: int | None) -> tuple[int, int, list[dict[str, Any]]]:
    """(length, samples, points): per recipe label, its budget and accuracy on each task the source is scored on
    (every task of the panel when no file has the source), each on its first ``samples`` samples (None: as many as
    every file holds); a label missing a task is left out, said on stderr."""
    runs = [json.loads(path.read_text()) for path in files]
    samples = samples or min(run["samples"] for run in runs)
    seeds, lengths = {run["seed"] for run in runs}, {tuple(run["lengths"]) for run in runs}
    if len(seeds) != 1 or len(lengths) != 1 or len(next(iter(lengths))) != 1:
        raise SystemExit(f"a panel's files share one seed and one length: {sorted(seeds)}, {sorted(lengths)}")
    for path, run in zip(files, runs, strict=True):  # a run of later samples (--from-sample) answered other prompts
        if run.get("first", 0):
            raise SystemExit(f"{path.name}: its samples start at the seed's {run['first'] + 1}th; a panel scores the "
                             "first ones")  # fmt: skip
    length = str(next(iter(lengths))[0])
    scores: dict[str, dict[str, float]] = {}
    budgets: dict[str, float] = {}
    recipes: dict[str, Any] = {}
    for path, run in zip(files, runs, strict=True):
        answers = run.get("answers")  # per sample; older files hold only each task's accuracy over all samples
        if run["samples"] < samples or (answers is None and run["samples"] != samples):
            raise SystemExit(f"{path.name}: {run['samples']} samples per task and no per-sample answers")
        recipes.update(run.get("recipes") or {})
        for label, budget in run["budgets"].items():
            key = "source" if label in SOURCES else label
            budgets[key] = budget
            for task in run["tasks"]:
                if answers is None:
                    accuracy = run["accuracy"][label][task][length]
                else:
                    first = answers[label][task][length][:samples]
                    accuracy = 100 * sum(score for score, _ in first) / len(first)
                known = scores.setdefault(key, {}).get(task)
                if key == "source" and known is not None and abs(known - accuracy) > 1e-6:  # other prompts
                    raise SystemExit(f"{path.name}: the source scores {task} {accuracy:.1f}, not {known:.1f}: "
                                     "these are other samples")  # fmt: skip
                scores[key][task] = accuracy
    tasks = set(scores["source"]) if "source" in scores else set.intersection(*(set(t) for t in scores.values()))
    points = []
    for label, accuracy in scores.items():
        if not tasks <= set(accuracy):
            print(f"left out {label!r}: scored on {sorted(accuracy)}, not {sorted(tasks)}", file=sys.stderr)
            continue
        mine = {task: accuracy[task] for task in sorted(tasks)}
        points.append({"label": label, "method": method_of(label, recipes.get(label)), "budget": budgets[label],
                       "accuracy": mine, "average": sum(mine.values()) / len(mine)})  # fmt: skip
    return int(length), samples, sorted(points, key=lambda p: (p["method"], p["budget"]))


def front(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points no other one beats with a budget as small and an accuracy as high: a method's best recipe at each
    budget, what its line joins."""
    best: list[dict[str, Any]] = []
    for point in sorted(points, key=lambda p: (p["budget"], -p["average"])):
        if not best or point["average"] > best[-1]["average"]:
            best.append(point)
    return best


def draw(panels: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    methods = sorted({p["method"] for panel in panels for p in panel["points"] if p["method"] != "source"})
    ncol = 2 if cols == 1 else 4  # the legend below the panels, as wide as they are
    legend = 0.3 + 0.2 * -(-(len(methods) + 1) // ncol)  # inches: its rows
    fig, grid = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows + legend), squeeze=False, sharey=True)
    axes = list(grid.flat)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    style = {m: (f"C{i % 10}", "o" if m.startswith("kvconvert") else "x") for i, m in enumerate(methods)}
    for ax, panel in zip(axes, panels, strict=False):  # spare axes stay hidden
        source = [p for p in panel["points"] if p["method"] == "source"]
        if source:
            ax.axhline(source[0]["average"], color="black", linestyle="--", linewidth=1, label="source")
        for method in methods:
            mine = [p for p in panel["points"] if p["method"] == method]
            if mine:  # every recipe a marker, the method's best at each budget joined
                color, marker = style[method]
                ax.scatter([p["budget"] for p in mine], [p["average"] for p in mine], marker=marker, color=color)
                best = front(mine)
                ax.plot([p["budget"] for p in best], [p["average"] for p in best], marker=marker, color=color,
                        linestyle="-" if marker == "o" else ":", label=method)  # fmt: skip
        tasks = len(panel["points"][0]["accuracy"]) if panel["points"] else 0
        ax.set_title(f"{panel['title']} ({tasks} tasks, {panel['samples']} samples each)", fontsize=9)
        ax.set_xlabel("KV budget (of a 16-bit cache)")
        budgets = [p["budget"] for p in panel["points"] if p["method"] != "source"] or [0.5]
        ax.set_xlim(max(0.0, min(budgets) - 0.04), min(1.0, max(budgets) + 0.06))  # the source: its dashed line
        ax.grid(alpha=0.3)
    for row in grid:
        row[0].set_ylabel("task accuracy, % (mean over the tasks)")
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines()}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, legend / (3.4 * rows + legend), 1, 1))
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--panel", nargs="+", action="append", required=True, metavar=("TITLE", "FILE"),
                        help="a panel's title, then JSON files of one model, length and seed")  # fmt: skip
    parser.add_argument("--samples", type=int, default=None,
                        help="score each task's first N samples (default: all a panel's files hold)")  # fmt: skip
    parser.add_argument("--out", required=True, help="NAME: writes NAME.png, NAME.json and NAME.md")
    args = parser.parse_args()
    panels = []
    for title, *files in args.panel:
        length, samples, points = panel_points([Path(f) for f in files], args.samples)
        panels.append({"title": title, "length": length, "samples": samples, "files": files, "points": points})
    out = Path(args.out)
    draw(panels, out.with_suffix(".png"))
    out.with_suffix(".json").write_text(json.dumps({"panels": panels}, indent=1))
    rows = [[f"{panel['title']} ({panel['samples']} a task)", p["label"], f"{p['budget']:.3f}", f"{p['average']:.1f}"]
            for panel in panels for p in panel["points"]]  # fmt: skip
    table = markdown_table(["panel (samples)", "model", "KV budget", "average accuracy (%)"], rows)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    command = " ".join(shlex.quote(a) for a in ["python", "bench/longctx_plot.py", *sys.argv[1:]])
    sources = "\n".join(f"- {p['title']}: " + ", ".join(f"`{Path(f).name}`" for f in p["files"]) for p in panels)
    out.with_suffix(".md").write_text(
        f"# {__doc__.splitlines()[0]}\n\nDrawn {time.strftime('%Y-%m-%d')} at {commit} from the runs below (each "
        f"file's header says where and when it was measured); the figure: `{out.with_suffix('.png').name}`.\n\n"
        f"    {command}\n\n{sources}\n\n{table}\n")  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
