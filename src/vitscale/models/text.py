"""The CLIP text tower: a causal transformer over BPE tokens, pooled at the end-of-text token.

Shapes: tokens int64 [B, L] -> token embeddings [B, L, W] -> blocks (causal) -> ln_final ->
the feature at each row's end-of-text position [B, W] -> projection [B, E].
As in CLIP/OpenCLIP, the end-of-text token has the largest id (49407), so its position is
`tokens.argmax(-1)`; padding (id 0) comes after it and is never attended to by it.
OpenCLIP's other text towers (interop/open_clip/) set `pool` ("eos": the first `eos_id` token,
"last", "first"), `causal=False` (bidirectional attention, e.g. CLIPA's and SigLIP's), `act`
"gelu_tanh" (SigLIP 2's), a projection with a bias or none at all (`proj_bias`, `proj`: SigLIP's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .layers import Block


@dataclass(frozen=True)
class TextSpec:
    vocab_size: int = 49408
    context_length: int = 77
    dim: int = 512
    depth: int = 12
    heads: int = 8
    mlp_ratio: float = 4.0
    embed_dim: int = 512  # output (shared embedding) size
    attention: str = "sdpa"  # "sdpa" | "explicit"
    # OpenCLIP's (interop/open_clip/convert.py): its LayerNorms use torch's default eps, its OpenAI models QuickGELU
    norm_eps: float = 1e-6  # every LayerNorm (blocks and ln_final)
    act: str = "gelu"  # MLP activation: "gelu" | "quick_gelu"
    causal: bool = True  # False: every token attends to every token (OpenCLIP's no_causal_mask)
    pool: str = "argmax"  # the pooled token: "argmax" (the largest id: CLIP's end of text) |
    # "eos" (the first `eos_id`) | "last" | "first" (OpenCLIP's pool_type)
    eos_id: int = 0  # pool="eos" only
    proj: str = (
        "linear"  # "linear" | "none": the pooled feature is the embedding (OpenCLIP's proj_type)
    )
    proj_bias: bool = (
        False  # the projection has a bias (OpenCLIP's proj_bias: SigLIP's text towers)
    )


class TextTransformer(nn.Module):
    def __init__(self, spec: TextSpec):
        super().__init__()
        self.spec = spec
        W = spec.dim
        self.token_embedding = nn.Embedding(spec.vocab_size, W)
        self.positional_embedding = nn.Parameter(torch.zeros(spec.context_length, W))
        self.blocks = nn.ModuleList(
            Block(
                W,
                spec.heads,
                spec.mlp_ratio,
                fused_attn=spec.attention == "sdpa",
                causal=spec.causal,
                eps=spec.norm_eps,
                act=spec.act,
            )
            for _ in range(spec.depth)
        )
        self.ln_final = nn.LayerNorm(W, eps=spec.norm_eps)
        if spec.proj not in ("linear", "none"):
            raise ValueError(f"unknown text proj '{spec.proj}' (expected linear or none)")
        if spec.proj == "none" and spec.embed_dim != W:
            raise ValueError(f"text proj='none' needs embed_dim == dim ({spec.embed_dim} != {W})")
        self.proj = (
            nn.Linear(W, spec.embed_dim, bias=spec.proj_bias)
            if spec.proj == "linear"
            else nn.Identity()
        )
        self.grad_checkpointing = False
        self.reset_parameters()

    def shard_units(self) -> list[nn.Module]:
        """The modules a sharding engine wraps one by one: the transformer blocks."""
        return list(self.blocks)

    def reset_parameters(self) -> None:
        """OpenCLIP's text init: token 0.02, positions 0.01, then width- and depth-scaled stds."""
        W, L = self.spec.dim, self.spec.depth
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        attn_std, proj_std, fc_std = W**-0.5, W**-0.5 * (2 * L) ** -0.5, (2 * W) ** -0.5
        for blk in self.blocks:
            nn.init.normal_(blk.attn.qkv.weight, std=attn_std)
            nn.init.normal_(blk.attn.proj.weight, std=proj_std)
            nn.init.normal_(blk.mlp.fc1.weight, std=fc_std)
            nn.init.normal_(blk.mlp.fc2.weight, std=proj_std)
            for b in (blk.attn.qkv.bias, blk.attn.proj.bias, blk.mlp.fc1.bias, blk.mlp.fc2.bias):
                nn.init.zeros_(b)
        if isinstance(self.proj, nn.Linear):
            nn.init.normal_(self.proj.weight, std=W**-0.5)
            if self.proj.bias is not None:
                nn.init.zeros_(self.proj.bias)

    def no_weight_decay(self) -> set[str]:
        """Nothing beyond norms and biases (OpenCLIP decays the token and position embeddings)."""
        return set()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        L = tokens.shape[1]
        if L > self.spec.context_length:
            raise ValueError(
                f"{L} tokens per caption, the model takes at most {self.spec.context_length}"
            )
        x = self.token_embedding(tokens) + self.positional_embedding[:L]  # [B, L, W]
        for blk in self.blocks:
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        x = self.ln_final(x)
        # [B, E]
        return self.proj(x[torch.arange(x.shape[0], device=x.device), self.pooled_position(tokens)])

    def pooled_position(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B] the position whose feature is the caption's (OpenCLIP's text_global_pool)."""
        pool = self.spec.pool
        if pool == "argmax":
            return tokens.argmax(dim=-1)  # end of text
        if pool == "eos":
            return (tokens == self.spec.eos_id).int().argmax(dim=-1)
        if pool in ("last", "first"):
            return torch.full(
                tokens.shape[:1], tokens.shape[1] - 1 if pool == "last" else 0, device=tokens.device
            )
        raise ValueError(f"unknown text pool '{pool}' (expected argmax, eos, last or first)")


def text_forward_macs(spec: TextSpec, length: int | None = None) -> int:
    """Multiply-accumulates of one caption's forward pass (matmuls; SDPA counted in full, as
    torch.utils.flop_counter counts it, also where causal masking lets a kernel skip half)."""
    W, T = spec.dim, length or spec.context_length
    hidden = int(W * spec.mlp_ratio)
    per_block = T * W * 3 * W + 2 * T * T * W + T * W * W + 2 * T * W * hidden
    return spec.depth * per_block + (W * spec.embed_dim if spec.proj == "linear" else 0)
