"""OpenCLIP's ViT CLIP weights <-> vitscale's CLIP.

OpenCLIP's `CLIP` (open_clip.create_model("ViT-B-32"), "ViT-B-16", "ViT-L-14", their
"-quickgelu" variants and the OpenAI weights) computes the same function as vitscale's CLIP with
the options below; the keys map one to one, transposing the two bare projection matrices:

    visual.conv1.weight                         visual.patch_embed.proj.weight   (patch_bias=False)
    visual.class_embedding [W]                  visual.cls_token [1, 1, W]
    visual.positional_embedding [N+1, W]        visual.pos_embed [1, N+1, W]
    visual.ln_pre                               visual.norm_pre                  (ln_pre=True)
    visual.transformer.resblocks.i.ln_1/ln_2    visual.blocks.i.norm1/norm2
      .attn.in_proj_weight/bias (q, k, v)         .attn.qkv.weight/bias
      .attn.out_proj                              .attn.proj
      .mlp.c_fc / .mlp.c_proj                     .mlp.fc1 / .mlp.fc2
    visual.ln_post                              visual.norm
    visual.proj [W, E]                          visual.head.weight [E, W]        (proj_bias=False)
    token_embedding, positional_embedding,      text.token_embedding, text.positional_embedding,
    transformer.resblocks.i.*, ln_final         text.blocks.i.*, text.ln_final
    text_projection [W, E]                      text.proj.weight [E, W]
    logit_scale []                              logit_scale [1]

OpenCLIP's LayerNorms use torch's eps 1e-5 (vitscale's 1e-6: vision_norm_eps / TextSpec.norm_eps)
and its text features are taken at the argmax token, as vitscale's are. What the weights do not
hold: the activation (QuickGELU for OpenAI's models and the "-quickgelu" configurations, else
GELU: `quick_gelu`) and the head counts (OpenCLIP's rule for its ViT configurations: width // 64 in
both towers, unless given). CustomTextCLIP's layout (the text tower under `text.`) is read too.
Variants vitscale does not implement (attentional pooling, layer scale, q/k norm, SigLIP's
logit_bias, timm or ResNet image towers, Hugging Face text towers) are refused with the keys that
show them. Nothing here imports open_clip.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace

import torch

from ..errors import UserError
from .files import first_keys, refuse_unsupported
from ..models.clip import CLIP, ClipSpec
from ..models.text import TextSpec
from ..models.vit import ViTSpec

BLOCK_MAP = (("ln_1", "norm1"), ("attn.in_proj_weight", "attn.qkv.weight"), ("attn.in_proj_bias", "attn.qkv.bias"),
             ("attn.out_proj", "attn.proj"), ("ln_2", "norm2"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2"))
UNSUPPORTED = {"attn_pool": "attentional pooling (CoCa)", ".ls_1.": "layer scale", ".ls_2.": "layer scale",
               ".ln_q.": "q/k normalization", ".ln_k.": "q/k normalization", "logit_bias": "SigLIP's logit_bias",
               "visual.trunk.": "a timm image tower", "visual.layer1.": "a ResNet image tower",
               "text.transformer.embeddings": "a Hugging Face text tower", "cls_emb": "a text class token",
               ".ln_attn.": "scaled attention norms", ".ln_inner.": "scaled attention norms"}
OPENAI_EXTRAS = ("input_resolution", "context_length", "vocab_size")  # in OpenAI's original files



def _normalize(sd: dict) -> dict:
    """OpenCLIP's CLIP layout: CustomTextCLIP's `text.` prefix removed, OpenAI's metadata dropped."""
    if "text.token_embedding.weight" in sd and "token_embedding.weight" not in sd:
        sd = {k[len("text."):] if k.startswith("text.") else k: v for k, v in sd.items()}
    return {k: v for k, v in sd.items() if k not in OPENAI_EXTRAS}


def _depth(sd: dict, prefix: str) -> int:
    layers = {int(m.group(1)) for k in sd if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    if not layers or layers != set(range(len(layers))):
        raise UserError(f"OpenCLIP: the blocks {prefix}N are missing or not numbered 0..N-1")
    return len(layers)


def _shape(sd: dict, key: str, ndim: int) -> tuple:
    if key not in sd:
        raise UserError(f"OpenCLIP: missing key {key}")
    if sd[key].ndim != ndim:
        raise UserError(f"OpenCLIP: {key} has shape {tuple(sd[key].shape)}; expected {ndim} dimensions")
    return tuple(sd[key].shape)


def open_clip_spec(sd: dict, *, quick_gelu: bool = False, vision_heads: int = 0, text_heads: int = 0) -> ClipSpec:
    """The ClipSpec that computes what OpenCLIP's CLIP with these weights computes (`quick_gelu`:
    the "-quickgelu" configurations and OpenAI's weights; heads: width // 64 unless given)."""
    sd = _normalize(sd)
    refuse_unsupported(sd, UNSUPPORTED, "OpenCLIP", "vitscale's CLIP")
    if "visual.conv1.weight" not in sd or "token_embedding.weight" not in sd:
        raise UserError("OpenCLIP: not an OpenCLIP ViT CLIP state dict (no visual.conv1.weight / "
                        f"token_embedding.weight; its keys begin {first_keys(sd, 3)})")
    dim, in_chans, patch, patch_w = _shape(sd, "visual.conv1.weight", 4)
    if patch != patch_w:
        raise UserError(f"OpenCLIP: visual.conv1.weight has a {patch}x{patch_w} patch; vitscale's patches are square")
    rows, pos_w = _shape(sd, "visual.positional_embedding", 2)
    grid = math.isqrt(rows - 1)
    if grid * grid != rows - 1 or pos_w != dim:
        raise UserError(f"OpenCLIP: visual.positional_embedding has shape {(rows, pos_w)}, which is no square "
                        f"patch grid plus a class token of width {dim}")
    proj_w, embed_dim = _shape(sd, "visual.proj", 2)
    vocab, width = _shape(sd, "token_embedding.weight", 2)
    context, _ = _shape(sd, "positional_embedding", 2)
    text_w, text_e = _shape(sd, "text_projection", 2)
    if proj_w != dim or text_w != width or text_e != embed_dim:
        raise UserError(f"OpenCLIP: visual.proj {(proj_w, embed_dim)} and text_projection {(text_w, text_e)} do not "
                        f"project widths {dim} and {width} to one embedding")
    vdepth, tdepth = _depth(sd, "visual.transformer.resblocks."), _depth(sd, "transformer.resblocks.")
    vhidden = _shape(sd, "visual.transformer.resblocks.0.mlp.c_fc.weight", 2)[0]
    thidden = _shape(sd, "transformer.resblocks.0.mlp.c_fc.weight", 2)[0]
    vision_heads, text_heads = vision_heads or max(1, dim // 64), text_heads or max(1, width // 64)
    for what, w, h in (("image", dim, vision_heads), ("text", width, text_heads)):
        if w % h:
            raise UserError(f"OpenCLIP: {what} width {w} is not divisible by {h} heads")
    act = "quick_gelu" if quick_gelu else "gelu"
    vision = ViTSpec(image_size=grid * patch, patch_size=patch, in_chans=in_chans, num_classes=embed_dim, dim=dim,
                     depth=vdepth, heads=vision_heads, mlp_ratio=vhidden / dim, head="token")
    text = TextSpec(vocab_size=vocab, context_length=context, dim=width, depth=tdepth, heads=text_heads,
                    mlp_ratio=thidden / width, embed_dim=embed_dim, norm_eps=1e-5, act=act)
    return ClipSpec(vision=vision, text=text, embed_dim=embed_dim, ln_pre="visual.ln_pre.weight" in sd,
                    patch_bias=False, proj_bias=False, vision_norm_eps=1e-5, vision_act=act)


def _key_map(spec: ClipSpec) -> dict[str, str]:
    """OpenCLIP key -> vitscale key, for every parameter of the spec's model."""
    m = {"visual.conv1.weight": "visual.patch_embed.proj.weight", "visual.class_embedding": "visual.cls_token",
         "visual.positional_embedding": "visual.pos_embed", "visual.proj": "visual.head.weight",
         "token_embedding.weight": "text.token_embedding.weight", "positional_embedding": "text.positional_embedding",
         "text_projection": "text.proj.weight", "logit_scale": "logit_scale"}
    for p in ("weight", "bias"):
        m[f"visual.ln_post.{p}"] = f"visual.norm.{p}"
        m[f"ln_final.{p}"] = f"text.ln_final.{p}"
        if spec.ln_pre:
            m[f"visual.ln_pre.{p}"] = f"visual.norm_pre.{p}"
    for theirs, ours, depth in (("visual.transformer.resblocks", "visual.blocks", spec.vision.depth),
                                ("transformer.resblocks", "text.blocks", spec.text.depth)):
        for i in range(depth):
            for a, b in BLOCK_MAP:
                names = [(a, b)] if a.startswith("attn.in_proj") else [(f"{a}.weight", f"{b}.weight"),
                                                                        (f"{a}.bias", f"{b}.bias")]
                for x, y in names:
                    m[f"{theirs}.{i}.{x}"] = f"{ours}.{i}.{y}"
    return m


def _is_open_clip_layout(spec: ClipSpec) -> bool:
    v = spec.vision
    return (not spec.patch_bias and not spec.proj_bias and v.head == "token" and v.stem == "patch"
            and not v.no_embed_class and not v.fc_norm and spec.vision_norm_eps == spec.text.norm_eps
            and spec.vision_act == spec.text.act)


RESHAPED = ("visual.class_embedding", "visual.positional_embedding", "logit_scale")  # [W] / [N+1, W] / []


def from_open_clip(sd: dict, *, quick_gelu: bool = False, vision_heads: int = 0, text_heads: int = 0,
                   attention: str = "sdpa") -> CLIP:
    """vitscale's CLIP holding an OpenCLIP ViT CLIP state dict's weights (the same function, in
    fp32). `attention` ("sdpa" | "explicit", both towers) changes no weights."""
    sd = _normalize(sd)
    spec = open_clip_spec(sd, quick_gelu=quick_gelu, vision_heads=vision_heads, text_heads=text_heads)
    spec = replace(spec, vision=replace(spec.vision, attention=attention),
                   text=replace(spec.text, attention=attention))
    with torch.device("meta"):  # no initialization: every parameter comes from the weights
        model = CLIP(spec)
    model.load_state_dict(_convert(sd, spec, model.state_dict()), strict=True, assign=True)
    return model


def _convert(sd: dict, spec: ClipSpec, ours: dict) -> dict[str, torch.Tensor]:
    """OpenCLIP's (normalized) state dict as the spec's model's, fp32 copies on the CPU; `ours`: the
    model's state dict (for the shapes; meta tensors will do)."""
    kmap = _key_map(spec)
    unknown, missing = set(sd) - set(kmap), set(kmap) - set(sd)
    if unknown or missing:
        parts = ([f"unknown keys {first_keys(unknown)}"] if unknown else []) + \
                ([f"missing keys {first_keys(missing)}"] if missing else [])
        raise UserError(f"OpenCLIP: {'; '.join(parts)}")
    out = {}
    for theirs, name in kmap.items():
        v = sd[theirs].detach().to("cpu", torch.float32, copy=True)  # the model owns its weights
        if theirs in ("visual.proj", "text_projection"):
            v = v.t().contiguous()
        if theirs in RESHAPED and v.numel() == ours[name].numel():
            v = v.reshape(ours[name].shape)
        if v.shape != ours[name].shape:
            raise UserError(f"OpenCLIP: {theirs} has shape {tuple(sd[theirs].shape)}, the model expects "
                            f"{tuple(ours[name].shape)} at {name}")
        out[name] = v
    return out


def to_open_clip(model: CLIP) -> dict[str, torch.Tensor]:
    """The state dict OpenCLIP's CLIP of the same configuration loads with strict=True (fp32, CPU):
    e.g. `open_clip.create_model("ViT-B-32")` for a model from `from_open_clip` of its weights."""
    spec = getattr(model, "spec", None)
    if not isinstance(spec, ClipSpec):
        raise UserError("export to OpenCLIP: not a vitscale CLIP model")
    if not _is_open_clip_layout(spec):
        raise UserError("export to OpenCLIP: the model lacks OpenCLIP's layout (it needs patch_bias=False, "
                        "proj_bias=False, the patch stem, a class token, and one LayerNorm eps and activation for "
                        "both towers); start from OpenCLIP weights (from_open_clip) to export to OpenCLIP")
    ours = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out = {}
    for theirs, name in _key_map(spec).items():
        v = ours[name]
        if theirs in ("visual.proj", "text_projection"):
            v = v.t()
        elif theirs == "visual.class_embedding":   # [1, 1, W] -> [W]
            v = v.reshape(-1)
        elif theirs == "visual.positional_embedding":  # [1, N+1, W] -> [N+1, W]
            v = v.reshape(v.shape[-2:])
        elif theirs == "logit_scale":  # [1] -> []
            v = v.reshape(())
        out[theirs] = v.contiguous()
    return out


def looks_like_open_clip(path) -> bool:
    """Whether a weights file has OpenCLIP's ViT CLIP keys (read from a safetensors header alone;
    other formats are loaded). An absent or unreadable file answers True: reading it reports that."""
    from pathlib import Path
    from .files import read_state_dict
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(path), "pt") as f:
                keys = set(f.keys())
        else:
            keys = set(read_state_dict(path))
    except Exception:
        return True
    keys = {k[len("text."):] if k.startswith("text.") else k for k in keys}
    return "visual.conv1.weight" in keys and "token_embedding.weight" in keys


def uses_quick_gelu(path) -> bool:
    """The activation is not in the weights: files whose name says "quickgelu" or "openai" (OpenCLIP's
    configurations and pretrained tags for OpenAI's weights, e.g. timm/vit_base_patch32_clip_224.openai)
    are read with QuickGELU, others with GELU."""
    from pathlib import Path
    name = str(Path(path)).lower()
    return "quickgelu" in name or "quick_gelu" in name or "openai" in name


def init_weights(path, *, image_size: int, in_chans: int, context_length: int, vocab_size: int,
                 vision_heads: int = 0, text_heads: int = 0, attention: str = "sdpa", drop_path: float = 0.0,
                 dropout: float = 0.0, quick_gelu: bool | None = None) -> tuple[ClipSpec, dict]:
    """`model.init` for CLIP: (spec, state dict for it) from an OpenCLIP ViT CLIP file, the architecture
    from the weights and the geometry from the run: the image position embeddings resampled to the
    data's patch grid (finetune.resample_pos_embed), RGB patch filters summed for grey images, the
    text position embeddings cut to `context_length` (exact: causal attention never looks past a
    caption's last token). `quick_gelu` None: from the file name (uses_quick_gelu)."""
    from .files import read_state_dict
    from .finetune import adapt_in_chans, resample_pos_embed
    sd = _normalize(read_state_dict(path))
    quick_gelu = uses_quick_gelu(path) if quick_gelu is None else quick_gelu
    try:
        src = open_clip_spec(sd, quick_gelu=quick_gelu, vision_heads=vision_heads, text_heads=text_heads)
        with torch.device("meta"):
            state = _convert(sd, src, CLIP(src).state_dict())
    except UserError as e:
        raise UserError(f"model.init: {path}: {e}") from None
    v, t = src.vision, src.text
    if image_size % v.patch_size:
        raise UserError(f"model.init: image size {image_size} is not divisible by the weights' patch size "
                        f"{v.patch_size} (set data.image_size)")
    if context_length > t.context_length:
        raise UserError(f"model.init: model.context_length={context_length} is longer than the weights' "
                        f"{t.context_length} positions")
    if vocab_size != t.vocab_size:
        raise UserError(f"model.init: the weights' vocabulary has {t.vocab_size} tokens, the tokenizer "
                        f"{vocab_size}")
    spec = replace(src, vision=replace(v, image_size=image_size, in_chans=in_chans, attention=attention,
                                       drop_path=drop_path, dropout=dropout),
                   text=replace(t, context_length=context_length, attention=attention))
    state["visual.pos_embed"] = resample_pos_embed(state["visual.pos_embed"], image_size // v.patch_size, 1)
    state["visual.patch_embed.proj.weight"] = adapt_in_chans(state["visual.patch_embed.proj.weight"], in_chans)
    state["text.positional_embedding"] = state["text.positional_embedding"][:context_length].contiguous()
    return spec, state
