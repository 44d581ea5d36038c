"""Measure this machine's collective link: a gloo all-reduce between K local processes (loopback /
shared memory on a CPU machine), fitted to the ring model of vitscale.lab.comm_model.

Each size B (fp32 tensor) is all-reduced `iters` times after a warm-up; the median time t(B) is
fitted by least squares to  t = 2(K-1) x a + 2(K-1)/K x B / bw  (one bucket), which gives the
link's bandwidth bw (bytes/s) and per-step latency a for `vitscale predict --link loopback`.
"""

from __future__ import annotations

import statistics

SIZES = (2**12, 2**16, 2**20, 2**22, 2**24, 2**26)  # bytes


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
    from ..strategy.comm import (
        time_all_reduce,  # torch.distributed: not at import (the CLI imports the lab)
    )

    rows = time_all_reduce(world, list(sizes), iters)
    bw, lat = fit(rows, world)
    return {
        "world": world,
        "rows": rows,
        "bw": bw,
        "latency": lat,
        "backend": "gloo",
        "model": "t = 2(K-1) a + 2(K-1)/K B / bw (least squares over sizes)",
    }
