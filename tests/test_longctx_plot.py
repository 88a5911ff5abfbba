"""``bench/longctx_plot.py``: runs of different sample counts compared on the same first samples, runs of other samples
refused, a method's line through its best recipe at each budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.longctx_plot import front, panel_points

TASKS = ("niah_single", "niah_multikey")


def _run(path: Path, samples: int, rows: dict[str, tuple[float, dict[str, list[float]]]], answers: bool) -> Path:
    """A longctx_bench JSON at 8192 tokens, seed 0: per label (budget, per task each sample's score)."""
    run = {"seed": 0, "lengths": [8192], "samples": samples, "tasks": list(TASKS),
           "budgets": {label: budget for label, (budget, _) in rows.items()},
           "recipes": {label: {"method": label.split()[0]} for label in rows if label != "source"},
           "accuracy": {label: {task: {"8192": 100 * sum(s) / len(s)} for task, s in scores.items()}
                        for label, (_, scores) in rows.items()}}  # fmt: skip
    if answers:
        run["answers"] = {label: {task: {"8192": [[score, f"answer {i}"] for i, score in enumerate(s)]}
                                  for task, s in scores.items()} for label, (_, scores) in rows.items()}  # fmt: skip
    path.write_text(json.dumps(run))
    return path


def test_runs_of_fifteen_and_five_samples_are_scored_on_the_same_five(tmp_path):
    source = {"niah_single": [1.0] * 5, "niah_multikey": [1.0, 0.0, 1.0, 0.0, 1.0]}
    short = _run(tmp_path / "a.json", 5, {"source": (1.0, source), "quant 3-bit": (0.22, {
        "niah_single": [1.0, 1.0, 1.0, 1.0, 0.0], "niah_multikey": [0.0] * 5})}, answers=False)  # fmt: skip
    # fifteen samples: the first five are the short run's prompts, the other ten would change the averages
    long = _run(tmp_path / "b.json", 15, {
        "source": (1.0, {task: scores + [0.0] * 10 for task, scores in source.items()}),
        "quant token": (0.23, {"niah_single": [1.0] * 5 + [0.0] * 10, "niah_multikey": [1.0, 0.0, 1.0, 0.0, 0.0] * 3}),
    }, answers=True)  # fmt: skip
    length, samples, points = panel_points([short, long], None)
    assert (length, samples) == (8192, 5)
    by_label = {p["label"]: p for p in points}
    assert by_label["source"]["average"] == pytest.approx((100 + 60) / 2)
    assert by_label["quant token"]["accuracy"] == pytest.approx({"niah_single": 100.0, "niah_multikey": 40.0})
    assert by_label["quant 3-bit"]["average"] == pytest.approx(40.0)
    assert by_label["quant 3-bit"]["method"] == "kvconvert quant"


def test_a_run_whose_source_answers_differently_is_refused(tmp_path):
    first = _run(tmp_path / "a.json", 5, {"source": (1.0, {task: [1.0] * 5 for task in TASKS})}, answers=True)
    other = _run(tmp_path / "b.json", 5, {"source": (1.0, {task: [0.0] * 5 for task in TASKS})}, answers=False)
    with pytest.raises(SystemExit, match="other samples"):
        panel_points([first, other], None)


def test_a_run_of_later_samples_is_refused(tmp_path):
    """A run extended with ``--from-sample`` answered the seed's later prompts: its first answers are not the panel's
    first samples, whichever labels it holds (a kvpress-only run has no source to catch it)."""
    first = _run(tmp_path / "a.json", 5, {"source": (1.0, {task: [1.0] * 5 for task in TASKS})}, answers=True)
    later = _run(tmp_path / "b.json", 5, {"kvpress KVzip@0.15": (0.15, {task: [0.0] * 5 for task in TASKS})},
                 answers=True)  # fmt: skip
    assert panel_points([first, later], None)[1] == 5
    later.write_text(json.dumps({**json.loads(later.read_text()), "first": 5}))
    with pytest.raises(SystemExit, match="start at the seed's 6th"):
        panel_points([first, later], None)


def test_a_methods_line_joins_its_best_recipe_at_each_budget():
    points = [{"budget": b, "average": a} for b, a in ((0.15, 40.0), (0.17, 35.0), (0.2, 50.0), (0.25, 50.0))]
    assert [(p["budget"], p["average"]) for p in front(points)] == [(0.15, 40.0), (0.2, 50.0)]
