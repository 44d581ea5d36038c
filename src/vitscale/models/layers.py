"""Transformer building blocks (torch only; nothing here knows about precision policies: only
attention_kernel looks at the device and dtype, to pick the fast attention backward)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .diff_attention import DiffAttention
from .ffn import ACTIVATIONS, Mlp, activation, make_mlp, make_norm, mlp_tp_plan
from .rope import RopeMixed, apply_rope

__all__ = ["ACTIVATIONS", "Mlp", "activation"]  # re-exported: their home is ffn.py


def grid_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, D, g, g] -> [B, N, D], token-major in memory. The transposed view alone would keep the
    [B, D, N] memory order; elementwise ops keep their input's order, so the whole residual stream
    would stay that way and every layer norm would reduce over D strided: the default recipe's step
    was 4-19% slower (docs/performance.md "Token layout")."""
    return x.flatten(2).transpose(1, 2).contiguous()


class PatchEmbed(nn.Module):
    """[B, C, H, W] -> [B, N, D] with N = (H/p)*(W/p): a stride-p convolution."""

    def __init__(
        self, image_size: int, patch_size: int, in_chans: int, dim: int, bias: bool = True
    ):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image size {image_size} is not divisible by patch size {patch_size}")
        self.grid = image_size // patch_size
        self.num_patches = self.grid * self.grid
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size, bias=bias)
        self.norm: nn.Module = nn.Identity()  # a norm of the embeddings (timm's embed_norm_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(grid_to_tokens(self.proj(x)))


class BatchNorm2d(nn.BatchNorm2d):
    """BatchNorm that normalizes in the dtype of its running statistics (fp32), whatever dtype its
    input and affine weights have. Engines that cast parameters but not buffers to bf16 (FSDP2's
    MixedPrecisionPolicy, DeepSpeed's bf16 mode) would otherwise hand F.batch_norm a mix of bf16
    and fp32 tensors, which it refuses. Same parameters, buffers and state-dict keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = self.running_mean.dtype if self.running_mean is not None else torch.float32
        if self.weight is None or self.weight.dtype == dt:
            # parameters and statistics agree (a bf16 input under autocast included): PyTorch's
            # own kernel, so the one-device recipe computes exactly as it always did
            return super().forward(x)
        # the momentum bookkeeping of nn.BatchNorm2d.forward, then the same call in `dt`
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        momentum = (
            self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        )
        use_batch_stats = self.training or self.running_mean is None
        return F.batch_norm(
            x.to(dt),
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight.to(dt),
            self.bias.to(dt),
            use_batch_stats,
            momentum or 0.0,
            self.eps,
        ).to(x.dtype)


class ConvStem(nn.Module):
    """Convolutional stem (Xiao et al. 2021, "Early convolutions help transformers see better"):
    3x3 stride-2 conv + norm + ReLU stages halving the image until it reaches the patch grid,
    then a 1x1 conv to `dim`. [B, C, H, W] -> [B, N, D], N = (H/p)^2 as with PatchEmbed.
    `patch_size` must be a power of two. BatchNorm, as in the paper (it beat a per-sample
    GroupNorm(1, C) by ~2 points after one Fashion-MNIST epoch); its batch statistics mean that
    accumulation and data parallelism equal the big-batch update only with the patch stem.

    `channels_last` (default): the convolutions compute in NHWC memory order, the one oneDNN's CPU
    kernels run fastest (the default recipe's training step 1.15-1.18x faster on an emulated AVX2 CPU:
    docs/performance.md "The conv stem in channels-last order"). Only the input is re-laid: each
    conv handed a channels-last input computes in that order and hands it on, and the last one's
    output is already token-major memory. The parameters stay contiguous NCHW tensors (FSDP2 and
    DeepSpeed take no other; oneDNN re-lays the few-KB weights itself). Same function, same
    state-dict, every module called as before (ZeRO-3's gathering hooks included)."""

    def __init__(
        self, image_size: int, patch_size: int, in_chans: int, dim: int, channels_last: bool = True
    ):
        super().__init__()
        if image_size % patch_size or patch_size & (patch_size - 1) or patch_size < 2:
            raise ValueError(
                f"conv stem needs a power-of-two patch size >= 2 dividing the image size "
                f"(got patch {patch_size}, image {image_size})"
            )
        self.grid = image_size // patch_size
        self.num_patches = self.grid * self.grid
        layers, c = [], in_chans
        widths = [
            max(16, dim // 2 ** (s + 1)) for s in reversed(range(patch_size.bit_length() - 1))
        ]
        for w in widths:  # e.g. patch 4, dim 192: 1 -> 48 -> 96 channels at /2, /4
            layers += [
                nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False),
                BatchNorm2d(w),
                nn.ReLU(inplace=True),
            ]
            c = w
        layers.append(nn.Conv2d(c, dim, 1))
        self.proj = nn.Sequential(*layers)
        self.widths = widths
        self.channels_last = channels_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            # .to, not .contiguous: a one-channel image is both orders at once, and .contiguous
            # would keep its NCHW strides, which oneDNN reads as NCHW; .to gives it channels-last
            # strides, and a conv handed a channels-last input computes and returns channels-last
            x = x.to(memory_format=torch.channels_last)
        return grid_to_tokens(self.proj(x))


class CpuFlashAttention(torch.autograd.Function):
    """Fused attention for bf16/fp16 training on CPUs: torch's CPU flash-attention forward, and
    FlashAttention-2's backward written as batched matmuls.

    torch's own backward for that kernel is 10-17x slower than explicit attention's in bf16 at
    short sequences (docs/performance.md "Why"), while its fp32 backward is fine. Like the flash
    kernel, only the output and the per-row logsumexp are kept for backward (not the [T, T]
    probabilities of every block); backward recomputes P = exp(s q k^T - lse) for the one block
    it is in, then dv = P^T do, dS = P * (do v^T - rowsum(do * o)), dq = s dS k, dk = s dS^T q,
    with the exponentials and row sums in fp32 and the matmuls in the input dtype.
    Inputs [B, h, T, d]; no dropout, no mask other than causal."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.to(q.dtype)
        s = (q @ k.transpose(-2, -1)).float() * ctx.scale  # [B, h, T, T]
        if ctx.causal:
            T = q.shape[-2]
            s = s.masked_fill(
                torch.ones(T, T, dtype=torch.bool, device=q.device).triu_(1), float("-inf")
            )
        p = torch.exp(s - lse.unsqueeze(-1))
        dv = p.to(q.dtype).transpose(-2, -1) @ do
        dp = (do @ v.transpose(-2, -1)).float()
        ds = (p * (dp - (do.float() * o.float()).sum(-1, keepdim=True)) * ctx.scale).to(q.dtype)
        return ds @ k, ds.transpose(-2, -1) @ q, dv, None, None


def attention_kernel(q, k, v, dropout: float = 0.0, causal: bool = False):
    """scaled_dot_product_attention, with CpuFlashAttention's backward where torch's is slow
    (CPU, bf16/fp16, gradients needed, no dropout)."""
    if (
        q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float16)
        and not dropout
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
    ):
        return CpuFlashAttention.apply(q, k, v, causal, q.shape[-1] ** -0.5)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal)


class Attention(nn.Module):
    """Multi-head self-attention; `fused` picks scaled_dot_product_attention (attention_kernel),
    else explicit math.
    `causal`: token t attends to tokens <= t only (the CLIP text transformer).
    timm's options (all off by default, each a state-dict key of timm's): `qk_norm`, a norm of each
    head's q and k (q_norm, k_norm over the head dimension); `out_norm`, a norm of the heads'
    concatenated output before the projection (timm's scale_attn_norm, BEiT-3, EVA02's
    scale_attn_inner: attn.norm); `qkv_bias` / `proj_bias`. `rope` (forward): the rotary position
    embedding's tensor, applied to q and k after their norms (rope.apply_rope), the first
    `rope_prefix` tokens left as they are."""

    def __init__(
        self,
        dim: int,
        heads: int,
        fused: bool = True,
        dropout: float = 0.0,
        causal: bool = False,
        *,
        qk_norm: nn.Module | None = None,
        out_norm: nn.Module | None = None,
        qkv_bias: bool = True,
        proj_bias: bool = True,
    ):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads, self.head_dim = heads, dim // heads
        self.scale = self.head_dim**-0.5
        self.fused = fused
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        if qk_norm is not None:  # one norm module per q and k, both over the head dimension
            self.q_norm, self.k_norm = qk_norm, copy.deepcopy(qk_norm)
        else:
            self.q_norm = self.k_norm = None
        self.norm = out_norm if out_norm is not None else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.dropout = dropout
        self.causal = causal
        self.rope_prefix, self.rope_half = 0, False  # set by a model with a rope (forward's `rope`)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        B, T, D = x.shape
        qkv = self.qkv(x)
        # this rank's heads: all of them, or under tensor parallelism its share (strategy/parallel.py)
        h = qkv.shape[-1] // (3 * self.head_dim)
        qkv = qkv.reshape(B, T, 3, h, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each [B, h, T, hd]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # the class and register tokens are not rotated
            q = apply_rope(q, rope, self.rope_prefix, self.rope_half)
            k = apply_rope(k, rope, self.rope_prefix, self.rope_half)
        p = self.dropout if self.training else 0.0
        if self.fused:
            x = attention_kernel(q, k, v, p, self.causal)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)  # [B, h, T, T]
            if self.causal:
                future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu_(1)
                attn = attn.masked_fill(future, float("-inf"))
            attn = attn.softmax(dim=-1)
            if p:
                attn = F.dropout(attn, p)
            x = attn @ v  # [B, h, T, hd]
        return self.proj(self.norm(x.transpose(1, 2).reshape(B, T, h * self.head_dim)))


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: zero the whole residual branch of a sample with probability p."""
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask / keep


DROP_PATH_MODES = ("mask", "skip")


def dropped_count(batch: int, p: float) -> int:
    """How many of a batch's rows the skip form drops in a block of rate p: round(p x batch), so the
    shapes are the same in every step (torch.compile, CUDA graphs)."""
    return round(p * batch)


def kept_rows(batch: int, n_drop: int, device) -> torch.Tensor:
    """The rows whose branch the skip form computes: batch - n_drop of them, drawn uniformly without
    replacement from the device's default generator (the run's seeded stream), in ascending order."""
    return torch.rand(batch, device=device).argsort()[n_drop:].sort().values


def skip_residual(x: torch.Tensor, branch, rows: torch.Tensor) -> torch.Tensor:
    """x + branch(x) * B / len(rows) on `rows`, x elsewhere, computing the branch for `rows` only: the
    mask form's sum given the same dropped rows, with the kept rows scaled by the kept fraction."""
    out = branch(x.index_select(0, rows))
    return x.index_add(0, rows, out.to(x.dtype), alpha=x.shape[0] / rows.numel())


def residual(
    x: torch.Tensor,
    branch,
    p: float,
    training: bool,
    mode: str = "mask",
    per_row: torch.Tensor | None = None,
) -> torch.Tensor:
    """x + branch(x) under stochastic depth of rate p. "mask": the branch computed for every sample and
    multiplied by a Bernoulli(1 - p) mask / (1 - p) (timm's DropPath). "skip": a fixed count of rows,
    round(p x batch), dropped at random and their branch never computed; the kept rows are scaled by
    batch / kept, so each sample's expected output is the same. A rate that rounds to no dropped row
    drops none. `per_row`: a batch-first tensor the branch takes as its second argument (a rope
    that follows patch dropout's kept tokens); the skip form hands it the same rows as x."""
    f = branch if per_row is None else (lambda y: branch(y, per_row))
    if p == 0.0 or not training:
        return x + f(x)
    if mode == "mask":
        return x + drop_path(f(x), p, training)
    B = x.shape[0]
    n_drop = dropped_count(B, p)
    if n_drop == 0:
        return x + f(x)
    if n_drop >= B:
        return x
    rows = kept_rows(B, n_drop, x.device)
    if per_row is not None:
        return skip_residual(x, lambda y: branch(y, per_row.index_select(0, rows)), rows)
    return skip_residual(x, branch, rows)


def set_drop_path_mode(model: nn.Module, mode: str) -> nn.Module:
    """Every Block of `model` computes its stochastic depth in `mode` (DROP_PATH_MODES); nothing else
    changes (no parameter, no state-dict key)."""
    if mode not in DROP_PATH_MODES:
        raise ValueError(
            f"unknown drop-path mode '{mode}' (expected one of {', '.join(DROP_PATH_MODES)})"
        )
    for m in model.modules():
        if hasattr(type(m), "drop_path_mode"):  # Block and the parallel blocks
            m.drop_path_mode = mode
    return model


@dataclass(frozen=True)
class BlockOptions:
    """What a block is built from beyond its sizes (timm's Block arguments; the defaults are
    vitscale's 2021 block). norm: "layernorm" | "rmsnorm" (every norm of the block); mlp: "mlp" |
    "swiglu" | "swiglu_packed" (ffn.MLPS); mlp_norm: a norm over the MLP's hidden units
    (scale_mlp_norm); out_norm: a norm of the attention's output before its projection
    (scale_attn_norm); qk_norm: norms of q and k; layer_scale: per-channel scales of each branch
    initialized to this value (timm's init_values; 0 = none); post_norm: the norms after each
    branch instead of before it (timm's ResPostBlock: x + norm1(attn(x)))."""

    norm: str = "layernorm"
    eps: float = 1e-6
    act: str = "gelu"
    mlp: str = "mlp"
    mlp_norm: bool = False
    out_norm: bool = False
    qk_norm: bool = False
    qkv_bias: bool = True
    proj_bias: bool = True
    layer_scale: float = 0.0
    post_norm: bool = False
    diff_attn: bool = False  # differential attention (models/diff_attention.py)


class LayerScale(nn.Module):
    """x * gamma, one learned scale per channel (timm's LayerScale: blocks.N.ls1/ls2.gamma)."""

    def __init__(self, dim: int, init: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)); with layer scale
    x + ls1(attn(norm1(x))) (CaiT, DeiT III, DINOv2); with post_norm x + norm1(attn(x)). Stochastic
    depth of rate `drop_path` on both branches, in `drop_path_mode` (residual). `options`
    (BlockOptions) names the norms, the MLP and timm's other variants; `eps` and `act` are its
    shorthands for the 2021 block."""

    drop_path_mode = "mask"

    def __init__(
        self,
        dim: int,
        heads: int,
        mlp_ratio: float,
        fused_attn: bool = True,
        drop_path: float = 0.0,
        dropout: float = 0.0,
        causal: bool = False,
        eps: float = 1e-6,
        act: str = "gelu",
        options: BlockOptions | None = None,
    ):
        super().__init__()
        o = options or BlockOptions(eps=eps, act=act)
        self.options = o
        norm = lambda n: make_norm(o.norm, n, o.eps)  # noqa: E731
        self.norm1 = norm(dim)
        head_dim = dim // heads // (2 if o.diff_attn else 1)  # differential: pairs of half heads
        qk = norm(head_dim) if o.qk_norm else None
        out = norm(dim) if o.out_norm else None
        self.attn: nn.Module
        if o.diff_attn:
            self.attn = DiffAttention(
                dim, heads, fused_attn, qk_norm=qk, out_norm=out, qkv_bias=o.qkv_bias,
                proj_bias=o.proj_bias,
            )  # fmt: skip
        else:
            self.attn = Attention(
                dim, heads, fused_attn, dropout, causal, qk_norm=qk, out_norm=out,
                qkv_bias=o.qkv_bias, proj_bias=o.proj_bias,
            )  # fmt: skip
        self.norm2 = norm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = make_mlp(
            o.mlp,
            dim,
            hidden,
            dropout=dropout,
            act=o.act,
            norm=norm(hidden // 2 if o.mlp == "swiglu_packed" else hidden) if o.mlp_norm else None,
            bias=o.proj_bias,
        )
        if o.layer_scale:
            self.ls1, self.ls2 = LayerScale(dim, o.layer_scale), LayerScale(dim, o.layer_scale)
        else:
            self.ls1 = self.ls2 = None
        self.drop_path = drop_path

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        """Tensor parallelism's plan of the block (strategy/parallel.py): Megatron's split, q, k
        and v column-wise by heads (one fused weight: `colwise_qkv`), the projection row-wise, the
        MLP's up-projections column-wise and its down-projection row-wise: one all-reduce per
        branch. With `sequence_parallel` the norms run on this rank's share of the tokens
        (`sequence`), and each all-reduce becomes a reduce-scatter and an all-gather."""
        plan = {"attn.qkv": "colwise_qkv", "attn.proj": "rowwise", **mlp_tp_plan(self.mlp)}
        if self.options.qk_norm:  # on each rank's heads: weights whole, gradients summed
            plan |= {"attn.q_norm": "local_norm", "attn.k_norm": "local_norm"}
        return {**plan, "norm1": "sequence", "norm2": "sequence"} if sequence_parallel else plan

    def tp_unsplittable(self) -> str:
        """What in this block tensor parallelism cannot split ("" when nothing): a norm over every
        head's output or every hidden unit at once needs them all on one rank."""
        if self.options.out_norm:
            return "norm of the attention's output (scale_attn_norm)"
        if self.options.mlp_norm:
            return "norm of the MLP's hidden units (scale_mlp_norm)"
        if self.options.diff_attn:
            return "differential attention (its heads in pairs, lambdas shared by them)"
        return ""

    def attn_branch(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        if self.options.post_norm:
            return self.norm1(self.attn(x, rope))
        y = self.attn(self.norm1(x), rope)
        return y if self.ls1 is None else self.ls1(y)

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        if self.options.post_norm:
            return self.norm2(self.mlp(x))
        y = self.mlp(self.norm2(x))
        return y if self.ls2 is None else self.ls2(y)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        """`rope`: None, or the model's rotary position embedding for this forward's tokens
        (models/rope.py), which the attention applies to q and k."""
        per_row = rope if rope is not None and rope.ndim == 4 else None  # [B, h, k, C]: kept tokens
        attn = (
            self.attn_branch
            if rope is None or per_row is not None
            else (lambda y: self.attn_branch(y, rope))
        )
        x = residual(x, attn, self.drop_path, self.training, self.drop_path_mode, per_row)
        return residual(x, self.mlp_branch, self.drop_path, self.training, self.drop_path_mode)


def tp_plan(model: nn.Module, sequence_parallel: bool = False) -> dict[str, str]:
    """The model's tensor-parallel plan: each transformer block's (Block.tp_plan), by the full name
    of the layer (both towers of a CLIP); every other parameter is replicated. With
    `sequence_parallel`, each tower's first block takes the tokens split over the ranks
    (`sequence_in`) and its last gives them back whole (`sequence_out`)."""
    plan: dict[str, str] = {}
    for name, m in model.named_modules():
        if not (isinstance(m, nn.ModuleList) and len(m) and all(isinstance(b, Block) for b in m)):
            continue
        for i, block in enumerate(m):
            assert isinstance(block, Block)
            plan.update({f"{name}.{i}.{k}": v for k, v in block.tp_plan(sequence_parallel).items()})
        if sequence_parallel:
            first, last = f"{name}.0", f"{name}.{len(m) - 1}"
            plan.update({first: "sequence_in", last: "sequence_out"})
            if first == last:
                plan[first] = "sequence_in_out"
    return plan


def tp_widths(model: nn.Module) -> dict[str, int | None]:
    """What tensor parallelism splits, by name: the attention heads and MLP widths of every block
    (strategy.tp must divide each); None for what it cannot split (Block.tp_unsplittable)."""
    widths: dict[str, int | None] = {}
    for m in model.modules():
        if isinstance(m, Block):
            width = m.attn.qkv.in_features
            widths[f"heads of a {width}-wide block"] = m.attn.heads
            widths[f"MLP width of a {width}-wide block"] = m.mlp.hidden
            if m.tp_unsplittable():
                widths[m.tp_unsplittable()] = None
        if hasattr(type(m), "drop_path_mode") and not isinstance(m, Block):
            widths[f"parallel block ({type(m).__name__})"] = None
        if isinstance(m, RopeMixed):  # one learned frequency table per head
            widths["rotary embedding learned per head (rope=mixed)"] = None
    return widths
