"""timm's `eva` family (EVA02, DINOv3, Perception Encoder, the vit_*_rope_* models, ...) <-> vitscale's
ViT. Nothing here imports timm.

timm's Eva is a pre-norm ViT whose blocks vitscale's ViTSpec names one by one: a 2-D rotary
embedding (rope, rope_options: models/rope.py), no absolute position embedding (pos_embed=False),
SwiGLU split (scale_mlp: with its inner norm) or packed, the attention's inner norm
(scale_attn_inner -> attn_norm), q/k norm, registers, layer scale, the MAP head (global_pool="map":
PE, over every token, prefix included, its own head count and MLP ratio, GELU), a norm before the
blocks (use_pre_transformer_norm, and no patch bias), and fc_norm / the final norm.

The state dicts differ in a few names, converted both ways:
    blocks.N.gamma_1 / gamma_2            <-> blocks.N.ls1.gamma / ls2.gamma
    blocks.N.attn.q_bias, v_bias          <-> blocks.N.attn.qkv.bias = [q_bias; 0; v_bias]
    blocks.N.attn.{q,k,v}_proj.{weight,bias} <-> blocks.N.attn.qkv.{weight,bias} (stacked)
EVA's attention has no key bias. A key bias adds q.b_k to every logit of a query, which softmax
ignores, so its zero rows in qkv.bias compute EVA's function, and the export drops them (the same
function, exactly, whatever training left there).
"""

from __future__ import annotations

import re

import torch

from ...errors import UserError
from ...models.rope import rope_from_timm_kwargs, rope_to_timm_kwargs
from ...models.vit import ViTSpec
from .args import mlp_ratio_for, norm_eps

# timm 1.0.31's Eva arguments and their defaults (norm_layer: timm's LayerNorm, eps 1e-6)
EVA_DEFAULTS = dict(
    img_size=224,
    patch_size=16,
    in_chans=3,
    num_classes=1000,
    global_pool="avg",
    embed_dim=768,
    depth=12,
    num_heads=12,
    num_kv_heads=None,
    qkv_bias=True,
    qkv_fused=True,
    qk_norm=False,
    mlp_ratio=4.0,
    swiglu_mlp=False,
    swiglu_align_to=0,
    scale_mlp=False,
    scale_attn_inner=False,
    attn_type="eva",
    norm_layer=None,
    init_values=None,
    attn_only_layer_scale=False,
    class_token=True,
    num_reg_tokens=0,
    no_embed_class=False,
    use_abs_pos_emb=True,
    use_rot_pos_emb=False,
    rope_type="cat",
    rope_grid_offset=0.0,
    rope_grid_indexing="ij",
    rope_temperature=10000.0,
    rope_rotate_half=False,
    rope_shift_coords=None,
    rope_jitter_coords=None,
    rope_rescale_coords=None,
    rope_mrope_section=None,
    use_post_norm=False,
    use_pre_transformer_norm=False,
    use_post_transformer_norm=None,
    use_fc_norm=None,
    attn_pool_num_heads=None,
    attn_pool_mlp_ratio=None,
    dynamic_img_size=False,
    dynamic_img_pad=False,
    ref_feat_shape=None,
)
# arguments that change nothing in the function at the weights' own image size
NEUTRAL = {
    "drop_rate",
    "pos_drop_rate",
    "patch_drop_rate",
    "proj_drop_rate",
    "attn_drop_rate",
    "drop_path_rate",
    "head_init_scale",
    "dynamic_img_size",
    "dynamic_img_pad",
    "swiglu_align_to",  # the hidden width comes from the weights
    "device",
    "dtype",
    "pretrained_strict",
    "out_indices",
}


def _refuse(label: str, what: str) -> UserError:
    return UserError(f"timm Eva{label}: {what} is not implemented by vitscale's ViT")


def _check(a: dict, label: str) -> None:
    """One line for an argument or combination vitscale's ViT does not compute."""
    unknown = sorted(set(a) - set(EVA_DEFAULTS) - NEUTRAL)
    if unknown:
        raise UserError(f"timm Eva{label}: the argument {unknown[0]}={a[unknown[0]]!r} is unknown")
    if a["num_kv_heads"] is not None:
        raise _refuse(label, "grouped-query attention (num_kv_heads)")
    if a["attn_type"] not in ("eva", "rope"):
        raise _refuse(label, f"attn_type={a['attn_type']!r}")
    if a["attn_only_layer_scale"]:
        raise _refuse(label, "layer scale on the attention branch only (attn_only_layer_scale)")
    if a["global_pool"] not in ("avg", "token", "map"):
        raise _refuse(label, f"global_pool={a['global_pool']!r}")
    if a["use_post_norm"] and a["init_values"] is not None:
        raise _refuse(label, "layer scale in post-norm blocks")


def _norms(a: dict, label: str) -> dict:
    """fc_norm / final norm as Eva activates them (use_fc_norm, use_post_transformer_norm)."""
    fc = a["global_pool"] == "avg" if a["use_fc_norm"] is None else bool(a["use_fc_norm"])
    post = (
        not fc if a["use_post_transformer_norm"] is None else bool(a["use_post_transformer_norm"])
    )
    if fc and post:
        raise _refuse(label, "both a final norm and fc_norm")
    return dict(fc_norm=fc, final_norm=fc or post)


def _mlp(a: dict, dim: int, hidden: int) -> dict:
    """Eva's MLP: SwiGLU split with its inner norm (scale_mlp or swiglu_align_to), packed SwiGLU
    (fc1 of 2 x hidden) otherwise; the plain MLP with an optional inner norm. `hidden`: the
    weights' hidden_features (fc1's rows, fc1_x's for the split SwiGLU)."""
    if not a["swiglu_mlp"]:
        return dict(mlp="mlp", mlp_norm=bool(a["scale_mlp"]), act="gelu")
    split = bool(a["scale_mlp"]) or bool(a["swiglu_align_to"])
    return dict(
        mlp="swiglu" if split else "swiglu_packed", mlp_norm=bool(a["scale_mlp"]), act="silu"
    )


def eva_spec(sd: dict, args: dict, label: str, facts: tuple, num_classes: int) -> ViTSpec:
    """The ViTSpec of timm's Eva with these arguments, its weights converted by eva_to_vitscale
    (`sd`), `facts` = (dim, in_chans, patch, depth, hidden, norm kind and eps, head count)."""
    a = {**EVA_DEFAULTS, **args}
    _check(a, label)
    dim, in_chans, patch, depth, hidden, (norm, eps), heads = facts
    try:
        rope = rope_from_timm_kwargs(a)
    except ValueError as e:
        raise UserError(f"timm Eva{label}: {e}") from None
    token, reg = bool(a["class_token"]), int(a["num_reg_tokens"] or 0)
    pool = a["global_pool"]
    size = a["img_size"] if isinstance(a["img_size"], int) else a["img_size"][0]
    grid = size // patch
    if "pos_embed" in sd:
        rows = sd["pos_embed"].shape[1] - (0 if a["no_embed_class"] else int(token) + reg)
        grid = round(rows**0.5)
    return ViTSpec(
        image_size=grid * patch,
        patch_size=patch,
        in_chans=in_chans,
        num_classes=num_classes,
        dim=dim,
        depth=depth,
        heads=heads,
        mlp_ratio=mlp_ratio_for(dim, hidden, None),
        head={"token": "token", "map": "map"}.get(pool, "pool"),
        class_token=None if token == (pool == "token") else token,
        reg_tokens=reg,
        no_embed_class=bool(a["no_embed_class"]),
        pos_embed=bool(a["use_abs_pos_emb"]),
        layer_scale=float(a["init_values"] or 0.0),
        qkv_bias="blocks.0.attn.qkv.bias" in sd,
        qk_norm=bool(a["qk_norm"]),
        attn_norm=bool(a["scale_attn_inner"]),
        pre_norm=bool(a["use_pre_transformer_norm"]),
        post_norm=bool(a["use_post_norm"]),
        norm=norm,
        norm_eps=eps,
        pool_prefix=pool == "map",
        pool_heads=int(a["attn_pool_num_heads"] or 0),
        pool_mlp_ratio=float(a["attn_pool_mlp_ratio"] or 0.0),
        pool_act="gelu" if pool == "map" else "",
        rope=rope[0] if rope else "",
        rope_options=rope[1] if rope else {},
        **_mlp(a, dim, hidden),
        **_norms(a, label),
    )


def eva_to_vitscale(sd: dict) -> dict:
    """timm Eva's state dict in vitscale's names (the module docstring's table)."""
    out, parts = {}, {}
    for k, v in sd.items():
        m = re.fullmatch(r"(blocks\.\d+\.)(gamma_[12]|attn\.(?:q_bias|v_bias|[qkv]_proj\.\w+))", k)
        if not m:
            out[k] = v
        elif m.group(2).startswith("gamma_"):
            out[f"{m.group(1)}ls{m.group(2)[-1]}.gamma"] = v
        else:
            parts.setdefault(m.group(1), {})[m.group(2)] = v
    for block, p in parts.items():
        if "attn.q_proj.weight" in p:
            w = [p[f"attn.{n}_proj.weight"] for n in "qkv"]
            out[f"{block}attn.qkv.weight"] = torch.cat(w)
        q, v = (
            p.get("attn.q_bias", p.get("attn.q_proj.bias")),
            p.get("attn.v_bias", p.get("attn.v_proj.bias")),
        )
        if q is not None and v is not None:
            k = p.get("attn.k_proj.bias", torch.zeros_like(q))
            out[f"{block}attn.qkv.bias"] = torch.cat([q, k, v])
    return out


def vitscale_to_eva(sd: dict, args: dict) -> dict:
    """vitscale's state dict in timm Eva's names for an Eva built with `args` (qkv_fused, attn_type);
    the key bias EVA's attention lacks is dropped (softmax ignores it: the module docstring)."""
    a = {**EVA_DEFAULTS, **args}
    out = {}
    for k, v in sd.items():
        m = re.fullmatch(r"(blocks\.\d+\.)(ls[12]\.gamma|attn\.qkv\.(weight|bias))", k)
        if not m:
            out[k] = v
        elif m.group(2).startswith("ls"):
            out[f"{m.group(1)}gamma_{m.group(2)[2]}"] = v
        elif a["qkv_fused"] and m.group(3) == "weight":
            out[k] = v
        elif a["qkv_fused"]:  # EvaAttention: q_bias, v_bias; AttentionRope: qkv.bias whole
            if a["attn_type"] == "rope":
                out[k] = v
            else:
                q, _, vb = v.chunk(3)
                out[f"{m.group(1)}attn.q_bias"], out[f"{m.group(1)}attn.v_bias"] = q, vb
        else:
            for n, part in zip("qkv", v.chunk(3)):
                if m.group(3) == "weight" or n != "k" or a["attn_type"] == "rope":
                    out[f"{m.group(1)}attn.{n}_proj.{m.group(3)}"] = part
    return {k: v.contiguous() for k, v in out.items()}


def _check_exportable(spec: ViTSpec, where: str) -> None:
    """One line for what of the spec no Eva argument expresses."""
    for bad, what in (
        (spec.distilled, "a distillation token"),
        (spec.embed_norm, "a patch-embedding norm"),
        (not spec.proj_bias, "projections without biases"),
        (spec.norm != "layernorm", "RMSNorm"),
        (spec.head == "map" and not spec.pool_prefix, "MAP over the patch tokens only"),
        (spec.head == "pool" and spec.pool_prefix, "an average over the prefix tokens too"),
        (spec.mlp == "swiglu_packed" and spec.mlp_norm, "the packed SwiGLU with an inner norm"),
        (spec.stem != "patch", "the conv stem"),
        ((spec.pool_act or spec.act) != "gelu" and spec.head == "map", "a MAP MLP without GELU"),
    ):
        if bad:
            raise UserError(f"{where}: {what} has no Eva argument")


def eva_kwargs(spec: ViTSpec) -> dict:
    """The Eva arguments that build the function of `spec` (all of them but norm_layer, which the
    chosen architecture gives: eva_export_arch). One line for what Eva cannot express."""
    where = "export to timm's Eva"
    _check_exportable(spec, where)
    swiglu = spec.mlp != "mlp"
    hidden = int(spec.dim * spec.mlp_ratio) // (2 if spec.mlp == "swiglu_packed" else 1)
    if (spec.act != "silu") if swiglu else (spec.act != "gelu"):
        raise UserError(f"{where}: Eva's MLP takes {'SiLU' if swiglu else 'GELU'}, not {spec.act}")
    out = dict(
        img_size=spec.image_size,
        patch_size=spec.patch_size,
        in_chans=spec.in_chans,
        num_classes=spec.num_classes,
        global_pool={"token": "token", "map": "map"}.get(spec.head, "avg"),
        embed_dim=spec.dim,
        depth=spec.depth,
        num_heads=spec.heads,
        qkv_bias=spec.qkv_bias,
        qkv_fused=True,
        qk_norm=spec.qk_norm,
        mlp_ratio=mlp_ratio_for(spec.dim, hidden),
        swiglu_mlp=swiglu,
        scale_mlp=spec.mlp_norm,
        # the split SwiGLU without its norm: Eva builds it for any alignment; 1 keeps the width
        swiglu_align_to=1 if spec.mlp == "swiglu" and not spec.mlp_norm else 0,
        scale_attn_inner=spec.attn_norm,
        attn_type="rope",  # a qkv bias whole: vitscale's attention (a zero key bias is EVA's)
        init_values=spec.layer_scale or None,
        class_token=spec.has_class_token,
        num_reg_tokens=spec.reg_tokens,
        no_embed_class=spec.no_embed_class,
        use_abs_pos_emb=spec.pos_embed,
        use_post_norm=spec.post_norm,
        use_pre_transformer_norm=spec.pre_norm,
        use_post_transformer_norm=spec.final_norm and not spec.fc_norm,
        use_fc_norm=spec.final_norm and spec.fc_norm,
        attn_pool_num_heads=spec.pool_heads or None,
        attn_pool_mlp_ratio=spec.pool_mlp_ratio or None,
    )
    if spec.rope:
        try:
            out.update(rope_to_timm_kwargs(spec.rope, spec.rope_options))
        except ValueError as e:
            raise UserError(f"{where}: {e}") from None
    if int(spec.dim * out["mlp_ratio"]) != hidden:
        raise UserError(f"{where}: no mlp_ratio gives the hidden width {hidden}")
    return out


def uses_eva(spec: ViTSpec) -> bool:
    """Whether timm's Eva, not its VisionTransformer, is the model to export `spec` to: a rotary
    embedding, or a MAP head as Eva's (over every token, its own heads or ratio)."""
    return (
        bool(spec.rope)
        or bool(spec.pool_heads or spec.pool_mlp_ratio)
        or (spec.head == "map" and spec.pool_prefix and spec.pool_act == "gelu")
    )


def eva_export_arch(spec: ViTSpec, kwargs: dict) -> str:
    """An eva architecture whose norm_layer (what no JSON argument gives) has the spec's eps, and
    which sets none of the arguments `kwargs` (eva_kwargs) leaves at None: timm.create_model drops
    None arguments, so the entry point's own value would stay."""
    from .archs import ARCHS

    unset = {k for k, v in kwargs.items() if v is None}
    for name, (module, _, args) in ARCHS.items():
        if (
            module == "eva"
            and norm_eps(args.get("norm_layer")) == spec.norm_eps
            and not unset & set(args)
        ):
            return name
    raise UserError(
        f"export to timm's Eva: no eva architecture has LayerNorm eps {spec.norm_eps:g}"
    )
