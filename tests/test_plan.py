"""``kvconvert plan``: the frontier's selection logic against hand-made rows, and the planner's numbers
against ``kvconvert eval`` of the checkpoint that ``kvconvert run`` builds from the recipe it wrote."""

from __future__ import annotations

import itertools
import json
import random
import shutil

import pytest
import yaml

from kvconvert.plan import best_within, pareto_front, smallest_within
from tests.helpers import run_cli


def row(label: str, method: str, budget: float, dppl: float, kl: float | None = None) -> dict:
    return {"label": label, "method": method, "kv_budget": budget, "dppl": dppl, "kl": dppl / 100 if kl is None else kl}


def dominated(a: dict, b: dict) -> bool:
    """b beats a on both axes (no worse on either, better on one)."""
    return (b["kv_budget"] <= a["kv_budget"] and b["dppl"] <= a["dppl"]) and (
        b["kv_budget"] < a["kv_budget"] or b["dppl"] < a["dppl"]
    )


def test_pareto_front_of_hand_made_rows():
    rows = [row("a", "quant", 0.28, 0.2), row("b", "quant", 0.22, 2.0), row("c", "razor", 0.5, 3.0),
            row("d", "razor", 0.15, 4.0), row("e", "quant", 0.56, 0.0), row("f", "lorc", 0.3, 40.0)]  # fmt: skip
    assert [r["label"] for r in pareto_front(rows)] == ["d", "b", "a", "e"]


@pytest.mark.parametrize("seed", range(5))
def test_pareto_front_holds_exactly_the_undominated(seed):
    rng = random.Random(seed)
    rows = [row(str(i), "m", round(rng.uniform(0.1, 1), 2), round(rng.uniform(-1, 30), 1)) for i in range(40)]
    front = pareto_front(rows)
    for a, b in itertools.product(front, rows):
        assert not dominated(a, b), (a, b)  # nothing beats a front member on both axes
    for a in rows:  # everything else is beaten by, or ties with, a front member
        assert a in front or any(dominated(a, f) or (f["kv_budget"], f["dppl"]) == (a["kv_budget"], a["dppl"])
                                 for f in front)  # fmt: skip


def test_winner_runner_up_and_smallest_within():
    rows = [row("q4", "quant", 0.28, 0.2), row("q3", "quant", 0.22, 0.6), row("r", "razor", 0.18, 3.8),
            row("r3", "razor", 0.15, 4.1)]  # fmt: skip
    pick = best_within(rows, 0.3)
    assert pick is not None
    assert (pick["winner"], pick["runner_up"]) == ("q4", "r") and pick["margin_dppl"] == pytest.approx(3.6)
    assert best_within(rows, 0.16)["winner"] == "r3" and best_within(rows, 0.16)["runner_up"] is None
    assert best_within(rows, 0.1) is None
    assert smallest_within(rows, 1.0)[0]["label"] == "q3"
    assert smallest_within(rows, 0.1) == (None, [])


def test_task_check_walks_candidates_by_kl_within_the_tries():
    """With a task check, the winner is the first of the ``tries`` best by KL that passes; those it rejected are
    named, the runner-up is never a rejected one, and past the tries nothing is recommended."""
    rows = [row("q4", "quant", 0.28, 0.2, kl=0.01), row("q3", "quant", 0.22, 0.6, kl=0.02),
            row("r", "razor", 0.18, 3.8, kl=0.03), row("z", "zack", 0.25, 5.0, kl=0.04)]  # fmt: skip
    failing = {"q4", "q3"}
    checked: list[str] = []

    def passes(r: dict) -> bool:
        checked.append(r["label"])
        return r["label"] not in failing

    pick = best_within(rows, 0.3, passes, tries=3)
    assert pick is not None and pick["winner"] == "r" and pick["rejected_by_tasks"] == ["q4", "q3"]
    assert pick["runner_up"] == "z" and checked == ["q4", "q3", "r"]
    assert best_within(rows, 0.3, passes, tries=2) == {"budget": 0.3, "winner": None, "rejected_by_tasks": ["q4", "q3"]}
    assert smallest_within(rows, 4.0, passes, tries=3) == (rows[2], [])
    failing.add("r")
    assert smallest_within(rows, 4.0, passes, tries=3) == (None, ["r", "q3", "q4"])


def test_winner_is_ranked_by_kl_not_by_noisy_dppl():
    """Two 4-bit layouts whose Δppl differ by noise (the frontier bench's numbers): the lower KL wins."""
    rows = [row("kivi", "quant", 0.284, -0.04, kl=0.0039), row("token", "quant", 0.292, 0.02, kl=0.0014),
            row("razor", "razor", 0.18, 3.9, kl=0.027)]  # fmt: skip
    pick = best_within(rows, 0.3)
    assert pick is not None and pick["winner"] == "token" and pick["kl"] == 0.0014
    assert pick["runner_up"] == "razor" and pick["margin_kl"] == pytest.approx(0.0256)
    assert best_within(rows, 0.29)["winner"] == "kivi"  # the token layout does not fit


@pytest.mark.slow
def test_plan_agrees_with_eval_of_the_recipe_it_writes(tokenized_model_dir, tmp_path):
    src = tokenized_model_dir("llama_gqa64")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the light keeper climbs the stairs at dusk and trims the wick"] * 40))
    plan_dir = tmp_path / "plan"
    result = run_cli("plan", "--model", str(src), "--out", str(plan_dir), "--methods", "quant,slim",
                     "--budgets", "0.6,0.3", "--max-dppl", "50", "--data", str(text), "--context", "192",
                     "--continuation", "32", "--windows", "2", "--device", "cpu", "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    frontier = json.loads((plan_dir / "frontier.json").read_text())
    assert {r["label"] for r in frontier["candidates"]} >= {"quant 8-bit", "quant 4-bit"}
    assert [r["method"] for r in frontier["refused"]] == ["slim", "slim"]  # GQA: refused with slim's reason
    assert "multi-head attention" in frontier["refused"][0]["reason"]
    assert (plan_dir / "frontier.png").stat().st_size > 0
    assert "budget 0.3:" in result.output and "refused: slim (paper)" in result.output
    pick = next(p for p in frontier["budgets"] if p["budget"] == 0.3)
    chosen = next(r for r in frontier["candidates"] if r["label"] == pick["winner"])
    assert chosen["kv_budget"] <= 0.3
    recipe = plan_dir / "recipes" / "budget-0.3.yaml"
    assert yaml.safe_load(recipe.read_text())["method"] == "quant"
    assert (plan_dir / "recipes" / "max-dppl-50.yaml").exists()

    dst = tmp_path / "built"
    assert run_cli("run", str(recipe), "--model", str(src), "--out", str(dst), "--quiet").exit_code == 0
    out = tmp_path / "eval.json"
    evaluated = run_cli("eval", "--model", str(dst), "--reference", str(src), "--data", str(text), "--context", "192",
                        "--continuation", "32", "--max-tokens", "448", "--no-retrieval", "--no-speed",
                        "--device", "cpu", "--json", str(out), "--quiet")  # fmt: skip
    assert evaluated.exit_code == 0, evaluated.output
    measured = json.loads(out.read_text())
    dppl = 100 * (measured["ppl"] / measured["reference_ppl"] - 1)
    assert dppl == pytest.approx(chosen["dppl"], rel=0.1, abs=1e-6)
    assert measured["kv_budget_vs_16bit"] == pytest.approx(chosen["kv_budget"], rel=1e-6)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--budgets", "half"], "--budgets must be comma-separated numbers"),
        (["--budgets", "1.5"], "--budgets must be numbers in (0, 1]"),
        (["--methods", "quant,magic"], "--methods must be some of"),
        (["--windows", "0"], "--windows >= 1"),
        (["--device", "tpu"], "--device must be cpu, cuda, cuda:N or auto"),
        (["--kv-budget", "0.3"], "--build and --kv-budget go together"),
    ],
)
def test_plan_user_errors_are_one_line_and_write_nothing(tokenized_model_dir, tmp_path, args, message):
    out = tmp_path / "plan"
    result = run_cli("plan", "--model", str(tokenized_model_dir("llama_gqa64")), "--out", str(out), *args)
    assert result.exit_code == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_plan_refuses_an_existing_out(tokenized_model_dir, tmp_path):
    out = tmp_path / "plan"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli("plan", "--model", str(tokenized_model_dir("llama_gqa64")), "--out", str(out), "--methods",
                     "quant", "--context", "48", "--continuation", "24", "--quiet")  # fmt: skip
    assert result.exit_code == 2 and "already exists" in result.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.slow
def test_plan_on_a_real_model_agrees_with_eval(aidreams_dir, tmp_path):
    """The same agreement on a real (llama2.c, MHA) model scored on real text: slim is a candidate here,
    and the winner at 0.6 is built from its recipe and evaluated by ``kvconvert eval``."""
    from tests.conftest import SHARED

    text = SHARED / "data" / "tinystories" / "tinystories_validation_head.txt"
    if not text.exists():
        pytest.skip("../shared/data/tinystories is not present")
    plan_dir = tmp_path / "plan"
    result = run_cli("plan", "--model", str(aidreams_dir), "--out", str(plan_dir), "--methods", "quant,slim",
                     "--budgets", "0.6", "--data", str(text), "--context", "96", "--continuation", "32",
                     "--windows", "2", "--device", "cpu", "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    frontier = json.loads((plan_dir / "frontier.json").read_text())
    slim = next(r for r in frontier["candidates"] if r["label"] == "slim (paper)")
    assert slim["kv_budget"] == pytest.approx(0.5, abs=0.01) and abs(slim["dppl"]) < 0.01  # exact, half the cache
    pick = frontier["budgets"][0]
    chosen = next(r for r in frontier["candidates"] if r["label"] == pick["winner"])
    dst = tmp_path / "built"
    assert run_cli("run", str(plan_dir / "recipes" / "budget-0.6.yaml"), "--model", str(aidreams_dir), "--out",
                   str(dst), "--quiet").exit_code == 0  # fmt: skip
    out = tmp_path / "eval.json"
    evaluated = run_cli("eval", "--model", str(dst), "--reference", str(aidreams_dir), "--data", str(text),
                        "--context", "96", "--continuation", "32", "--max-tokens", "256", "--no-retrieval",
                        "--no-speed", "--device", "cpu", "--json", str(out), "--quiet")  # fmt: skip
    assert evaluated.exit_code == 0, evaluated.output
    measured = json.loads(out.read_text())
    dppl = 100 * (measured["ppl"] / measured["reference_ppl"] - 1)
    assert dppl == pytest.approx(chosen["dppl"], rel=0.1, abs=1e-3)
    assert measured["kv_budget_vs_16bit"] == pytest.approx(chosen["kv_budget"], rel=1e-3)


@pytest.mark.slow
def test_plan_build_makes_the_winner_in_one_command(tokenized_model_dir, tmp_path):
    import kvconvert

    src = tokenized_model_dir("llama_gqa64")
    dst = tmp_path / "built"
    result = run_cli("plan", "--model", str(src), "--out", str(tmp_path / "plan"), "--methods", "quant",
                     "--budgets", "0.6", "--context", "192", "--continuation", "32", "--windows", "1",
                     "--device", "cpu", "--build", str(dst), "--kv-budget", "0.3", "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "built budget-0.3.yaml" in result.output
    assert (tmp_path / "plan" / "recipes" / "budget-0.6.yaml").exists()  # the asked budget is planned too
    spec = kvconvert.load(dst).config.kvconvert
    winner = next(p for p in json.loads((tmp_path / "plan" / "frontier.json").read_text())["budgets"]
                  if p["budget"] == 0.3)  # fmt: skip
    assert spec["method"] == "quant" and winner["kv_budget"] <= 0.3


@pytest.mark.slow
def test_plan_keeps_one_candidate_on_disk_at_a_time(tokenized_model_dir, tmp_path, monkeypatch):
    """Each candidate is a whole checkpoint: it is deleted once scored, so a plan of a 7B model needs
    the disk of one conversion, not of twenty."""
    import re
    import shutil
    from pathlib import Path

    import kvconvert.plan as plan

    removed: list[list[str]] = []
    rmtree = shutil.rmtree

    def watched(path, *args, **kwargs):
        path = Path(path)
        if re.fullmatch(r"c\d+", path.name):  # a candidate: what the work dir holds right then
            removed.append(sorted(p.name for p in path.parent.iterdir()))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(plan.shutil, "rmtree", watched)
    result = run_cli("plan", "--model", str(tokenized_model_dir("llama_gqa64")), "--out", str(tmp_path / "plan"),
                     "--methods", "quant", "--budgets", "0.6", "--context", "64", "--continuation", "16",
                     "--windows", "1", "--device", "cpu", "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert len(removed) == len(plan.CANDIDATES["quant"])
    assert all(len(names) == 1 for names in removed), removed


@pytest.mark.slow
def test_plan_recommends_only_recipes_within_the_task_drop(tokenized_model_dir, tmp_path, monkeypatch):
    """``--tasks``: the source and each checked candidate answer the same samples (made once, at the window's
    length); a budget's winner is the best by KL whose accuracy is within ``--max-task-drop`` of the source's.
    Accuracy is faked by bits (a tiny random model answers nothing), the rest is the real plan."""
    import kvconvert.eval.tasks as tasks

    answered: list[list[tuple]] = []  # per check (source first), the prompts answered in order

    def fake_answer(model, tokenizer, sample, chunk=512, prefill_with=None):
        if not answered or tuple(sample.prompt) == answered[0][0]:  # every check starts at the first sample
            answered.append([])
        answered[-1].append(tuple(sample.prompt))
        spec = getattr(model.config, "kvconvert", None)
        bits = 16 if spec is None else (spec.get("kv_quant") or {}).get("bits", 16)
        return sample.answers[0] if bits >= 8 else "wrong"  # below 8 bits every answer is wrong

    monkeypatch.setattr(tasks, "answer", fake_answer)
    src = tmp_path / "src"  # the tiny model with room for prompts that hold needles in its character tokens
    shutil.copytree(tokenized_model_dir("llama_gqa64"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    plan_dir = tmp_path / "plan"
    result = run_cli("plan", "--model", str(src), "--out", str(plan_dir),
                     "--methods", "quant", "--budgets", "0.6,0.3", "--context", "992", "--continuation", "32",
                     "--windows", "1", "--tasks", "niah_single,niah_multikey", "--task-samples", "2",
                     "--device", "cpu", "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    frontier = json.loads((plan_dir / "frontier.json").read_text())
    assert frontier["tasks"]["source_average"] == 100.0 and frontier["tasks"]["length"] == 1024
    source_prompts, *others = answered
    assert len(source_prompts) == 4 and others  # 2 tasks × 2 samples
    assert all(prompts == source_prompts[: len(prompts)] for prompts in others)  # the very same prompts, in order
    high, low = frontier["budgets"]
    assert high["winner"] is not None and high["task_drop"] == 0.0
    fitting = sorted((r for r in frontier["candidates"] if r["kv_budget"] <= 0.3), key=lambda r: (r["kl"], r["dppl"]))
    assert fitting and low["winner"] is None  # every candidate below 8 bits loses 50 points: none is recommended
    assert low["rejected_by_tasks"] == [r["label"] for r in fitting[:3]]
    # each rejected check stopped after its first wrong answer: the 2-point bound was out of reach
    assert all(r["task_check_stopped"] and r["task_drop"] == 25.0 for r in fitting[:3])
    assert sum(len(prompts) == 1 for prompts in others) == len(fitting[:3])
    assert "(at most -25.0 points, stopped once out of reach)" in result.output
    assert not (plan_dir / "recipes" / "budget-0.3.yaml").exists()
    assert "tasks +0.0 points" in result.output and "budget 0.3: no candidate passes the task check" in result.output
    # 2 tasks × 2 samples: one answer is 25 points of the average, far coarser than the 2-point bound, and it says so
    assert "(one answer moves the average by up to 25.0 points; more --task-samples resolve finer)" in result.output
    assert "long-context tasks +0.0 points" in (plan_dir / "recipes" / "budget-0.6.yaml").read_text()


def test_plan_task_errors_are_one_line(tokenized_model_dir, tmp_path):
    src = str(tokenized_model_dir("llama_gqa64"))
    for args, message in ((["--tasks", "niah_magic"], "unknown task niah_magic"),
                          (["--tasks", "niah_multivalue", "--context", "40", "--continuation", "24"],
                           "cannot hold the task's needles"),
                          (["--max-task-drop", "-1"], "--max-task-drop >= 0")):  # fmt: skip
        result = run_cli("plan", "--model", src, "--out", str(tmp_path / "plan"), "--methods", "quant", *args)
        assert result.exit_code == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "plan").exists()


def test_plan_task_checks_ask_first_what_the_source_missed(tokenized_model_dir, tmp_path, monkeypatch):
    """A candidate's check answers first the samples the source missed (as a rule it misses them too, so a check
    bound to fail is out of reach sooner), then the rest in the source's order; the verdicts are the bound's."""
    import kvconvert.eval.tasks as tasks

    checks: list[tuple[int, list[tuple]]] = []  # (model, prompts answered in order), one per check

    def fake_answer(model, tokenizer, sample, chunk=512, prefill_with=None):
        if not checks or checks[-1][0] != id(model):
            checks.append((id(model), []))
        checks[-1][1].append(tuple(sample.prompt))
        source = getattr(model.config, "kvconvert", None) is None
        missed = source and len(checks[-1][1]) == 3  # the source misses its third sample
        return "wrong" if missed else sample.answers[0]

    monkeypatch.setattr(tasks, "answer", fake_answer)
    src = tmp_path / "src"
    shutil.copytree(tokenized_model_dir("llama_gqa64"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    result = run_cli("plan", "--model", str(src), "--out", str(tmp_path / "plan"), "--methods", "quant",
                     "--budgets", "0.6", "--context", "992", "--continuation", "32", "--windows", "1", "--tasks",
                     "niah_single,niah_multikey", "--task-samples", "2", "--device", "cpu", "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    (_, source), (_, candidate), *_ = checks
    assert len(source) == 4 and candidate == [source[2], source[0], source[1], source[3]]
    frontier = json.loads((tmp_path / "plan" / "frontier.json").read_text())
    assert frontier["tasks"]["source_average"] == 75.0 and frontier["budgets"][0]["task_drop"] == -25.0


def test_plan_quantizes_sliding_windows_of_models_that_have_them(tokenized_model_dir, tmp_path):
    """On a model with sliding-window layers (Gemma 3) quant's integer candidates store the windows at 8 bits too
    (``kv_local_bits: 8`` in the recipe written, said in the label; left at 16 bits they would floor every budget at a
    long context); every one of them converts and is scored, and a model without windows keeps the list as it is."""
    from kvconvert import plan

    plain = plan.candidates(("quant",), local_layers=False)
    assert [(label, recipe) for _, label, recipe in plain] == plan.CANDIDATES["quant"]
    result = run_cli("plan", "--model", str(tokenized_model_dir("gemma3_64")), "--out", str(tmp_path / "plan"),
                     "--methods", "quant", "--budgets", "0.6", "--context", "96", "--continuation", "16",
                     "--windows", "1", "--device", "cpu", "--tasks", "none", "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    frontier = json.loads((tmp_path / "plan" / "frontier.json").read_text())
    rows = {row["label"]: row for row in frontier["candidates"]}
    integer = [label for _, label, recipe in plan.candidates(("quant",), True) if "kv_local_bits" in recipe]
    assert len(integer) == len(plan.CANDIDATES["quant"]) - 1  # all but fp8
    assert all("local layers at 8 bits" in label and rows[label]["recipe"]["kv_local_bits"] == 8 for label in integer)
    refused = {entry["label"] for entry in frontier["refused"]}
    assert not refused & set(integer) and set(integer) <= set(rows)


def test_every_candidate_is_a_recipe_its_method_accepts():
    """A candidate's recipe is what ``kvconvert run`` reads back: each parses, builds its method and writes itself
    out again with its options (a misspelled or misplaced key would fail here, not minutes into a plan)."""
    from kvconvert import plan
    from kvconvert.methods import build_method
    from kvconvert.recipe import parse_recipe, recipe_text

    for method, label, recipe in plan.candidates(tuple(plan.CANDIDATES), local_layers=True):
        name, config, storage = parse_recipe({"method": method, **recipe}, label)
        written = yaml.safe_load(recipe_text(build_method(name, config, storage)))
        assert all(written[key] == value for key, value in recipe.items()), (label, written)
