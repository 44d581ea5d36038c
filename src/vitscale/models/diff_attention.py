"""Differential attention (Ye et al. 2024, "Differential Transformer"; timm's DiffAttention and
DiffParallelScalingBlock, attn_layer="diff": the vit_dwee / vit_dlittle / vit_dpwee models). Torch only.

Each of the h heads is a pair of half-width heads (q, k: 2h heads of d = dim / h / 2; v: h heads of
2d): two softmax attentions over the same values, the second subtracted with a learned weight,
    o = softmax(q1 k1^T / sqrt(d)) v - lambda softmax(q2 k2^T / sqrt(d)) v
    lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init
then an RMSNorm over each head's 2d features (sub_norm, eps 1e-5) scaled by (1 - lambda_init),
lambda_init = 0.8 - 0.6 exp(-0.3 depth) for the block at `depth`. Parameter names are timm's.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn


def lambda_init_at(depth: int) -> float:
    """The fixed part of lambda for the block at `depth` (0-based), timm's set_lambda_init."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


def register_lambdas(module: nn.Module, head_dim: int, depth: int = 0) -> None:
    """The learned lambda vectors and the sub-head norm, registered on the module that attends
    (their keys are its own: lambda_q1, lambda_k1, lambda_q2, lambda_k2, sub_norm)."""
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        module.register_parameter(name, nn.Parameter(torch.randn(head_dim) * 0.1))
    module.sub_norm = nn.RMSNorm(2 * head_dim, eps=1e-5)
    module.lambda_init = lambda_init_at(depth)


def diff_attend(module: nn.Module, q, k, v, fused: bool) -> torch.Tensor:
    """q, k [B, 2h, T, d], v [B, h, T, 2d] -> [B, T, h * 2d]: each pair's difference, normed
    (`module` holds the lambdas: register_lambdas)."""
    B, h2, T, d = q.shape
    h = h2 // 2
    lam = torch.exp(torch.sum(module.lambda_q1 * module.lambda_k1, dim=-1).float())
    lam = lam - torch.exp(torch.sum(module.lambda_q2 * module.lambda_k2, dim=-1).float())
    lam = (lam + module.lambda_init).type_as(q)
    if fused:
        q1, q2 = q.reshape(B, h, 2, T, d).unbind(2)
        k1, k2 = k.reshape(B, h, 2, T, d).unbind(2)
        o = F.scaled_dot_product_attention(q1, k1, v)
        o = o - lam * F.scaled_dot_product_attention(q2, k2, v)
    else:
        a = ((q * d**-0.5) @ k.transpose(-2, -1)).softmax(dim=-1).view(B, h, 2, T, T)
        o = (a[:, :, 0] - lam * a[:, :, 1]) @ v
    o = module.sub_norm(o) * (1 - module.lambda_init)
    return o.transpose(1, 2).reshape(B, T, h * 2 * d)


def split_heads(q, k, v, heads: int):
    """[B, T, D] each -> q, k [B, 2h, T, d] and v [B, h, T, 2d] (d = D / h / 2)."""
    B, T, D = q.shape
    d = D // heads // 2
    q = q.reshape(B, T, 2 * heads, d).transpose(1, 2)
    k = k.reshape(B, T, 2 * heads, d).transpose(1, 2)
    return q, k, v.reshape(B, T, heads, 2 * d).transpose(1, 2)


class DiffAttention(nn.Module):
    """Differential self-attention with timm's keys (qkv, q_norm, k_norm, norm, proj, the lambdas,
    sub_norm): a drop-in for layers.Attention in a Block (ViTSpec.diff_attn)."""

    def __init__(
        self,
        dim: int,
        heads: int,
        fused: bool = True,
        *,
        qk_norm: nn.Module | None = None,
        out_norm: nn.Module | None = None,
        qkv_bias: bool = True,
        proj_bias: bool = True,
    ):
        super().__init__()
        if dim % (2 * heads):
            raise ValueError(
                f"differential attention needs dim {dim} divisible by 2 x {heads} heads"
            )
        self.heads, self.head_dim, self.fused = heads, dim // heads // 2, fused
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.q_norm, self.k_norm = qk_norm, copy.deepcopy(qk_norm)
        self.norm = out_norm if out_norm is not None else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        register_lambdas(self, self.head_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        if rope is not None:
            raise ValueError("differential attention takes no rope")
        q, k, v = split_heads(*self.qkv(x).chunk(3, dim=-1), self.heads)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.proj(self.norm(diff_attend(self, q, k, v, self.fused)))
