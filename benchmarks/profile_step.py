"""Where a training step's time goes: torch.profiler over `Trainer.train_step` (the loop's own step),
with inductor's generated kernels named when the config compiles.

  python benchmarks/profile_step.py [CONFIG] [--set k=v ...] [--steps 5] [--warmup 4] [--rows 25]

Prints the step time under the profiler, the operators and compiled kernels sorted by their own
time, and the same self time grouped into the parts of a ViT step (linear layers, attention's
batched matmuls, the conv stem, GELU, other compiled kernels, the optimizer, the rest) with what
MFU the step would reach if the linear layers alone took time (docs/performance.md "Against the
targets").
"""

from __future__ import annotations

import argparse

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from vitscale.lab.recipes import lab_config
from vitscale.lab.timing import Bench
from vitscale.metrics import peak_flops

GROUPS = [  # (part of the step, test on the event name), first match wins
    ("linear layers (mm, addmm)", lambda n: n in ("aten::mm", "aten::addmm", "aten::linear")),
    ("attention's batched matmuls (bmm)", lambda n: n in ("aten::bmm", "aten::baddbmm")),
    (
        "conv stem (convolutions, their batch norms)",
        lambda n: "convolution" in n or "batch_norm" in n,
    ),
    ("GELU (forward, backward)", lambda n: "gelu" in n),
    ("other compiled kernels (norms, adds, softmax, reshapes)", lambda n: n.startswith("graph_")),
    (
        "optimizer",
        lambda n: "adam" in n.lower() or "Optimizer" in n or n.startswith("aten::_foreach"),
    ),
]


def grouped(events, steps: int) -> list[tuple[str, float]]:
    """ms per step of self time per part of the step; the rest (eager elementwise ops, copies,
    launches, Python) in a last row."""
    ms = {name: 0.0 for name, _ in GROUPS}
    rest = 0.0
    for e in events:
        t = e.self_cpu_time_total / 1e3 / steps
        for name, test in GROUPS:
            if test(e.key):
                ms[name] += t
                break
        else:
            rest += t
    return list(ms.items()) + [("the rest (eager ops, copies, launches, Python)", rest)]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    inductor_config.cpp.enable_kernel_profile = (
        True  # each generated CPU kernel becomes a profiler event
    )
    bench = Bench(lab_config(args.config, args.overrides), synthetic=True)
    bench.steps(args.warmup)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall, _ = bench.steps(args.steps)
    print(
        f"step under the profiler: {1e3 * wall / args.steps:.1f} ms ({bench.global_batch} images, "
        f"{torch.get_num_threads()} threads)"
    )
    events = prof.key_averages()
    print(
        events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70)
    )
    parts = grouped(events, args.steps)
    total = sum(v for _, v in parts)
    print(f"self time per step: {total:.1f} ms")
    for name, v in parts:
        print(f"  {name:58s} {v:7.1f} ms  {100 * v / total:5.1f}%")
    flops = (
        3 * bench.trainer.flops_per_image * bench.global_batch
    )  # per step, counted as MFU counts
    peak, src = peak_flops(bench.s.device, "bf16")
    budget = 1e3 * flops / (0.6 * peak)  # ms per step at 60% MFU
    linear, rest = parts[0][1], total - parts[0][1]
    print(
        f"MFU of this step under the profiler: {100 * flops / (total / 1e3 * peak):.1f}% of {peak / 1e9:.0f} "
        f"GFLOP/s ({src}). 60% would need a {budget:.1f} ms step: with the linear layers as they are, "
        f"{budget - linear:.1f} ms for everything else, now {rest:.1f} ms"
    )
    bench.close()


if __name__ == "__main__":
    main()
