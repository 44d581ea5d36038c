"""Time to target (issue 50): train.targets, the training time at which a run's evaluations first
reached each target (summary.json's time_to_target, the closing line, a note when reached; kept
across a resume), and `vitscale search --score time-to-target`."""

import json
import types

import pytest
from helpers import TINY, FakeTrial, interrupted_copy, run, sets

from vitscale.errors import UserError
from vitscale.run_report import describe_targets, first_reached, time_to_target
from vitscale.run_state import RunProgress


# -- the key ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["0", "1.2", "-0.1"])
def test_a_target_outside_0_1_is_refused_in_one_line(capsys, bad):
    rc, _, err = run(capsys, "config", TINY, "--set", f"train.targets=[0.9,{bad}]")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "train.targets" in err and "(0, 1]" in err and f"got {float(bad)!r}" in err


def test_targets_are_read_as_a_list_from_set_and_toml(capsys):
    from vitscale.config import load_config

    for text in ("[0.9,0.91]", "0.9,0.91", "[0.9, 0.91]"):
        assert load_config(TINY, [f"train.targets={text}"]).train.targets == [0.9, 0.91]
    assert load_config(TINY, ["train.targets=1"]).train.targets == [1.0]  # 100% is a target
    assert load_config(TINY).train.targets == []
    assert load_config().train.targets == [0.9, 0.91]  # the default job's
    rc, out, _ = run(capsys, "config", TINY, "--set", "train.targets=[0.5]")
    assert rc == 0 and "targets = [0.5]" in out  # written back as TOML


# -- the first evaluation that reached each target -------------------------------------------------
def record(step: int, acc: float) -> dict:
    """An evaluation's record as the run keeps it (4 steps per epoch, 1.5 s of training a step)."""
    return {"step": step, "epoch": step / 4, "train_time_s": 1.5 * step, "test_accuracy": acc}


EVALS = [record(4, 0.40), record(8, 0.75), record(12, 0.70), record(16, 0.85)]


def test_time_to_target_is_the_first_evaluation_that_reached_each():
    got = time_to_target(EVALS, [0.5, 0.75, 0.8, 0.99], "test_accuracy")
    assert got == {
        "0.5": {"train_time_s": 12.0, "step": 8, "epoch": 2.0},  # 0.75 at step 8, the first >= 0.5
        "0.75": {"train_time_s": 12.0, "step": 8, "epoch": 2.0},  # equal counts as reached
        "0.8": {"train_time_s": 24.0, "step": 16, "epoch": 4.0},  # not the dip at step 12
        "0.99": None,
    }
    assert time_to_target([], [0.5], "test_accuracy") == {"0.5": None}
    assert time_to_target(EVALS, [], "test_accuracy") == {}
    # the note during training: the targets each evaluation reached first, none twice
    notes = [first_reached(EVALS[: i + 1], [0.5, 0.75, 0.8], "test_accuracy") for i in range(4)]
    assert notes == [[], [0.5, 0.75], [], [0.8]]
    assert describe_targets(got) == (
        "50% at 12.0s (epoch 2), 75% at 12.0s (epoch 2), 80% at 24.0s (epoch 4), 99% not reached"
    )


def test_a_checkpoint_from_before_the_record_starts_it_from_its_last_evaluation():
    """A checkpoint written before RunProgress kept every evaluation (no "evals" entry: the
    dd5435d fixture's kind) knows its last one, which is what the run's record starts from."""
    last = record(8, 0.75)
    old = {"step": 8, "train_time": 12.0, "images_seen": 128, "steady": [10.0, 112]}
    p = RunProgress()
    p.load_state_dict({**old, "best_acc": 0.75, "last_eval": last})
    assert p.evals == [last] and p.evals[0] is not last
    p.load_state_dict({**old, "best_acc": None, "last_eval": None})
    assert p.evals == []


# -- a run and its resume --------------------------------------------------------------------------
def evals_of(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "eval"]


def expected(evals: list[dict], targets) -> dict:
    """What the summary should say, read from metrics.jsonl directly: the first record at or
    above each target."""
    out = {}
    for t in targets:
        hits = [r for r in evals if r["test_accuracy"] >= t]
        out[repr(t)] = {k: hits[0][k] for k in ("train_time_s", "step", "epoch")} if hits else None
    return out


def test_a_run_reports_its_time_to_target_and_a_resume_keeps_it(tmp_path, capsys):
    full = tmp_path / "full"
    keys = ["run.threads=1", "train.epochs=3", "run.checkpoint_every=3", "run.keep_last=100"]
    targets = [0.25, 0.5, 1.0]
    rc, out, err = run(
        capsys,
        "train",
        TINY,
        "--out",
        full,
        *sets([*keys, "run.progress=plain", "train.targets=[0.25,0.5,1.0]"]),
    )
    assert rc == 0, err
    evals = evals_of(full)
    assert [r["step"] for r in evals] == [4, 8, 12]
    summary = json.loads((full / "summary.json").read_text())
    want = expected(evals, targets)
    assert summary["time_to_target"] == want
    reached = [t for t in targets if want[repr(t)]]
    notes = [line for line in err.splitlines() if line.startswith("target ")]
    assert len(notes) == len(reached)
    for t, note in zip(reached, notes):
        hit = want[repr(t)]
        assert note.startswith(f"target {100 * t:g}% test accuracy reached at ")
        assert f"(step {hit['step']}, epoch {hit['epoch']:.2f})" in note
    closing = out.strip().splitlines()[-1]
    said = describe_targets(want)  # "25% at 0.0s (epoch 1), 50% at ..., 100% not reached"
    assert said.endswith("100% not reached") or evals[-1]["test_accuracy"] == 1.0
    assert closing.index("MFU") < closing.index(f"; {said}; run folder")

    # killed after the checkpoint at step 6 (mid-epoch 2): the evaluation at step 4 came before it;
    # the resume asks for a target that evaluation reached exactly, and one it did not
    part = interrupted_copy(full, tmp_path / "part", step=6)
    first, best = evals[0]["test_accuracy"], max(r["test_accuracy"] for r in evals)
    assert first > 0  # a valid target
    new_targets = f"train.targets=[{first!r},{best!r},1.0]"
    rc, out, err = run(capsys, "train", "--resume", part, *sets([new_targets]))
    assert rc == 0, err
    resumed = json.loads((part / "summary.json").read_text())["time_to_target"]
    assert resumed == expected(evals_of(part), [first, best, 1.0])
    # found before the kill: the full run's own record of step 4, its training time included
    assert resumed[repr(first)] == {k: evals[0][k] for k in ("train_time_s", "step", "epoch")}
    assert resumed[repr(best)]["step"] == want_step(evals, best)


def want_step(evals: list[dict], target: float) -> int:
    return next(r["step"] for r in evals if r["test_accuracy"] >= target)


# -- the search's score ----------------------------------------------------------------------------
def test_time_to_target_scores_every_reached_trial_before_every_other():
    from vitscale.lab.search.score import Score, time_score

    budget = 100.0
    reached = [time_score(t, acc, budget) for t, acc in ((5.0, 0.9), (99.0, 0.91), (101.0, 0.95))]
    missed = [time_score(None, acc, budget) for acc in (0.89, 0.5, 0.0)]
    assert reached == [5.0, 99.0, 101.0]  # the time itself (the last step may pass the budget)
    assert missed == [pytest.approx(211.0), 250.0, 300.0]  # 100 x (3 - accuracy)
    assert max(reached) < min(missed) and missed == sorted(missed)  # the more accurate first
    assert time_score(None, None, budget) is None  # no accuracy: no score (a failed run)

    s = Score("time-to-target", 0.9, budget)
    assert s.direction == "minimize" and Score().direction == "maximize"
    summary = {"accuracy": 0.92, "time_to_target": {"0.9": {"train_time_s": 42.0, "step": 9}}}
    assert s.of_run(summary) == 42.0 and Score().of_run(summary) == 0.92
    assert s.of_run({"accuracy": 0.8, "time_to_target": {"0.9": None}}) == pytest.approx(220.0)
    assert sorted([250.0, 42.0, 220.0], key=s.sort_key) == [42.0, 220.0, 250.0]
    assert s.gain(42.0, 60.0) == 18.0 and Score().gain(0.9, 0.8) == pytest.approx(0.1)
    assert s.reach_text(42.0) == "90% at 42.0s" and s.reach_text(220.0) == "90% not reached"


def search_args(**kw):
    return types.SimpleNamespace(**{"budget_s": 100.0, "score": "accuracy", "target": None, **kw})


def test_the_search_target_defaults_to_the_recipes_and_bad_ones_are_refused():
    from vitscale.config import load_config
    from vitscale.lab.search.score import search_score

    recipe, tiny = load_config(TINY, ["train.targets=[0.9,0.91]"]), load_config(TINY)
    timed = search_args(score="time-to-target")
    assert search_score(timed, recipe).target == 0.9  # the recipe's first train.targets entry
    assert search_score(search_args(score="time-to-target", target=0.8), recipe).target == 0.8
    for args, cfg, needle in (
        (timed, tiny, "needs a target: --target 0.9, or train.targets"),
        (search_args(score="time-to-target", target=1.2), recipe, "in (0, 1], got 1.2"),
        (search_args(score="time-to-target", target=0.0), recipe, "in (0, 1], got 0.0"),
        (search_args(target=0.9), recipe, "--target is for --score time-to-target"),
    ):
        with pytest.raises(UserError, match="search: ") as e:
            search_score(args, cfg)
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_score_is_part_of_a_search_and_train_targets_is_not():
    from vitscale.config import load_config
    from vitscale.lab.search import fingerprint
    from vitscale.lab.search.score import Score

    base = load_config(TINY)
    other = load_config(TINY, ["train.targets=[0.5]"])
    acc, timed = Score(budget_s=1.0), Score("time-to-target", 0.9, 1.0)
    assert fingerprint(base, [], 1.0) == fingerprint(base, [], 1.0, acc)  # as before --score
    assert fingerprint(base, [], 1.0, acc) == fingerprint(other, [], 1.0, acc)
    assert fingerprint(base, [], 1.0, timed) != fingerprint(base, [], 1.0, acc)
    assert fingerprint(base, [], 1.0, timed) != fingerprint(
        base, [], 1.0, Score("time-to-target", 0.8, 1.0)
    )


def test_pruning_under_time_to_target_reports_the_score_so_far():
    optuna = pytest.importorskip("optuna")

    from vitscale.lab.search.score import Score
    from vitscale.lab.search.trials import Pruning

    trial = FakeTrial()
    score = Score("time-to-target", 0.9, 10.0)
    prune = Pruning(optuna, trial, 10.0, "test_accuracy", score)
    for t, acc in ((1.0, 0.5), (2.0, 0.9), (2.2, 0.95), (4.0, 0.85)):  # 2.2 s: under 5 points later
        prune({"train_time_s": t, "step": 0, "epoch": 0.0, "test_accuracy": acc})
    # before the target: what the accuracy would score; from the first reach (equal counts) on: its
    # time, also where the accuracy dips after it
    assert trial.reports == [(10, pytest.approx(25.0)), (20, 2.0), (40, 2.0)]


def test_decide_under_time_to_target_asks_a_faster_pick_whose_test_reaches_the_target():
    from vitscale.lab.search.score import Score
    from vitscale.lab.search.trials import decide

    s = Score("time-to-target", 0.9, 100.0)
    pick = {"trial": 3, "mean": 40.0, "std": 2.0}
    recipe = {"trial": "recipe", "mean": 60.0, "std": 5.0, "values": [60.0]}
    d = decide(pick, {"test_accuracy": 0.905}, recipe, {"test_accuracy": 0.91}, s)
    assert d["adopt"] and d["val_gap"] == 20.0 and "40.0s vs 60.0s" in d["text"]
    assert not decide(pick, {"test_accuracy": 0.89}, recipe, {"test_accuracy": 0.91}, s)["adopt"]
    slower = {**pick, "mean": 70.0}
    assert not decide(slower, {"test_accuracy": 0.95}, recipe, {"test_accuracy": 0.91}, s)["adopt"]


def test_a_tiny_time_to_target_search_minimizes_and_says_so(tmp_path, capsys):
    """Two trials of a 1 s budget, the best repeated once, scored by the time to a validation
    accuracy of 0.3: the study minimizes, each trial's value is its score of its own summary, the
    report says which score ranked them, and the same folder with the accuracy score is refused."""
    optuna = pytest.importorskip("optuna")

    from vitscale.lab.search.score import time_score

    space = tmp_path / "space.toml"
    space.write_text("[optim]\nlr = { low = 1e-3, high = 1e-2, log = true }\n")
    out = tmp_path / "search"
    argv = ["search", TINY, "--space", space, "--budget-s", "1", "--trials", "2", "--out", out]
    argv += ["--repeat-top", "1", "--seeds", "1", "--no-recipe", "--pruner", "none"]
    argv += sets(["run.threads=1", "data.val_fraction=0.25", "run.eval_every=20"])
    rc, _, err = run(capsys, *argv, "--score", "time-to-target", "--target", "0.3")
    assert rc == 0, err
    study = optuna.load_study(study_name="search", storage=f"sqlite:///{out / 'search.db'}")
    assert study.direction == optuna.study.StudyDirection.MINIMIZE
    for t in study.trials:
        summary = json.loads((out / "trials" / f"{t.number:05d}" / "summary.json").read_text())
        hit = summary["time_to_target"]["0.3"]
        want = time_score(hit and hit["train_time_s"], summary["test_accuracy"], 1.0)
        assert t.value == pytest.approx(want) and t.user_attrs["accuracy"] == pytest.approx(
            summary["test_accuracy"]
        )
    rep = json.loads((out / "search.json").read_text())
    assert rep["score"]["name"] == "time-to-target" and rep["score"]["direction"] == "minimize"
    best = min(study.trials, key=lambda t: t.value)
    assert rep["finish"]["pick"]["trial"] == best.number
    md = (out / "search.md").read_text()
    assert "training time to 30% validation accuracy (lower is better" in md
    rc, _, err = run(capsys, *argv)  # the same study scored on accuracy: another search
    assert rc == 2 and "--score/--target" in err
