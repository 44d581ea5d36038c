"""The cases a review found by trying vitscale as a user (issue 42, item 10): each does what it says
or is refused in one line."""

import json

import pytest
from helpers import CLIP, TINY, run
from helpers import sets as set_list

from vitscale import checkpoint as ckpt


def test_a_resume_that_its_saved_cap_stops_short_of_new_epochs_names_the_cap(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(capsys, "train", TINY, "--out", out, *set_list(["run.max_steps=4"]))[0] == 0
    rc, _, err = run(capsys, "train", "--resume", out, *set_list(["train.epochs=3"]))
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(
        "vitscale: error: resume: run.max_steps = 4 caps this run at step 4"
    )
    assert "--set run.max_steps=0" in last
    assert ckpt.load_checkpoint(out)["step"] == 4  # nothing written
    rc, _, err = run(
        capsys, "train", "--resume", out, *set_list(["train.epochs=3", "run.max_steps=0"])
    )
    assert rc == 0, err
    assert json.loads((out / "summary.json").read_text())["steps"] == 12  # 3 epochs of 4


def damaged_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        run(
            capsys,
            "train",
            TINY,
            "--out",
            out,
            *set_list(["run.checkpoint_every=2", "run.keep_last=10"]),
        )[0]
        == 0
    )
    newest = ckpt.list_checkpoints(out)[-1]
    newest.write_bytes(newest.read_bytes()[:1000])  # a disk that filled up
    return out, newest


def test_eval_and_export_of_a_run_pass_over_a_damaged_newest_checkpoint_with_one_line(
    tmp_path, capsys, caplog
):
    out, newest = damaged_run(tmp_path, capsys)
    rc, text, err = run(capsys, "eval", out)
    assert rc == 0 and "step_00000006.pt" in text, err
    rc, text, err = run(capsys, "export", out, "--out", tmp_path / "m.safetensors")
    assert rc == 0 and (tmp_path / "m.safetensors").is_file(), err
    lines = [r.getMessage() for r in caplog.records if "cannot read" in r.getMessage()]
    assert len(lines) == 2 and all(newest.name in x for x in lines)
    assert "evaluating step_00000006.pt" in lines[0] and "exporting step_00000006.pt" in lines[1]


def test_eval_of_a_damaged_checkpoint_file_names_the_one_before_it(tmp_path, capsys):
    out, newest = damaged_run(tmp_path, capsys)
    rc, _, err = run(capsys, "eval", newest)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert f"`vitscale eval {out / 'checkpoints' / 'step_00000006.pt'}`" in err


def test_metrics_of_steps_a_resume_goes_back_over_are_moved_aside(tmp_path, capsys):
    """A resume from step 4 of a run that had gone to step 8: the records of steps 5-8 written before
    are not the run's any more. metrics.jsonl keeps one record per step and kind, in order."""
    out = tmp_path / "run"
    assert (
        run(
            capsys,
            "train",
            TINY,
            "--out",
            out,
            *set_list(["run.checkpoint_every=2", "run.keep_last=10"]),
        )[0]
        == 0
    )
    before = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert run(capsys, "train", "--resume", out / "checkpoints" / "step_00000004.pt")[0] == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["kind"], r["step"]) for r in records]
    assert keys == [(r["kind"], r["step"]) for r in before] and len(set(keys)) == len(keys)
    moved = [json.loads(x) for x in (out / "metrics_superseded.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in moved] == [k for k in keys if k[1] > 4]
    assert all(r["superseded_at"] == 4 for r in moved)


def test_a_missing_model_init_file_is_one_line_with_no_warning_before_it(tmp_path, capsys):
    rc, _, err = run(
        capsys,
        "train",
        "--out",
        tmp_path / "run",
        *set_list(["model.init=/nonexistent.safetensors"]),
    )
    assert rc == 2 and err.strip().splitlines() == [
        "vitscale: error: weights file not found: /nonexistent.safetensors"
    ]


def test_a_run_refused_after_its_start_leaves_no_folder_behind(tmp_path, capsys):
    rc, _, err = run(
        capsys, "train", "--out", tmp_path / "new", *set_list(["data.root=/nonexistent"])
    )
    assert rc == 2 and "Fashion-MNIST not found in /nonexistent" in err
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"  # a folder that was there: what was in it stays, nothing is added
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert run(capsys, "train", "--out", mine, *set_list(["data.root=/nonexistent"]))[0] == 2
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(
    "sets_",
    [
        ["strategy.name=fsdp", "train.ema_decay=0.999"],
        ["strategy.name=fsdp", "train.ema_decay=0", "train.precision=pure_bf16"],
        ["strategy.name=deepspeed", "train.ema_decay=0.999"],
        [
            "strategy.name=deepspeed",
            "train.ema_decay=0",
            "strategy.zero_stage=2",
            "optim.name=lamb",
        ],
        ["train.precision=fp16"],  # this CPU's refusal, whatever the engine
        ["data.batch_size=10", "train.accum_steps=3"],  # the global batch does not split
        ["strategy.name=ddp", "train.accum_steps=0"],  # the schema's own check, for comparison
        ["optim.name=lamb", "optim.impl=fused"],  # the optimizer's
        ["strategy.name=ddp", "strategy.backend=nccl"],  # the process group's, on a CPU
        ["data.name=openclipart"],  # what the data cannot give this kind of model
        ["data.name=folder", "data.val_fraction=0.1"],
        ["clip", "train.accum_steps=2", "data.batch_size=16"],  # CLIP's: a whole batch per step
        ["clip", "clip.tau_init=0.005"],  # the [clip] keys' own
    ],
)
def test_config_and_info_refuse_what_train_refuses_with_the_same_line(tmp_path, capsys, sets_):
    """Issue 42, item 5: the engines' refusals are asked before anything starts, so `vitscale config`
    and `vitscale info` give the line `vitscale train` gives."""
    if "strategy.name=deepspeed" in sets_:
        pytest.importorskip("deepspeed")
    config, sets_ = (CLIP, sets_[1:]) if sets_[0] == "clip" else (TINY, sets_)
    lines = []
    for argv in (
        ["config", config],
        ["info", config],
        ["train", config, "--out", tmp_path / "run"],
    ):
        rc, _, err = run(capsys, *argv, *set_list(sets_))
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        lines.append(err)
    assert lines[0] == lines[1] == lines[2]
    words = ("does not support", "refused on CPU", "multiple of", "accum", "LAMB", "nccl needs")
    more = ("holds image-text pairs", "data.val_fraction", "clip.tau_init")
    assert any(w in lines[0] for w in (*words, *more))
    assert not (tmp_path / "run").exists()
