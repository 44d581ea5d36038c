"""Starting a run from published weights (`model.init`): the architecture comes from the file, the
image size, channels and classes from the run's data, and the weights are adapted as timm adapts
them when it loads a checkpoint into another geometry:
- position embeddings resampled to the new patch grid (bicubic with antialiasing, the class
  token's row kept), like timm's `resample_abs_pos_embed`;
- a 3-channel patch embedding summed over its input channels for 1-channel images, a 1-channel
  one spread over N channels, like timm's `adapt_input_conv`;
- the classifier kept when the class count matches (`model.init_head=auto`), else a new one.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..models.vit import VisionTransformer, ViTSpec
from .files import named_arch, read_state_dict
from .timm.vision_transformer import (
    read_hub_config,
    timm_source,
    timm_state_dict,
    timm_vit_spec,
    weights_in_folder,
)

log = logging.getLogger("vitscale.interop")


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
    return torch.cat(
        [head, img.permute(0, 2, 3, 1).reshape(1, grid * grid, d).to(pos.dtype)], dim=1
    )


def adapt_in_chans(w: torch.Tensor, in_chans: int) -> torch.Tensor:
    """A patch embedding [D, C, p, p] for `in_chans` input channels: the same; RGB summed for
    grey images (a grey image seen as three equal channels gives the same response); a grey
    filter spread over the channels, divided by their number, for colour images (a colour image
    then gives the response its channel mean would)."""
    if w.shape[1] == in_chans:
        return w
    if w.shape[1] == 3 and in_chans == 1:
        return w.sum(dim=1, keepdim=True)
    if w.shape[1] == 1:
        return w.repeat(1, in_chans, 1, 1) / in_chans
    raise UserError(
        f"model.init: the weights take {w.shape[1]}-channel images, the data has {in_chans} "
        "channels (adapted: 3 -> 1 and 1 -> N)"
    )


def weights_file(path) -> Path:
    """model.init's weights file: the file given, or the one timm reads from a hub folder."""
    path = Path(path)
    return weights_in_folder(path) if path.is_dir() else path


def _metadata(path) -> dict:
    """A safetensors file's metadata ({} for other files, and for unreadable ones: read_state_dict
    reports those in one line)."""
    if not str(path).endswith(".safetensors"):
        return {}
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return f.metadata() or {}
    except Exception:
        return {}


def weights_config(path) -> dict | None:
    """timm's hub config for a weights file: the config.json beside it, else the one a `vitscale
    export --format timm` file carries in its metadata."""
    config = read_hub_config(path)
    if config is None and "timm_config" in (meta := _metadata(path)):
        config = json.loads(meta["timm_config"])
    return config


def vitscale_export_spec(path) -> ViTSpec | None:
    """The spec a `vitscale export` file's metadata holds (None for other files: timm's layout is
    then read from the keys)."""
    meta = _metadata(path)
    if meta.get("format", "").startswith("vitscale") and meta.get("format") != "vitscale-vit":
        raise UserError(
            f"model.init: {path} holds a {meta['format'][len('vitscale-') :]} model; model.init "
            "starts ViT classifiers"
        )
    return (
        ViTSpec(**json.loads(meta["spec"]))
        if meta.get("format") == "vitscale-vit" and "spec" in meta
        else None
    )


def init_arch(path: str, arch: str = "") -> str:
    """model.init_arch, else the architecture a training checkpoint names (timm's `arch` entry or
    `args.model`), announced in one line; "" where neither says."""
    if arch:
        return arch
    file = weights_file(path)
    named = named_arch(file) if file.is_file() else ""
    if named:
        _announce_arch(str(file), named)
    return named


@functools.lru_cache(maxsize=8)
def _announce_arch(file: str, arch: str) -> None:  # once per file and process
    log.warning(
        "model.init: %s: the architecture is the one the checkpoint names, %s (model.init_arch "
        "sets another)",
        file,
        arch,
    )


def init_weights(
    path: str,
    *,
    image_size: int,
    in_chans: int,
    num_classes: int,
    heads: int = 0,
    head_policy: str = "auto",
    arch: str = "",
    which: str = "auto",
    **overrides,
) -> tuple[ViTSpec, dict]:
    """(spec, state dict for it) from a `vitscale export` file (its spec in the metadata: any
    stem and head) or a timm ViT file or hub folder (the spec from the config.json beside the
    weights, or `arch`, timm's architecture name; else from the keys, with timm's defaults
    announced), for this run's image size, channels and classes. The head is dropped from the
    state dict when it is re-initialized."""
    file = weights_file(path)
    sd = read_state_dict(file, which)
    src = vitscale_export_spec(file)
    if src is not None and arch:
        raise UserError(
            f"model.init_arch={arch}: {path} is a vitscale export, which carries its own "
            "architecture (leave model.init_arch empty)"
        )
    try:
        if src is None:  # timm's eva family in vitscale's names (the others are already)
            sd = timm_state_dict(sd, weights_config(file), arch)
        src = src or timm_vit_spec(
            sd,
            heads,
            num_classes,
            config=weights_config(file),
            arch=arch,
            announce=f"model.init: {path}",
        )
    except UserError as e:
        raise UserError(f"model.init: {path}: {str(e)}") from None
    _check_size(image_size, src.patch_size)
    spec = replace(
        src, image_size=image_size, in_chans=in_chans, num_classes=num_classes, **overrides
    )
    _check_keys(sd, src, path)
    out = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    # the class and register tokens' rows
    prefix = 0 if spec.no_embed_class else spec.num_prefix_tokens
    if "pos_embed" in out:  # a rope alone (DINOv3) follows the grid by itself
        grid = image_size // spec.patch_size
        out["pos_embed"] = resample_pos_embed(out["pos_embed"], grid, prefix)
    first = "patch_embed.proj.weight" if spec.stem == "patch" else "patch_embed.proj.0.weight"
    out[first] = adapt_in_chans(out[first], in_chans)
    _fit_head(out, head_policy, num_classes)
    return spec, out


def _check_size(image_size: int, p: int) -> None:
    """One line for an image size the weights' patch size `p` does not divide, naming the nearest
    that it does."""
    if image_size % p:
        near = min(
            (image_size // p * p, image_size // p * p + p), key=lambda n: abs(n - image_size)
        )
        raise UserError(
            f"model.init: image size {image_size} is not divisible by the weights' patch size "
            f"{p}: the nearest size that is, {max(near, p)} (set data.image_size={max(near, p)})"
        )


def _check_keys(sd: dict, src: ViTSpec, path: str) -> None:
    """Refuse a state dict whose keys are not those of `src`'s model (the head may be absent)."""
    with torch.device("meta"):  # the keys and shapes, without the memory
        want = VisionTransformer(src).state_dict()
    unknown, missing = set(sd) - set(want), set(want) - set(sd) - {"head.weight", "head.bias"}
    if unknown or missing:
        parts = ([f"unknown keys {', '.join(sorted(unknown)[:4])}"] if unknown else []) + (
            [f"missing keys {', '.join(sorted(missing)[:4])}"] if missing else []
        )
        raise UserError(f"model.init: {path}: {'; '.join(parts)}")


def _fit_head(out: dict, head_policy: str, num_classes: int) -> None:
    """model.init_head: keep the weights' head (refused unless it has `num_classes` rows), or drop
    it from `out` to be re-initialized (reset, or auto with another number of classes)."""
    same_head = "head.weight" in out and out["head.weight"].shape[0] == num_classes
    if head_policy == "keep" and not same_head:
        raise UserError(
            f"model.init_head=keep: the weights' head has "
            f"{out['head.weight'].shape[0] if 'head.weight' in out else 'no'} classes, the data "
            f"{num_classes} (use init_head=auto or reset)"
        )
    if head_policy == "reset" or not same_head:
        out.pop("head.weight", None)
        out.pop("head.bias", None)


def weights_normalization(path: str, arch: str = "") -> str:
    """data.normalize for data.normalize=auto with model.init: a `vitscale export` file says it was
    trained on its own data's normalization ("dataset": the new data keeps its own); timm's weights
    say theirs in their pretrained config (config.json, or timm's for the architecture name):
    ImageNet's or CLIP's mean/std are taken; any other, or none recorded, means ImageNet's, announced
    in one line."""
    from ..data.transforms import NORMALIZATIONS

    try:
        file = weights_file(path)
        if not file.is_file():  # init_weights says so in one line, with no warning before it
            return "imagenet"
        if _metadata(file).get("format", "").startswith("vitscale"):
            return "dataset"
        _, _, source, pcfg = timm_source(weights_config(file), arch)
    except (UserError, ValueError):  # init_weights reports a bad file or name in one line
        return "imagenet"
    if not source:
        log.warning(
            "model.init: %s: the images are normalized with ImageNet's mean and std, which the weights "
            "do not record (no config.json beside them, no model.init_arch); data.normalize sets another",
            path,
        )
        return "imagenet"
    mean, std = pcfg.get("mean"), pcfg.get("std")
    for name, (m, s) in NORMALIZATIONS.items():
        if (
            mean
            and std
            and len(mean) == len(m)
            and all(abs(a - b) < 1e-4 for a, b in zip([*mean, *std], [*m, *s]))
        ):
            return name
    log.warning(
        "model.init: %s: the weights were trained with mean %s and std %s (%s), which data.normalize does "
        "not offer; the images are normalized with ImageNet's (data.normalize sets another)",
        path,
        tuple(mean or ()),
        tuple(std or ()),
        source,
    )
    return "imagenet"
