"""Models: plain torch modules (nothing distributed, no precision handling inside)."""
from .flops import count_params, vit_forward_flops, vit_forward_macs, vit_train_flops
from .vit import REGISTRY, SIZES, VisionTransformer, ViTSpec, model_names, resolve_spec, vit

__all__ = ["REGISTRY", "SIZES", "VisionTransformer", "ViTSpec", "model_names", "resolve_spec", "vit",
           "count_params", "vit_forward_flops", "vit_forward_macs", "vit_train_flops"]
