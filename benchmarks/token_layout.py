"""The token layout a stem hands to the transformer, side by side: vitscale's token-major tokens
([B, N, D] contiguous) against the transposed view of the stem's [B, D, g, g] output that
`conv(x).flatten(2).transpose(1, 2)` gives (what vitscale did before, and what timm's PatchEmbed
still does).

Elementwise ops keep their input's memory order, so with the transposed view the whole residual
stream stays in [B, D, N] order and every layer norm reduces over strided memory; a class token
hides it (torch.cat writes a contiguous tensor), a pooled head does not.

  python benchmarks/token_layout.py [--set k=v ...] [--steps 4] [--rounds 8] [--warmup 3]

Prints img/s for both and the ratio (docs/performance.md "Token layout").
"""

from __future__ import annotations

import argparse
import statistics
import types

import torch

from vitscale.lab.recipes import lab_config
from vitscale.lab.rounds import paired_rounds, rate, rounds_won, side_by_side
from vitscale.lab.timing import Bench


def transposed_view(self, x):
    return (
        self.proj(x).flatten(2).transpose(1, 2)
    )  # [B, D, g, g] -> a [B, N, D] view in [B, D, N] order


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    names = ["token-major (vitscale)", "transposed view"]
    benches = [Bench(lab_config(None, args.overrides), synthetic=True) for _ in names]
    stem = benches[
        1
    ].s.module.patch_embed  # patched before the first step: compile traces the patched forward
    stem.forward = types.MethodType(transposed_view, stem)
    stems = (benches[0].s.module.patch_embed, stem)
    with (
        torch.no_grad()
    ):  # the two arms really differ in layout (eval mode: no batch-norm statistics moved)
        for m in stems:
            m.eval()
        w = next(stem.parameters())
        x = torch.randn(2, *benches[0].fixed[0].shape[1:], dtype=w.dtype, device=w.device)
        assert stems[0](x).is_contiguous() and not stems[1](x).is_contiguous()
        for m in stems:
            m.train()
    times = side_by_side(benches, args.steps, args.rounds, args.warmup, label=lambda i: names[i])
    ips = [rate(t, args.steps, b.global_batch)["images_per_s"] for t, b in zip(times, benches)]
    print(
        f"overrides: {' '.join(args.overrides) or '(the default recipe)'}; synthetic batch "
        f"{benches[0].global_batch}, {args.rounds} rounds x {args.steps} steps"
    )
    for n, v in zip(names, ips):
        print(f"  {n}: {v:.1f} img/s")
    rounds = paired_rounds(times, [b.global_batch for b in benches])[
        1
    ]  # transposed / token-major, per round
    print(
        f"  token-major / transposed view: {ips[0] / ips[1]:.3f}x (median rounds), "
        f"{statistics.median(1 / r for r in rounds):.3f}x round by round "
        f"(faster in {rounds_won([1 / r for r in rounds])} of {len(rounds)} rounds)"
    )
    for b in benches:
        b.close()


if __name__ == "__main__":
    main()
