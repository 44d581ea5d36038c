"""Parallel transformer blocks (torch only): attention and MLP computed side by side instead of one
after the other. Parameter names are timm's, so weights map one to one (interop/timm/vision_transformer.py).

- `BranchesBlock` (ViTSpec.parallel="branches"; timm's ParallelThingsBlock, Touvron et al. 2022,
  "Three things everyone should know about ViTs": the `*_18x2_*` models): two attention branches,
  then two MLP branches, each with its own norm and layer scale:
      x = x + sum_i ls_i(attn_i(norm_i(x)));  x = x + sum_i ls'_i(mlp_i(norm'_i(x)))
- `FusedBlock` (ViTSpec.parallel="fused"; timm's ParallelScalingBlock, ViT-22B: the `*_xp_*`
  models): one norm and one input projection give q, k, v and the MLP's hidden units; the
  attention's and the MLP's outputs are projected and added:
      [h; q; k; v] = in_proj(in_norm(x));  x = x + ls(attn_out_proj(attn(q, k, v)) + mlp_out_proj(act(h)))

Both take stochastic depth in both modes (each branch its own mask, as timm's DropPath per branch;
the skip form drops rows of the block's whole update) and a rope like Block. Tensor parallelism
has no plan for them (refused in one line: layers.tp_widths).
"""

from __future__ import annotations

import torch
from torch import nn

from .diff_attention import diff_attend, register_lambdas, split_heads
from .ffn import activation, make_mlp, make_norm
from .layers import Attention, BlockOptions, LayerScale, attention_kernel, drop_path, residual
from .rope import apply_rope


class _Branch(nn.Module):
    """norm -> attn or mlp -> layer scale: one of BranchesBlock's branches (timm's Sequential of
    norm, attn / mlp, ls)."""

    def __init__(self, norm: nn.Module, body: nn.Module, name: str, ls: LayerScale | None):
        super().__init__()
        self.norm = norm
        self.add_module(name, body)
        self.body_name = name
        self.ls = ls if ls is not None else nn.Identity()

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        body = getattr(self, self.body_name)
        y = body(self.norm(x), rope) if self.body_name == "attn" else body(self.norm(x))
        return self.ls(y)


class BranchesBlock(nn.Module):
    """Two attention branches, then two MLP branches, summed into the residual (module docstring)."""

    drop_path_mode = "mask"

    def __init__(
        self,
        dim: int,
        heads: int,
        mlp_ratio: float,
        fused_attn: bool = True,
        drop_path: float = 0.0,
        dropout: float = 0.0,
        options: BlockOptions | None = None,
        branches: int = 2,
    ):
        super().__init__()
        o = options or BlockOptions()
        if o.post_norm:
            raise ValueError("parallel='branches' has pre-norm branches (post_norm=False)")
        self.options, self.drop_path = o, drop_path

        def norm(n):
            return make_norm(o.norm, n, o.eps)

        def ls():
            return LayerScale(dim, o.layer_scale) if o.layer_scale else None

        def attn():
            return Attention(
                dim,
                heads,
                fused_attn,
                dropout,
                qk_norm=norm(dim // heads) if o.qk_norm else None,
                out_norm=norm(dim) if o.out_norm else None,
                qkv_bias=o.qkv_bias,
                proj_bias=o.proj_bias,
            )

        def mlp():
            hidden = int(dim * mlp_ratio)
            inner = (
                norm(hidden // 2 if o.mlp == "swiglu_packed" else hidden) if o.mlp_norm else None
            )
            return make_mlp(
                o.mlp, dim, hidden, dropout=dropout, act=o.act, norm=inner, bias=o.proj_bias
            )

        self.attns = nn.ModuleList(
            _Branch(norm(dim), attn(), "attn", ls()) for _ in range(branches)
        )
        self.ffns = nn.ModuleList(_Branch(norm(dim), mlp(), "mlp", ls()) for _ in range(branches))

    def attentions(self) -> list[Attention]:
        return [b.attn for b in self.attns]

    def _sum(self, branches, x, rope, training):
        if training and self.drop_path and self.drop_path_mode == "mask":  # a mask per branch
            return sum(drop_path(b(x, rope), self.drop_path, True) for b in branches)
        return sum(b(x, rope) for b in branches)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        p, mode = self.drop_path, self.drop_path_mode
        if self.training and p and mode == "mask":
            x = x + self._sum(self.attns, x, rope, True)
            return x + self._sum(self.ffns, x, None, True)
        per_row = rope if rope is not None and rope.ndim == 4 else None
        if per_row is None:
            x = residual(x, lambda y: self._sum(self.attns, y, rope, False), p, self.training, mode)
        else:
            x = residual(
                x, lambda y, r: self._sum(self.attns, y, r, False), p, self.training, mode, per_row
            )
        return residual(x, lambda y: self._sum(self.ffns, y, None, False), p, self.training, mode)


class FusedBlock(nn.Module):
    """One norm and one input projection for attention and MLP, side by side (module docstring)."""

    drop_path_mode = "mask"

    def __init__(
        self,
        dim: int,
        heads: int,
        mlp_ratio: float,
        fused_attn: bool = True,
        drop_path: float = 0.0,
        dropout: float = 0.0,
        options: BlockOptions | None = None,
    ):
        super().__init__()
        o = options or BlockOptions()
        if o.mlp != "mlp" or o.mlp_norm or o.out_norm or o.post_norm:
            raise ValueError("parallel='fused' takes the plain MLP and no inner or post norms")
        self.options, self.drop_path = o, drop_path
        self.heads, self.fused = heads, fused_attn
        self.head_dim = dim // heads // (2 if o.diff_attn else 1)  # differential: half heads
        self.hidden = int(mlp_ratio * dim)
        self.in_norm = make_norm(o.norm, dim, o.eps)
        self.in_proj = nn.Linear(dim, self.hidden + 3 * dim, bias=o.qkv_bias)
        # without a qkv bias the MLP's first bias is its own parameter (timm's mlp_bias)
        self.mlp_bias = None if o.qkv_bias else nn.Parameter(torch.zeros(self.hidden))
        self.q_norm = make_norm(o.norm, self.head_dim, o.eps) if o.qk_norm else None
        self.k_norm = make_norm(o.norm, self.head_dim, o.eps) if o.qk_norm else None
        self.mlp_act = activation(o.act)
        if o.diff_attn:  # timm's DiffParallelScalingBlock: one output projection of both
            register_lambdas(self, self.head_dim)
            self.out_proj = nn.Linear(dim + self.hidden, dim, bias=o.proj_bias)
        else:
            self.attn_out_proj = nn.Linear(dim, dim, bias=o.proj_bias)
            self.mlp_out_proj = nn.Linear(self.hidden, dim, bias=o.proj_bias)
        self.ls = LayerScale(dim, o.layer_scale) if o.layer_scale else None
        self.rope_prefix, self.rope_half = 0, False  # set by a model with a rope

    def update(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        """The block's residual update: ls(attention and MLP side by side) [B, T, D]."""
        B, T, D = x.shape
        h, hd = self.heads, self.head_dim
        mlp, q, k, v = self.in_proj(self.in_norm(x)).split([self.hidden, D, D, D], dim=-1)
        if self.mlp_bias is not None:
            mlp = mlp + self.mlp_bias
        if self.options.diff_attn:
            q, k, v = split_heads(q, k, v, h)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            a = diff_attend(self, q, k, v, self.fused)
            y = self.out_proj(torch.cat([a, self.mlp_act(mlp)], dim=-1))
            return y if self.ls is None else self.ls(y)
        q, k, v = (t.reshape(B, T, h, hd) for t in (q, k, v))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, h, T, hd]
        if rope is not None:
            q = apply_rope(q, rope, self.rope_prefix, self.rope_half)
            k = apply_rope(k, rope, self.rope_prefix, self.rope_half)
        if self.fused:
            a = attention_kernel(q, k, v)
        else:
            a = ((q * hd**-0.5) @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        a = a.transpose(1, 2).reshape(B, T, D)
        y = self.attn_out_proj(a) + self.mlp_out_proj(self.mlp_act(mlp))
        return y if self.ls is None else self.ls(y)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        per_row = rope if rope is not None and rope.ndim == 4 else None
        if rope is None or per_row is not None:
            return residual(
                x, self.update, self.drop_path, self.training, self.drop_path_mode, per_row
            )
        update = lambda y: self.update(y, rope)  # noqa: E731
        return residual(x, update, self.drop_path, self.training, self.drop_path_mode)
