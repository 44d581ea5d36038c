"""What OpenCLIP's two layouts share (arch.py's ViT towers, timm_tower.py's timm towers): the text
block's key names, block counts, MLP ratios."""

from __future__ import annotations

import math
import re

from ...errors import UserError

# OpenCLIP's residual block -> vitscale's Block
BLOCK_MAP = (
    ("ln_1", "norm1"),
    ("attn.in_proj_weight", "attn.qkv.weight"),
    ("attn.in_proj_bias", "attn.qkv.bias"),
    ("attn.out_proj", "attn.proj"),
    ("ln_2", "norm2"),
    ("mlp.c_fc", "mlp.fc1"),
    ("mlp.c_proj", "mlp.fc2"),
)


def depth_of(sd: dict, prefix: str) -> int:
    layers = {int(m.group(1)) for k in sd if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    if not layers or layers != set(range(len(layers))):
        raise UserError(f"OpenCLIP: the blocks {prefix}N are missing or not numbered 0..N-1")
    return len(layers)


def ratio(hidden: int, dim: int) -> float:
    """The MLP ratio r with int(dim * r) == hidden (both libraries size the MLP so; hidden / dim
    alone can land a float just below, e.g. ViT-bigG-14's 8192 / 1664)."""
    r = hidden / dim
    while int(dim * r) < hidden:
        r = math.nextafter(r, math.inf)
    return r
