"""DeepSpeed ZeRO on CPU: 2 gloo ranks launched by torchrun give the single-process result.

Every run here is about 10 s: the strategy keeps DeepSpeed from compiling its shared-memory comm
op (only tensor-parallel inference uses it) and hands DeepSpeed a torch optimizer (no FusedAdam or
cpu_adam build), so nothing is compiled, cold cache or warm.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import (
    BASE,
    TINY,
    check_eval_and_export,
    comm_per_step,
    free_port,
    rel_diff,
    sets,
    weights,
)

from vitscale import checkpoint as ckpt
from vitscale.cli import main


def _deepspeed_importable() -> tuple[bool, str]:
    # in a subprocess: importing DeepSpeed picks an accelerator and sets up logging in the process
    p = subprocess.run(
        [sys.executable, "-c", "import deepspeed"],
        capture_output=True,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        timeout=120,
    )
    last = (p.stderr.strip().splitlines() or ["?"])[-1]
    return p.returncode == 0, last


_ok, _why = _deepspeed_importable()
pytestmark = pytest.mark.skipif(
    not _ok,
    reason=f"`import deepspeed` fails ({_why}); install it with "
    "DS_BUILD_OPS=0 pip install -c constraints.txt -e '.[deepspeed]'",
)

DS = ["strategy.name=deepspeed"]
# the tiny model's tensors are all below ZeRO-3's persistence threshold (1e5 elements): 0 makes
# ZeRO-3 gather and release every parameter, as it would for a real model; also tests the merge
Z3_JSON = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def launch(args, nproc=2, timeout=240):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def ds_train(out, extra, nproc=2):
    return launch(
        ["-m", "vitscale", "train", TINY, "--out", str(out), *sets(BASE + DS + extra)], nproc
    )


def saved_strategy(run_dir) -> dict:
    return torch.load(ckpt.list_checkpoints(run_dir)[-1], weights_only=False)["strategy"]


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3")
    (tmp / "ds.json").write_text(json.dumps(Z3_JSON))
    p = ds_train(tmp / "run", ["strategy.zero_stage=3", f"strategy.ds_config={tmp / 'ds.json'}"])
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp / "run", p.stderr


def check_run(out, single, tol, stderr):
    d = rel_diff(weights(out), weights(single))
    print(f"relative weight difference vs single process: {d:.2e}")
    assert d <= tol, d
    s_ds = json.loads((out / "summary.json").read_text())
    s_one = json.loads((single / "summary.json").read_text())
    assert s_ds["world_size"] == 2 and s_ds["steps"] == s_one["steps"]
    assert s_ds["images_seen"] == s_one["images_seen"]
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(
        e["test_count"] == 32 for e in evals if e["kind"] == "eval"
    )  # gathered, each image once
    assert abs(s_ds["test_accuracy"] - s_one["test_accuracy"]) <= 1 / 32
    trains = [e for e in evals if e["kind"] == "train"]
    assert trains and all(e["grad_norm"] > 0 and not e["skipped"] for e in trains)
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    "extra,tol",
    [
        (["strategy.zero_stage=1"], 1e-5),
        (["strategy.zero_stage=2"], 1e-5),
        (
            ["strategy.zero_stage=1", "train.accum_steps=2"],
            1e-5,
        ),  # = the big batch: one step per 2 micro
        (["strategy.zero_stage=2", "train.accum_steps=2"], 1e-5),
        (["strategy.zero_stage=3", "train.accum_steps=2"], 1e-5),
        (
            [
                "strategy.zero_stage=3",
                "strategy.offload_optimizer=true",
                "strategy.offload_params=true",
            ],
            1e-5,
        ),
        (
            ["strategy.zero_stage=2", "train.precision=bf16"],
            2e-2,
        ),  # bf16 weights/grads, fp32 masters: 3.7e-3
        (["strategy.zero_stage=2", "train.compile=true"], 1e-5),  # DeepSpeed's engine.compile()
    ],
)
def test_deepspeed_two_ranks_match_single_process(tmp_path, single, extra, tol):
    out = tmp_path / "ds"
    p = ds_train(out, extra)
    assert p.returncode == 0, p.stderr[-3000:]
    check_run(out, single, tol, p.stderr)
    sd = saved_strategy(out)
    assert (
        sd["ds_config"]["train_micro_batch_size_per_gpu"]
        * 2
        * sd["ds_config"]["gradient_accumulation_steps"]
        == 16
    )
    assert sd["ds_config"]["gradient_clipping"] == 1.0
    check_comm(out, extra)


def check_comm(out, extra):
    """Bytes per step / 4P against what each ZeRO stage communicates: gradients reduced (ZeRO-2 and 3
    at every micro-batch, ZeRO-1 once per step), updated parameters all-gathered (ZeRO-1/2, in the
    weights' dtype), ZeRO-3 gathering every parameter before use (at least once per step: with
    DeepSpeed's default stage3_max_reuse_distance the tiny model's parameters stay gathered from
    forward to backward)."""
    A = 2 if "train.accum_steps=2" in extra else 1
    stage = int(next(x for x in extra if x.startswith("strategy.zero_stage="))[-1])
    width = 0.5 if "train.precision=bf16" in extra else 1.0
    micro = A if stage >= 2 else 1
    for c in comm_per_step(out):
        print(f"ZeRO-{stage} {extra}: bytes per step / 4P: {c}")
        grads = c.get("allreduce", 0) + c.get("reducescatter", 0)
        assert micro * width <= grads <= micro * width * 1.01, c
        if stage in (1, 2):
            assert c["allgather"] == pytest.approx(width, rel=1e-3), c
        else:
            assert c["allgather"] >= 1, c


def test_zero3_matches_single_process_and_user_config_is_merged(zero3, single):
    run, stderr = zero3
    check_run(run, single, 1e-5, stderr)
    check_comm(run, ["strategy.zero_stage=3"])
    summary = json.loads((run / "summary.json").read_text())
    for r in summary["state_bytes_per_rank"]:  # each rank holds its half of the fp32 parameters
        assert 0.45 <= r["params"] / (4 * summary["params"]) <= 0.6, r
    sd = saved_strategy(run)
    assert sd["zero_stage"] == 3
    assert sd["ds_config"]["zero_optimization"] == {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
    }
    one = weights(single)  # consolidated: plain module keys, full fp32 tensors
    assert {k: (v.shape, v.dtype) for k, v in sd["model"].items()} == {
        k: (v.shape, v.dtype) for k, v in one.items()
    }


def test_eval_and_export_of_a_deepspeed_run(zero3, tmp_path, capsys, monkeypatch):
    zero3 = zero3[0]
    for k in (
        "MASTER_ADDR",
        "WORLD_SIZE",
        "RANK",
    ):  # `vitscale eval` runs alone, without a launcher
        monkeypatch.delenv(k, raising=False)
    result = check_eval_and_export(zero3, tmp_path, capsys, weights(zero3))
    assert result["count"] == 32


def test_one_process_without_a_launcher(tmp_path, single):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK")
    }
    out = tmp_path / "one"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "vitscale",
            "train",
            TINY,
            "--out",
            str(out),
            *sets(BASE + DS + ["strategy.zero_stage=1"]),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    d = rel_diff(weights(out), weights(single))
    print(f"relative weight difference, DeepSpeed ZeRO-1 in one process vs single: {d:.2e}")
    assert d <= 1e-5, d


def test_engine_checkpoint_resumes_exactly(tmp_path):
    full = tmp_path / "full"
    extra = [
        "strategy.zero_stage=2",
        "train.precision=bf16",
        "run.checkpoint_every=3",
        "run.keep_last=2",
        "train.epochs=3",
    ]
    p = launch(["-m", "vitscale", "train", TINY, "--out", str(full), *sets(BASE + DS + extra)])
    assert p.returncode == 0, p.stderr[-3000:]
    names = sorted(
        x.name for x in (full / "checkpoints").iterdir() if x.suffix != ".py"
    )  # DeepSpeed's scripts
    # pruned, and no temp folder left: the engine folder is written under a temp name, then renamed
    assert names == ["step_00000009.ds", "step_00000009.pt", "step_00000012.ds", "step_00000012.pt"]
    part = tmp_path / "part"
    shutil.copytree(full, part)
    for old in (part / "checkpoints").glob("step_00000012.*"):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    (part / "summary.json").unlink()
    p = launch(["-m", "vitscale", "train", "--resume", str(part)])
    assert p.returncode == 0, p.stderr[-3000:]
    d = rel_diff(weights(part), weights(full))
    print(f"relative weight difference DeepSpeed resumed from step 9 vs uninterrupted: {d:.2e}")
    assert d == 0.0, d
    p = launch(
        ["-m", "vitscale", "train", "--resume", str(part)], nproc=1
    )  # ZeRO shards do not re-partition
    assert p.returncode != 0 and "resume with the same number of processes" in p.stderr


def test_refused_configs_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": 32}))
    cases = [
        (
            ["train.precision=fp16"],
            "strategy.name=deepspeed does not support train.precision=fp16 on CPU",
        ),
        ([f"strategy.ds_config={bad}"], "train_batch_size=32 conflicts with data.batch_size = 16"),
        (["strategy.offload_params=true"], "strategy.offload_params needs strategy.zero_stage=3"),
        (["train.ema_decay=0.9"], "does not support train.ema_decay"),
    ]
    for extra, message in cases:
        assert main(["train", TINY, "--out", str(tmp_path / "x"), *sets(DS + extra)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
