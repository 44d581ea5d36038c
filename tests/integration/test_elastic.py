"""`vitscale train --nproc-per-node N` (src/vitscale/elastic.py, issue 62): the ranks started by torch's
elastic launcher API, one command owning their output and status. A config refusal is one line and
exit 2 before any rank starts; the run equals the one-process run; a stop signal to the command
saves every rank at one step and exits 128 + the signal; a rank killed ends in one line naming it
and the last complete checkpoint. Under plain torchrun a refusal is printed by rank 0 only."""

import json
import os
import signal
import subprocess
import sys
import time

from helpers import BASE, TINY, rel_diff, sets, torchrun, weights

VITSCALE = [sys.executable, "-m", "vitscale", "train", TINY]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def errors(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith("vitscale: error")]


def test_a_refusal_is_one_line_before_any_rank_starts(tmp_path):
    out = tmp_path / "run"
    bad = ["strategy.name=fsdp", "strategy.tp=4"]
    p = subprocess.run(
        [*VITSCALE, "--nproc-per-node", "4", "--out", str(out), *sets(BASE + bad)],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "strategy.tp=4 does not divide" in lines[0], lines
    assert not out.exists()  # no rank started, nothing written


def test_two_ranks_train_the_one_process_run(tmp_path, single):
    out = tmp_path / "run"
    p = subprocess.run(
        [
            *VITSCALE,
            "--nproc-per-node",
            "2",
            "--out",
            str(out),
            *sets(BASE + ["strategy.name=ddp"]),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=ENV,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert errors(p.stderr) == [] and "test accuracy" in p.stdout
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    assert rel_diff(weights(out), weights(single)) <= 1e-5


def long_run(out, extra=()):
    """A 2-rank run long enough to be stopped, started in the background, once it has trained."""
    cmd = [*VITSCALE, "--nproc-per-node", "2", "--out", str(out)]
    cmd += sets(BASE + ["strategy.name=ddp", "train.epochs=400", "run.checkpoint_every=40", *extra])
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 120
    while time.time() < deadline and not list((out / "checkpoints").glob("step_*.pt")):
        time.sleep(0.2)
    assert p.poll() is None, p.communicate()[1][-2000:]
    return p


def test_a_stop_signal_to_the_command_saves_every_rank_and_exits_128_plus_it(tmp_path):
    out = tmp_path / "run"
    p = long_run(out)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 143, err[-2000:]
    stopped = [x for x in err.splitlines() if x.startswith("vitscale: stopped by SIGTERM")]
    assert len(stopped) == 1 and errors(err) == [], err[-2000:]
    step = int(stopped[0].split(" at step ")[1].split()[0])
    assert (out / "checkpoints" / f"step_{step:08d}.pt").exists()
    # the resume, through the same command, continues from that step
    more = f"run.max_steps={step + 4}"
    r = subprocess.run(
        [sys.executable, "-m", "vitscale", "train", "--resume", str(out), "--nproc-per-node", "2"]
        + sets([more]),
        capture_output=True,
        text=True,
        timeout=240,
        env=ENV,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == step + 4


def test_a_killed_rank_ends_in_one_line_naming_it_and_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    p = long_run(out)
    ranks = subprocess.run(
        ["pgrep", "-f", f"vitscale train {TINY} --out {out}"], capture_output=True, text=True
    ).stdout.split()
    assert len(ranks) == 2, ranks
    os.kill(int(ranks[-1]), signal.SIGKILL)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 137, err[-2000:]
    last = errors(err)[-1]
    assert "was killed by SIGKILL" in last and "the last complete checkpoint is " in last
    assert f"vitscale train --resume {out}" in last


def test_under_torchrun_a_refusal_is_printed_by_rank_0_only(tmp_path):
    p = torchrun(tmp_path / "run", ["strategy.name=fsdp", "strategy.tp=4"], nproc=4)
    assert p.returncode != 0
    mine = errors(p.stderr)
    assert len(mine) == 1 and "[rank 0]" in mine[0], mine
