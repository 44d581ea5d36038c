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
    patch = stem_macs(spec)
    attn = T * D * 3 * D + 2 * T * T * D + T * D * D  # qkv, q@k^T and attn@v, proj
    mlp = T * mlp_macs_per_token(spec)
    block = 2 * (attn + mlp) if spec.parallel == "branches" else attn + mlp  # two of each
    head = D * spec.num_classes * (2 if spec.distilled else 1) + pool_macs(spec, T)
    return patch + spec.depth * block + head


def mlp_macs_per_token(spec: ViTSpec) -> int:
    """One token through the MLP: fc1 + fc2; the split SwiGLU's two up-projections; the packed
    one's fc1 of the whole hidden width and fc2 of its half."""
    D, hidden = spec.dim, int(spec.dim * spec.mlp_ratio)
    if spec.mlp == "swiglu":
        return 3 * D * hidden
    if spec.mlp == "swiglu_packed":
        return D * hidden + hidden // 2 * D
    return 2 * D * hidden


def pool_macs(spec: ViTSpec, tokens: int) -> int:
    """The MAP head: the query's projection, k and v of every token, the one query's attention,
    the output projection and the MLP (0 for the other heads)."""
    if spec.head != "map":
        return 0
    D, T = spec.dim, tokens if spec.pool_prefix else tokens - spec.num_prefix_tokens
    hidden = int(D * (spec.pool_mlp_ratio or spec.mlp_ratio))
    return D * D + T * 2 * D * D + 2 * T * D + D * D + 2 * D * hidden


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
