"""The conv stem's memory order, side by side: vitscale's channels-last stem (its convolutions
computing in NHWC order, `ConvStem(channels_last=True)`, the default) against the same stem in
PyTorch's default NCHW order, each arm the whole training step of the recipe (data on the device,
forward, backward, optimizer).

  python benchmarks/stem_memory_format.py [--set k=v ...] [--steps 4] [--rounds 8] [--warmup 3]

Prints img/s for both and the ratio (docs/performance.md "The conv stem in channels-last order").
The recipe must have `model.stem = "conv"` (the default recipe does).
"""

from __future__ import annotations

import torch
from two_arms import arguments, time_and_report

from vitscale.lab.recipes import lab_config
from vitscale.lab.timing import Bench
from vitscale.models.layers import ConvStem


def last_conv_input(stem: ConvStem, x: torch.Tensor) -> torch.Tensor:
    """What the stem's last conv is handed for the input `x` (its memory order)."""
    seen = []
    handle = stem.proj[-1].register_forward_hook(lambda m, i, o: seen.append(i[0]) and None)
    with torch.no_grad():  # eval mode: no batch-norm statistics moved
        stem.eval()
        stem(x)
        stem.train()
    handle.remove()
    return seen[0]


def main() -> None:
    args = arguments(__doc__)
    names = ["channels-last stem (vitscale)", "NCHW stem"]
    benches = [Bench(lab_config(None, args.overrides), synthetic=True) for _ in names]
    stems = [b.s.module.patch_embed for b in benches]
    if not all(isinstance(s, ConvStem) for s in stems):
        raise SystemExit("stem_memory_format.py: the recipe's model.stem is not 'conv'")
    stems[1].channels_last = False  # the stem as it was before
    w = next(stems[0].parameters())
    x = torch.randn(2, *benches[0].fixed[0].shape[1:], dtype=w.dtype, device=w.device)
    got = [last_conv_input(s, x) for s in stems]
    assert got[0].is_contiguous(memory_format=torch.channels_last) and not got[0].is_contiguous()
    assert got[1].is_contiguous()
    time_and_report(benches, names, args)


if __name__ == "__main__":
    main()
