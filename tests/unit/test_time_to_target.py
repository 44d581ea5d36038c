"""Time to target (issue 50): train.targets, the training time at which a run's evaluations first
reached each target (summary.json's time_to_target, the closing line, a note when reached; kept
across a resume), and `vitscale search --score time-to-target`."""

import json

import pytest
from helpers import TINY, interrupted_copy, run, sets

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
