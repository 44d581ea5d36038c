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

import types

import torch
from two_arms import arguments, time_and_report

from vitscale.lab.recipes import lab_config
from vitscale.lab.timing import Bench


def transposed_view(self, x):
    return (
        self.proj(x).flatten(2).transpose(1, 2)
    )  # [B, D, g, g] -> a [B, N, D] view in [B, D, N] order


def main() -> None:
    args = arguments(__doc__)
    names = ["token-major (vitscale)", "transposed view"]
    benches = [Bench(lab_config(None, args.overrides), synthetic=True) for _ in names]
    stem = benches[
        1
    ].s.module.patch_embed  # patched before the first step: compile traces the patched forward
    stem.forward = types.MethodType(transposed_view, stem)
    stems = (benches[0].s.module.patch_embed, stem)
    for m in stems:  # the conv stem in NCHW order in both arms, as when this was measured: its
        # channels-last order makes the token-major memory without a copy, and
        # stem_memory_format.py measures that on its own
        if hasattr(m, "channels_last"):
            m.channels_last = False
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
    time_and_report(benches, names, args)


if __name__ == "__main__":
    main()
