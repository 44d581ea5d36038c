"""timm's VisionTransformer weights <-> vitscale's ViT.

vitscale's ViT uses timm's parameter names (cls_token, pos_embed, patch_embed.proj, blocks.N.
{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}, norm, head), its LayerNorm eps (1e-6) and
its attention, so a state dict maps one to one. Where timm's variants compute another function,
the spec takes the matching option, read from the keys and shapes:
- average-pool models (`class_token=False, global_pool="avg"`): no cls_token, `fc_norm` instead of
  `norm` -> head="pool", fc_norm=True;
- `no_embed_class` (DeiT III style): the position embedding has no row for the class token ->
  no_embed_class=True.
The head count is not in the weights: it is timm's for the standard widths (tiny 3, small 6,
base 12, large 16, huge 16), else dim / 64, unless given.
Variants vitscale does not implement (register tokens, layer scale, q/k norm, a pre-norm) are
refused with the keys that show them.
"""
from __future__ import annotations

import math
import re

import torch

from ..errors import UserError
from .files import first_keys, refuse_unsupported
from ..models.vit import VisionTransformer, ViTSpec

HEADS_BY_DIM = {96: 3, 128: 4, 192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}
BLOCK_KEYS = ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")
UNSUPPORTED = {"reg_token": "register tokens", ".ls1.": "layer scale", ".ls2.": "layer scale",
               "q_norm": "q/k normalization", "k_norm": "q/k normalization", "norm_pre": "a pre-norm",
               "patch_embed.norm": "a patch-embedding norm"}



def expected_keys(spec: ViTSpec) -> set[str]:
    keys = {"pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias", "head.weight", "head.bias"}
    keys |= {"cls_token"} if spec.head == "token" else set()
    keys |= {f"{'fc_norm' if spec.fc_norm else 'norm'}.{p}" for p in ("weight", "bias")}
    keys |= {f"blocks.{i}.{k}.{p}" for i in range(spec.depth) for k in BLOCK_KEYS for p in ("weight", "bias")}
    return keys


def timm_vit_spec(sd: dict, heads: int = 0, num_classes: int = 0) -> ViTSpec:
    """The ViTSpec that computes what timm's model with these weights computes. `num_classes`:
    for a checkpoint without a classifier (timm's num_classes=0); a head it has wins."""
    refuse_unsupported(sd, UNSUPPORTED, "timm ViT", "vitscale's ViT")
    if "patch_embed.proj.weight" not in sd or "pos_embed" not in sd:
        raise UserError("timm ViT: not a timm VisionTransformer state dict (no patch_embed.proj.weight / "
                        f"pos_embed; its keys begin {first_keys(sd, 3)})")
    w = sd["patch_embed.proj.weight"]
    if w.ndim != 4 or w.shape[-1] != w.shape[-2]:
        raise UserError(f"timm ViT: patch_embed.proj.weight has shape {tuple(w.shape)}; expected a square "
                        "[dim, channels, patch, patch] convolution")
    dim, in_chans, patch = w.shape[0], w.shape[1], w.shape[-1]
    depth = len({int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))})
    if depth == 0 or f"blocks.{depth - 1}.mlp.fc1.weight" not in sd:
        raise UserError("timm ViT: the blocks are missing or not numbered 0..N-1")
    token = "cls_token" in sd
    rows = sd["pos_embed"].shape[1]
    grid = math.isqrt(rows - 1) if token and math.isqrt(rows - 1) ** 2 == rows - 1 else math.isqrt(rows)
    no_embed_class = token and grid * grid == rows
    if grid * grid != rows - (1 if token and not no_embed_class else 0):
        raise UserError(f"timm ViT: pos_embed has {rows} rows, which is no square patch grid "
                        f"({'with' if token else 'without'} a class token)")
    if "head.weight" in sd:
        num_classes = sd["head.weight"].shape[0]
    elif num_classes <= 0:
        raise UserError("timm ViT: the checkpoint has no classifier head (timm's num_classes=0): "
                        "give the number of classes of the new head")
    heads = heads or HEADS_BY_DIM.get(dim, max(1, dim // 64))
    if dim % heads:
        raise UserError(f"timm ViT: width {dim} is not divisible by {heads} heads")
    return ViTSpec(image_size=grid * patch, patch_size=patch, in_chans=in_chans, num_classes=num_classes,
                   dim=dim, depth=depth, heads=heads, mlp_ratio=sd["blocks.0.mlp.fc1.weight"].shape[0] / dim,
                   head="token" if token else "pool", fc_norm="fc_norm.weight" in sd,
                   no_embed_class=no_embed_class)


def from_timm(sd: dict, heads: int = 0, num_classes: int = 0, **spec_overrides) -> VisionTransformer:
    """vitscale's ViT holding a timm ViT state dict's weights (the same function, in fp32).
    `spec_overrides` (e.g. attention="explicit", drop_path=0.1) change nothing in the weights."""
    from dataclasses import replace
    spec = replace(timm_vit_spec(sd, heads, num_classes), **spec_overrides)
    want = expected_keys(spec)
    have = set(sd)
    unknown, missing = have - want, want - have - ({"head.weight", "head.bias"} if "head.weight" not in sd else set())
    if unknown or missing:
        parts = ([f"unknown keys {first_keys(unknown)}"] if unknown else []) + \
                ([f"missing keys {first_keys(missing)}"] if missing else [])
        raise UserError(f"timm ViT: {'; '.join(parts)}")
    model = VisionTransformer(spec)
    theirs = {k: v.float() for k, v in sd.items()}
    for k, v in model.state_dict().items():
        if k in theirs and theirs[k].shape != v.shape:
            raise UserError(f"timm ViT: {k} has shape {tuple(theirs[k].shape)}, the model expects {tuple(v.shape)}")
    model.load_state_dict(theirs, strict=False)  # strict on everything but a head the file lacks
    return model


def timm_kwargs(spec: ViTSpec) -> dict:
    """`timm.create_model("vit_base_patch16_224", **timm_kwargs(spec))` builds the model whose
    weights `to_timm` writes (any of timm's vit_* names: these arguments set every size)."""
    kw = dict(img_size=spec.image_size, patch_size=spec.patch_size, in_chans=spec.in_chans,
              num_classes=spec.num_classes, embed_dim=spec.dim, depth=spec.depth, num_heads=spec.heads,
              mlp_ratio=spec.mlp_ratio)
    if spec.head == "pool":
        kw.update(class_token=False, global_pool="avg")
    if spec.no_embed_class:
        kw["no_embed_class"] = True
    return kw


def to_timm(model: VisionTransformer) -> dict[str, torch.Tensor]:
    """The state dict timm's VisionTransformer of the same configuration loads (fp32, CPU):
    `timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=..., num_classes=N),
    num_classes=N, img_size=..., class_token=..., global_pool=..., no_embed_class=...)` (the overlay's
    num_classes too: otherwise timm drops a head whose size differs from the named model's 1000)."""
    spec = model.spec
    if spec.stem != "patch":
        raise UserError("export to timm: model.stem=conv has no timm ViT counterpart (use the patch stem)")
    if spec.head == "pool" and not spec.fc_norm:
        raise UserError("export to timm: head=pool without fc_norm (LayerNorm before the mean) has no timm "
                        "counterpart; timm's average pool normalizes after the mean (model.fc_norm=true)")
    return {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
