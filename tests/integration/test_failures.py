"""A rank that dies or hangs stops the others with a clear error within a bounded time; under
torchrun --max-restarts the run restarts and resumes from its last complete checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import (
    BASE,
    TINY,
    alive,
    engine_case,
    free_port,
    launch,
    rel_diff,
    sets,
    torchrun,
    wait_for_checkpoint,
    weights,
)

from vitscale import checkpoint as ckpt

LONG = [
    "run.threads=1",
    "strategy.name=ddp",
    "train.epochs=2000",
    "run.progress=plain",
    "run.checkpoint_every=20",
    "run.eval_every=0",
]


def spawn_ranks(out, extra, timeout_s=20):
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vitscale",
                    "train",
                    TINY,
                    "--out",
                    str(out),
                    *sets(LONG + [f"strategy.timeout_s={timeout_s}"] + extra),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def test_killed_rank_stops_the_other_with_a_clear_error(tmp_path):
    out = tmp_path / "run"
    r0, r1 = spawn_ranks(out, [])
    try:
        wait_for_checkpoint(out, (r0, r1))
        r1.send_signal(signal.SIGKILL)
        t0 = time.time()
        _, err = r0.communicate(timeout=60)
        elapsed = time.time() - t0
    finally:
        for p in (r0, r1):
            p.kill()
    assert r0.returncode == 1 and elapsed < 60, (r0.returncode, elapsed, err[-2000:])
    last = err.strip().splitlines()[-1]
    assert last.startswith("vitscale: error: [rank 0] lost contact with another process")
    assert "Traceback" not in err
    assert ckpt.load_checkpoint(out)["step"] > 0  # the last complete checkpoint is intact


def test_hung_rank_times_out_instead_of_hanging(tmp_path):
    out = tmp_path / "run"
    r0, r1 = spawn_ranks(out, [], timeout_s=8)
    try:
        wait_for_checkpoint(out, (r0, r1))
        r1.send_signal(signal.SIGSTOP)  # alive but silent: only the collective timeout can tell
        t0 = time.time()
        _, err = r0.communicate(timeout=90)
        elapsed = time.time() - t0
    finally:
        r1.send_signal(signal.SIGCONT)
        for p in (r0, r1):
            p.kill()
    assert r0.returncode == 1 and elapsed < 90, (r0.returncode, elapsed, err[-2000:])
    assert "lost contact with another process" in err.strip().splitlines()[-1]


def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path):
    steps = ["train.epochs=20", "run.checkpoint_every=10", "run.keep_last=100"]
    ddp = BASE + ["strategy.name=ddp", "strategy.timeout_s=30"]  # torchrun() adds BASE itself
    reference = tmp_path / "uninterrupted"
    p = torchrun(reference, ddp[len(BASE) :] + steps)
    assert p.returncode == 0, p.stderr[-2000:]
    out = tmp_path / "elastic"
    # 2 restarts allowed: now and then gloo's re-connection after a kill needs a second go
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "-m",
        "vitscale",
        "train",
        TINY,
        "--out",
        str(out),
        *sets(ddp + steps),
    ]
    agent = subprocess.Popen(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not ckpt.list_checkpoints(out):
            assert time.time() < deadline and agent.poll() is None, "no checkpoint appeared"
            time.sleep(0.1)
        workers = subprocess.run(
            ["pgrep", "-P", str(agent.pid)], capture_output=True, text=True
        ).stdout.split()
        assert workers, "no worker processes found"
        os.kill(int(workers[-1]), signal.SIGKILL)
        _, err = agent.communicate(timeout=240)
    finally:
        agent.kill()
    assert agent.returncode == 0, err[-3000:]
    assert ": resuming" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 80 and summary["images_seen"] == 80 * 16
    d = rel_diff(weights(out), weights(reference))
    print(f"relative weight difference restarted vs uninterrupted DDP: {d:.2e}")
    assert d <= 1e-6, d  # the restarted run ends where an uninterrupted one does


# -- kill -9 of a launcher or of its ranks, then resume (issue 33) --------------------------------


@pytest.mark.parametrize(
    "engine,kill",
    [
        ("single", "ranks"),
        ("ddp", "launcher"),
        ("ddp", "ranks"),
        ("fsdp", "ranks"),
        ("zero2", "ranks"),
        ("tp", "ranks"),
        ("hsdp", "launcher"),
    ],
)
def test_kill_9_then_resume_is_bit_equal(tmp_path, uninterrupted, engine, kill):
    """kill -9 of the launcher alone (its ranks notice they are orphans and stop by themselves,
    so that the resumed launch is the folder's only writer) or of every rank and the launcher;
    the resumed run ends with the uninterrupted run's weights, bit for bit."""
    nproc, extra, reference = engine_case(uninterrupted, engine)
    out = tmp_path / "killed"
    agent = launch(out, extra, nproc)
    try:
        wait_for_checkpoint(out, (agent,), limit=180)
        ranks = [
            int(p)
            for p in subprocess.run(
                ["pgrep", "-P", str(agent.pid)], capture_output=True, text=True
            ).stdout.split()
        ]
        assert ranks, "no rank processes found"
        for pid in [agent.pid] + ranks if kill == "ranks" else [agent.pid]:
            os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 90  # orphans stop at their next step; a bound, not a timing
        while any(alive(p) for p in ranks) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in ranks), "orphaned ranks went on running"
    finally:
        try:
            os.killpg(agent.pid, signal.SIGKILL)  # whatever is left of the launch
        except ProcessLookupError:
            pass
        agent.wait()
    assert 0 < ckpt.load_checkpoint(out)["step"] < 40
    p = torchrun(None, [], nproc=nproc, resume=out)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = weights(reference), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel_diff(b, a)
