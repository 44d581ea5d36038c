"""Models: plain torch modules (nothing distributed, no precision handling inside)."""

from .clip import CLIP, CLIP_REGISTRY, ClipSpec, clip_forward_flops, is_clip_arch, resolve_clip_spec
from .flops import count_params, vit_forward_flops, vit_forward_macs, vit_train_flops
from .layers import DROP_PATH_MODES, set_drop_path_mode
from .text import TextSpec, TextTransformer, text_forward_macs
from .vit import (
    REGISTRY,
    SIZES,
    VisionTransformer,
    ViTSpec,
    kept_patches,
    model_names,
    resolve_spec,
    set_patch_dropout,
    vit,
)

__all__ = [
    "REGISTRY",
    "SIZES",
    "VisionTransformer",
    "ViTSpec",
    "model_names",
    "resolve_spec",
    "vit",
    "count_params",
    "vit_forward_flops",
    "vit_forward_macs",
    "vit_train_flops",
    "CLIP",
    "CLIP_REGISTRY",
    "ClipSpec",
    "clip_forward_flops",
    "is_clip_arch",
    "resolve_clip_spec",
    "TextSpec",
    "TextTransformer",
    "text_forward_macs",
    "DROP_PATH_MODES",
    "set_drop_path_mode",
    "kept_patches",
    "set_patch_dropout",
]
