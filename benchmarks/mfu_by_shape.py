"""MFU against model shape on this machine: the default recipe's training step (pure bf16 + compile,
the fastest settings `vitscale tune --allow-precision bf16,pure_bf16` finds here) at wider models
and more tokens, side by side in one process, each against the bf16 matmul peak measured right
after. Shows how much of the MFU gap is the default model's shape (16 tokens x 192 wide: half the
step is elementwise work) rather than the framework.

  python benchmarks/mfu_by_shape.py [--steps 5] [--rounds 3] [--warmup 3] [--no-compile]
"""

from __future__ import annotations

import argparse

import torch

from vitscale.lab.recipes import lab_config, with_overrides
from vitscale.lab.rounds import measure_configs
from vitscale.metrics import peak_flops

SHAPES = {  # name: overrides on the default recipe (batch 256, conv stem, pooled head)
    "default: 16 tokens, 6 x 192": {},
    "64 tokens (64 px), 6 x 192": {"data.image_size": 64},
    "16 tokens, 6 x 384": {"model.dim": 384, "model.heads": 6},
    "16 tokens, 6 x 768": {"model.dim": 768, "model.heads": 12},
    "64 tokens (64 px), 6 x 384": {"data.image_size": 64, "model.dim": 384, "model.heads": 6},
}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args()
    base = with_overrides(
        lab_config(None, []), {"train.precision": "pure_bf16", "train.compile": not args.no_compile}
    )
    cfgs = [with_overrides(base, o) for o in SHAPES.values()]
    res = measure_configs(
        cfgs, args.steps, args.rounds, args.warmup, synthetic=True, names=list(SHAPES)
    )
    peak, src = peak_flops(torch.device("cpu"), "bf16")
    print(
        f"# pure bf16{'' if args.no_compile else ' + compile'}, batch 256, synthetic; peak {peak / 1e9:.0f} GFLOP/s ({src})\n"
    )
    print(
        "| model | MFLOPs / image (fwd) | img/s | achieved GFLOP/s | MFU |\n|---|---:|---:|---:|---:|"
    )
    for name, r in zip(SHAPES, res):
        if "error" in r:
            print(f"| {name} | | {r['error']} | | |")
            continue
        achieved = 3 * r["flops_per_image"] * r["images_per_s"]
        print(
            f"| {name} | {r['flops_per_image'] / 1e6:.1f} | {r['images_per_s']:.1f} | {achieved / 1e9:.0f} | "
            f"{100 * achieved / peak:.1f}% |"
        )


if __name__ == "__main__":
    main()
