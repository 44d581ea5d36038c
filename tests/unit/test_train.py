"""End-to-end: the CLI on a tiny synthetic recipe; resume equivalence; NaN stop; bad input."""

import json

import pytest
import torch
from helpers import interrupted_copy, poison_loss, run
from safetensors.torch import load_file

from vitscale import checkpoint as ckpt
from vitscale.errors import UserError

TINY = "configs/tests/tiny.toml"


def final_weights(run_dir):
    return torch.load(ckpt.list_checkpoints(run_dir)[-1], weights_only=False)["strategy"]["model"]


def test_train_eval_export_info_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    rc, stdout, err = run(
        capsys,
        "train",
        TINY,
        "--out",
        str(out),
        "--set",
        "run.tensorboard=true",
        "--set",
        "train.epochs=4",
    )
    assert rc == 0, err
    assert "test accuracy" in stdout
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "test_accuracy",
        "best_test_accuracy",
        "train_time_s",
        "images_per_s",
        "params",
        "flops_per_image",
        "mfu",
    ):
        assert key in summary
    assert summary["steps"] == 16 and summary["epochs"] == 4.0
    assert summary["test_accuracy"] > 0.5  # 4 learnable classes: chance is 0.25
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8, 12, 16]  # every epoch
    assert {"step", "epoch", "loss", "lr", "images_per_s", "step_time_s"} <= set(train[0])
    assert train[-1]["loss"] < train[0]["loss"]
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert (out / "config.toml").read_text().count("[model]") == 1

    rc, stdout, err = run(capsys, "eval", str(out), "--json")
    assert rc == 0, err
    assert json.loads(stdout)["test_accuracy"] == pytest.approx(summary["test_accuracy"])

    rc, stdout, err = run(capsys, "export", str(out))
    assert rc == 0, err
    tensors = load_file(str(out / "model.safetensors"))
    for k, v in final_weights(out).items():
        torch.testing.assert_close(tensors[k], v.float())

    rc, stdout, err = run(capsys, "info", TINY, "--json")
    assert rc == 0 and json.loads(stdout)["params"] == summary["params"]


@pytest.mark.parametrize(
    "extra",
    [
        [],  # plain fp32
        [
            "data.mixup_alpha=0.4",
            "data.crop_padding=1",
            "data.hflip=true",
            "model.drop_path=0.2",
            "train.ema_decay=0.9",
            "train.accum_steps=2",
            "optim.grad_clip=1.0",
        ],
    ],
)
def test_resumed_run_ends_with_the_same_weights(tmp_path, capsys, extra):
    sets = [
        a
        for e in extra + ["run.checkpoint_every=3", "run.keep_last=100", "train.epochs=3"]
        for a in ("--set", e)
    ]
    full = tmp_path / "full"
    assert run(capsys, "train", TINY, "--out", str(full), *sets)[0] == 0
    # an interrupted copy: only the checkpoint at step 6 (mid-epoch 2) survives
    part = interrupted_copy(full, tmp_path / "part", step=6)
    rc, _, err = run(capsys, "train", "--resume", str(part))
    assert rc == 0, err
    a, b = final_weights(full), final_weights(part)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa = json.loads((full / "summary.json").read_text())
    sb = json.loads((part / "summary.json").read_text())
    assert sa["test_accuracy"] == sb["test_accuracy"] and sb["steps"] == 12


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    poison_loss(monkeypatch, 6, float("nan"))
    out = tmp_path / "nan"
    rc, _, err = run(capsys, "train", TINY, "--out", str(out), "--set", "run.checkpoint_every=2")
    assert rc == 2
    assert "loss is nan at step 6" in err and "step_00000004.pt" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    saved = ckpt.list_checkpoints(out)
    assert [p.name for p in saved] == ["step_00000002.pt", "step_00000004.pt"]
    state = ckpt.load_checkpoint(saved[-1])
    assert all(torch.isfinite(v).all() for v in state["strategy"]["model"].values())


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    ckpt.save_checkpoint(tmp_path, 1, {"a": torch.ones(3)}, keep_last=2)

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(UserError, match="No space left on device"):  # one line (SaveError)
        ckpt.save_checkpoint(tmp_path, 2, {"a": torch.zeros(3)}, keep_last=2)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001.pt"]
    monkeypatch.undo()
    for step in range(2, 6):
        ckpt.save_checkpoint(tmp_path, step, {"a": torch.zeros(3)}, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step_00000004.pt",
        "step_00000005.pt",
    ]


@pytest.mark.parametrize("precision", ["bf16", "pure_bf16"])
def test_half_precision_runs_train(tmp_path, capsys, precision):
    out = tmp_path / precision
    rc, _, err = run(
        capsys,
        "train",
        TINY,
        "--out",
        str(out),
        "--set",
        f"train.precision={precision}",
        "--set",
        "train.epochs=3",
        "--set",
        "model.attention=sdpa",
    )
    assert rc == 0, err
    assert json.loads((out / "summary.json").read_text())["test_accuracy"] > 0.4


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["train", TINY, "--set", "data.batch_size=128"], "larger than the training set"),
        (["train", TINY, "--set", "optim.lrr=1"], "did you mean 'optim.lr'"),
        (["train", TINY, "--set", "train.precision=fp16"], "refused on CPU"),
        (["train", TINY, "--set", "model.arch=vit_nan"], "unknown model 'vit_nan'"),
        (["train", TINY, "--set", "model.stem=conv", "--set", "model.patch_size=3"], "patch size"),
        (
            ["train", "--set", "data.root=/nonexistent/fmnist"],
            "vitscale data download fashion-mnist",
        ),
        (["eval", "/nonexistent/run"], "checkpoint not found"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, needle):
    rc, _, err = run(capsys, *argv, *(["--out", str(tmp_path / "o")] if argv[0] == "train" else []))
    assert rc == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_truncated_checkpoint_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "checkpoints" / "step_00000001.pt"
    bad.parent.mkdir()
    bad.write_bytes(b"PK\x03\x04garbage")
    rc, _, err = run(capsys, "eval", str(tmp_path))
    assert rc == 2 and "cannot read checkpoint" in err


def test_refuses_to_train_over_an_existing_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(capsys, "train", TINY, "--out", str(out), "--set", "train.epochs=1")[0] == 0
    before = [p.stat().st_mtime_ns for p in ckpt.list_checkpoints(out)]
    rc, _, err = run(capsys, "train", TINY, "--out", str(out))
    assert rc == 2 and "--resume" in err and len(err.strip().splitlines()) == 1
    assert [p.stat().st_mtime_ns for p in ckpt.list_checkpoints(out)] == before


def test_lr_scaling_reaches_the_optimizer(tmp_path, capsys):
    out = tmp_path / "scaled"
    rc, _, err = run(
        capsys,
        "train",
        TINY,
        "--out",
        str(out),
        "--set",
        "optim.lr_scaling=linear",
        "--set",
        "optim.lr_ref_batch=4",
        "--set",
        "optim.schedule=constant",
        "--set",
        "optim.warmup_steps=0",
        "--set",
        "train.epochs=1",
    )
    assert rc == 0, err
    assert json.loads((out / "summary.json").read_text())["lr"] == pytest.approx(3e-3 * 16 / 4)
    state = torch.load(ckpt.list_checkpoints(out)[-1], weights_only=False)
    assert state["strategy"]["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1.2e-2)
    assert state["config"]["optim"]["lr"] == pytest.approx(
        3e-3
    )  # the saved config keeps the user's value
