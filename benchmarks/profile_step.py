"""Where a training step's time goes: torch.profiler over `Trainer.train_step` (the loop's own step),
with inductor's generated kernels named when the config compiles.

  python benchmarks/profile_step.py [CONFIG] [--set k=v ...] [--steps 5] [--warmup 4] [--rows 25]

Prints the step time under the profiler and the operators and compiled kernels sorted by their own
time (docs/performance.md "Against the targets" has one such table, grouped by hand).
"""
from __future__ import annotations

import argparse

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from vitscale.lab_harness import Bench, lab_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    inductor_config.cpp.enable_kernel_profile = True  # each generated CPU kernel becomes a profiler event
    bench = Bench(lab_config(args.config, args.overrides), synthetic=True)
    bench.steps(args.warmup)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall, _ = bench.steps(args.steps)
    print(f"step under the profiler: {1e3 * wall / args.steps:.1f} ms ({bench.global_batch} images, "
          f"{torch.get_num_threads()} threads)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
    bench.close()


if __name__ == "__main__":
    main()
