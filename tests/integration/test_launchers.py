"""Launchers other than torchrun: the `deepspeed` launcher starts 2 CPU ranks of `vitscale train`
(docs/distributed.md, "Launching") and gives the single-process result."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BASE, TINY, free_port, rel_diff, sets, weights

DEEPSPEED = (
    Path(sys.executable).parent / "deepspeed"
)  # the launcher script pip installs next to python
pytestmark = pytest.mark.skipif(
    not DEEPSPEED.exists() or importlib.util.find_spec("deepspeed") is None,
    reason="the deepspeed launcher is not installed; install it with "
    "DS_BUILD_OPS=0 pip install -c constraints.txt -e '.[deepspeed]'",
)


def deepspeed_launch(out, extra, nproc=2, timeout=240):
    # --num_gpus: on a CPU the launcher counts NUMA nodes as devices (1 here); --no_local_rank: vitscale
    # reads LOCAL_RANK from the environment and refuses an unknown --local_rank argument
    cmd = [
        str(DEEPSPEED),
        "--num_gpus",
        str(nproc),
        "--master_port",
        str(free_port()),
        "--no_local_rank",
        "--module",
        "vitscale",
        "train",
        TINY,
        "--out",
        str(out),
        *sets(BASE + extra),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the launcher leaves it unset (torchrun sets it)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if (
        p.returncode and "address already in use" in (p.stdout + p.stderr).lower()
    ):  # lost a port race
        return deepspeed_launch(out, extra, nproc, timeout)
    return p


def test_deepspeed_launcher_two_ranks_match_single_process(tmp_path, single):
    out = tmp_path / "ds"
    p = deepspeed_launch(out, ["strategy.name=deepspeed", "strategy.zero_stage=2"])
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    d = rel_diff(weights(out), weights(single))
    print(
        f"deepspeed launcher, ZeRO-2, 2 ranks: relative weight difference vs single process {d:.2e}"
    )
    assert d <= 1e-5, d
    s, one = (json.loads((r / "summary.json").read_text()) for r in (out, single))
    assert (
        s["world_size"] == 2
        and s["steps"] == one["steps"]
        and s["images_seen"] == one["images_seen"]
    )
    assert s["threads"] == 1
    assert "Traceback" not in p.stderr
