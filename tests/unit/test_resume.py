"""What a checkpoint may hold and what a resume does (issue 33): no checkpoint, evaluation or
export of a non-finite state; a key changed on resume takes effect or is refused in one line;
one live writer per run folder; a damaged newest checkpoint is passed over with one line."""

import json
import os
import shutil
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
from helpers import run

from vitscale import checkpoint as ckpt
from vitscale.config import SECTIONS, Config
from vitscale.errors import ConfigError
from vitscale.run_state import (
    CHANGEABLE_ON_RESUME,
    FROM_COMMAND,
    FROM_SAVED,
    check_mesh,
    fixed_reason,
    resumed_config,
)
from vitscale.strategy.single import SingleDevice

TINY = "configs/tests/tiny.toml"


def sets(*items):
    return [a for item in items for a in ("--set", item)]


def records(run_dir, kind="train"):
    return [
        r
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == kind
    ]


def overflow_update(monkeypatch, call: int) -> None:
    """The `call`-th optimizer step leaves an infinite weight behind, as an overflowing update
    does: the step's own loss was finite."""
    calls = {"n": 0}
    real = SingleDevice.step

    def step(self):
        info = real(self)
        calls["n"] += 1
        if calls["n"] == call:
            with torch.no_grad():
                next(self.module.parameters()).view(-1)[0] = float("inf")
        return info

    monkeypatch.setattr(SingleDevice, "step", step)


# -- 1. never save, evaluate or export a non-finite state -----------------------------------------
def test_an_update_that_overflows_never_becomes_a_checkpoint(tmp_path, capsys, monkeypatch):
    overflow_update(monkeypatch, 6)
    out = tmp_path / "run"
    rc, _, err = run(capsys, "train", TINY, "--out", str(out), *sets("run.checkpoint_every=2"))
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "training state is not finite after step 6" in err and "step_00000004.pt" in err
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000002.pt", "step_00000004.pt"]
    # a resume from the last good one says which checkpoint it came from when it stops again
    overflow_update(monkeypatch, 1)
    rc, _, err = run(capsys, "train", "--resume", str(out))
    assert rc == 2 and "last good checkpoint" in err and "step_00000004.pt" in err, err
    assert "no checkpoint was written" not in err


def test_eval_and_export_refuse_a_checkpoint_with_non_finite_weights(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(capsys, "train", TINY, "--out", str(out), *sets("train.epochs=1"))[0] == 0
    path = ckpt.list_checkpoints(out)[-1]
    state = ckpt.load_checkpoint(path)
    key = next(iter(state["strategy"]["model"]))
    state["strategy"]["model"][key].view(-1)[0] = float("nan")  # as written before saving checked
    torch.save(state, path)
    for argv in (
        ["eval", str(out)],
        ["export", str(out), "--out", str(tmp_path / "m.safetensors")],
    ):
        rc, _, err = run(capsys, *argv)
        assert (
            rc == 2 and "non-finite weights (1 of" in err and len(err.strip().splitlines()) == 1
        ), (argv, err)
    assert not (tmp_path / "m.safetensors").exists()


# -- 2. a key changed on resume takes effect, or is refused ----------------------------------------
def test_a_changed_lr_and_weight_decay_take_effect_on_resume(tmp_path, capsys, caplog):
    """The resumed run's logged lr is the one a run with the new lr from the start logs at the
    same steps; the optimizer's weight decay is the new one; config.toml says what ran."""
    part, fresh = tmp_path / "part", tmp_path / "fresh"
    assert run(capsys, "train", TINY, "--out", str(part), *sets("train.epochs=1"))[0] == 0
    new = ("optim.lr=1e-3", "optim.weight_decay=0.3", "train.epochs=2")
    rc, _, err = run(capsys, "train", "--resume", str(part), *sets(*new))
    assert rc == 0, err
    said = [r.getMessage() for r in caplog.records if "resume:" in r.getMessage()]
    assert (
        len(said) == 1
        and "from step 4 with optim.lr 0.003 -> 0.001, optim.weight_decay 0.05 -> 0.3, "
        "train.epochs 1.0 -> 2.0"
        in said[0]
    ), said
    assert run(capsys, "train", TINY, "--out", str(fresh), *sets(*new))[0] == 0
    lr = {r["step"]: r["lr"] for r in records(fresh)}
    resumed = {r["step"]: r["lr"] for r in records(part) if r["step"] > 4}
    assert resumed and all(v == pytest.approx(lr[s], rel=1e-12) for s, v in resumed.items()), (
        resumed,
        lr,
    )
    groups = ckpt.load_checkpoint(part)["strategy"]["optimizer"]["param_groups"]
    assert groups[0]["weight_decay"] == 0.3 and groups[1]["weight_decay"] == 0.0
    assert "lr = 0.001" in (part / "config.toml").read_text()


@pytest.mark.parametrize(
    "key",
    [
        "model.dim=64",
        "data.batch_size=32",
        "optim.name=sgd",
        "run.seed=3",
        "train.precision=pure_bf16",
    ],
)
def test_a_key_that_cannot_change_on_resume_is_refused_by_name(tmp_path, capsys, key):
    out = tmp_path / "run"
    assert run(capsys, "train", TINY, "--out", str(out), *sets("train.epochs=1"))[0] == 0
    config = (out / "config.toml").read_text()
    rc, _, err = run(capsys, "train", "--resume", str(out), *sets(key))
    name = key.split("=")[0]
    assert rc == 2 and f"resume: {name} cannot change on resume" in err, err
    assert len(err.strip().splitlines()) == 1
    assert (out / "config.toml").read_text() == config  # nothing written


def test_every_config_key_either_takes_effect_or_is_refused_on_resume():
    """A new key must be classified: refused (FIXED_ON_RESUME, with its reason) or known to take
    effect (listed here, where the resume re-applies it: the optimizer's hyperparameters, the
    schedule, run and evaluation settings, the engine's runtime switches)."""
    takes_effect = {
        "run": {
            "device",
            "threads",
            "log_every",
            "eval_every",
            "checkpoint_every",
            "keep_last",
            "max_steps",
            "progress",
            "tensorboard",
        },
        "data": {
            "root",
            "test_root",
            "csv_image_key",
            "csv_caption_key",
            "caption_template",
            "test_size",
            "eval_batch_size",
            "num_workers",
            "decoder",
            "on_device",
            "pin_memory",
            "crop_padding",
            "hflip",
            "randaugment_ops",
            "randaugment_magnitude",
            "mixup_alpha",
            "cutmix_alpha",
            "mix_prob",
            "min_batch_size",  # data.batch_rule's floor: the resumed rule is fixed
        },
        "model": {
            "drop_path",
            "drop_path_mode",
            "dropout",
            "attention",
            "patch_dropout",
            "patch_dropout_until",
        },
        "optim": {
            "impl",
            "lr",
            "weight_decay",
            "beta1",
            "beta2",
            "eps",
            "momentum",
            "nesterov",
            "schedule",
            "schedule_clock",
            "warmup_epochs",
            "warmup_steps",
            "min_lr_ratio",
            "grad_clip",
            "lr_scaling",
            "lr_ref_batch",
            # Muon's group keys: re-applied over the checkpoint's as AdamW's are
            "muon_lr",
            "muon_weight_decay",
            "muon_momentum",
            "muon_nesterov",
            "muon_ns_steps",
            "muon_adjust_lr",
            "muon_ns_dtype",
        },
        "train": {
            "epochs",
            "time_limit_s",
            "precision",
            "accum_steps",
            "label_smoothing",
            "ema_decay",
            "ema_warmup",
            "ema_eval",
            "min_steps",
            "compile",
            "compile_mode",
            "activation_checkpointing",
            "tf32",
            "cudnn_benchmark",
            "channels_last",
            "eval_hflip_tta",
            "capture",
            "sdpa_backend",
            "inductor_coordinate_descent",  # the compile's options: a resumed run compiles anew
            "inductor_combo_kernels",
            "inductor_mix_order",
            "inductor_gemm",
            "compile_cache",
            "fp8",
            "targets",  # only what the run reports (time_to_target, from every evaluation)
        },
        "strategy": {
            "name",
            "dp_replicate",  # the mesh: a checkpoint moves between meshes (test_mesh_dist.py)
            "dp_shard",
            "tp",
            "sequence_parallel",
            "backend",
            "timeout_s",
            "bucket_mb",
            "grad_compression",
            "reduce_dtype",
            "reshard_after_forward",
            "cpu_offload",
            "checkpoint_format",
            "wall_clock_breakdown",
            "comms_logger",
            "flops_profiler",
        },
        "clip": {"prompt_templates"},
    }
    cfg = Config()
    for (
        sec
    ) in SECTIONS:  # a recipe's [per_device] tables are resolved before a run saves its config
        for f in fields(getattr(cfg, sec)):
            key = f"{sec}.{f.name}"
            if f.name in takes_effect.get(sec, ()):
                assert fixed_reason(key) is None, key
            else:
                assert fixed_reason(key), (
                    f"{key}: neither refused on resume nor known to take effect"
                )
    assert {k.split(".")[1] for k in CHANGEABLE_ON_RESUME} <= set().union(*takes_effect.values())


# -- 3. one live writer per run folder -------------------------------------------------------------
def test_a_live_writer_is_refused_and_a_dead_ones_lock_taken_over(tmp_path, capsys, caplog):
    out = tmp_path / "run"
    assert run(capsys, "train", TINY, "--out", str(out), *sets("train.epochs=1"))[0] == 0
    other = ckpt.RunLock(out)  # another live run holds the folder (an flock of its own)
    assert other.acquire() is None
    try:
        rc, _, err = run(capsys, "train", "--resume", str(out), *sets("train.epochs=2"))
    finally:
        held = (out / ".lock").read_text()
        other.fd and os.close(other.fd)  # dies without releasing: its record stays
    assert (
        rc == 2
        and "is being written by another live run" in err
        and f"process {os.getpid()}" in err
    )
    assert len(err.strip().splitlines()) == 1 and len(ckpt.list_checkpoints(out)) == 1
    rc, _, err = run(capsys, "train", "--resume", str(out), *sets("train.epochs=2"))
    assert rc == 0, err
    assert any(
        "took over the lock of a run that is no longer running" in r.getMessage()
        for r in caplog.records
    )
    assert json.loads(held)["pid"] == os.getpid()
    assert (out / ".lock").read_text() == ""  # released at the end


# -- 4. a damaged newest checkpoint ----------------------------------------------------------------
def test_a_damaged_newest_checkpoint_resumes_from_the_one_before(tmp_path, capsys, caplog):
    full, part = tmp_path / "full", tmp_path / "part"
    common = sets("run.checkpoint_every=2", "run.keep_last=10", "train.epochs=2")
    assert run(capsys, "train", TINY, "--out", str(full), *common)[0] == 0
    shutil.copytree(full, part)  # as if it had stopped while writing step 6's checkpoint
    (part / "checkpoints" / "step_00000008.pt").unlink()
    (part / "summary.json").unlink()
    newest = ckpt.list_checkpoints(part)[-1]
    assert newest.name == "step_00000006.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # a disk that filled up
    # a file given by name: refused with the command that resumes the one before
    rc, _, err = run(capsys, "train", "--resume", str(newest))
    # short, whatever folder the test runs in (the message names the two paths in full)
    assert (
        rc == 2 and len(err.strip().splitlines()) == 1 and len(err.replace(str(part), "RUN")) < 300
    ), err
    assert f"vitscale train --resume {part / 'checkpoints' / 'step_00000004.pt'}" in err
    # the run folder: the newest readable one, with one line naming both
    rc, _, err = run(capsys, "train", "--resume", str(part))
    assert rc == 0, err
    line = [r.getMessage() for r in caplog.records if "cannot read" in r.getMessage()]
    assert (
        len(line) == 1
        and "step_00000006.pt" in line[0]
        and "resuming from step_00000004.pt" in line[0]
    )
    a = ckpt.load_checkpoint(full)["strategy"]["model"]
    b = ckpt.load_checkpoint(part)["strategy"]["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_resume_reads_and_checks_the_checkpoint_once(tmp_path, capsys, monkeypatch):
    """Issue 34: `vitscale train --resume RUN --set ...` reads the checkpoint once, checks what may
    change on resume once and runs the config's checks once; the progress record comes back whole."""
    import vitscale.checks
    import vitscale.loop
    import vitscale.run_state
    import vitscale.tasks

    out = tmp_path / "run"
    run(
        capsys,
        "train",
        TINY,
        "--out",
        str(out),
        "--set",
        "run.max_steps=4",
        "--set",
        "run.checkpoint_every=2",
    )
    saved = ckpt.load_checkpoint(out / "checkpoints" / "step_00000004.pt")
    counts = {"load": 0, "resumable": 0, "config": 0}

    def counting(name, real):
        def f(*a, **k):
            counts[name] += 1
            return real(*a, **k)

        return f

    monkeypatch.setattr(
        ckpt, "load_checkpoint", counting("load", ckpt.load_checkpoint)
    )  # newest_readable's
    monkeypatch.setattr(
        vitscale.run_state,
        "check_resumable",
        counting("resumable", vitscale.run_state.check_resumable),
    )
    monkeypatch.setattr(
        vitscale.loop, "check_resumable", counting("resumable", vitscale.loop.check_resumable)
    )
    checks = counting("config", vitscale.tasks.check_config)  # the CLI's import and the Trainer's
    monkeypatch.setattr(vitscale.tasks, "check_config", checks)
    monkeypatch.setattr(vitscale.checks, "check_config", checks)
    seen = {}
    real_fit = vitscale.loop.Trainer.fit

    def fit(self):
        seen.update(self.progress.state_dict())  # the record as restored, before training on
        return real_fit(self)

    monkeypatch.setattr(vitscale.loop.Trainer, "fit", fit)
    run(capsys, "train", "--resume", str(out), "--set", "run.max_steps=6")
    assert counts == {"load": 1, "resumable": 1, "config": 1}
    assert seen == {k: saved[k] for k in seen} and seen["step"] == 4 and seen["images_seen"] > 0


# issue 62 item 3: a run saved under FSDP x TP (dp_shard=2, tp=2 on 4 processes), resumed elsewhere
FSDP_TP = SimpleNamespace(
    config_dict={"strategy": {"name": "fsdp", "dp_shard": 2, "tp": 2, "sequence_parallel": True}},
    path="RUN/checkpoints/step_00000004.pt",
)


def mesh_of(cfg) -> tuple:
    s = cfg.strategy
    return (s.name, s.dp_replicate, s.dp_shard, s.tp, s.sequence_parallel)


def test_a_resume_onto_another_strategy_takes_its_mesh_defaults_where_none_is_set():
    cfg, origin = resumed_config(FSDP_TP, ["strategy.name=single"])  # type: ignore[arg-type]
    assert mesh_of(cfg) == ("single", 0, 0, 1, False) and origin == {}
    check_mesh(cfg, origin, world_size=1)  # one process: continues
    cfg, origin = resumed_config(FSDP_TP, ["strategy.name=ddp", "strategy.tp=2"])  # type: ignore[arg-type]
    assert mesh_of(cfg) == ("ddp", 0, 0, 2, False)
    assert origin == {"name": FROM_COMMAND, "tp": FROM_COMMAND}
    check_mesh(cfg, origin, world_size=4)
    # the same strategy keeps the saved mesh, whatever else changes
    cfg, origin = resumed_config(FSDP_TP, ["strategy.name=fsdp", "optim.lr=0.001"])  # type: ignore[arg-type]
    assert mesh_of(cfg) == ("fsdp", 0, 2, 2, True)
    check_mesh(cfg, origin, world_size=4)


def test_a_mesh_refusal_on_resume_names_where_its_values_came_from():
    cfg, origin = resumed_config(FSDP_TP, [])  # type: ignore[arg-type]
    assert origin == {
        "name": FROM_SAVED,
        "dp_shard": FROM_SAVED,
        "tp": FROM_SAVED,
        "sequence_parallel": FROM_SAVED,
    }
    with pytest.raises(ConfigError) as e:
        check_mesh(cfg, origin, world_size=2)  # 4 processes' mesh on 2
    assert str(e.value) == (
        "config: the mesh dp_replicate=1 x dp_shard=2 (from the saved run) x tp=2 (from the saved "
        "run) has 4 processes, the launch 2: strategy.dp_replicate x dp_shard x tp must be the "
        "world size (one may be -1)"
    )
    cfg, origin = resumed_config(FSDP_TP, ["strategy.name=single", "strategy.tp=2"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as e:
        check_mesh(cfg, origin, world_size=1)
    assert str(e.value).startswith(
        "config: strategy.tp=2 (from the command line) with strategy.name=single: that dimension "
        "is single's to leave at 1"
    )
    cfg, origin = resumed_config(FSDP_TP, ["strategy.tp=1", "strategy.dp_shard=-1"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"strategy.sequence_parallel \(from the saved run\) "):
        check_mesh(cfg, origin, world_size=2)
