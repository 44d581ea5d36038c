"""The one map from precision names to torch dtypes (configs name "fp32", "bf16", "fp16";
train.precision adds "pure_bf16" / "pure_fp16", whose weights themselves are half), and the number
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
