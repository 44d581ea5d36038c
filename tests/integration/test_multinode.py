"""The multi-node launch path on one machine: docs/launch/vitscale.sbatch run as SLURM would run it
on 2 nodes (a stand-in `srun` starts one task per "node", `scontrol` names this machine as the
head node), so two torchrun agents meet through the c10d rendezvous, each with one CPU process."""

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import BASE, TINY, free_port, rel_diff, sets, weights

SRUN = """#!/bin/bash
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""


def test_sbatch_script_two_nodes_match_single_process(tmp_path, single):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", "#!/bin/bash\necho 127.0.0.1\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "run"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_GPUS_ON_NODE": "1",
        "SLURM_CPUS_PER_TASK": "1",
        "VITSCALE_RDZV_PORT": str(free_port()),
        "VITSCALE_OUT": str(out),
    }
    p = subprocess.run(
        ["bash", "docs/launch/vitscale.sbatch", TINY, *sets(BASE + ["strategy.name=ddp"])],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    d = rel_diff(weights(out), weights(single))
    print(
        f"relative weight difference, 2 nodes x 1 process (sbatch script, c10d rendezvous) vs single: {d:.2e}"
    )
    assert d <= 1e-5, d


def test_srun_without_torchrun_two_tasks_match_single_process(tmp_path, single):
    """`srun --ntasks 2 python -m vitscale train ...` with no torchrun: each task reads its rank,
    the world size and the rendezvous host from SLURM's variables (vitscale/launch.launch_env)."""
    out = tmp_path / "run"
    port = str(free_port())
    procs = []
    for task in range(2):
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
        }
        env.update(
            SLURM_PROCID=str(task),
            SLURM_LOCALID=str(task),
            SLURM_NODEID="0",
            SLURM_STEP_NUM_TASKS="2",
            SLURM_NTASKS="2",
            SLURM_STEP_NODELIST="127.0.0.1",
            SLURM_JOB_ID="4242",
            MASTER_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vitscale",
                    "train",
                    TINY,
                    *sets(BASE + ["strategy.name=ddp"]),
                    "--out",
                    str(out),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), results[0][1][-3000:] + results[1][1][-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    d = rel_diff(weights(out), weights(single))
    print(f"relative weight difference, srun 2 tasks (no torchrun) vs single: {d:.2e}")
    assert d <= 1e-5, d
