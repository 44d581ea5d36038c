"""Vision Transformer (ViT) with a registry of the standard sizes and small-image variants."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import did_you_mean
from .layers import Block, ConvStem, PatchEmbed


@dataclass(frozen=True)
class ViTSpec:
    image_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    dim: int = 768
    depth: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    head: str = "token"        # "token" (class token) | "pool" (global average of patch tokens)
    attention: str = "sdpa"    # "sdpa" (fused scaled_dot_product_attention) | "explicit"
    stem: str = "patch"        # "patch" (one stride-p conv, as in ViT) | "conv" (3x3 conv stages)
    drop_path: float = 0.0
    dropout: float = 0.0
    # timm's variants, so that imported weights compute the same function (interop/timm.py):
    fc_norm: bool = False          # pool head: mean of the un-normed tokens, then LayerNorm (timm's
                                   # global_pool="avg"); False: LayerNorm of every token, then mean
    no_embed_class: bool = False   # position embeddings for the patches only, added before the class
                                   # token is prepended (timm's no_embed_class, e.g. DeiT III)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        """The sequence length the blocks see (patches, plus the class token)."""
        return self.num_patches + (1 if self.head == "token" else 0)

    @property
    def pos_tokens(self) -> int:
        """Rows of the position embedding (the class token's row left out with no_embed_class)."""
        return self.num_patches if self.no_embed_class else self.num_tokens


# name -> (dim, depth, heads, mlp_ratio, default patch size)
SIZES = {
    "pico": (96, 6, 3, 3.0),      # small-image models for 28-32 px inputs
    "nano": (128, 6, 4, 3.0),
    "tiny": (192, 12, 3, 4.0),
    "small": (384, 12, 6, 4.0),
    "base": (768, 12, 12, 4.0),
    "large": (1024, 24, 16, 4.0),
    "huge": (1280, 32, 16, 4.0),
}
REGISTRY: dict[str, ViTSpec] = {}
for _size, (_d, _l, _h, _r) in SIZES.items():
    for _p in (2, 4, 7, 8, 14, 16, 32):
        REGISTRY[f"vit_{_size}_patch{_p}"] = ViTSpec(dim=_d, depth=_l, heads=_h, mlp_ratio=_r, patch_size=_p)
    default_patch = {"pico": 4, "nano": 4, "huge": 14}.get(_size, 16)
    REGISTRY[f"vit_{_size}"] = REGISTRY[f"vit_{_size}_patch{default_patch}"]


def model_names() -> list[str]:
    return sorted(REGISTRY)


class VisionTransformer(nn.Module):
    """Pre-norm ViT. Shapes: image [B, C, H, W] -> tokens [B, T, D] -> logits [B, num_classes]."""

    def __init__(self, spec: ViTSpec):
        super().__init__()
        self.spec = spec
        D = spec.dim
        stem = ConvStem if spec.stem == "conv" else PatchEmbed
        self.patch_embed = stem(spec.image_size, spec.patch_size, spec.in_chans, D)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if spec.head == "token" else None
        self.pos_embed = nn.Parameter(torch.zeros(1, spec.pos_tokens, D))
        self.norm_pre = nn.Identity()  # a LayerNorm before the blocks in CLIP's image tower (ln_pre)
        dpr = [spec.drop_path * i / max(1, spec.depth - 1) for i in range(spec.depth)]  # rises with depth
        self.blocks = nn.ModuleList(
            Block(D, spec.heads, spec.mlp_ratio, fused_attn=spec.attention == "sdpa",
                  drop_path=dpr[i], dropout=spec.dropout)
            for i in range(spec.depth))
        # fc_norm: the LayerNorm moves after the pooling (timm's keys: no `norm`, a `fc_norm`)
        self.norm = nn.Identity() if spec.fc_norm else nn.LayerNorm(D, eps=1e-6)
        self.fc_norm = nn.LayerNorm(D, eps=1e-6) if spec.fc_norm else None
        self.head = nn.Linear(D, spec.num_classes)
        self.grad_checkpointing = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """timm/DeiT-style init: truncated normal(0.02) weights, zero biases, unit norms."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if isinstance(self.patch_embed, PatchEmbed):
            w = self.patch_embed.proj.weight  # like a Linear over the flattened patch
            nn.init.trunc_normal_(w.view(w.shape[0], -1), std=0.02)
            nn.init.zeros_(self.patch_embed.proj.bias)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)  # [B, N, D]
        if self.spec.no_embed_class:
            x = x + self.pos_embed
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # [B, N+1, D]
        if not self.spec.no_embed_class:
            x = x + self.pos_embed
        x = self.norm_pre(x)
        for blk in self.blocks:
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.norm(x)  # [B, T, D]

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x[:, 0] if self.cls_token is not None else x.mean(dim=1)  # [B, D]
        if self.fc_norm is not None:
            x = self.fc_norm(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def resolve_spec(arch: str, **overrides) -> ViTSpec:
    """Registry spec with overrides; zero/None overrides keep the registry value."""
    if arch not in REGISTRY:
        raise KeyError(f"unknown model '{arch}'{did_you_mean(arch, REGISTRY)}")
    return replace(REGISTRY[arch], **{k: v for k, v in overrides.items() if v not in (None, 0, 0.0)})


def vit(arch: str, **overrides) -> VisionTransformer:
    return VisionTransformer(resolve_spec(arch, **overrides))
