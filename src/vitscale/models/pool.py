"""Multihead attention pooling (MAP): the head of SigLIP / SigLIP 2 and Perception Encoder towers
(timm's AttentionPoolLatent, global_pool="map"; big_vision's MAPHead). Torch only.

One learned latent query attends over the tokens, then a residual MLP:
    q = W_q latent, [k; v] = W_kv x, o = proj(softmax(q k^T / sqrt(d_h)) v)       [B, 1, D]
    out = o + mlp(norm(o))[:, 0]                                                    [B, D]
Parameter names are timm's (attn_pool.latent, .q, .kv, .proj, .norm, .mlp.fc1/fc2), so weights map
one to one. Under tensor parallelism it stays whole on every rank (replicated: one query per image,
a small share of the step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ffn import Mlp


class AttentionPool(nn.Module):
    """[B, T, D] -> [B, D]: one latent query attends over the T tokens (MAP)."""

    def __init__(
        self,
        dim: int,
        heads: int,
        mlp_ratio: float,
        norm: nn.Module,
        act: str = "gelu",
        fused: bool = True,
    ):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads, self.head_dim = heads, dim // heads
        self.fused = fused
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = norm
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act=act)

    def reset_parameters(self) -> None:
        """timm's init of the latent: truncated normal of std dim^-0.5 (the linears are the model's)."""
        nn.init.trunc_normal_(self.latent, std=self.latent.shape[-1] ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        h, hd = self.heads, self.head_dim
        q = self.q(self.latent.expand(B, -1, -1)).reshape(B, 1, h, hd).transpose(1, 2)
        k, v = self.kv(x).reshape(B, T, 2, h, hd).permute(2, 0, 3, 1, 4).unbind(0)
        # timm's fused kernel; on tensor parallelism's replicated DTensors (`placements`), which
        # have no CPU fused backward, the explicit softmax (one query: as cheap)
        if self.fused and not hasattr(x, "placements"):
            o = F.scaled_dot_product_attention(q, k, v)  # [B, h, 1, hd]
        else:
            o = ((q * hd**-0.5) @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        o = self.proj(o.transpose(1, 2).reshape(B, 1, D))
        return (o + self.mlp(self.norm(o)))[:, 0]
