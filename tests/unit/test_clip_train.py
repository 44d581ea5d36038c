"""CLIP training end to end: every loss trains through `vitscale train`; resume is exact with the
FastCLIP per-sample state; `vitscale eval` reproduces the run's metrics (2 gloo ranks under DDP, FSDP2
and DeepSpeed: integration/test_clip_train_dist.py)."""

import json

import pytest
import torch
from helpers import interrupted_copy, last_state, rel_diff, sets

from vitscale import checkpoint as ckpt
from vitscale.cli import main

CLIP = "configs/tests/clip_tiny.toml"
LOSSES = [
    "openclip",
    "fastclip_v0",
    "fastclip_v1",
    "fastclip_v2",
    "fastclip_v3",
    "sogclr",
    "isogclr",
]


def run(out, *extra):
    assert main(["train", CLIP, "--out", str(out), *sets(["run.threads=1", *extra])]) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_trains_and_reports_clip_metrics(tmp_path, loss):
    s = run(tmp_path / loss, f"clip.loss={loss}")
    assert s["steps"] == 8 and s["world_size"] == 1
    for k in (
        "test_i2t_r1",
        "test_i2t_r5",
        "test_t2i_r1",
        "test_t2i_r10",
        "retrieval_r1",
        "zeroshot_synthetic_top1",
        "best_retrieval_r1",
    ):
        assert 0.0 <= s[k] <= 1.0, k
    assert s["test_pairs"] == 32 and s["zeroshot_synthetic_count"] == 32
    rows = [json.loads(x) for x in (tmp_path / loss / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    per_sample = s["state_bytes_per_rank"][0]["loss_state"]
    if loss == "openclip":
        assert per_sample == 0
    else:  # u1, u2 (+ tau1, tau2 and their two Adam moments each for individual temperatures), fp32
        arrays = 2 + (6 if loss in ("fastclip_v2", "isogclr") else 0)
        assert per_sample >= 4 * arrays * 64, per_sample


def test_a_bad_clip_setup_is_one_line_error(tmp_path, capsys):
    assert main(["train", CLIP, "--out", str(tmp_path / "a"), "--set", "train.accum_steps=2"]) == 2
    assert "accum_steps" in capsys.readouterr().err
    assert main(["train", CLIP, "--out", str(tmp_path / "b"), "--set", "data.captions=false"]) == 2
    assert "image-text pairs" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "configs/tests/tiny.toml",
                "--out",
                str(tmp_path / "c"),
                "--set",
                "data.name=openclipart",
            ]
        )
        == 2
    )
    assert "CLIP model" in capsys.readouterr().err


@pytest.mark.parametrize("loss", ["fastclip_v2", "fastclip_v3"])
def test_resume_is_exact_with_per_sample_state(tmp_path, loss):
    full = tmp_path / "full"
    run(full, f"clip.loss={loss}", "run.checkpoint_every=3", "run.keep_last=100", "train.epochs=3")
    # an interrupted copy: only the checkpoint at step 6 (mid-epoch 2, gamma < 1) survives
    part = interrupted_copy(full, tmp_path / "part", step=6)
    assert main(["train", "--resume", str(part)]) == 0
    a, b = last_state(part), last_state(full)
    assert a["step"] == b["step"] == 12
    assert rel_diff(a["strategy"]["model"], b["strategy"]["model"]) == 0.0
    tensors = [k for k, v in b["task"].items() if torch.is_tensor(v)]
    assert {"lu1", "lu2"} <= set(tensors)
    for k in tensors:  # u, temperatures, their optimizer moments
        assert torch.equal(a["task"][k], b["task"][k]), k
    if loss == "fastclip_v3":  # theta = logit_scale and its Adam state, in the checkpoint
        assert {"theta", "theta_m", "theta_v", "theta_step"} <= set(tensors)
        assert b["task"]["theta_step"].item() == 12


def test_a_loss_state_from_an_older_vitscale_is_a_one_line_error(tmp_path, capsys):
    run(tmp_path / "r", "clip.loss=fastclip_v3", "train.epochs=1")
    path = ckpt.list_checkpoints(tmp_path / "r")[-1]
    st = torch.load(path, weights_only=False)
    st["task"]["tau"] = st["task"].pop("theta")  # the pre-parity layout kept tau itself
    torch.save(st, path)
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "r"), "--set", "train.epochs=2"]) == 2
    err = capsys.readouterr().err
    assert "lacks theta" in err and err.count("\n") == 1, err


def test_eval_command_reproduces_the_run(tmp_path, capsys):
    s = run(tmp_path / "r", "clip.loss=fastclip_v1")
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "r"), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    for k in ("test_i2t_r1", "test_t2i_r5", "zeroshot_synthetic_top1"):
        assert ev[k] == pytest.approx(s[k]), k
    assert main(["eval", str(tmp_path / "r")]) == 0
    assert "image->text R@1" in capsys.readouterr().out


def test_the_v0_temperature_follows_the_lr_on_the_time_clock(tmp_path):
    """issue 49: one schedule. FastCLIP v0's temperature lr is tau_lr times the model's schedule
    factor; under optim.schedule_clock=time that factor is the LambdaLR's (training seconds over
    train.time_limit_s), not a step count's. Half-way through the time budget, at step 1 of 8."""
    from vitscale.config import load_config
    from vitscale.loop import Trainer

    cfg = load_config(
        CLIP,
        [
            "clip.loss=fastclip_v0",
            "optim.schedule_clock=time",
            "train.time_limit_s=100",
            "optim.warmup_steps=0",
        ],
    )
    tr = Trainer(cfg, tmp_path / "run")
    try:
        tr.progress.train_time = 50.0
        temperature = tr.task.loss_module.temperatures
        model_factor = tr.scheduler.lr_lambdas[0](1)
        assert model_factor == pytest.approx(0.5 * (1 + cfg.optim.min_lr_ratio), rel=1e-6)
        assert float(temperature.lr_at(1)) == pytest.approx(temperature.lr * model_factor)
    finally:
        tr.close()
