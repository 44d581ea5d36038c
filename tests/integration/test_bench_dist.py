"""vitscale bench under torchrun: 2 gloo processes under DDP give one JSON (rank 0 prints it) with
the communication counted and split. No timing is asserted."""

import json
import os
import subprocess
import sys

from helpers import TINY, check_bench_schema, free_port, sets


def test_bench_two_processes_ddp(tmp_path):
    out = tmp_path / "ddp.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "vitscale",
        "bench",
        TINY,
        "--json",
        "--out",
        str(out),
        "--steps",
        "2",
        "--trials",
        "1",
        "--warmup",
        "1",
        "--split-steps",
        "1",
        *sets(["strategy.name=ddp", "run.threads=1"]),
    ]
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert json.loads(p.stdout) == r  # rank 0 alone printed
    check_bench_schema(r)
    assert r["world_size"] == 2 and r["strategy"] == "ddp" and r["batch_size"] == 16
    assert (
        r["comm"]["comm_allreduce_bytes_per_step"] > 0
        and r["comm"]["comm_allreduce_calls_per_step"] >= 1
    )
    for k in ("comm_exposed", "comm_overlapped", "comm_total"):
        assert isinstance(r["split"][k], float) and r["split"][k] >= 0
