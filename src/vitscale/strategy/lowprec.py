"""train.precision=bf16_act (issue 51): bf16 activations with fp32 parameters, between autocast's
bf16 and pure_bf16 (NVIDIA NeMo's "O2" for ViT, MosaicML's low-precision LayerNorm).

Under autocast alone, layer_norm runs in fp32 (autocast's fp32 list) and the residual stream stays
fp32: every block reads and writes its [B, T, D] stream, and its norms' outputs, in fp32. Here,
applied to a plain model from outside (the models know nothing of it):

- every nn.LayerNorm computes in autocast's dtype (`LowPrecisionLayerNorm`: input, weight and bias
  cast, autocast off inside; the statistics are still accumulated in fp32 by the kernel), so its
  output is bf16;
- each shard unit (a model's transformer blocks: `shard_units()`) casts its floating-point input to
  that dtype, so the residual stream x + branch(x) stays bf16 from the first block on.

The parameters stay fp32 (the optimizer updates them and keeps fp32 state; their gradients come back
fp32 through the casts), and the matmuls run in bf16 under autocast as before. Without autocast
(evaluation outside it) both are no-ops: the model computes as written.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn


def _low_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype for `x`'s device where autocast is on and `x` is floating point, else None."""
    kind = x.device.type
    if not (x.is_floating_point() and torch.is_autocast_enabled(kind)):
        return None
    return torch.get_autocast_dtype(kind)


class LowPrecisionLayerNorm(nn.LayerNorm):
    """nn.LayerNorm in autocast's dtype (its parameters stay fp32; cast per call)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dtype = _low_dtype(input)
        if dtype is None:
            return super().forward(input)
        w = None if self.weight is None else self.weight.to(dtype)
        b = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(input.device.type, enabled=False):
            return F.layer_norm(input.to(dtype), self.normalized_shape, w, b, self.eps)


def _stream_in(module: nn.Module, args: tuple):
    """A shard unit's forward pre-hook: its floating-point input in autocast's dtype."""
    if not args or not torch.is_tensor(args[0]):
        return None
    dtype = _low_dtype(args[0])
    if dtype is None or args[0].dtype == dtype:
        return None
    return (args[0].to(dtype), *args[1:])


def apply_bf16_act(model: nn.Module) -> int:
    """Make `model` compute its norms and residual stream in autocast's dtype, in place (the same
    parameters, names and state dict). Returns the number of LayerNorms converted."""
    n = 0
    for m in model.modules():
        if type(m) is nn.LayerNorm:
            m.__class__ = LowPrecisionLayerNorm
            n += 1
    units = getattr(model, "shard_units", None)
    blocks: list[nn.Module] = list(cast(list, units())) if callable(units) else []
    for unit in blocks:
        unit.register_forward_pre_hook(_stream_in)
    return n
