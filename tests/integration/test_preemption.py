"""Preempted, not lost (issue 44): a stop signal to a launched run, on every engine, leaves a checkpoint
of the step every rank stopped at, the line that names it, and a status a scheduler acts on; the
resume ends with the uninterrupted run's weights, bit for bit.

Each engine is signalled the way a user's run is: plain `vitscale train` by SIGUSR1 (SLURM's
`--signal=USR1@90`); torchrun by SIGTERM or SIGINT to the launcher alone (Kubernetes and `kill`; a
Ctrl-C in the terminal, which reaches torchrun only: it starts its ranks in sessions of their own,
and forwards both signals to them); every process of the launch by SIGUSR1 (SLURM's `--signal` to a
job step: torchrun does not handle SIGUSR1 and ends at once, and its ranks save and stop as
orphans). The signal
handling itself (each signal, a second Ctrl-C, a signal during a checkpoint write or an evaluation,
the scheduler's end time) is tests/unit/test_stop.py, in one process."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    BASE,
    TINY,
    default_signals,
    engine_case,
    launch,
    sets,
    torchrun,
    wait_for_checkpoint,
    weights,
)

import vitscale
from vitscale import checkpoint as ckpt
from vitscale.stop import CTRL_C_HINT

CASES = [
    ("single", "SIGUSR1", "process"),
    ("ddp", "SIGTERM", "launcher"),
    ("fsdp", "SIGINT", "launcher"),
    ("zero2", "SIGUSR1", "all"),
    ("tp", "SIGTERM", "launcher"),
    ("hsdp", "SIGUSR1", "all"),
]


def plain(out, extra):
    return subprocess.Popen(
        [sys.executable, "-m", "vitscale", "train", TINY, "--out", str(out), *sets(BASE + extra)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_signals,
    )


@pytest.mark.parametrize("engine,sig,to", CASES)
def test_a_stop_signal_saves_the_step_every_rank_stopped_at_and_the_resume_is_bit_equal(
    tmp_path, uninterrupted, engine, sig, to
):
    nproc, extra, reference = engine_case(uninterrupted, engine)
    out = tmp_path / "stopped"
    proc = plain(out, extra) if to == "process" else launch(out, extra, nproc)
    try:
        wait_for_checkpoint(
            out, (proc,), limit=180
        )  # a few steps in: the signal comes at a step of its own
        number = getattr(signal, sig)
        # "all": the launcher and each rank, as SLURM signals every process of a job step (torchrun
        # starts its ranks in sessions of their own, so a process group would not reach them)
        ranks = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        for pid in [proc.pid] + ([int(r) for r in ranks] if to == "all" else []):
            os.kill(pid, number)
        _, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if to == "process":
        assert proc.returncode == 128 + number, (proc.returncode, err[-3000:])
    stopped = re.findall(
        rf"vitscale: stopped by {sig} at step (\d+) of 40 \(epoch [\d.]+\); checkpoint (\S+); "
        rf"continue with: vitscale train --resume (\S+)",
        err,
    )
    assert len(stopped) == 1, err[-3000:]  # one line, from the main process
    # nothing else said of the stop: a Ctrl-C alone is told at once how to stop now (main process)
    assert err.count(CTRL_C_HINT) == (sig == "SIGINT"), err[-3000:]
    assert "Ctrl-C again" not in err.replace(CTRL_C_HINT, "") and " received: " not in err
    step, path, run = int(stopped[0][0]), stopped[0][1], stopped[0][2]
    assert 0 < step < 40 and run == str(out)
    assert (
        ckpt.list_checkpoints(out)[-1].as_posix() == path
        and ckpt.load_checkpoint(out)["step"] == step
    )
    assert (
        step % 2 == 0 or nproc == 1
    )  # several processes stop at a log step (run.log_every=2), together
    # no traceback from vitscale's code (torchrun prints its own SignalException when it is signalled
    # itself); vitscale's frames named by the package's own folder, whatever the checkout is called
    assert f'File "{Path(vitscale.__file__).parent}' not in err and (
        "Traceback" not in err or "SignalException" in err
    )
    assert not (out / "summary.json").exists()
    p = torchrun(None, [], nproc=nproc, resume=out)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = weights(reference), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_to_the_launcher_in_the_final_evaluation_saves_and_the_resumes_finish(tmp_path):
    """issue 52 at 2 ranks: SIGTERM to torchrun while both ranks evaluate after the last step
    (run.max_steps=6 of 8 steps: no checkpoint of step 6 before it). Every rank completes the evaluation,
    the state of step 6 is saved with it, the main process prints the stop line; the resume
    writes the summary and the result line and trains nothing; a resume of the finished run says
    so in one line, exit 0."""
    out, hold = tmp_path / "run", tmp_path / "hold"
    hold.mkdir()
    entry = [str(Path(__file__).with_name("hold_final_eval.py"))]
    env = {"HOLD_DIR": str(hold)}
    proc = launch(out, ["strategy.name=ddp", "run.max_steps=6"], 2, entry=entry, env=env)
    try:
        deadline = time.time() + 180
        while len(list(hold.iterdir())) < 2:
            assert time.time() < deadline and proc.poll() is None, "no rank reached the evaluation"
            time.sleep(0.1)
        # epoch 1's checkpoint (step 4) only: the final step is not saved before its evaluation
        assert [c.name for c in ckpt.list_checkpoints(out)] == ["step_00000004.pt"]
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    stopped = [x for x in err.splitlines() if x.startswith("vitscale: stopped by")]
    assert stopped == [
        f"vitscale: stopped by SIGTERM at step 6 of 6 (epoch 1.50); checkpoint "
        f"{out / 'checkpoints' / 'step_00000006.pt'}; continue with: vitscale train --resume {out}"
    ], err[-3000:]
    saved = ckpt.load_checkpoint(out)
    assert saved["step"] == 6 and saved["last_eval"]["step"] == 6
    assert not (out / "summary.json").exists()
    p = torchrun(None, [], nproc=2, resume=out)
    assert p.returncode == 0, p.stderr[-3000:]
    results = [x for x in p.stdout.splitlines() if x.startswith("test accuracy")]
    assert len(results) == 1 and json.loads((out / "summary.json").read_text())["steps"] == 6
    assert not any('"step": 7' in x for x in (out / "metrics.jsonl").open())
    p = torchrun(None, [], nproc=2, resume=out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [x for x in p.stdout.splitlines() if x.startswith("vitscale:")] == [
        f"vitscale: {out} is finished at step 6 of 6: {results[0].split(' after ')[0]}; nothing "
        f"to train (for more steps: --resume {out} --set run.max_steps=M)"
    ]
