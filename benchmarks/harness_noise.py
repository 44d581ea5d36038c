"""How noisy side-by-side timing is on this machine, and what tune's rules make of it: the same
configuration built N times and timed in interleaved rounds (the lab's rounds.py), so every
difference is noise. Prints each copy's round-by-round ratios to the first copy, their median, and
whether `vitscale tune` would have taken the copy for a gain (more than 2/3 of the rounds faster and
a median above 1.01); then the optimizer step alone for each `optim.impl` on the recipe's model.

  python benchmarks/harness_noise.py [CONFIG] [--set k=v ...] [--copies 3] [--steps 2] [--rounds 9]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from vitscale.lab.recipes import lab_config
from vitscale.lab.rounds import measure_configs
from vitscale.lab.tune import beats_first
from vitscale.optim import build_optimizer
from vitscale.tasks import build_task


def optimizer_steps(cfg, reps: int = 20, rounds: int = 3) -> dict:
    """ms per optimizer step for each implementation, on the recipe's model with random gradients."""
    task = build_task(cfg)
    model = task.build_model(task.build_spec(*task.geometry()))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opts = {}
    for impl in ("forloop", "foreach", "fused"):
        opts[impl] = build_optimizer(model, dataclasses.replace(cfg.optim, impl=impl))
        opts[impl].step()
    ms = {impl: [] for impl in opts}
    for _ in range(rounds):  # interleaved, like lab/rounds.py
        for impl, o in opts.items():
            t = time.perf_counter()
            for _ in range(reps):
                o.step()
            ms[impl].append(1e3 * (time.perf_counter() - t) / reps)
    n = sum(p.numel() for p in model.parameters())
    return {
        "parameters": n,
        "tensors": len(list(model.parameters())),
        "ms": {k: statistics.median(v) for k, v in ms.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--copies", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    cfgs = [lab_config(args.config, args.overrides) for _ in range(args.copies)]
    res = measure_configs(cfgs, args.steps, args.rounds, args.warmup, synthetic=True)
    print(
        f"{args.copies} copies of one configuration, {args.rounds} rounds x {args.steps} steps, "
        f"{torch.get_num_threads()} threads"
    )
    for i, r in enumerate(res):
        rounds = r["paired_rounds"]
        taken = i and beats_first(r["paired_vs_first"], rounds)
        print(
            f"  copy {i}: {r['images_per_s']:.1f} img/s (median round); vs copy 0 round by round "
            f"{min(rounds):.3f}-{max(rounds):.3f}, median {r['paired_vs_first']:.3f}"
            + (f"; tune would take it: {'yes (a false gain)' if taken else 'no'}" if i else "")
        )
    o = optimizer_steps(cfgs[0])
    print(
        f"optimizer step alone ({o['parameters']:,} parameters in {o['tensors']} tensors): "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in o["ms"].items())
    )


if __name__ == "__main__":
    main()
