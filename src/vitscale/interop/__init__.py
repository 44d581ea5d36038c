"""Weights from and to other libraries' layouts, one subpackage per library: timm's ViTs (timm/:
vision_transformer.py, eva.py) and OpenCLIP's CLIP models (open_clip/: convert.py moves the
weights, arch.py says which model a file holds). Reading a state dict file is `read_state_dict`;
nothing here imports timm or open_clip."""

from .files import read_state_dict, write_state_dict
from .open_clip import from_open_clip, open_clip_spec, to_open_clip
from .timm.vision_transformer import (
    from_timm,
    read_hub_config,
    timm_hub_config,
    timm_kwargs,
    timm_load_call,
    timm_vit_spec,
    to_timm,
)

__all__ = [
    "read_state_dict",
    "write_state_dict",
    "from_timm",
    "timm_kwargs",
    "timm_vit_spec",
    "to_timm",
    "read_hub_config",
    "timm_hub_config",
    "timm_load_call",
    "from_open_clip",
    "open_clip_spec",
    "to_open_clip",
]
