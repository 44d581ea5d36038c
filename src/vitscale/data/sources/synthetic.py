"""Synthetic images of any shape, deterministic from the seed and learnable.

Each class has a fixed smooth random template (a 4x4 pattern upsampled to the image size);
a sample is its class template plus Gaussian pixel noise, so a tiny model can fit it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..sampler import generator
from ..types import TensorSplits

NOISE_STD = 40.0  # pixel noise (0..255 scale) on top of the class template


def _images(
    templates: torch.Tensor, labels: torch.Tensor, g: torch.Generator, chunk: int = 256
) -> torch.Tensor:
    """templates float [K,C,S,S] in 0..255, labels [N] -> uint8 [N,C,S,S]."""
    out = torch.empty(len(labels), *templates.shape[1:], dtype=torch.uint8)
    for s in range(0, len(labels), chunk):
        base = templates[labels[s : s + chunk]]
        noise = torch.randn(base.shape, generator=g) * NOISE_STD
        out[s : s + chunk] = (base + noise).round_().clamp_(0, 255).to(torch.uint8)
    return out


def make(cfg, seed: int) -> TensorSplits:
    size, c, k = cfg.image_size or 32, cfg.channels, cfg.num_classes
    g = generator("synthetic-templates", seed, c, size, k)
    coarse = torch.rand(k, c, 4, 4, generator=g)  # [K,C,4,4]
    templates = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    templates = 32 + 192 * templates  # [K,C,S,S] in 32..224
    splits = []
    for name, n in (("train", cfg.train_size), ("test", cfg.test_size)):
        g = generator("synthetic", seed, name, c, size, k, n)
        labels = torch.randint(0, k, (n,), generator=g)
        splits += [_images(templates, labels, g), labels]
    sample = splits[0][:1024].double() / 255  # [<=1024,C,S,S]
    mean = tuple(round(v, 4) for v in sample.mean(dim=(0, 2, 3)).tolist())
    std = tuple(max(round(v, 4), 1e-3) for v in sample.std(dim=(0, 2, 3)).tolist())
    return TensorSplits(*splits, [f"class_{i}" for i in range(k)], mean, std)
