"""What a multi-process run reports is what it saves: the live end-of-run evaluation, `vitscale eval`
of the final checkpoint and the evaluation of a run resumed from an earlier checkpoint agree, for
every engine, on a model with BatchNorm (the conv stem), whose running statistics each rank
updates from its own batches (2 gloo ranks)."""

import json

import pytest
from helpers import interrupted_copy, torchrun

from vitscale.cli import main

BN = ["model.stem=conv", "data.train_size=96", "run.log_every=1"]


def last_eval(run_dir) -> dict:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == "eval"][-1]


@pytest.mark.parametrize("engine,resume", [("ddp", True), ("fsdp", False), ("deepspeed", True)])
def test_live_checkpoint_and_resumed_evaluations_agree(tmp_path, capsys, engine, resume):
    if engine == "deepspeed":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    extra = [f"strategy.name={engine}", *BN] + (
        ["strategy.zero_stage=2"] if engine == "deepspeed" else []
    )
    full = tmp_path / "full"
    p = torchrun(full, extra, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    live = last_eval(full)
    capsys.readouterr()
    assert main(["eval", str(full), "--json"]) == 0
    saved = json.loads(capsys.readouterr().out)
    assert saved["test_count"] == live["test_count"] == 32
    assert saved["test_accuracy"] == live["test_accuracy"]
    assert abs(saved["test_loss"] - live["test_loss"]) <= 1e-5, (
        saved["test_loss"],
        live["test_loss"],
    )
    if resume:  # from the end of epoch 1 (6 steps of 16): the same last evaluation
        part = interrupted_copy(full, tmp_path / "part", 6)
        p = torchrun(part, extra, resume=part, timeout=400)
        assert p.returncode == 0, p.stderr[-3000:]
        again = last_eval(part)
        assert (
            again["step"] == live["step"] == 12 and again["test_accuracy"] == live["test_accuracy"]
        )
        assert abs(again["test_loss"] - live["test_loss"]) <= 1e-5, (
            again["test_loss"],
            live["test_loss"],
        )


def test_an_epoch_ending_in_fewer_samples_than_processes_skips_that_step_on_every_rank(tmp_path):
    """data.drop_last=false, 65 samples in batches of 16 on 2 ranks: the 5th batch holds 1 sample,
    so rank 1's share is empty; both ranks skip it (decided without a collective) and go on."""
    out = tmp_path / "r"
    p = torchrun(
        out,
        [
            "strategy.name=ddp",
            "data.train_size=65",
            "data.drop_last=false",
            "train.epochs=2",
            "run.progress=plain",
        ],
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 10 and s["images_seen"] == 2 * 64
    assert p.stderr.count("fewer samples than processes; step skipped on every rank") == 2


def test_single_strategy_under_a_launcher_is_refused_in_one_line(tmp_path):
    """torchrun with the default strategy.name=single used to start N independent runs writing the
    same run folder (every metric line twice)."""
    p = torchrun(tmp_path / "r", [])
    assert p.returncode != 0
    lines = [x for x in p.stderr.splitlines() if "strategy.name=single under a launcher" in x]
    assert len(lines) == 1 and "[rank 0]" in lines[0]  # rank 0's, once (issue 62)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
