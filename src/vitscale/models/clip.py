"""CLIP: a ViT image tower and a causal text tower projected to one embedding, plus a learnable
`logit_scale` (log of the inverse temperature, used by the OpenCLIP mini-batch loss) and, with
ClipSpec.logit_bias set (clip.loss=siglip), a learnable `logit_bias` (SigLIP's).

    encode_image(images [B, C, H, W]) -> [B, E]     encode_text(tokens [B, L]) -> [B, E]
    forward(images, tokens) -> (image features [B, E], text features [B, E], logit_scale [1]),
    features L2-normalized. `logit_scale` has shape [1], not [] (FSDP2 cannot shard a 0-d tensor);
    with a bias the third output is [logit_scale, logit_bias], shape [2] (logit_params).

OpenCLIP's ViT CLIP computes the same function with the options that interop/open_clip/convert.py sets
(all off by default): ClipSpec.ln_pre / patch_bias / proj_bias / vision_norm_eps / vision_act /
vision_pool / vision_norm_after_pool for the image tower, TextSpec.norm_eps / act / causal / pool /
eos_id / proj / proj_bias for the text tower; its SigLIP, EVA-CLIP and PE-Core models (a timm image
tower) with ClipSpec.vision_timm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .layers import PatchEmbed, activation, tp_plan
from .text import TextSpec, TextTransformer, text_forward_macs
from .vit import VisionTransformer, ViTSpec, did_you_mean


@dataclass(frozen=True)
class ClipSpec:
    vision: ViTSpec
    text: TextSpec
    embed_dim: int = 512
    init_tau: float = 0.07
    # SigLIP's learned logit bias, its initial value (OpenCLIP's init_logit_bias); None: no parameter
    logit_bias: float | None = None
    # the image tower's OpenCLIP options (interop/open_clip/convert.py); the defaults are vitscale's ViT
    ln_pre: bool = False  # a LayerNorm after adding the position embeddings, before the blocks
    patch_bias: bool = True  # the patch convolution has a bias (OpenCLIP's conv1 has none)
    proj_bias: bool = True  # the projection (the ViT's head) has a bias (OpenCLIP's proj has none)
    vision_norm_eps: float = 1e-6  # every LayerNorm of the image tower (OpenCLIP: torch's 1e-5)
    vision_act: str = "gelu"  # its MLP activation: "gelu" | "quick_gelu" (OpenAI's models)
    vision_pool: str = (
        "token"  # the image feature: "token" (the class token's) | "avg" (the mean of the
    )
    # patch tokens, the class token left out: OpenCLIP's pool_type="avg")
    vision_norm_after_pool: bool = (
        False  # the final LayerNorm after pooling (OpenCLIP's final_ln_after_pool;
    )
    # its parameters are then visual.fc_norm, not visual.norm)
    # OpenCLIP's TimmModel image tower (SigLIP, EVA-CLIP, PE-Core): the timm architecture its trunk
    # is; `vision` is then that trunk whole (its head the projection, num_classes=0: none, the
    # pooled feature is the embedding) and the image-tower options above do not apply
    vision_timm: str = ""


# name -> (vision ViTSpec, text (dim, depth, heads), embed_dim)
CLIP_REGISTRY: dict[str, ClipSpec] = {
    # tests: a few thousand parameters per tower
    "clip_tiny": ClipSpec(
        ViTSpec(image_size=32, patch_size=8, dim=32, depth=2, heads=2, mlp_ratio=2.0),
        TextSpec(dim=32, depth=2, heads=2, mlp_ratio=2.0, embed_dim=32),
        32,
    ),
    # CPU experiments at 64 px (OpenClipArt): 65 image tokens, short captions
    "clip_mini": ClipSpec(
        ViTSpec(image_size=64, patch_size=8, dim=192, depth=6, heads=3),
        TextSpec(dim=192, depth=4, heads=3, embed_dim=192),
        192,
    ),
    "clip_small": ClipSpec(
        ViTSpec(image_size=224, patch_size=16, dim=384, depth=12, heads=6),
        TextSpec(dim=384, depth=12, heads=6, embed_dim=384),
        384,
    ),
    # CLIP's ViT-B/32 and ViT-B/16 (text width 512, 12 layers, 8 heads; embedding 512)
    "clip_vit_b32": ClipSpec(
        ViTSpec(image_size=224, patch_size=32, dim=768, depth=12, heads=12),
        TextSpec(dim=512, depth=12, heads=8, embed_dim=512),
        512,
    ),
    "clip_vit_b16": ClipSpec(
        ViTSpec(image_size=224, patch_size=16, dim=768, depth=12, heads=12),
        TextSpec(dim=512, depth=12, heads=8, embed_dim=512),
        512,
    ),
}


def is_clip_arch(arch: str) -> bool:
    return arch.startswith("clip_")


def resolve_clip_spec(
    arch: str, *, vision: dict | None = None, text: dict | None = None, embed_dim: int = 0
) -> ClipSpec:
    """Registry spec with overrides (zero/None values keep the registry's)."""
    if arch not in CLIP_REGISTRY:
        raise KeyError(f"unknown CLIP model '{arch}'{did_you_mean(arch, CLIP_REGISTRY)}")
    spec = CLIP_REGISTRY[arch]
    keep = lambda d: {k: v for k, v in (d or {}).items() if v not in (None, 0, 0.0, "")}  # noqa: E731
    E = embed_dim or spec.embed_dim
    return replace(
        spec,
        embed_dim=E,
        vision=replace(spec.vision, **keep(vision), num_classes=E, head="token"),
        text=replace(spec.text, **keep(text), embed_dim=E),
    )


class ImageTower(VisionTransformer):
    """vitscale's ViT (its head is the projection) with ClipSpec's image-tower options. With the
    defaults it is VisionTransformer exactly: same parameters, same initialization, same function.
    `norm_pre` (timm's name for OpenCLIP's ln_pre) normalizes the tokens before the first block."""

    def __init__(self, spec: ClipSpec):
        if spec.vision_timm:  # the trunk as timm builds it (interop/open_clip/timm_tower.py)
            self._init_trunk(spec)
            return
        if spec.vision_pool not in ("token", "avg"):
            raise ValueError(f"unknown vision_pool '{spec.vision_pool}' (expected token or avg)")
        if spec.vision_pool == "avg" and spec.vision.head != "token":
            raise ValueError("vision_pool='avg' leaves out a class token: it needs head='token'")
        # vision_norm_after_pool: vitscale's ViT with fc_norm (no `norm`, a LayerNorm after pooling)
        super().__init__(
            replace(
                spec.vision,
                num_classes=spec.embed_dim,
                fc_norm=spec.vision.fc_norm or spec.vision_norm_after_pool,
            )
        )
        self.clip_pool = spec.vision_pool
        if spec.ln_pre:
            self.norm_pre = nn.LayerNorm(spec.vision.dim, eps=spec.vision_norm_eps)
        if not spec.patch_bias:
            if not isinstance(self.patch_embed, PatchEmbed):
                raise ValueError("patch_bias=False needs the patch stem (model.stem=patch)")
            self.patch_embed.proj.register_parameter("bias", None)
        if not spec.proj_bias:
            self.head.register_parameter("bias", None)
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                m.eps = spec.vision_norm_eps
        if spec.vision_act != "gelu":
            for blk in self.blocks:
                blk.mlp.act = activation(spec.vision_act)

    def _init_trunk(self, spec: ClipSpec) -> None:
        v = spec.vision
        if (v.num_classes or v.dim) != spec.embed_dim:
            raise ValueError(
                f"the image tower gives {v.num_classes or v.dim} features, embed_dim is {spec.embed_dim}"
            )
        super().__init__(replace(v, num_classes=v.num_classes or 1))
        self.clip_pool = "token"
        if not v.num_classes:  # no projection: the pooled feature
            self.head = nn.Identity()

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.clip_pool == "token":
            return super().forward_head(x, pre_logits)
        x = x[:, 1:].mean(dim=1)  # the patch tokens' mean, the class token left out  [B, D]
        if self.fc_norm is not None:
            x = self.fc_norm(x)
        return x if pre_logits else self.head(x)


class CLIP(nn.Module):
    def __init__(self, spec: ClipSpec):
        super().__init__()
        if spec.ln_pre and spec.vision.no_embed_class:
            raise ValueError("ln_pre with no_embed_class is not implemented")
        self.spec = spec
        self.visual = ImageTower(spec)  # head = projection
        self.text = TextTransformer(replace(spec.text, embed_dim=spec.embed_dim))
        self.logit_scale = nn.Parameter(torch.full((1,), math.log(1 / spec.init_tau)))
        if spec.logit_bias is not None:  # shape [1] as logit_scale's
            self.logit_bias = nn.Parameter(torch.full((1,), float(spec.logit_bias)))

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.visual.set_grad_checkpointing(enable)
        self.text.grad_checkpointing = enable

    def shard_units(self) -> list[nn.Module]:
        """The modules a sharding engine wraps one by one: both towers' transformer blocks."""
        return [*self.visual.shard_units(), *self.text.shard_units()]

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        """Tensor parallelism's plan: every block's split layers by full name (layers.tp_plan)."""
        return tp_plan(self, sequence_parallel)

    def no_weight_decay(self) -> set[str]:
        return (
            {f"visual.{n}" for n in self.visual.no_weight_decay()}
            | {f"text.{n}" for n in self.text.no_weight_decay()}
            | {"logit_scale"}
            | ({"logit_bias"} if self.spec.logit_bias is not None else set())
        )

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        f = self.visual(images)
        return F.normalize(f, dim=-1) if normalize else f

    def encode_text(self, tokens: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        f = self.text(tokens)
        return F.normalize(f, dim=-1) if normalize else f

    def forward(self, images: torch.Tensor | None, tokens: torch.Tensor | None):
        """Either input may be None (its features come back None): evaluation encodes one side
        through `forward`, so that engines that gather parameters in forward hooks (FSDP2,
        ZeRO-3) see every call."""
        img = None if images is None else self.encode_image(images)
        txt = None if tokens is None else self.encode_text(tokens)
        return img, txt, self.logit_params()

    def logit_params(self) -> torch.Tensor:
        """logit_scale [1], or [logit_scale, logit_bias] [2] with a bias: a copy made inside
        forward (FSDP2 frees the gathered parameters' storage after forward)."""
        if self.spec.logit_bias is None:
            return self.logit_scale.clone()
        return torch.cat([self.logit_scale, self.logit_bias])


def clip_forward_flops(
    spec: ClipSpec, text_length: int | None = None, patch_dropout: float = 0.0
) -> int:
    """FLOPs of one (image, caption) pair's forward pass, both towers (1 MAC = 2 FLOPs); with
    patch_dropout, of a training forward (the image blocks see the kept patch tokens only)."""
    from .flops import vit_forward_macs

    vision = spec.vision if spec.vision_timm else replace(spec.vision, num_classes=spec.embed_dim)
    return 2 * (
        vit_forward_macs(vision, patch_dropout)
        + text_forward_macs(replace(spec.text, embed_dim=spec.embed_dim), text_length)
    )
