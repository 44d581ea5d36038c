"""What an OpenCLIP ViT CLIP computes, from its weights' keys and shapes and its configuration: the
ClipSpec of vitscale's CLIP that computes the same function (open_clip_spec, resolve), or a one-line
refusal. convert.py moves the weights themselves.

What the weights do not hold comes from OpenCLIP's configuration of the model: the
`open_clip_config.json` that OpenCLIP's hub folders keep beside the weights ({"model_cfg": ...,
"preprocess_cfg": ...}), or an OpenCLIP model name (configs.py: OpenCLIP's own table),
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
from dataclasses import dataclass
from pathlib import Path

from ...errors import UserError, did_you_mean
from ...models.clip import ClipSpec
from ...models.text import TextSpec
from ...models.vit import ViTSpec
from ..files import first_keys, refuse_unsupported
from .layout import depth_of, ratio
from .timm_tower import TRUNK, has_timm_tower, refuse_timm_config, timm_clip_spec

log = logging.getLogger("vitscale")

UNSUPPORTED = {
    "visual.trunk.": "a timm image tower",
    "visual.layer1.": "a ResNet image tower",
    "text.transformer.embeddings": "a Hugging Face text tower",
    "text_decoder.": "CoCa's text decoder",
    "attn_pool": "attentional pooling (CoCa)",
    ".ln_q.": "q/k normalization",
    ".ln_k.": "q/k normalization",
    "logit_bias": "SigLIP's logit_bias",
    "cls_emb": "a text class token",
    ".ln_attn.": "scaled attention norms",
    ".ln_inner.": "scaled attention norms",
    "text_projection.bias": "a text projection with a bias",
    "logit_scale_attn": "scaled cosine attention",
    ".head_scale": "per-head attention scales",
}
OPENAI_EXTRAS = ("input_resolution", "context_length", "vocab_size")  # in OpenAI's original files
CONFIG_FILE = "open_clip_config.json"
# OpenCLIP's model_cfg keys that change the function to one vitscale does not compute: (key, what it is)
REFUSED_MODEL = (
    ("multimodal_cfg", "CoCa's text decoder"),
    ("init_logit_bias", "SigLIP's logit_bias"),
)
REFUSED_TOWER = (
    ("qk_norm", "q/k normalization"),
    ("scaled_cosine_attn", "scaled cosine attention"),
    ("scale_heads", "per-head attention scales"),
    ("scale_attn_inner", "scaled attention norms"),
    ("scale_attn", "scaled attention norms"),
    ("scale_fc", "a LayerNorm inside the MLP"),
    ("attentional_pool", "attentional pooling (CoCa)"),
    ("output_tokens", "token outputs (CoCa)"),
    ("embed_cls", "a text class token"),
    ("proj_bias", "a text projection with a bias"),
)


def normalize(sd: dict) -> dict:
    """OpenCLIP's CLIP layout: CustomTextCLIP's `text.` prefix removed, OpenAI's metadata dropped."""
    if "text.token_embedding.weight" in sd and "token_embedding.weight" not in sd:
        sd = {k[len("text.") :] if k.startswith("text.") else k: v for k, v in sd.items()}
    return {k: v for k, v in sd.items() if k not in OPENAI_EXTRAS}


def _shape(sd: dict, key: str, ndim: int) -> tuple:
    if key not in sd:
        raise UserError(f"OpenCLIP: missing key {key}")
    if len(sd[key].shape) != ndim:
        raise UserError(
            f"OpenCLIP: {key} has shape {tuple(sd[key].shape)}; expected {ndim} dimensions"
        )
    return tuple(sd[key].shape)


# -- OpenCLIP's configuration: where it comes from, what it says ------------------------------------
def read_config(config, weights=None) -> tuple[dict | None, dict, str]:
    """(model_cfg, preprocess_cfg, where it came from) for `config`: an OpenCLIP model name (OpenCLIP's
    own table), a path to an open_clip_config.json or its folder, a dict (open_clip_config.json's
    content, or a model_cfg), or None/"": the open_clip_config.json beside `weights`, if there is one."""
    if isinstance(config, dict):
        if "model_cfg" in config:
            return (
                config["model_cfg"],
                dict(config.get("preprocess_cfg") or {}),
                "the given open_clip config",
            )
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
            raise UserError(
                f"OpenCLIP: {path}: not a readable open_clip_config.json ({e})"
            ) from None
        if not isinstance(data, dict) or not isinstance(data.get("model_cfg", data), dict):
            raise UserError(f"OpenCLIP: {path}: not an open_clip_config.json (no model_cfg)")
        mc = data.get("model_cfg", data)
        if not all(k in mc for k in ("embed_dim", "vision_cfg", "text_cfg")):
            raise UserError(
                f"OpenCLIP: {path}: its model_cfg lacks embed_dim / vision_cfg / text_cfg"
            )
        return mc, dict(data.get("preprocess_cfg") or {}), str(path)
    from .configs import CONFIGS, OPEN_CLIP_VERSION

    name = str(config).replace("/", "-")
    if name not in CONFIGS:
        hint = (
            " (vitscale reads no hub: give the open_clip_config.json of the downloaded folder)"
            if ":" in name
            else f"{did_you_mean(name, CONFIGS)} (or give a path to an open_clip_config.json)"
        )
        raise UserError(
            f"OpenCLIP: no model configuration '{config}' in OpenCLIP {OPEN_CLIP_VERSION}{hint}"
        )
    return CONFIGS[name], {}, f"the {name} configuration"


def refuse_config(mc: dict, where: str) -> None:
    """One line for the first thing the configuration says that vitscale's CLIP does not compute
    (the kind of tower first: that is what a reader needs to hear)."""
    v, t = mc.get("vision_cfg") or {}, mc.get("text_cfg") or {}

    def no(what: str, key: str, value) -> None:
        shown = key if isinstance(value, dict) and len(repr(value)) > 40 else f"{key}={value!r}"
        raise UserError(
            f"OpenCLIP: {where}: {what} ({shown}) is not implemented by vitscale's CLIP"
        )

    if v.get("timm_model_name"):  # SigLIP, EVA-CLIP, PE-Core, ...: a layout of its own
        refuse_timm_config(mc, where)
        return
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


def refuse_keys(sd: dict) -> None:
    """One line for the first variant the (normalized) keys show that vitscale's CLIP does not compute."""
    refuse_unsupported(sd, UNSUPPORTED, "OpenCLIP", "vitscale's CLIP")
    text_ls = [k for k in sd if k.startswith("transformer.resblocks.") and ".ls_" in k]
    if text_ls:
        raise UserError(
            f"OpenCLIP: layer scale in the text tower ({first_keys(text_ls, 2)}) is not implemented by "
            "vitscale's CLIP"
        )


def _square(x) -> int:
    return x[0] if isinstance(x, (list, tuple)) else x


def _from_config(mc: dict) -> dict:
    """What an OpenCLIP model_cfg says the function is: the open values and the shapes it implies."""
    v, t = mc["vision_cfg"], mc["text_cfg"]
    width, twidth = v.get("width", 768), t.get("width", 512)
    head_width = v.get("head_width", 64)
    return dict(
        quick_gelu=bool(mc.get("quick_gelu", False)),
        vision_heads=width // head_width,
        text_heads=t.get("heads", 8),
        vision_pool="avg" if v.get("pool_type", "tok") == "avg" else "token",
        vision_norm_after_pool=bool(v.get("final_ln_after_pool", False))
        and v.get("pool_type", "tok") == "avg",
        vision_eps=float((v.get("norm_kwargs") or {}).get("eps", 1e-5)),
        text_eps=float((t.get("norm_kwargs") or {}).get("eps", 1e-5)),
        causal=not t.get("no_causal_mask", False),
        text_pool=t.get("pool_type", "argmax"),
        eos_id=int(t.get("eos_id", 2)) if t.get("pool_type") == "eos" else 0,
        shapes={
            "embed_dim": mc["embed_dim"],
            "image width": width,
            "image layers": v.get("layers", 12),
            "patch size": _square(v.get("patch_size", 16)),
            "image size": _square(v.get("image_size", 224)),
            "image MLP width": int(width * v.get("mlp_ratio", 4.0)),
            "ln_pre": not v.get("no_ln_pre", False),
            "image layer scale": bool(v.get("ls_init_value")),
            "text width": twidth,
            "text layers": t.get("layers", 12),
            "text MLP width": int(twidth * t.get("mlp_ratio", 4.0)),
            "context length": t.get("context_length", 77),
            "vocabulary": t.get("vocab_size", 49408),
        },
        width_ok=width % head_width == 0,
    )


def _wide_head_refusal(what: str, width: int, heads_key: str) -> None:
    """No configuration: refuse where OpenCLIP's own configurations of this width do not use head
    width 64 (ViT-H/g/bigG/e: 80/88/104/112), rather than split the heads wrongly."""
    from .configs import CONFIGS

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
        # the plain configurations first
        names.sort(key=lambda n: (not n.startswith("ViT-"), len(n), n))
        raise UserError(
            f"OpenCLIP: the weights' {what} tower is {width} wide; OpenCLIP's configurations of that "
            f"width ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}) have {heads} heads "
            f"(head width {width // heads}), not width // 64 = {width // 64}: the head count is not in "
            f"the weights: name the configuration or give it ({heads_key})"
        )


# -- the spec --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Weights:
    """What an OpenCLIP ViT CLIP state dict's shapes say (_read_weights)."""

    dim: int  # image width
    in_chans: int
    patch: int
    grid: int  # patches per side
    embed_dim: int
    vocab: int
    width: int  # text width
    context: int
    vdepth: int
    tdepth: int
    vhidden: int  # image MLP width
    thidden: int  # text MLP width
    ln_pre: bool
    layer_scale: bool  # its value comes with the weights

    def shapes(self) -> dict:
        """The weights' side of _from_config's "shapes"."""
        return {
            "embed_dim": self.embed_dim,
            "image width": self.dim,
            "image layers": self.vdepth,
            "patch size": self.patch,
            "image size": self.grid * self.patch,
            "image MLP width": self.vhidden,
            "ln_pre": self.ln_pre,
            "image layer scale": self.layer_scale,
            "text width": self.width,
            "text layers": self.tdepth,
            "text MLP width": self.thidden,
            "context length": self.context,
            "vocabulary": self.vocab,
        }


def _read_weights(sd: dict) -> _Weights:
    """The shapes of a normalized state dict, refused where they are no OpenCLIP ViT CLIP."""
    if "visual.conv1.weight" not in sd or "token_embedding.weight" not in sd:
        raise UserError(
            "OpenCLIP: not an OpenCLIP ViT CLIP state dict (no visual.conv1.weight / "
            f"token_embedding.weight; its keys begin {first_keys(sd, 3)})"
        )
    dim, in_chans, patch, patch_w = _shape(sd, "visual.conv1.weight", 4)
    if patch != patch_w:
        raise UserError(
            f"OpenCLIP: visual.conv1.weight has a {patch}x{patch_w} patch; vitscale's patches are square"
        )
    rows, pos_w = _shape(sd, "visual.positional_embedding", 2)
    grid = math.isqrt(rows - 1)
    if grid * grid != rows - 1 or pos_w != dim:
        raise UserError(
            f"OpenCLIP: visual.positional_embedding has shape {(rows, pos_w)}, which is no square "
            f"patch grid plus a class token of width {dim}"
        )
    proj_w, embed_dim = _shape(sd, "visual.proj", 2)
    vocab, width = _shape(sd, "token_embedding.weight", 2)
    context, _ = _shape(sd, "positional_embedding", 2)
    text_w, text_e = _shape(sd, "text_projection", 2)
    if proj_w != dim or text_w != width or text_e != embed_dim:
        raise UserError(
            f"OpenCLIP: visual.proj {(proj_w, embed_dim)} and text_projection {(text_w, text_e)} do not "
            f"project widths {dim} and {width} to one embedding"
        )
    vdepth, tdepth = (
        depth_of(sd, "visual.transformer.resblocks."),
        depth_of(sd, "transformer.resblocks."),
    )
    vhidden = _shape(sd, "visual.transformer.resblocks.0.mlp.c_fc.weight", 2)[0]
    thidden = _shape(sd, "transformer.resblocks.0.mlp.c_fc.weight", 2)[0]
    return _Weights(
        dim=dim,
        in_chans=in_chans,
        patch=patch,
        grid=grid,
        embed_dim=embed_dim,
        vocab=vocab,
        width=width,
        context=context,
        vdepth=vdepth,
        tdepth=tdepth,
        vhidden=vhidden,
        thidden=thidden,
        ln_pre="visual.ln_pre.weight" in sd,
        layer_scale="visual.transformer.resblocks.0.ls_1.gamma" in sd,
    )


def _options_from_config(w: _Weights, mc: dict, where: str, given: dict, keys: dict) -> dict:
    """The options a configuration sets, checked against the weights and the explicit arguments
    (`given`: vision_heads, text_heads, quick_gelu as the caller passed them)."""
    said = _from_config(mc)
    have = w.shapes()
    wrong = [
        f"{k} {said['shapes'][k]} (the weights: {have[k]})"
        for k in have
        if said["shapes"][k] != have[k]
    ]
    if wrong:
        raise UserError(
            f"OpenCLIP: {where} does not describe these weights: {', '.join(wrong[:3])}"
            f"{' ...' if len(wrong) > 3 else ''}"
        )
    if not said["width_ok"]:
        raise UserError(
            f"OpenCLIP: {where}: image width {w.dim} is not a multiple of vision_cfg.head_width"
        )
    for arg, value, want in (
        ("vision_heads", given["vision_heads"] or None, said["vision_heads"]),
        ("text_heads", given["text_heads"] or None, said["text_heads"]),
        ("quick_gelu", given["quick_gelu"], said["quick_gelu"]),
    ):
        if value is not None and value != want:
            shown = (
                {True: "quick_gelu", False: "gelu"}.get(value, value)
                if arg == "quick_gelu"
                else value
            )
            raise UserError(
                f"OpenCLIP: {keys[arg]}{shown} disagrees with {where}, which says {arg} {want}"
            )
    return dict(
        vision_heads=said["vision_heads"],
        text_heads=said["text_heads"],
        act="quick_gelu" if said["quick_gelu"] else "gelu",
        pools=dict(
            vision_pool=said["vision_pool"], vision_norm_after_pool=said["vision_norm_after_pool"]
        ),
        text_opts=dict(causal=said["causal"], pool=said["text_pool"], eos_id=said["eos_id"]),
        eps=(said["vision_eps"], said["text_eps"]),
        assumed=[],
    )


def _options_by_default(w: _Weights, given: dict, keys: dict, act_note: str) -> dict:
    """Without a configuration: the explicit arguments, else OpenCLIP's defaults, listed in
    "assumed" (refused where OpenCLIP's configurations of the width use other head counts)."""
    vision_heads, text_heads, quick_gelu = (
        given["vision_heads"],
        given["text_heads"],
        given["quick_gelu"],
    )
    if not vision_heads:
        _wide_head_refusal("image", w.dim, keys["config"] + ", or " + keys["vision_heads"])
    if not text_heads:
        _wide_head_refusal("text", w.width, keys["config"] + ", or " + keys["text_heads"])
    vh, th = vision_heads or max(1, w.dim // 64), text_heads or max(1, w.width // 64)
    assumed = [
        f"image heads {vh} ({'given' if vision_heads else f'width {w.dim} / head width 64'})",
        f"text heads {th} ({'given' if text_heads else f'width {w.width} / 64'})",
        f"{'QuickGELU' if quick_gelu else 'GELU'}"
        f"{f' ({act_note})' if act_note else ' (given)' if quick_gelu is not None else ''}",
        "the class token's image feature",
        "a causal text tower read at the end-of-text token",
    ]
    if not w.ln_pre:
        assumed[-1] += (
            " (weights without ln_pre may be CLIPA's, which average-pool and read text bidirectionally)"
        )
    return dict(
        vision_heads=vh,
        text_heads=th,
        act="quick_gelu" if quick_gelu else "gelu",
        pools={},
        text_opts={},
        eps=(1e-5, 1e-5),
        assumed=assumed,
    )


def _spec(w: _Weights, opts: dict, mc: dict | None) -> ClipSpec:
    """The ClipSpec of the weights' shapes with the resolved options."""
    for what, width, h in (
        ("image", w.dim, opts["vision_heads"]),
        ("text", w.width, opts["text_heads"]),
    ):
        if width % h:
            raise UserError(f"OpenCLIP: {what} width {width} is not divisible by {h} heads")
    act, eps = opts["act"], opts["eps"]
    vision = ViTSpec(
        image_size=w.grid * w.patch,
        patch_size=w.patch,
        in_chans=w.in_chans,
        num_classes=w.embed_dim,
        dim=w.dim,
        depth=w.vdepth,
        heads=opts["vision_heads"],
        mlp_ratio=ratio(w.vhidden, w.dim),
        head="token",
        **(
            {"layer_scale": float((mc or {}).get("vision_cfg", {}).get("ls_init_value") or 1e-5)}
            if w.layer_scale
            else {}
        ),
    )
    text = TextSpec(
        vocab_size=w.vocab,
        context_length=w.context,
        dim=w.width,
        depth=w.tdepth,
        heads=opts["text_heads"],
        mlp_ratio=ratio(w.thidden, w.width),
        embed_dim=w.embed_dim,
        norm_eps=eps[1],
        act=act,
        **opts["text_opts"],
    )
    return ClipSpec(
        vision=vision,
        text=text,
        embed_dim=w.embed_dim,
        ln_pre=w.ln_pre,
        patch_bias=False,
        proj_bias=False,
        vision_norm_eps=eps[0],
        vision_act=act,
        **opts["pools"],
    )


def resolve(
    sd: dict,
    config,
    *,
    quick_gelu: bool | None,
    vision_heads: int,
    text_heads: int,
    weights=None,
    keys: dict | None = None,
    act_note: str = "",
) -> tuple[ClipSpec, list[str], dict | None, str]:
    """(spec, the defaults taken [empty when a configuration said everything], model_cfg or None, where
    it came from). `keys`: how the caller spells its arguments in messages ({"config", "vision_heads",
    "text_heads", "quick_gelu"}); `act_note`: where a `quick_gelu` given without a configuration came
    from (default: the caller)."""
    keys = {
        "config": "config=NAME or an open_clip_config.json",
        "vision_heads": "vision_heads=",
        "text_heads": "text_heads=",
        "quick_gelu": "quick_gelu=",
    } | (keys or {})
    sd = normalize(sd)
    mc, _, where = read_config(config, weights)
    if has_timm_tower(mc):
        return _resolve_timm(sd, mc, where, quick_gelu=quick_gelu, text_heads=text_heads, keys=keys)
    if mc is not None:
        refuse_config(mc, where)
    if any(k.startswith(TRUNK) for k in sd):
        raise UserError(
            f"OpenCLIP: a timm image tower ({TRUNK}*): which timm architecture it is is not in the "
            f"weights: give its configuration ({keys['config']})"
        )
    refuse_keys(sd)
    w = _read_weights(sd)
    given = dict(vision_heads=vision_heads, text_heads=text_heads, quick_gelu=quick_gelu)
    opts = (
        _options_from_config(w, mc, where, given, keys)
        if mc is not None
        else _options_by_default(w, given, keys, act_note)
    )
    return _spec(w, opts, mc), opts["assumed"], mc, where


def _resolve_timm(sd: dict, mc: dict, where: str, *, quick_gelu, text_heads: int, keys: dict):
    """resolve's answer for a timm image tower (timm_tower.py): everything from the configuration."""
    spec = timm_clip_spec(sd, mc, where)
    for arg, value, want in (
        ("text_heads", text_heads or None, spec.text.heads),
        ("quick_gelu", quick_gelu, spec.text.act == "quick_gelu"),
    ):
        if value is not None and value != want:
            raise UserError(
                f"OpenCLIP: {keys[arg]}{value} disagrees with {where}, which says {arg} {want}"
            )
    return spec, [], mc, where


def announce(prefix: str, assumed: list[str], keys: str) -> None:
    if assumed:
        log.warning(
            f"{prefix}: OpenCLIP's defaults taken for what the weights do not hold: {', '.join(assumed)} "
            f"(set {keys})"
        )


PY_KEYS = "config=NAME or an open_clip_config.json, or vision_heads= / text_heads= / quick_gelu="


def open_clip_spec(
    sd: dict,
    config=None,
    *,
    quick_gelu: bool | None = None,
    vision_heads: int = 0,
    text_heads: int = 0,
) -> ClipSpec:
    """The ClipSpec that computes what OpenCLIP's model with these weights computes. `config`: an
    OpenCLIP model name, an open_clip_config.json (path, folder or dict) or a model_cfg dict; without
    one, OpenCLIP's defaults for what the weights leave open, announced in one warning line (and
    refused where OpenCLIP's configurations of that width use other head counts). `quick_gelu`,
    `vision_heads`, `text_heads`: explicit values (they must agree with a configuration)."""
    spec, assumed, _, _ = resolve(
        sd, config, quick_gelu=quick_gelu, vision_heads=vision_heads, text_heads=text_heads
    )
    announce("OpenCLIP", assumed, PY_KEYS)
    return spec
