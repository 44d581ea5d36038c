"""OpenCLIP's CLIPs with a timm image tower (its TimmModel) <-> vitscale's CLIP: SigLIP, SigLIP 2,
EVA02-CLIP, EVA01-CLIP and PE-Core, and the text towers they come with.

OpenCLIP's TimmModel holds `visual.trunk` = timm.create_model(timm_model_name, num_classes=N,
global_pool=timm_pool) with N = embed_dim for timm_proj=None (timm's head, a Linear with a bias, is
the projection: EVA-CLIP, PE-Core) or 0 for timm_proj="none" (the pooled feature is the embedding:
SigLIP); its other heads (timm_proj "linear" / "mlp", attention pools) are refused. The trunk is
read by interop/timm/vision_transformer.py (timm's vision_transformer, deit and eva families) as vitscale's ViT;
ClipSpec.vision_timm keeps its architecture name for the export. The number of blocks is the
weights' (OpenCLIP's configuration does not say it; a file of the architecture has its depth).

These models are OpenCLIP's CustomTextCLIP: the text tower's keys are under `text.` (normalize
removes the prefix, the export writes it back); its options come from text_cfg: heads, pool_type,
no_causal_mask, norm_kwargs' eps, act_kwargs {"approximate": "tanh"} (GELU-tanh, SigLIP 2),
proj_bias (text_projection is then a Linear: weight [E, W] and bias) and proj_type "none" (no
projection); init_logit_bias gives ClipSpec.logit_bias (the value is in the weights). The
tokenizer is not vitscale's business here: the weights load and export whatever it is (model.init
refuses a tokenizer other than CLIP's BPE: convert._refuse_tokenizer). Nothing here imports
open_clip or timm.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...errors import UserError
from ...models.clip import ClipSpec
from ...models.text import TextSpec
from ...models.vit import ViTSpec
from ..files import first_keys
from ..timm.eva import vitscale_to_eva
from ..timm.vision_transformer import (
    arch_entry,
    arch_pretrained_cfg,
    timm_state_dict,
    timm_vit_spec,
)
from .layout import BLOCK_MAP, depth_of, ratio

TRUNK = "visual.trunk."
POOLS = ("token", "map", "avg")  # timm's global_pool values vitscale's ViT computes (its head)
TEXT_REFUSED = (
    ("ls_init_value", "layer scale in the text tower"),
    ("embed_cls", "a text class token"),
    ("output_tokens", "token outputs (CoCa)"),
    ("attentional_pool", "attentional pooling (CoCa)"),
    ("qk_norm", "q/k normalization"),
    ("scaled_cosine_attn", "scaled cosine attention"),
    ("scale_heads", "per-head attention scales"),
    ("scale_attn_inner", "scaled attention norms"),
    ("scale_attn", "scaled attention norms"),
    ("scale_fc", "a LayerNorm inside the MLP"),
)
TANH = ({"approximate": "tanh"}, "gelu_tanh")


def has_timm_tower(mc: dict | None) -> bool:
    return bool(((mc or {}).get("vision_cfg") or {}).get("timm_model_name"))


def _no(where: str, what: str, key: str, value) -> UserError:
    return UserError(
        f"OpenCLIP: {where}: {what} ({key}={value!r}) is not implemented by vitscale's CLIP"
    )


def refuse_timm_config(mc: dict, where: str) -> None:
    """One line for the first thing a timm-tower configuration says that vitscale does not compute."""
    v, t = mc["vision_cfg"], mc.get("text_cfg") or {}
    name = v["timm_model_name"]
    try:
        arch_entry(name, "vision_cfg.timm_model_name")
    except UserError:
        raise _no(
            where, "a timm image tower other than timm's ViTs", "vision_cfg.timm_model_name", name
        ) from None
    proj, pool = v.get("timm_proj", "linear"), v.get("timm_pool", "avg")
    if proj not in (None, "", "none"):
        raise _no(where, "a projection head after the timm trunk", "vision_cfg.timm_proj", proj)
    if pool not in POOLS:
        raise _no(where, "this timm image pooling", "vision_cfg.timm_pool", pool)
    if t.get("hf_model_name"):
        raise _no(where, "a Hugging Face text tower", "text_cfg.hf_model_name", t["hf_model_name"])
    if mc.get("multimodal_cfg") is not None:
        raise _no(where, "CoCa's text decoder", "multimodal_cfg", "...")
    for key, what in TEXT_REFUSED:
        if t.get(key):
            raise _no(where, what, f"text_cfg.{key}", t[key])
    if t.get("block_type") not in (None, "default"):
        raise _no(
            where, "OpenCLIP's custom attention block", "text_cfg.block_type", t["block_type"]
        )
    if t.get("act_kwargs") and t["act_kwargs"] != TANH[0]:
        raise _no(
            where, "an activation with these arguments", "text_cfg.act_kwargs", t["act_kwargs"]
        )
    if set(t.get("norm_kwargs") or {}) - {"eps"}:
        raise _no(
            where, "a LayerNorm with these arguments", "text_cfg.norm_kwargs", t["norm_kwargs"]
        )
    if t.get("pool_type", "argmax") not in ("argmax", "eos", "last", "first"):
        raise _no(where, "text token outputs", "text_cfg.pool_type", t["pool_type"])
    if t.get("proj_type", "linear") not in ("linear", "none"):
        raise _no(where, "this text projection", "text_cfg.proj_type", t["proj_type"])


def trunk_config(mc: dict, depth: int) -> dict:
    """timm's hub config that builds what OpenCLIP's TimmModel builds (the trunk), `depth` blocks."""
    v = mc["vision_cfg"]
    proj = v.get("timm_proj", "linear")
    args = {
        "num_classes": 0 if proj == "none" else mc["embed_dim"],
        "global_pool": v.get("timm_pool", "avg"),
        "depth": depth,
    }
    return {"architecture": v["timm_model_name"], "model_args": args}


def _trunk(sd: dict) -> dict:
    return {k[len(TRUNK) :]: t for k, t in sd.items() if k.startswith(TRUNK)}


def _vision(sd: dict, mc: dict, where: str) -> ViTSpec:
    trunk = _trunk(sd)
    other = [k for k in sd if k.startswith("visual.") and not k.startswith(TRUNK)]
    if other:
        raise UserError(f"OpenCLIP: {where}: unknown image-tower keys {first_keys(other)}")
    depth = depth_of(trunk, "blocks.")
    cfg = trunk_config(mc, depth)
    try:
        spec = timm_vit_spec(trunk, num_classes=mc["embed_dim"], config=cfg)
    except UserError as e:
        raise UserError(f"OpenCLIP: {where}: the timm image tower: {e}") from None
    if cfg["model_args"]["num_classes"] == 0:
        if spec.dim != mc["embed_dim"]:
            raise UserError(
                f"OpenCLIP: {where}: the timm image tower is {spec.dim} wide without a projection "
                f"(timm_proj='none'), embed_dim is {mc['embed_dim']}"
            )
        spec = replace(spec, num_classes=0)
    elif "head.weight" not in trunk:
        raise UserError(f"OpenCLIP: {where}: the timm image tower has no head (visual.trunk.head)")
    return spec


def _text(sd: dict, mc: dict, where: str) -> TextSpec:
    t = mc.get("text_cfg") or {}
    vocab, width = _shape(sd, "token_embedding.weight", where)
    context = _shape(sd, "positional_embedding", where)[0]
    depth = depth_of(sd, "transformer.resblocks.")
    hidden = _shape(sd, "transformer.resblocks.0.mlp.c_fc.weight", where)[0]
    if "text_projection" in sd:
        proj, bias, embed = "linear", False, _shape(sd, "text_projection", where)[1]
    elif "text_projection.weight" in sd:
        proj, bias = "linear", "text_projection.bias" in sd
        embed = _shape(sd, "text_projection.weight", where)[0]
    else:
        proj, bias, embed = "none", False, width
    said = {
        "text width": (t.get("width", 512), width),
        "text layers": (t.get("layers", 12), depth),
        "context length": (t.get("context_length", 77), context),
        "vocabulary": (t.get("vocab_size", 49408), vocab),
        "text MLP width": (int(t.get("width", 512) * t.get("mlp_ratio", 4.0)), hidden),
        "embed_dim": (mc["embed_dim"], embed),
        "text projection": (
            "none" if t.get("proj_type", "linear") == "none" else "linear",
            proj,
        ),
        "text projection bias": (bool(t.get("proj_bias")) and proj == "linear", bias),
    }
    wrong = [f"{k} {a} (the weights: {b})" for k, (a, b) in said.items() if a != b]
    if wrong:
        raise UserError(
            f"OpenCLIP: {where} does not describe these weights: {', '.join(wrong[:3])}"
        )
    heads = t.get("heads", 8)
    if width % heads:
        raise UserError(f"OpenCLIP: text width {width} is not divisible by {heads} heads")
    act = "quick_gelu" if mc.get("quick_gelu") else "gelu"
    if t.get("act_kwargs") == TANH[0]:  # (with quick_gelu: refused by timm_clip_spec)
        act = "gelu_tanh"
    pool = t.get("pool_type", "argmax")
    return TextSpec(
        vocab_size=vocab,
        context_length=context,
        dim=width,
        depth=depth,
        heads=heads,
        mlp_ratio=ratio(hidden, width),
        embed_dim=embed,
        norm_eps=float((t.get("norm_kwargs") or {}).get("eps", 1e-5)),
        act=act,
        causal=not t.get("no_causal_mask", False),
        pool=pool,
        eos_id=int(t.get("eos_id", 2)) if pool == "eos" else 0,
        proj=proj,
        proj_bias=bias,
    )


def _shape(sd: dict, key: str, where: str) -> tuple:
    if key not in sd:
        raise UserError(f"OpenCLIP: {where}: missing key {key}")
    return tuple(sd[key].shape)


def timm_clip_spec(sd: dict, mc: dict, where: str) -> ClipSpec:
    """The ClipSpec of an OpenCLIP timm-tower CLIP's (normalized) state dict and its model_cfg."""
    refuse_timm_config(mc, where)
    if act := (mc.get("text_cfg") or {}).get("act_kwargs"):
        if mc.get("quick_gelu"):
            raise _no(where, "QuickGELU with arguments", "text_cfg.act_kwargs", act)
    vision, text = _vision(sd, mc, where), _text(sd, mc, where)
    bias = mc.get("init_logit_bias")
    if (bias is not None) != ("logit_bias" in sd):
        raise UserError(
            f"OpenCLIP: {where} {'says' if bias is not None else 'does not say'} init_logit_bias, "
            f"the weights {'have' if 'logit_bias' in sd else 'have no'} logit_bias"
        )
    return ClipSpec(
        vision=vision,
        text=text,
        embed_dim=mc["embed_dim"],
        logit_bias=None if bias is None else float(bias),
        vision_timm=mc["vision_cfg"]["timm_model_name"],
    )


# -- the weights -----------------------------------------------------------------------------------
def text_key_map(spec: ClipSpec) -> dict[str, str]:
    """OpenCLIP key (normalized: no `text.` prefix) -> vitscale key, the text tower and the logit
    parameters."""
    t = spec.text
    m = {
        "token_embedding.weight": "text.token_embedding.weight",
        "positional_embedding": "text.positional_embedding",
        "ln_final.weight": "text.ln_final.weight",
        "ln_final.bias": "text.ln_final.bias",
        "logit_scale": "logit_scale",
    }
    if spec.logit_bias is not None:
        m["logit_bias"] = "logit_bias"
    if t.proj == "linear" and t.proj_bias:
        m["text_projection.weight"], m["text_projection.bias"] = (
            "text.proj.weight",
            "text.proj.bias",
        )
    elif t.proj == "linear":
        m["text_projection"] = "text.proj.weight"  # [W, E], transposed
    for i in range(t.depth):
        for a, b in BLOCK_MAP:
            names = (
                [(a, b)]
                if a.startswith("attn.in_proj")
                else [(f"{a}.weight", f"{b}.weight"), (f"{a}.bias", f"{b}.bias")]
            )
            for x, y in names:
                m[f"transformer.resblocks.{i}.{x}"] = f"text.blocks.{i}.{y}"
    return m


def from_timm_tower(sd: dict, spec: ClipSpec, ours: dict) -> dict[str, torch.Tensor]:
    """OpenCLIP's (normalized) state dict as the spec's model's (fp32 CPU copies); `ours`: the
    model's state dict (shapes)."""
    cfg = trunk_config(
        {"vision_cfg": {"timm_model_name": spec.vision_timm}, "embed_dim": 0}, spec.vision.depth
    )
    trunk = timm_state_dict(_trunk(sd), cfg)
    out = {f"visual.{k}": v for k, v in trunk.items()}
    kmap = text_key_map(spec)
    unknown = set(sd) - set(kmap) - {k for k in sd if k.startswith(TRUNK)}
    missing = set(kmap) - set(sd)
    if unknown or missing:
        parts = ([f"unknown keys {first_keys(unknown)}"] if unknown else []) + (
            [f"missing keys {first_keys(missing)}"] if missing else []
        )
        raise UserError(f"OpenCLIP: {'; '.join(parts)}")
    for theirs, name in kmap.items():
        out[name] = sd[theirs].t() if theirs == "text_projection" else sd[theirs]
    out = {k: v.detach().to("cpu", torch.float32, copy=True).contiguous() for k, v in out.items()}
    for k in ("logit_scale", "logit_bias"):
        if k in out and k in ours:
            out[k] = out[k].reshape(ours[k].shape)
    extra, lacking = set(out) - set(ours), set(ours) - set(out)
    if extra or lacking:
        raise UserError(
            f"OpenCLIP: the timm image tower's keys do not fit the model: "
            f"{first_keys(extra or lacking)}"
        )
    for k, v in out.items():
        if v.shape != ours[k].shape:
            raise UserError(
                f"OpenCLIP: {k} has shape {tuple(v.shape)}, the model expects {tuple(ours[k].shape)}"
            )
    return out


def to_timm_tower(ours: dict, spec: ClipSpec) -> dict[str, torch.Tensor]:
    """vitscale's CLIP state dict (fp32 CPU) as OpenCLIP's CustomTextCLIP of open_clip_config(spec)
    loads it: `visual.trunk.*` in timm's names, the text tower under `text.`."""
    check_exportable(spec)
    trunk = {k[len("visual.") :]: v for k, v in ours.items() if k.startswith("visual.")}
    module, _, args = arch_entry(spec.vision_timm, "export to OpenCLIP")
    if module == "eva":  # the arch's attention layout (qkv_fused, attn_type): the names
        trunk = vitscale_to_eva(trunk, args)
    out = {f"{TRUNK}{k}": v.contiguous() for k, v in trunk.items()}
    for theirs, name in text_key_map(spec).items():
        v = ours[name]
        if theirs == "text_projection":
            v = v.t()
        elif theirs in ("logit_scale", "logit_bias"):
            v = v.reshape(())
        out[theirs if theirs.startswith("logit_") else f"text.{theirs}"] = v.contiguous()
    return out


def check_exportable(spec: ClipSpec) -> int:
    """One line where OpenCLIP's TimmModel of spec.vision_timm cannot hold the image tower: timm
    builds the architecture at its own image size (its patch grid) and input channels, with its
    pooling. Returns that image size (OpenCLIP's vision_cfg.image_size)."""
    v = spec.vision
    _, _, args = arch_entry(spec.vision_timm, "export to OpenCLIP")
    size = args.get("img_size") or (
        arch_pretrained_cfg(spec.vision_timm).get("input_size") or [224]
    )
    size = size[-1] if isinstance(size, (list, tuple)) else size  # (timm's: the pretrained cfg's)
    for what, theirs, mine in (
        ("a patch grid of", size // v.patch_size, v.image_size // v.patch_size),
        ("input channels", args.get("in_chans", 3), v.in_chans),
    ):
        if theirs != mine:
            raise UserError(
                f"export to OpenCLIP: OpenCLIP's TimmModel builds {spec.vision_timm} with {what} "
                f"{theirs}, the model has {mine}"
            )
    if v.head not in POOLS or v.distilled:
        raise UserError(f"export to OpenCLIP: the image tower's head '{v.head}' has no timm_pool")
    act = spec.text.act
    if act not in ("gelu", "quick_gelu", "gelu_tanh"):
        raise UserError(f"export to OpenCLIP: the text activation {act} has no text_cfg")
    return size


def timm_model_cfg(spec: ClipSpec) -> dict:
    """OpenCLIP's model_cfg (CustomTextCLIP) that computes the spec's function."""
    size = check_exportable(spec)
    v, t = spec.vision, spec.text
    text = {
        "context_length": t.context_length,
        "vocab_size": t.vocab_size,
        "width": t.dim,
        "heads": t.heads,
        "layers": t.depth,
        "mlp_ratio": t.mlp_ratio,
        "norm_kwargs": {"eps": t.norm_eps},
    }
    if not t.causal:
        text["no_causal_mask"] = True
    if t.pool != "argmax":
        text["pool_type"] = t.pool
    if t.pool == "eos":
        text["eos_id"] = t.eos_id
    if t.act == "gelu_tanh":
        text["act_kwargs"] = dict(TANH[0])
    if t.proj == "none":
        text["proj_type"] = "none"
    elif t.proj_bias:
        text["proj_bias"] = True
    cfg = {
        "embed_dim": spec.embed_dim,
        "custom_text": True,
        "quick_gelu": t.act == "quick_gelu",
        "vision_cfg": {
            "timm_model_name": spec.vision_timm,
            "timm_model_pretrained": False,
            "timm_pool": v.head,
            "timm_proj": "none" if not v.num_classes else None,
            "image_size": size,
        },
        "text_cfg": text,
    }
    if spec.logit_bias is not None:
        cfg["init_logit_bias"] = spec.logit_bias
    return cfg
