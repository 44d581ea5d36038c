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
    visual.ln_post                              visual.norm (visual.fc_norm with final_ln_after_pool)
    visual.proj [W, E]                          visual.head.weight [E, W]        (proj_bias=False)
    token_embedding, positional_embedding,      text.token_embedding, text.positional_embedding,
    transformer.resblocks.i.*, ln_final         text.blocks.i.*, text.ln_final
    text_projection [W, E]                      text.proj.weight [E, W]
    logit_scale []                              logit_scale [1]

What the weights do not hold comes from OpenCLIP's configuration of the model: the
`open_clip_config.json` that OpenCLIP's hub folders keep beside the weights ({"model_cfg": ...,
"preprocess_cfg": ...}), or an OpenCLIP model name (open_clip_configs.py: OpenCLIP's own table),
or explicit arguments:
- the head counts (vision_cfg.width // head_width; text_cfg.heads): ViT-H-14, ViT-g-14 and
  ViT-bigG-14 have head widths 80, 88 and 104, not 64;
- the activation (quick_gelu: OpenAI's models and the "-quickgelu" configurations);
- the image feature (pool_type "tok" | "avg", final_ln_after_pool: CLIPA's average pool), the text
  feature (pool_type "argmax" | "eos" + eos_id | "last" | "first") and the causal mask
  (no_causal_mask: CLIPA's bidirectional text tower); the LayerNorm eps (norm_kwargs).
Without any of them, OpenCLIP's defaults (head width 64, GELU, class token, causal text pooled at
the end-of-text token) are taken and said in one warning line, naming the keys that change them;
for an image width where OpenCLIP's own configurations use other head counts the weights are
refused instead. A configuration that disagrees with the weights' shapes is refused.
Variants vitscale does not implement (timm, ResNet or Hugging Face towers, CoCa, attentional
pooling, layer scale, q/k norm, SigLIP's logit_bias, ...) are refused in one line naming the
configuration key or the weights' keys that show them. Nothing here imports open_clip.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import UserError, did_you_mean
from .files import first_keys, refuse_unsupported
from ..models.clip import CLIP, ClipSpec
from ..models.text import TextSpec
from ..models.vit import ViTSpec

log = logging.getLogger("vitscale")

BLOCK_MAP = (("ln_1", "norm1"), ("attn.in_proj_weight", "attn.qkv.weight"), ("attn.in_proj_bias", "attn.qkv.bias"),
             ("attn.out_proj", "attn.proj"), ("ln_2", "norm2"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2"))
UNSUPPORTED = {"visual.trunk.": "a timm image tower", "visual.layer1.": "a ResNet image tower",
               "text.transformer.embeddings": "a Hugging Face text tower", "text_decoder.": "CoCa's text decoder",
               "attn_pool": "attentional pooling (CoCa)", ".ln_q.": "q/k normalization", ".ln_k.": "q/k normalization", "logit_bias": "SigLIP's logit_bias",
               "cls_emb": "a text class token", ".ln_attn.": "scaled attention norms",
               ".ln_inner.": "scaled attention norms", "text_projection.bias": "a text projection with a bias",
               "logit_scale_attn": "scaled cosine attention", ".head_scale": "per-head attention scales"}
OPENAI_EXTRAS = ("input_resolution", "context_length", "vocab_size")  # in OpenAI's original files
CONFIG_FILE = "open_clip_config.json"
# what open_clip's `local-dir:` loader picks from a folder first (factory._find_checkpoint_in_dir)
LOCAL_DIR_PREFERRED = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
                       "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth", "model.safetensors",
                       "pytorch_model.bin", "pytorch_model.pth", "model.pth")

# OpenCLIP's model_cfg keys that change the function to one vitscale does not compute: (key, what it is)
REFUSED_MODEL = (("multimodal_cfg", "CoCa's text decoder"), ("init_logit_bias", "SigLIP's logit_bias"))
REFUSED_TOWER = (("qk_norm", "q/k normalization"),
                 ("scaled_cosine_attn", "scaled cosine attention"), ("scale_heads", "per-head attention scales"),
                 ("scale_attn_inner", "scaled attention norms"), ("scale_attn", "scaled attention norms"),
                 ("scale_fc", "a LayerNorm inside the MLP"), ("attentional_pool", "attentional pooling (CoCa)"),
                 ("output_tokens", "token outputs (CoCa)"), ("embed_cls", "a text class token"),
                 ("proj_bias", "a text projection with a bias"))


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
    if len(sd[key].shape) != ndim:
        raise UserError(f"OpenCLIP: {key} has shape {tuple(sd[key].shape)}; expected {ndim} dimensions")
    return tuple(sd[key].shape)


def _ratio(hidden: int, dim: int) -> float:
    """The MLP ratio r with int(dim * r) == hidden (both libraries size the MLP so; hidden / dim
    alone can land a float just below, e.g. ViT-bigG-14's 8192 / 1664)."""
    r = hidden / dim
    while int(dim * r) < hidden:
        r = math.nextafter(r, math.inf)
    return r


# -- OpenCLIP's configuration: where it comes from, what it says ------------------------------------
def read_config(config, weights=None) -> tuple[dict | None, dict, str]:
    """(model_cfg, preprocess_cfg, where it came from) for `config`: an OpenCLIP model name (OpenCLIP's
    own table), a path to an open_clip_config.json or its folder, a dict (open_clip_config.json's
    content, or a model_cfg), or None/"": the open_clip_config.json beside `weights`, if there is one."""
    if isinstance(config, dict):
        if "model_cfg" in config:
            return config["model_cfg"], dict(config.get("preprocess_cfg") or {}), "the given open_clip config"
        return config, {}, "the given OpenCLIP model_cfg"
    if not config:
        beside = Path(weights).parent / CONFIG_FILE if weights else None
        if beside is None or not beside.is_file():
            return None, {}, ""
        config = beside
    path = Path(config)
    if isinstance(config, Path) or path.suffix == ".json" or path.is_dir() or path.is_file():
        path = path / CONFIG_FILE if path.is_dir() else path
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"OpenCLIP: {path}: not a readable open_clip_config.json ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("model_cfg", data), dict):
            raise UserError(f"OpenCLIP: {path}: not an open_clip_config.json (no model_cfg)")
        mc = data.get("model_cfg", data)
        if not all(k in mc for k in ("embed_dim", "vision_cfg", "text_cfg")):
            raise UserError(f"OpenCLIP: {path}: its model_cfg lacks embed_dim / vision_cfg / text_cfg")
        return mc, dict(data.get("preprocess_cfg") or {}), str(path)
    from .open_clip_configs import CONFIGS, OPEN_CLIP_VERSION
    name = str(config).replace("/", "-")
    if name not in CONFIGS:
        hint = (" (vitscale reads no hub: give the open_clip_config.json of the downloaded folder)" if ":" in name
                else f"{did_you_mean(name, CONFIGS)} (or give a path to an open_clip_config.json)")
        raise UserError(f"OpenCLIP: no model configuration '{config}' in OpenCLIP {OPEN_CLIP_VERSION}{hint}")
    return CONFIGS[name], {}, f"the {name} configuration"


def _refuse_config(mc: dict, where: str) -> None:
    """One line for the first thing the configuration says that vitscale's CLIP does not compute
    (the kind of tower first: that is what a reader needs to hear)."""
    v, t = mc.get("vision_cfg") or {}, mc.get("text_cfg") or {}

    def no(what: str, key: str, value) -> None:
        shown = key if isinstance(value, dict) and len(repr(value)) > 40 else f"{key}={value!r}"
        raise UserError(f"OpenCLIP: {where}: {what} ({shown}) is not implemented by vitscale's CLIP")
    if v.get("timm_model_name"):
        no("a timm image tower", "vision_cfg.timm_model_name", v["timm_model_name"])
    if isinstance(v.get("layers"), (list, tuple)):
        no("a ResNet image tower", "vision_cfg.layers", v["layers"])
    if t.get("hf_model_name"):
        no("a Hugging Face text tower", "text_cfg.hf_model_name", t["hf_model_name"])
    for key, what in REFUSED_MODEL:
        if mc.get(key) is not None:
            no(what, key, mc[key])
    if t.get("ls_init_value"):
        no("layer scale in the text tower", "text_cfg.ls_init_value", t["ls_init_value"])
    for tower, cfg in (("vision_cfg", v), ("text_cfg", t)):
        for key, what in REFUSED_TOWER:
            if cfg.get(key):
                no(what, f"{tower}.{key}", cfg[key])
        if cfg.get("block_type") not in (None, "default"):
            no("OpenCLIP's custom attention block", f"{tower}.block_type", cfg["block_type"])
        if cfg.get("act_kwargs"):
            no("an activation with arguments", f"{tower}.act_kwargs", cfg["act_kwargs"])
        if set(cfg.get("norm_kwargs") or {}) - {"eps"}:
            no("a LayerNorm with these arguments", f"{tower}.norm_kwargs", cfg["norm_kwargs"])
    if v.get("pool_type", "tok") not in ("tok", "avg"):
        no("image token outputs", "vision_cfg.pool_type", v["pool_type"])
    if v.get("pos_embed_type", "learnable") not in ("learnable", "sin_cos_2d"):
        no("this position embedding", "vision_cfg.pos_embed_type", v["pos_embed_type"])
    for key in ("image_size", "patch_size"):
        if isinstance(v.get(key), (list, tuple)) and len(set(v[key])) > 1:
            no("a non-square image or patch", f"vision_cfg.{key}", v[key])
    if t.get("pool_type", "argmax") not in ("argmax", "eos", "last", "first"):
        no("text token outputs", "text_cfg.pool_type", t["pool_type"])
    if t.get("proj_type", "linear") != "linear":
        no("a text tower without a linear projection", "text_cfg.proj_type", t["proj_type"])


def _refuse_keys(sd: dict) -> None:
    """One line for the first variant the (normalized) keys show that vitscale's CLIP does not compute."""
    refuse_unsupported(sd, UNSUPPORTED, "OpenCLIP", "vitscale's CLIP")
    text_ls = [k for k in sd if k.startswith("transformer.resblocks.") and ".ls_" in k]
    if text_ls:
        raise UserError(f"OpenCLIP: layer scale in the text tower ({first_keys(text_ls, 2)}) is not implemented by "
                        "vitscale's CLIP")


def _square(x) -> int:
    return x[0] if isinstance(x, (list, tuple)) else x


def _from_config(mc: dict) -> dict:
    """What an OpenCLIP model_cfg says the function is: the open values and the shapes it implies."""
    v, t = mc["vision_cfg"], mc["text_cfg"]
    width, twidth = v.get("width", 768), t.get("width", 512)
    head_width = v.get("head_width", 64)
    return dict(
        quick_gelu=bool(mc.get("quick_gelu", False)), vision_heads=width // head_width, text_heads=t.get("heads", 8),
        vision_pool="avg" if v.get("pool_type", "tok") == "avg" else "token",
        vision_norm_after_pool=bool(v.get("final_ln_after_pool", False)) and v.get("pool_type", "tok") == "avg",
        vision_eps=float((v.get("norm_kwargs") or {}).get("eps", 1e-5)),
        text_eps=float((t.get("norm_kwargs") or {}).get("eps", 1e-5)),
        causal=not t.get("no_causal_mask", False), text_pool=t.get("pool_type", "argmax"),
        eos_id=int(t.get("eos_id", 2)) if t.get("pool_type") == "eos" else 0,
        shapes={"embed_dim": mc["embed_dim"], "image width": width, "image layers": v.get("layers", 12),
                "patch size": _square(v.get("patch_size", 16)), "image size": _square(v.get("image_size", 224)),
                "image MLP width": int(width * v.get("mlp_ratio", 4.0)), "ln_pre": not v.get("no_ln_pre", False),
                "image layer scale": bool(v.get("ls_init_value")),
                "text width": twidth, "text layers": t.get("layers", 12),
                "text MLP width": int(twidth * t.get("mlp_ratio", 4.0)),
                "context length": t.get("context_length", 77), "vocabulary": t.get("vocab_size", 49408)},
        width_ok=width % head_width == 0)


def _wide_head_refusal(what: str, width: int, heads_key: str) -> None:
    """No configuration: refuse where OpenCLIP's own configurations of this width do not use head
    width 64 (ViT-H/g/bigG/e: 80/88/104/112), rather than split the heads wrongly."""
    from .open_clip_configs import CONFIGS
    odd = {}
    for name, mc in CONFIGS.items():
        v, t = mc["vision_cfg"], mc["text_cfg"]
        if v.get("timm_model_name") or isinstance(v.get("layers"), (list, tuple)):
            continue
        if what == "image" and v.get("width", 768) == width:
            heads = width // v.get("head_width", 64)
        elif what == "text" and not t.get("hf_model_name") and t.get("width", 512) == width:
            heads = t.get("heads", 8)
        else:
            continue
        if heads != max(1, width // 64):
            odd.setdefault(heads, []).append(name)
    if odd:
        heads, names = next(iter(odd.items()))
        names.sort(key=lambda n: (not n.startswith("ViT-"), len(n), n))  # the plain configurations first
        raise UserError(f"OpenCLIP: the weights' {what} tower is {width} wide; OpenCLIP's configurations of that "
                        f"width ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}) have {heads} heads "
                        f"(head width {width // heads}), not width // 64 = {width // 64}: the head count is not in "
                        f"the weights: name the configuration or give it ({heads_key})")


# -- the spec --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Weights:
    """What an OpenCLIP ViT CLIP state dict's shapes say (_read_weights)."""
    dim: int            # image width
    in_chans: int
    patch: int
    grid: int           # patches per side
    embed_dim: int
    vocab: int
    width: int          # text width
    context: int
    vdepth: int
    tdepth: int
    vhidden: int        # image MLP width
    thidden: int        # text MLP width
    ln_pre: bool
    layer_scale: bool   # its value comes with the weights

    def shapes(self) -> dict:
        """The weights' side of _from_config's "shapes"."""
        return {"embed_dim": self.embed_dim, "image width": self.dim, "image layers": self.vdepth,
                "patch size": self.patch, "image size": self.grid * self.patch, "image MLP width": self.vhidden,
                "ln_pre": self.ln_pre, "image layer scale": self.layer_scale, "text width": self.width,
                "text layers": self.tdepth, "text MLP width": self.thidden, "context length": self.context,
                "vocabulary": self.vocab}


def _read_weights(sd: dict) -> _Weights:
    """The shapes of a normalized state dict, refused where they are no OpenCLIP ViT CLIP."""
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
    return _Weights(dim=dim, in_chans=in_chans, patch=patch, grid=grid, embed_dim=embed_dim, vocab=vocab,
                    width=width, context=context, vdepth=vdepth, tdepth=tdepth, vhidden=vhidden, thidden=thidden,
                    ln_pre="visual.ln_pre.weight" in sd,
                    layer_scale="visual.transformer.resblocks.0.ls_1.gamma" in sd)


def _options_from_config(w: _Weights, mc: dict, where: str, given: dict, keys: dict) -> dict:
    """The options a configuration sets, checked against the weights and the explicit arguments
    (`given`: vision_heads, text_heads, quick_gelu as the caller passed them)."""
    said = _from_config(mc)
    have = w.shapes()
    wrong = [f"{k} {said['shapes'][k]} (the weights: {have[k]})" for k in have if said["shapes"][k] != have[k]]
    if wrong:
        raise UserError(f"OpenCLIP: {where} does not describe these weights: {', '.join(wrong[:3])}"
                        f"{' ...' if len(wrong) > 3 else ''}")
    if not said["width_ok"]:
        raise UserError(f"OpenCLIP: {where}: image width {w.dim} is not a multiple of vision_cfg.head_width")
    for arg, value, want in (("vision_heads", given["vision_heads"] or None, said["vision_heads"]),
                             ("text_heads", given["text_heads"] or None, said["text_heads"]),
                             ("quick_gelu", given["quick_gelu"], said["quick_gelu"])):
        if value is not None and value != want:
            shown = {True: "quick_gelu", False: "gelu"}.get(value, value) if arg == "quick_gelu" else value
            raise UserError(f"OpenCLIP: {keys[arg]}{shown} disagrees with {where}, which says {arg} {want}")
    return dict(vision_heads=said["vision_heads"], text_heads=said["text_heads"],
                act="quick_gelu" if said["quick_gelu"] else "gelu",
                pools=dict(vision_pool=said["vision_pool"], vision_norm_after_pool=said["vision_norm_after_pool"]),
                text_opts=dict(causal=said["causal"], pool=said["text_pool"], eos_id=said["eos_id"]),
                eps=(said["vision_eps"], said["text_eps"]), assumed=[])


def _options_by_default(w: _Weights, given: dict, keys: dict, act_note: str) -> dict:
    """Without a configuration: the explicit arguments, else OpenCLIP's defaults, listed in
    "assumed" (refused where OpenCLIP's configurations of the width use other head counts)."""
    vision_heads, text_heads, quick_gelu = given["vision_heads"], given["text_heads"], given["quick_gelu"]
    if not vision_heads:
        _wide_head_refusal("image", w.dim, keys["config"] + ", or " + keys["vision_heads"])
    if not text_heads:
        _wide_head_refusal("text", w.width, keys["config"] + ", or " + keys["text_heads"])
    vh, th = vision_heads or max(1, w.dim // 64), text_heads or max(1, w.width // 64)
    assumed = [f"image heads {vh} ({'given' if vision_heads else f'width {w.dim} / head width 64'})",
               f"text heads {th} ({'given' if text_heads else f'width {w.width} / 64'})",
               f"{'QuickGELU' if quick_gelu else 'GELU'}"
               f"{f' ({act_note})' if act_note else ' (given)' if quick_gelu is not None else ''}",
               "the class token's image feature", "a causal text tower read at the end-of-text token"]
    if not w.ln_pre:
        assumed[-1] += " (weights without ln_pre may be CLIPA's, which average-pool and read text bidirectionally)"
    return dict(vision_heads=vh, text_heads=th, act="quick_gelu" if quick_gelu else "gelu",
                pools={}, text_opts={}, eps=(1e-5, 1e-5), assumed=assumed)


def _spec(w: _Weights, opts: dict, mc: dict | None) -> ClipSpec:
    """The ClipSpec of the weights' shapes with the resolved options."""
    for what, width, h in (("image", w.dim, opts["vision_heads"]), ("text", w.width, opts["text_heads"])):
        if width % h:
            raise UserError(f"OpenCLIP: {what} width {width} is not divisible by {h} heads")
    act, eps = opts["act"], opts["eps"]
    vision = ViTSpec(image_size=w.grid * w.patch, patch_size=w.patch, in_chans=w.in_chans, num_classes=w.embed_dim,
                     dim=w.dim, depth=w.vdepth, heads=opts["vision_heads"], mlp_ratio=_ratio(w.vhidden, w.dim),
                     head="token",
                     **({"layer_scale": float((mc or {}).get("vision_cfg", {}).get("ls_init_value") or 1e-5)}
                        if w.layer_scale else {}))
    text = TextSpec(vocab_size=w.vocab, context_length=w.context, dim=w.width, depth=w.tdepth,
                    heads=opts["text_heads"], mlp_ratio=_ratio(w.thidden, w.width), embed_dim=w.embed_dim,
                    norm_eps=eps[1], act=act, **opts["text_opts"])
    return ClipSpec(vision=vision, text=text, embed_dim=w.embed_dim, ln_pre=w.ln_pre, patch_bias=False,
                    proj_bias=False, vision_norm_eps=eps[0], vision_act=act, **opts["pools"])


def _resolve(sd: dict, config, *, quick_gelu: bool | None, vision_heads: int, text_heads: int,
             weights=None, keys: dict | None = None, act_note: str = "") -> tuple[ClipSpec, list[str], dict | None, str]:
    """(spec, the defaults taken [empty when a configuration said everything], model_cfg or None, where
    it came from). `keys`: how the caller spells its arguments in messages ({"config", "vision_heads",
    "text_heads", "quick_gelu"}); `act_note`: where a `quick_gelu` given without a configuration came
    from (default: the caller)."""
    keys = {"config": "config=NAME or an open_clip_config.json", "vision_heads": "vision_heads=",
            "text_heads": "text_heads=", "quick_gelu": "quick_gelu="} | (keys or {})
    sd = _normalize(sd)
    mc, _, where = read_config(config, weights)
    if mc is not None:
        _refuse_config(mc, where)
    _refuse_keys(sd)
    w = _read_weights(sd)
    given = dict(vision_heads=vision_heads, text_heads=text_heads, quick_gelu=quick_gelu)
    opts = (_options_from_config(w, mc, where, given, keys) if mc is not None
            else _options_by_default(w, given, keys, act_note))
    return _spec(w, opts, mc), opts["assumed"], mc, where


def _announce(prefix: str, assumed: list[str], keys: str) -> None:
    if assumed:
        log.warning(f"{prefix}: OpenCLIP's defaults taken for what the weights do not hold: {', '.join(assumed)} "
                    f"(set {keys})")


PY_KEYS = "config=NAME or an open_clip_config.json, or vision_heads= / text_heads= / quick_gelu="


def open_clip_spec(sd: dict, config=None, *, quick_gelu: bool | None = None, vision_heads: int = 0,
                   text_heads: int = 0) -> ClipSpec:
    """The ClipSpec that computes what OpenCLIP's model with these weights computes. `config`: an
    OpenCLIP model name, an open_clip_config.json (path, folder or dict) or a model_cfg dict; without
    one, OpenCLIP's defaults for what the weights leave open, announced in one warning line (and
    refused where OpenCLIP's configurations of that width use other head counts). `quick_gelu`,
    `vision_heads`, `text_heads`: explicit values (they must agree with a configuration)."""
    spec, assumed, _, _ = _resolve(sd, config, quick_gelu=quick_gelu, vision_heads=vision_heads,
                                   text_heads=text_heads)
    _announce("OpenCLIP", assumed, PY_KEYS)
    return spec


def _key_map(spec: ClipSpec) -> dict[str, str]:
    """OpenCLIP key -> vitscale key, for every parameter of the spec's model."""
    m = {"visual.conv1.weight": "visual.patch_embed.proj.weight", "visual.class_embedding": "visual.cls_token",
         "visual.positional_embedding": "visual.pos_embed", "visual.proj": "visual.head.weight",
         "token_embedding.weight": "text.token_embedding.weight", "positional_embedding": "text.positional_embedding",
         "text_projection": "text.proj.weight", "logit_scale": "logit_scale"}
    post = "visual.fc_norm" if spec.vision_norm_after_pool else "visual.norm"
    for p in ("weight", "bias"):
        m[f"visual.ln_post.{p}"] = f"{post}.{p}"
        m[f"ln_final.{p}"] = f"text.ln_final.{p}"
        if spec.ln_pre:
            m[f"visual.ln_pre.{p}"] = f"visual.norm_pre.{p}"
    for theirs, ours, depth in (("visual.transformer.resblocks", "visual.blocks", spec.vision.depth),
                                ("transformer.resblocks", "text.blocks", spec.text.depth)):
        for i in range(depth):
            if ours == "visual.blocks" and getattr(spec.vision, "layer_scale", 0):
                m[f"{theirs}.{i}.ls_1.gamma"], m[f"{theirs}.{i}.ls_2.gamma"] = f"{ours}.{i}.ls1.gamma", f"{ours}.{i}.ls2.gamma"
            for a, b in BLOCK_MAP:
                names = [(a, b)] if a.startswith("attn.in_proj") else [(f"{a}.weight", f"{b}.weight"),
                                                                        (f"{a}.bias", f"{b}.bias")]
                for x, y in names:
                    m[f"{theirs}.{i}.{x}"] = f"{ours}.{i}.{y}"
    return m


def _layout_problem(spec: ClipSpec) -> str:
    """'' when OpenCLIP's CLIP computes the spec's function, else what it lacks."""
    v = spec.vision
    vit_variants = (getattr(v, "reg_tokens", 0) or not getattr(v, "qkv_bias", True) or getattr(v, "pre_norm", False)
                    or not getattr(v, "final_norm", True) or getattr(v, "class_token", None) is False
                    or getattr(v, "act", "gelu") != "gelu" or getattr(v, "norm_eps", 1e-6) != 1e-6)
    if (spec.patch_bias or spec.proj_bias or v.stem != "patch" or v.head != "token" or v.no_embed_class or v.fc_norm
            or vit_variants):
        return ("the model lacks OpenCLIP's layout (it needs patch_bias=False, proj_bias=False, the patch stem and a "
                "class token); start from OpenCLIP weights (from_open_clip) to export to OpenCLIP")
    if spec.vision_act != spec.text.act or spec.vision_act not in ("gelu", "quick_gelu"):
        return (f"the towers' activations ({spec.vision_act}, {spec.text.act}) are not one GELU or QuickGELU for both, "
                "as OpenCLIP's quick_gelu sets them")
    if v.in_chans != 3:
        return (f"the model takes {v.in_chans}-channel images; OpenCLIP's image tower takes RGB "
                "(visual.conv1 has 3 input channels)")
    return ""


RESHAPED = ("visual.class_embedding", "visual.positional_embedding", "logit_scale")  # [W] / [N+1, W] / []


def from_open_clip(sd: dict, config=None, *, quick_gelu: bool | None = None, vision_heads: int = 0,
                   text_heads: int = 0, attention: str = "sdpa") -> CLIP:
    """vitscale's CLIP holding an OpenCLIP ViT CLIP state dict's weights (the same function, in
    fp32); `config` etc.: as open_clip_spec. `attention` ("sdpa" | "explicit", both towers) changes
    no weights."""
    sd = _normalize(sd)
    spec = open_clip_spec(sd, config, quick_gelu=quick_gelu, vision_heads=vision_heads, text_heads=text_heads)
    return _build(sd, spec, attention)


def _build(sd: dict, spec: ClipSpec, attention: str = "sdpa") -> CLIP:
    spec = replace(spec, vision=replace(spec.vision, attention=attention),
                   text=replace(spec.text, attention=attention))
    with torch.device("meta"):  # no initialization: every parameter comes from the weights
        model = CLIP(spec)
    model.load_state_dict(_convert(sd, spec, model.state_dict()), strict=True, assign=True)
    return model


def load_open_clip(path, config=None, *, quick_gelu: bool | None = None, vision_heads: int = 0,
                   text_heads: int = 0, attention: str = "sdpa") -> CLIP:
    """vitscale's CLIP from an OpenCLIP weights file as published: its configuration from `config`
    (a model name, an open_clip_config.json) or else the open_clip_config.json beside the file
    (OpenCLIP's hub folders keep one), else OpenCLIP's defaults, announced. The configuration is
    read, and checked against the file's keys and shapes, before the weights."""
    from .files import read_state_dict
    try:
        spec, assumed, _, _ = _resolve(_header(path), config, quick_gelu=quick_gelu, vision_heads=vision_heads,
                                       text_heads=text_heads, weights=path)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    _announce(f"OpenCLIP: {path}", assumed, PY_KEYS)
    return _build(_normalize(read_state_dict(path)), spec, attention)


def _header(path) -> dict:
    """{key: an object with .shape} from a weights file: a safetensors header alone (meta tensors),
    other formats loaded."""
    from .files import read_state_dict
    path = Path(path)
    if path.suffix == ".safetensors" and path.is_file():
        from safetensors import safe_open
        try:
            with safe_open(str(path), "pt") as f:
                return {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
        except Exception:  # unreadable: read_state_dict says so in one line
            pass
    return read_state_dict(path)


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


# -- export ----------------------------------------------------------------------------------------
def to_open_clip(model: CLIP) -> dict[str, torch.Tensor]:
    """The state dict OpenCLIP's CLIP of the same configuration (open_clip_config(model.spec)) loads
    with strict=True (fp32, CPU)."""
    spec = getattr(model, "spec", None)
    if not isinstance(spec, ClipSpec):
        raise UserError("export to OpenCLIP: not a vitscale CLIP model")
    problem = _layout_problem(spec)
    if problem:
        raise UserError(f"export to OpenCLIP: {problem}")
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


def open_clip_config(spec: ClipSpec, preprocess: dict | None = None) -> dict:
    """open_clip_config.json for the spec: {"model_cfg": what OpenCLIP's CLIP(**model_cfg) needs to
    compute the spec's function, "preprocess_cfg": `preprocess`}."""
    problem = _layout_problem(spec)
    if problem:
        raise UserError(f"export to OpenCLIP: {problem}")
    v, t = spec.vision, spec.text
    vision = {"image_size": v.image_size, "patch_size": v.patch_size, "width": v.dim, "layers": v.depth,
              "head_width": v.dim // v.heads, "mlp_ratio": v.mlp_ratio}
    if not spec.ln_pre:
        vision["no_ln_pre"] = True
    if getattr(v, "layer_scale", 0):
        vision["ls_init_value"] = v.layer_scale  # (the scales themselves are in the weights)
    if spec.vision_pool == "avg":
        vision["pool_type"] = "avg"
    if spec.vision_norm_after_pool:
        vision["final_ln_after_pool"] = True
    text = {"context_length": t.context_length, "vocab_size": t.vocab_size, "width": t.dim, "heads": t.heads,
            "layers": t.depth, "mlp_ratio": t.mlp_ratio}
    if not t.causal:
        text["no_causal_mask"] = True
    if t.pool != "argmax":
        text["pool_type"] = t.pool
    if t.pool == "eos":
        text["eos_id"] = t.eos_id
    for cfg, eps in ((vision, spec.vision_norm_eps), (text, t.norm_eps)):
        if eps != 1e-5:  # OpenCLIP's LayerNorm: torch's default
            cfg["norm_kwargs"] = {"eps": eps}
    model_cfg = {"embed_dim": spec.embed_dim, "quick_gelu": spec.vision_act == "quick_gelu",
                 "vision_cfg": vision, "text_cfg": text}
    return {"model_cfg": model_cfg, "preprocess_cfg": dict(preprocess or {})}


def save_open_clip(model: CLIP, out, preprocess: dict | None = None, metadata: dict | None = None) -> Path:
    """OpenCLIP's layout on disk: the weights (safetensors) and open_clip_config.json beside them.
    `out`: a folder (the weights go to FOLDER/open_clip_model.safetensors, the name open_clip's
    `local-dir:` loader takes first) or a .safetensors file (open_clip_config.json in its folder).
    Refuses to overwrite an open_clip_config.json that describes another model. Returns the weights'
    path (load_call(path) is the call that loads them)."""
    from ..checkpoint import export_safetensors
    from .files import SUFFIXES
    sd = to_open_clip(model)
    config = open_clip_config(model.spec, preprocess)
    out = Path(out)
    if out.suffix in SUFFIXES and out.suffix != ".safetensors":
        raise UserError(f"export --format open_clip: --out {out}: give a folder or a .safetensors file")
    weights = out if out.suffix == ".safetensors" else out / LOCAL_DIR_PREFERRED[0]
    cfg_path = weights.parent / CONFIG_FILE
    if cfg_path.is_file():
        try:
            same = json.loads(cfg_path.read_text()) == json.loads(json.dumps(config))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            same = False
        if not same:
            raise UserError(f"export --format open_clip: {cfg_path} already describes another model; export into a "
                            "folder of its own (--out DIR)")
    weights.parent.mkdir(parents=True, exist_ok=True)
    path = export_safetensors(sd, weights, metadata or {"format": "open_clip"})
    cfg_path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def local_dir_choice(folder) -> Path | None:
    """The weights file open_clip's `local-dir:FOLDER` loads (factory._find_checkpoint_in_dir)."""
    folder = Path(folder)
    found = sorted([*folder.glob("*.safetensors"), *folder.glob("*.bin"), *folder.glob("*.pth")])
    found.sort(key=lambda p: p.suffix == ".safetensors", reverse=True)
    preferred = [p for p in found if p.name in LOCAL_DIR_PREFERRED]
    if preferred:
        return min(preferred, key=lambda p: LOCAL_DIR_PREFERRED.index(p.name))
    return found[0] if found else None


def load_call(path) -> str:
    """The Python that loads an exported file in OpenCLIP as the trained function, with its preprocessing
    and tokenizer (image size, mean/std, context length from open_clip_config.json)."""
    path = Path(path).resolve()
    folder = path.parent
    call = (f'model, _, preprocess = open_clip.create_model_and_transforms("local-dir:{folder}"); '
            f'tokenizer = open_clip.get_tokenizer("local-dir:{folder}")')
    chosen = local_dir_choice(folder)
    if chosen is not None and chosen.resolve() != path:
        return (f"open_clip's local-dir: loader would read {chosen.name} from {folder}, not {path.name}: put "
                f"{path.name} and {CONFIG_FILE} in a folder of their own (or export with --out DIR), then load it: "
                + call.replace(str(folder), "DIR"))
    return f"load it in OpenCLIP: {call}"


# -- model.init ------------------------------------------------------------------------------------
INIT_KEYS = {"config": "model.init_open_clip=NAME or CONFIG.json", "vision_heads": "model.heads=",
             "text_heads": "model.text_heads=", "quick_gelu": "model.init_act="}
INIT_HINT = "model.init_open_clip=NAME or CONFIG.json, or model.heads / model.text_heads / model.init_act"


def _refuse_tokenizer(mc: dict, where: str) -> None:
    """A run tokenizes its captions with CLIP's BPE: weights trained on another tokenizer's ids cannot start it."""
    t = mc.get("text_cfg") or {}
    for key in ("hf_tokenizer_name", "tokenizer_mode"):
        if t.get(key):
            raise UserError(f"OpenCLIP: {where}: the weights were trained with another tokenizer (text_cfg.{key}="
                            f"{t[key]!r}); vitscale tokenizes captions with CLIP's BPE")


def check_init(path, open_clip: str = "") -> None:
    """config's check of a CLIP model.init: a one-line UserError with the real cause where the file (with
    its configuration) cannot start vitscale's CLIP; reads the configuration and the file's keys only."""
    if not Path(path).is_file():
        return  # the run reports a missing file when it reads it
    try:
        sd = _header(path)
        mc, _, where = read_config(open_clip, path)
    except UserError as e:
        raise UserError(f"model.init={path}: {e}") from None
    if mc is not None:
        try:
            _refuse_config(mc, where)
            _refuse_tokenizer(mc, where)
        except UserError as e:
            raise UserError(f"model.init={path}: {e}") from None
    keys = {k[len("text."):] if k.startswith("text.") else k for k in sd}
    if "pos_embed" in keys and "patch_embed.proj.weight" in keys and "visual.conv1.weight" not in keys:
        raise UserError(f"model.init={path} holds ViT classifier weights (pos_embed, patch_embed); CLIP models cannot "
                        "be initialized from ViT classifier weights, only from OpenCLIP CLIP weights")
    try:
        _refuse_keys(_normalize(sd))
    except UserError as e:
        raise UserError(f"model.init={path}: {e}") from None
    if "visual.conv1.weight" not in keys or "token_embedding.weight" not in keys:
        raise UserError(f"model.init={path} holds no OpenCLIP CLIP weights (no visual.conv1.weight / "
                        f"token_embedding.weight; its keys begin {first_keys(sd, 3)})")


def uses_quick_gelu(path) -> bool:
    """The activation is not in the weights: without a configuration, files whose name says "quickgelu"
    or "openai" (OpenCLIP's configurations and pretrained tags for OpenAI's weights, e.g.
    timm/vit_base_patch32_clip_224.openai) are read with QuickGELU, others with GELU (announced)."""
    name = str(Path(path)).lower()
    return "quickgelu" in name or "quick_gelu" in name or "openai" in name


def init_weights(path, *, image_size: int, in_chans: int, context_length: int, vocab_size: int,
                 vision_heads: int = 0, text_heads: int = 0, attention: str = "sdpa", drop_path: float = 0.0,
                 dropout: float = 0.0, quick_gelu: bool | None = None, open_clip: str = "") -> tuple[ClipSpec, dict]:
    """`model.init` for CLIP: (spec, state dict for it) from an OpenCLIP ViT CLIP file, the architecture
    from the weights and their configuration (`open_clip`: model.init_open_clip, a model name or an
    open_clip_config.json; "": the open_clip_config.json beside the file; else OpenCLIP's defaults,
    announced), the geometry from the run: the image position embeddings resampled to the data's patch
    grid (finetune.resample_pos_embed), RGB patch filters summed for grey images, the text position
    embeddings cut to `context_length` (exact: causal attention never looks past a caption's last
    token). `quick_gelu` None: from the configuration, else from the file name (uses_quick_gelu)."""
    from .files import read_state_dict
    from .finetune import adapt_in_chans, resample_pos_embed
    try:
        mc, _, _ = read_config(open_clip, path)
        note = ""
        if quick_gelu is None and mc is None:  # the file name's word (announced)
            quick_gelu = uses_quick_gelu(path)
            note = f"the file name {'says' if quick_gelu else 'does not say'} quickgelu or openai"
        src, assumed, mc, where = _resolve(_header(path), open_clip, quick_gelu=quick_gelu, vision_heads=vision_heads,
                                           text_heads=text_heads, weights=path, keys=INIT_KEYS, act_note=note)
        if mc is not None:
            _refuse_tokenizer(mc, where)
        sd = _normalize(read_state_dict(path))
        with torch.device("meta"):
            state = _convert(sd, src, CLIP(src).state_dict())
    except UserError as e:
        raise UserError(f"model.init: {path}: {str(e).removeprefix('OpenCLIP: ')}") from None
    _announce(f"model.init: {path}" + (" (no open_clip_config.json beside it)" if mc is None else ""), assumed,
              INIT_HINT)
    v, t = src.vision, src.text
    if image_size % v.patch_size:
        raise UserError(f"model.init: image size {image_size} is not divisible by the weights' patch size "
                        f"{v.patch_size} (set data.image_size)")
    if context_length > t.context_length:
        raise UserError(f"model.init: model.context_length={context_length} is longer than the weights' "
                        f"{t.context_length} positions")
    if context_length < t.context_length and not t.causal:
        raise UserError(f"model.init: model.context_length={context_length} is shorter than the weights' "
                        f"{t.context_length}: their text tower is bidirectional, so cutting it changes every feature")
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


def export_run(model: CLIP, out, metadata: dict, run_dir, preprocess: dict) -> Path:
    """`vitscale export RUN --format open_clip`: save_open_clip with the run's preprocessing
    (`preprocess`: tasks/base.py's run_preprocess; its OpenCLIP keys are written); the default
    `out` (RUN/model_open_clip.safetensors) becomes the folder RUN/open_clip."""
    out = Path(out)
    if out == Path(run_dir) / "model_open_clip.safetensors":
        out = Path(run_dir) / "open_clip"
    return save_open_clip(model, out, {k: v for k, v in preprocess.items() if k in PREPROCESS_KEYS}, metadata)


PREPROCESS_KEYS = ("size", "mode", "mean", "std", "interpolation", "resize_mode", "fill_color")  # OpenCLIP's
