"""Vision Transformer (ViT) with a registry of the standard sizes and small-image variants."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .diff_attention import lambda_init_at
from .ffn import make_norm
from .layers import Block, BlockOptions, ConvStem, LayerScale, PatchEmbed, tp_plan
from .parallel import BranchesBlock, FusedBlock
from .pool import AttentionPool
from .rope import build_rope, keep_rope


@dataclass(frozen=True)
class ViTSpec:
    image_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    dim: int = 768
    depth: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    head: str = "token"  # "token" (class token) | "pool" (global average of patch tokens) |
    # "map" (attention pooling: one learned query, SigLIP's MAP head; timm's global_pool="map")
    attention: str = "sdpa"  # "sdpa" (fused scaled_dot_product_attention) | "explicit"
    stem: str = "patch"  # "patch" (one stride-p conv, as in ViT) | "conv" (3x3 conv stages)
    drop_path: float = 0.0
    dropout: float = 0.0
    # timm's variants, so that imported weights compute the same function (interop/timm/vision_transformer.py):
    fc_norm: bool = False  # pool head: mean of the un-normed tokens, then LayerNorm (timm's
    # global_pool="avg"); False: LayerNorm of every token, then mean
    no_embed_class: bool = False  # position embeddings for the patches only, added before the class
    # token is prepended (timm's no_embed_class, e.g. DeiT III)
    # more of timm's variants (interop/timm/vision_transformer.py); the defaults are vitscale's ViT, so a spec saved
    # before they existed loads as the same model
    class_token: bool | None = None  # a class token; None: exactly when head="token". head="pool"
    # with a class token averages the patch tokens only (timm's
    # class_token=True, global_pool="avg")
    reg_tokens: int = 0  # register tokens after the class token (timm's reg_tokens)
    layer_scale: float = 0.0  # per-channel scales of each residual branch, initialized to this
    # value (timm's init_values, blocks.N.ls1/ls2.gamma); 0 = none
    qkv_bias: bool = True  # the attention's qkv projection has a bias
    pre_norm: bool = False  # a LayerNorm before the blocks, and no patch-embedding bias (timm's
    # pre_norm, CLIP's image towers)
    final_norm: bool = True  # False: no LayerNorm after the blocks (neither norm nor fc_norm)
    norm_eps: float = 1e-6  # every LayerNorm's eps (timm's CLIP models: 1e-5)
    act: str = "gelu"  # the MLP activation: gelu | gelu_tanh | quick_gelu | silu
    # the blocks of the 2022-2025 encoders (SigLIP, DINOv2/v3, EVA02, PE, AIMv2; timm's arguments in
    # brackets); the defaults are the 2021 ViT, so a spec saved before they existed loads the same
    norm: str = "layernorm"  # every norm: "layernorm" | "rmsnorm" (timm's norm_layer=RmsNorm)
    mlp: str = "mlp"  # "mlp" | "swiglu" (fc1_g, fc1_x) | "swiglu_packed" (one fc1; mlp_layer)
    mlp_norm: bool = False  # a norm over the MLP's hidden units (scale_mlp_norm)
    attn_norm: bool = False  # a norm of the attention's output before its projection
    # (scale_attn_norm)
    qk_norm: bool = False  # norms of each head's q and k (qk_norm)
    proj_bias: bool = True  # the attention projection and the MLP's linears have biases (proj_bias)
    post_norm: bool = False  # the norms after each branch: x + norm1(attn(x)) (ResPostBlock)
    embed_norm: bool = False  # a norm of the patch embeddings (embed_norm_layer: AIMv2)
    pos_embed: bool = True  # a learned absolute position embedding (pos_embed="none": False)
    pool_prefix: bool = False  # head "pool"/"map" pools the class and register tokens too
    # (pool_include_prefix)
    distilled: bool = False  # DeiT's distillation token after the class token and a second head
    # (head_dist); the output is the mean of both heads' logits, as timm's in evaluation
    diff_attn: bool = False  # differential attention (attn_layer="diff"; models/diff_attention.py)
    parallel: str = ""  # parallel blocks: "" (attention, then MLP) | "branches" (two attention
    # branches, then two MLP branches: timm's ParallelThingsBlock) | "fused" (one input projection
    # for both, side by side: ParallelScalingBlock, ViT-22B) (models/parallel.py)
    rope: str = ""  # a 2-D rotary position embedding of q and k: "" (none) | "cat" (EVA02, PE) |
    # "mixed" (learned per block and head) | "dinov3" (models/rope.py; the class and register tokens
    # are not rotated)
    rope_options: dict = field(default_factory=dict)  # the rope class's keyword arguments
    # (rope.RopeCat / RopeMixed / RopeDinoV3: temperature, grid_indexing, grid_offset, rotate_half,
    # ref_feat_shape, ...)
    pool_heads: int = 0  # head "map": its attention heads (0 = heads; PE: 8)
    pool_mlp_ratio: float = 0.0  # head "map": its MLP's ratio (0 = mlp_ratio)
    pool_act: str = ""  # head "map": its MLP's activation ("" = act; timm's eva family: gelu)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def has_class_token(self) -> bool:
        return self.head == "token" if self.class_token is None else self.class_token

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patches: the class, distillation and register tokens."""
        return int(self.has_class_token) + int(self.distilled) + self.reg_tokens

    def block_options(self) -> BlockOptions:
        """What each block is built from (layers.BlockOptions)."""
        return BlockOptions(
            norm=self.norm,
            eps=self.norm_eps,
            act=self.act,
            mlp=self.mlp,
            mlp_norm=self.mlp_norm,
            out_norm=self.attn_norm,
            qk_norm=self.qk_norm,
            qkv_bias=self.qkv_bias,
            proj_bias=self.proj_bias,
            layer_scale=self.layer_scale,
            post_norm=self.post_norm,
            diff_attn=self.diff_attn,
        )

    @property
    def num_tokens(self) -> int:
        """The sequence length the blocks see (patches, plus the class and register tokens)."""
        return self.num_patches + self.num_prefix_tokens

    @property
    def pos_tokens(self) -> int:
        """Rows of the position embedding (the class and register tokens' rows left out with
        no_embed_class)."""
        return self.num_patches if self.no_embed_class else self.num_tokens


# name -> (dim, depth, heads, mlp_ratio, default patch size)
SIZES = {
    "pico": (96, 6, 3, 3.0),  # small-image models for 28-32 px inputs
    "nano": (128, 6, 4, 3.0),
    "tiny": (192, 12, 3, 4.0),
    "small": (384, 12, 6, 4.0),
    "base": (768, 12, 12, 4.0),
    "large": (1024, 24, 16, 4.0),
    "huge": (1280, 32, 16, 4.0),
}
REGISTRY: dict[str, ViTSpec] = {}
for _size, (_d, _l, _h, _r) in SIZES.items():
    for _p in (2, 4, 7, 8, 14, 16, 32):
        REGISTRY[f"vit_{_size}_patch{_p}"] = ViTSpec(
            dim=_d, depth=_l, heads=_h, mlp_ratio=_r, patch_size=_p
        )
    default_patch = {"pico": 4, "nano": 4, "huge": 14}.get(_size, 16)
    REGISTRY[f"vit_{_size}"] = REGISTRY[f"vit_{_size}_patch{default_patch}"]


def model_names() -> list[str]:
    return sorted(REGISTRY)


def kept_patches(num_patches: int, p: float) -> int:
    """Patch tokens a training step keeps under patch dropout of rate p: OpenCLIP's PatchDropout
    count, max(1, int(N x (1 - p))), a fixed number so that shapes are static."""
    return max(1, int(num_patches * (1 - p)))


def drop_patches(x: torch.Tensor, prefix: int, p: float, with_keep: bool = False):
    """FLIP's patch dropout (OpenCLIP's PatchDropout): keep the `prefix` tokens (class, registers)
    and a random subset of kept_patches(N, p) of the N patch tokens per sample, drawn uniformly
    without replacement from the device's default generator (the run's seeded stream) as the top-k
    of Gaussian noise, as OpenCLIP draws them. [B, prefix + N, D] -> [B, prefix + k, D]; with
    `with_keep`, also the kept patches' indices [B, k] (a rotary embedding follows them)."""
    B, T, D = x.shape
    n = T - prefix
    keep = torch.randn(B, n, device=x.device).topk(kept_patches(n, p), dim=-1).indices  # [B, k]
    kept = x[:, prefix:].gather(1, keep.unsqueeze(-1).expand(-1, -1, D))  # [B, k, D]
    out = torch.cat([x[:, :prefix], kept], dim=1) if prefix else kept
    return (out, keep) if with_keep else out


class LayerScaleBlock(Block):
    """A Block with layer scale 1e-5 (CaiT, DeiT III, DINOv2; timm's init_values): the shorthand
    for Block(..., options=BlockOptions(layer_scale=...))."""

    def __init__(self, dim: int, *args, eps: float = 1e-6, act: str = "gelu", **kwargs):
        options = BlockOptions(eps=eps, act=act, layer_scale=1e-5)
        super().__init__(dim, *args, options=options, **kwargs)


class VisionTransformer(nn.Module):
    """Pre-norm ViT. Shapes: image [B, C, H, W] -> tokens [B, T, D] -> logits [B, num_classes].

    `patch_dropout` (set_patch_dropout; 0 = off): in training, after the position embeddings are
    added and before norm_pre (OpenCLIP's ln_pre), only the class and register tokens and a random
    kept_patches(N, p) of the N patch tokens go on to the blocks (drop_patches). Evaluation sees
    every token. It is no parameter and no state-dict key."""

    patch_dropout = 0.0

    def __init__(self, spec: ViTSpec):
        super().__init__()
        if spec.head == "token" and not spec.has_class_token:
            raise ValueError("head='token' needs the class token (class_token=True)")
        if spec.diff_attn and spec.rope:
            raise ValueError("differential attention takes no rope (diff_attn with rope)")
        if spec.embed_norm and spec.stem != "patch":
            raise ValueError("embed_norm=True norms the patch stem's embeddings: stem='patch'")
        if spec.distilled and (spec.head != "token" or spec.reg_tokens):
            raise ValueError("distilled=True reads the class and distillation tokens: head='token'")
        self.spec = spec
        D = spec.dim
        norm = lambda: make_norm(spec.norm, D, spec.norm_eps)  # noqa: E731
        stem = ConvStem if spec.stem == "conv" else PatchEmbed
        self.patch_embed = stem(spec.image_size, spec.patch_size, spec.in_chans, D)
        if spec.pre_norm and isinstance(self.patch_embed, PatchEmbed):  # timm: bias=not pre_norm
            self.patch_embed.proj.register_parameter("bias", None)
        if spec.embed_norm:  # timm's PatchEmbed(norm_layer=...): patch_embed.norm
            self.patch_embed.norm = norm()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if spec.has_class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, D)) if spec.distilled else None
        self.reg_token = (
            nn.Parameter(torch.zeros(1, spec.reg_tokens, D)) if spec.reg_tokens else None
        )
        self.pos_embed = (
            nn.Parameter(torch.zeros(1, spec.pos_tokens, D)) if spec.pos_embed else None
        )
        # a norm before the blocks: timm's pre_norm, and CLIP's image tower (ln_pre)
        self.norm_pre = norm() if spec.pre_norm else nn.Identity()
        # rises with depth
        dpr = [spec.drop_path * i / max(1, spec.depth - 1) for i in range(spec.depth)]
        options = spec.block_options()
        block = {"": Block, "branches": BranchesBlock, "fused": FusedBlock}[spec.parallel]
        self.blocks = nn.ModuleList(
            block(
                D,
                spec.heads,
                spec.mlp_ratio,
                fused_attn=spec.attention == "sdpa",
                drop_path=dpr[i],
                dropout=spec.dropout,
                options=options,
            )
            for i in range(spec.depth)
        )
        self._build_head(spec, norm)
        self.grad_checkpointing = False
        self.reset_parameters()

    def _build_head(self, spec: ViTSpec, norm) -> None:
        """The final norm, the pooling (MAP's attention pool), the classifier(s) and the rope."""
        D = spec.dim
        # fc_norm: the norm moves after the pooling (timm's keys: no `norm`, a `fc_norm`)
        self.norm = norm() if spec.final_norm and not spec.fc_norm else nn.Identity()
        self.attn_pool = (
            AttentionPool(
                D,
                spec.pool_heads or spec.heads,
                spec.pool_mlp_ratio or spec.mlp_ratio,
                norm(),
                spec.pool_act or spec.act,
                spec.attention == "sdpa",
            )
            if spec.head == "map"
            else None
        )
        self.rope = (
            build_rope(spec.rope, D // spec.heads, spec.heads, spec.depth, **spec.rope_options)
            if spec.rope
            else None
        )
        for i, blk in enumerate(self.blocks):  # differential attention: lambda's part by depth
            for m in blk.modules():
                if hasattr(m, "lambda_init"):
                    m.lambda_init = lambda_init_at(i)
        for m in self.blocks.modules():  # what the attention's rotation leaves out, its layout
            if hasattr(m, "rope_prefix"):
                m.rope_prefix = spec.num_prefix_tokens
                m.rope_half = bool(spec.rope_options.get("rotate_half", False))
        self.fc_norm = norm() if spec.final_norm and spec.fc_norm else None
        self.head = nn.Linear(D, spec.num_classes)
        self.head_dist = nn.Linear(D, spec.num_classes) if spec.distilled else None

    def reset_parameters(self) -> None:
        """timm/DeiT-style init: truncated normal(0.02) weights, zero biases, unit norms."""
        if self.pos_embed is not None:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        if self.dist_token is not None:
            nn.init.trunc_normal_(self.dist_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, LayerScale):
                nn.init.constant_(m.gamma, self.spec.layer_scale)
        if self.attn_pool is not None:
            self.attn_pool.reset_parameters()
        if isinstance(self.patch_embed, PatchEmbed):
            w = self.patch_embed.proj.weight  # like a Linear over the flattened patch
            nn.init.trunc_normal_(w.view(w.shape[0], -1), std=0.02)
            if self.patch_embed.proj.bias is not None:
                nn.init.zeros_(self.patch_embed.proj.bias)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def shard_units(self) -> list[nn.Module]:
        """The modules a sharding engine wraps one by one (FSDP2 shards each unit, then the root):
        the transformer blocks (torchtitan's convention: the model names them)."""
        return list(self.blocks)

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        """Tensor parallelism's plan: every block's split layers by full name (layers.tp_plan)."""
        return tp_plan(self, sequence_parallel)

    def no_weight_decay(self) -> set[str]:
        tokens = ("pos_embed", "cls_token", "dist_token", "reg_token")
        rope = {f"rope.{n}" for n in getattr(self.rope, "no_weight_decay", set)()}
        return {t for t in tokens if getattr(self, t) is not None} | rope

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, prefix + N, D]: the patch embeddings with the class, distillation
        and register tokens before them and the position embedding added (timm's _pos_embed)."""
        x = self.patch_embed(x)  # [B, N, D]
        if self.pos_embed is not None and self.spec.no_embed_class:
            x = x + self.pos_embed
        tokens = (self.cls_token, self.dist_token, self.reg_token)
        prefix = [t.expand(x.shape[0], -1, -1) for t in tokens if t is not None]
        if prefix:
            x = torch.cat([*prefix, x], dim=1)  # [B, prefix + N, D]
        if self.pos_embed is not None and not self.spec.no_embed_class:
            x = x + self.pos_embed
        return x

    def rotations(self, keep: torch.Tensor | None = None) -> list:
        """Per block, the rope tensor its attention rotates q and k with (None without a rope): the
        patch grid's (only the tokens patch dropout kept: `keep` [B, k]); "mixed" has one per
        block."""
        if self.rope is None:
            return [None] * len(self.blocks)
        grid = self.spec.image_size // self.spec.patch_size
        emb = self.rope.get_embed((grid, grid))
        if keep is not None:
            emb = keep_rope(emb, keep)
        if self.spec.rope == "mixed":
            return [emb[i] for i in range(len(self.blocks))]
        return [emb] * len(self.blocks)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        keep = None
        if self.patch_dropout and self.training:  # [B, prefix + k, D]
            x, keep = drop_patches(x, self.spec.num_prefix_tokens, self.patch_dropout, True)
        x = self.norm_pre(x)
        for blk, rope in zip(self.blocks, self.rotations(keep)):
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(blk, x, rope=rope, use_reentrant=False)
            else:
                x = blk(x, rope=rope)
        return self.norm(x)  # [B, T, D]

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, D] (timm's pool): the class token's features, the mean of the patch
        tokens or their attention pooling (the class and register tokens left out unless
        pool_prefix)."""
        if self.spec.head == "token":
            return x[:, 0]
        prefix = 0 if self.spec.pool_prefix else self.spec.num_prefix_tokens
        x = x[:, prefix:] if prefix else x
        return self.attn_pool(x) if self.attn_pool is not None else x.mean(dim=1)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.head_dist is not None:  # DeiT's distilled model: the mean of both heads
            if pre_logits:
                return (x[:, 0] + x[:, 1]) / 2
            return (self.head(x[:, 0]) + self.head_dist(x[:, 1])) / 2
        x = self.pool(x)
        if self.fc_norm is not None:
            x = self.fc_norm(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def set_patch_dropout(model: nn.Module, p: float) -> nn.Module:
    """Every ViT of `model` (a classifier, a CLIP image tower) drops patch tokens at rate p in
    training (0 <= p < 1; 0 = every token, the model exactly as without it)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"patch dropout must be in [0, 1), got {p}")
    for m in model.modules():
        if isinstance(m, VisionTransformer):
            m.patch_dropout = float(p)
    return model


def did_you_mean(name: str, options) -> str:
    """' (did you mean 'X'?)' for the closest registry name (models import only torch, the
    standard library and their own package)."""
    m = difflib.get_close_matches(name, list(options), n=1, cutoff=0.0)
    return f" (did you mean '{m[0]}'?)" if m else ""


def resolve_spec(arch: str, **overrides) -> ViTSpec:
    """Registry spec with overrides; zero/None overrides keep the registry value."""
    if arch not in REGISTRY:
        raise KeyError(f"unknown model '{arch}'{did_you_mean(arch, REGISTRY)}")
    return replace(
        REGISTRY[arch], **{k: v for k, v in overrides.items() if v not in (None, 0, 0.0)}
    )


def vit(arch: str, **overrides) -> VisionTransformer:
    return VisionTransformer(resolve_spec(arch, **overrides))
