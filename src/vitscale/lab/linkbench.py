"""Measure this machine's collective link: a gloo all-reduce between K local processes (loopback /
shared memory on a CPU machine), fitted to the ring model of vitscale.lab.comm_model.

Each size B (fp32 tensor) is all-reduced `iters` times after a warm-up; the median time t(B) is
fitted by least squares to  t = 2(K-1) x a + 2(K-1)/K x B / bw  (one bucket), which gives the
link's bandwidth bw (bytes/s) and per-step latency a for `vitscale predict --link loopback`.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

SIZES = (2**12, 2**16, 2**20, 2**22, 2**24, 2**26)   # bytes


def _worker(rank: int, world: int, init_file: str, sizes, iters: int, out_file: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        for _ in range(2):
            dist.all_reduce(x)
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        rows.append((nbytes, statistics.median(times)))
    if rank == 0:
        with open(out_file, "w") as f:
            f.write("\n".join(f"{b} {t}" for b, t in rows))
    dist.destroy_process_group()


def fit(rows: list[tuple[float, float]], world: int) -> tuple[float, float]:
    """(bw bytes/s, latency s per ring step) from [(bytes, seconds)] by least squares on
    t = 2(K-1) a + 2(K-1)/K B / bw."""
    xs = [2 * (world - 1) / world * b for b, _ in rows]
    ys = [t for _, t in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    return 1.0 / slope, max(0.0, intercept) / (2 * (world - 1))


def measure_gloo(world: int = 2, sizes=SIZES, iters: int = 10) -> dict:
    """Spawn `world` local gloo processes and fit the ring model; returns sizes, times, bw, latency."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "out")
        mp.spawn(_worker, args=(world, init, list(sizes), iters, out), nprocs=world, join=True)
        rows = [(int(b), float(t)) for b, t in (ln.split() for ln in open(out).read().splitlines())]
    bw, lat = fit(rows, world)
    return {"world": world, "rows": rows, "bw": bw, "latency": lat, "backend": "gloo",
            "model": "t = 2(K-1) a + 2(K-1)/K B / bw (least squares over sizes)"}
