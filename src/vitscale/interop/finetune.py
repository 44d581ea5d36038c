"""Starting a run from published weights (`model.init`): the architecture comes from the file, the
image size, channels and classes from the run's data, and the weights are adapted as timm adapts
them when it loads a checkpoint into another geometry:
- position embeddings resampled to the new patch grid (bicubic with antialiasing, the class
  token's row kept), like timm's `resample_abs_pos_embed`;
- a 3-channel patch embedding summed over its input channels for 1-channel images, like timm's
  `adapt_input_conv`;
- the classifier kept when the class count matches (`model.init_head=auto`), else a new one.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..models.vit import ViTSpec
from .files import read_state_dict
from .timm_vit import expected_keys, timm_vit_spec


def resample_pos_embed(pos: torch.Tensor, grid: int, prefix: int) -> torch.Tensor:
    """[1, prefix + g*g, D] -> [1, prefix + grid*grid, D]: the patch rows as a g x g image,
    resized bicubically (antialiased when shrinking); the `prefix` rows (class token) unchanged."""
    head, patches = pos[:, :prefix], pos[:, prefix:]
    g = math.isqrt(patches.shape[1])
    if g == grid:
        return pos
    d = patches.shape[-1]
    img = patches.reshape(1, g, g, d).permute(0, 3, 1, 2).float()
    img = F.interpolate(img, size=(grid, grid), mode="bicubic", antialias=True, align_corners=False)
    return torch.cat([head, img.permute(0, 2, 3, 1).reshape(1, grid * grid, d).to(pos.dtype)], dim=1)


def adapt_in_chans(w: torch.Tensor, in_chans: int) -> torch.Tensor:
    """A patch embedding [D, C, p, p] for `in_chans` input channels: the same, or RGB summed for
    grey images (a grey image seen as three equal channels gives the same response)."""
    if w.shape[1] == in_chans:
        return w
    if w.shape[1] == 3 and in_chans == 1:
        return w.sum(dim=1, keepdim=True)
    raise UserError(f"model.init: the weights take {w.shape[1]}-channel images, the data has {in_chans} "
                    "channels (only 3 -> 1 is adapted)")


def init_weights(path: str, *, image_size: int, in_chans: int, num_classes: int, heads: int = 0,
                 head_policy: str = "auto", **overrides) -> tuple[ViTSpec, dict]:
    """(spec, state dict for it) from a timm ViT file or a `vitscale export` file (same keys), for
    this run's image size, channels and classes. The head is dropped from the state dict when
    it is re-initialized."""
    sd = read_state_dict(path)
    try:
        src = timm_vit_spec(sd, heads, num_classes)
    except UserError as e:
        raise UserError(f"model.init: {path}: {str(e)}") from None
    if image_size % src.patch_size:
        raise UserError(f"model.init: image size {image_size} is not divisible by the weights' patch size "
                        f"{src.patch_size} (set data.image_size)")
    spec = replace(src, image_size=image_size, in_chans=in_chans, num_classes=num_classes, **overrides)
    unknown = set(sd) - expected_keys(src)
    if unknown:
        raise UserError(f"model.init: {path}: unknown keys {', '.join(sorted(unknown)[:4])}")
    out = {k: v.float() for k, v in sd.items()}
    prefix = 1 if spec.head == "token" and not spec.no_embed_class else 0
    out["pos_embed"] = resample_pos_embed(out["pos_embed"], image_size // spec.patch_size, prefix)
    out["patch_embed.proj.weight"] = adapt_in_chans(out["patch_embed.proj.weight"], in_chans)
    same_head = "head.weight" in out and out["head.weight"].shape[0] == num_classes
    if head_policy == "keep" and not same_head:
        raise UserError(f"model.init_head=keep: the weights' head has "
                        f"{out['head.weight'].shape[0] if 'head.weight' in out else 'no'} classes, the data "
                        f"{num_classes} (use init_head=auto or reset)")
    if head_policy == "reset" or not same_head:
        out.pop("head.weight", None)
        out.pop("head.bias", None)
    return spec, out


def weights_normalization(path: str) -> str:
    """data.normalize for data.normalize=auto with model.init: a `vitscale export` file says it was
    trained on its own data's normalization ("dataset": the new data keeps its own); anything else
    (timm's files) was trained with ImageNet's mean/std."""
    if str(path).endswith(".safetensors"):
        from safetensors import safe_open
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
        except Exception:  # unreadable: init_weights says so in one line
            return "imagenet"
        if meta.get("format", "").startswith("vitscale"):
            return "dataset"
    return "imagenet"
