"""The one map from precision names to torch dtypes (configs name "fp32", "bf16", "fp16";
train.precision adds "pure_bf16" / "pure_fp16", whose weights themselves are half, and "bf16_act",
bf16 autocast with bf16 norms and residual stream: strategy/lowprec.py), and the number
format a run's matmuls compute in. Plain functions of names: the strategies (strategy/), the losses'
state, MFU peaks (metrics.py) and the lab use them."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype_name(precision: str, tf32: bool = False) -> str:
    """The number format the matmuls run in: "bf16", "fp16", "fp32", or "tf32" (fp32 precision
    with TF32 on: `tf32` says whether the device runs TF32, see tf32_active). MFU peaks
    are per format."""
    name = "bf16" if "bf16" in precision else "fp16" if "fp16" in precision else "fp32"
    return "tf32" if name == "fp32" and tf32 else name


def tf32_active(device_type: str, precision: str, tf32: bool) -> bool:
    """Whether the fp32 matmuls of this run run as TF32 (CUDA, fp32 precision, train.tf32)."""
    return device_type == "cuda" and tf32 and precision == "fp32"


def half_dtype(precision: str) -> torch.dtype | None:
    """The half dtype of a mixed or pure half precision (None for fp32)."""
    name = compute_dtype_name(precision)
    return None if name == "fp32" else DTYPES[name]


# train.fp8: (recipe, model width) -> the float8 step's speed over bf16's, measured side by side on
# one GPU (strategy/fp8.py converts; a width as narrow as one measured slower is refused)
FP8_MEASURED = {
    # issue 32: timm's vit_base_patch16_224, torch 2.11 + torchao 0.17, compiled, batch 256, one H100
    ("tensorwise", 768): (0.805, "timm ViT-B/16 on one H100, torchao 0.17"),
    # issue 41: vitscale's ViT-L/16 compiled, batch 128, bf16 beside train.fp8=rowwise, one H200,
    # torch 2.11 + torchao 0.17 (143.4 ms against 112.0 ms per step, slower in 3 of 3 rounds)
    ("rowwise", 1024): (0.781, "vitscale ViT-L/16 on one H200, torchao 0.17"),
}


def fp8_slower(recipe: str, width: int) -> str | None:
    """The one-line refusal of train.fp8=`recipe` for a model `width` wide where a width at least
    as wide was measured slower than bf16 (a narrower model does relatively more scaling work per
    matmul), or None."""
    slower = sorted(
        (w, r, src)
        for (rec, w), (r, src) in FP8_MEASURED.items()
        if rec == recipe and r < 1 and w >= width
    )
    if not slower:
        return None
    w, ratio, src = slower[0]
    return (
        f"config: train.fp8={recipe} is refused at model width {width}: float8 measured {ratio:.3f}x bf16's "
        f"speed at width {w} ({src}; docs/performance.md); use bf16"
    )
