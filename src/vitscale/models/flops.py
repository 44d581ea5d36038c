"""Analytic FLOP counts for the ViT (matmuls only, as torch.utils.flop_counter counts them).

One multiply-accumulate = 2 FLOPs. Norms, softmax, GELU and adds are not counted (they are
a few percent of the total and are not matmul work). Training = 3x forward (backward = 2x).
"""

from __future__ import annotations

from .vit import ViTSpec, kept_patches


def vit_forward_macs(spec: ViTSpec, patch_dropout: float = 0.0) -> int:
    """Multiply-accumulates of one image's forward pass; with patch_dropout, of a training forward,
    whose blocks see the kept patch tokens only (the patch embedding still sees every patch)."""
    D, T = spec.dim, spec.num_tokens
    if patch_dropout:
        T = spec.num_prefix_tokens + kept_patches(spec.num_patches, patch_dropout)
    hidden = int(D * spec.mlp_ratio)
    patch = stem_macs(spec)
    attn = T * D * 3 * D + 2 * T * T * D + T * D * D  # qkv, q@k^T and attn@v, proj
    mlp = 2 * T * D * hidden  # fc1 + fc2
    head = D * spec.num_classes
    return patch + spec.depth * (attn + mlp) + head


def stem_macs(spec: ViTSpec) -> int:
    """The patch embedding: one stride-p conv, or the conv stem's 3x3 stride-2 stages + 1x1 conv."""
    if spec.stem == "patch":
        return spec.num_patches * spec.in_chans * spec.patch_size**2 * spec.dim
    from .layers import ConvStem

    widths = ConvStem(spec.patch_size, spec.patch_size, 1, spec.dim).widths
    macs, c, size = 0, spec.in_chans, spec.image_size
    for w in widths:
        size = (size + 1) // 2  # 3x3, stride 2, padding 1
        macs += size * size * 9 * c * w
        c = w
    return macs + spec.num_patches * c * spec.dim


def vit_forward_flops(spec: ViTSpec, patch_dropout: float = 0.0) -> int:
    return 2 * vit_forward_macs(spec, patch_dropout)


def vit_train_flops(spec: ViTSpec) -> int:
    """Forward + backward (activation and weight gradients) = 3x forward."""
    return 3 * vit_forward_flops(spec)


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
