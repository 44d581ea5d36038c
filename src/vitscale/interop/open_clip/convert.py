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

What the weights do not hold comes from OpenCLIP's configuration of the model or from OpenCLIP's
defaults, and variants vitscale does not implement are refused: arch.py. Nothing here
imports open_clip.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from ...errors import UserError
from ...models.clip import CLIP, ClipSpec
from ..files import first_keys
from .arch import (
    CONFIG_FILE,
    PY_KEYS,
    announce,
    normalize,
    open_clip_spec,
    read_config,
    refuse_config,
    refuse_keys,
    resolve,
)
from .layout import BLOCK_MAP
from .timm_tower import from_timm_tower, has_timm_tower, timm_model_cfg, to_timm_tower

# what open_clip's `local-dir:` loader picks from a folder first (factory._find_checkpoint_in_dir)
LOCAL_DIR_PREFERRED = (
    "open_clip_model.safetensors",
    "open_clip_pytorch_model.safetensors",
    "open_clip_pytorch_model.bin",
    "open_clip_pytorch_model.pth",
    "model.safetensors",
    "pytorch_model.bin",
    "pytorch_model.pth",
    "model.pth",
)


def _key_map(spec: ClipSpec) -> dict[str, str]:
    """OpenCLIP key -> vitscale key, for every parameter of the spec's model."""
    m = {
        "visual.conv1.weight": "visual.patch_embed.proj.weight",
        "visual.class_embedding": "visual.cls_token",
        "visual.positional_embedding": "visual.pos_embed",
        "visual.proj": "visual.head.weight",
        "token_embedding.weight": "text.token_embedding.weight",
        "positional_embedding": "text.positional_embedding",
        "text_projection": "text.proj.weight",
        "logit_scale": "logit_scale",
    }
    post = "visual.fc_norm" if spec.vision_norm_after_pool else "visual.norm"
    for p in ("weight", "bias"):
        m[f"visual.ln_post.{p}"] = f"{post}.{p}"
        m[f"ln_final.{p}"] = f"text.ln_final.{p}"
        if spec.ln_pre:
            m[f"visual.ln_pre.{p}"] = f"visual.norm_pre.{p}"
    for theirs, ours, depth in (
        ("visual.transformer.resblocks", "visual.blocks", spec.vision.depth),
        ("transformer.resblocks", "text.blocks", spec.text.depth),
    ):
        for i in range(depth):
            if ours == "visual.blocks" and getattr(spec.vision, "layer_scale", 0):
                m[f"{theirs}.{i}.ls_1.gamma"], m[f"{theirs}.{i}.ls_2.gamma"] = (
                    f"{ours}.{i}.ls1.gamma",
                    f"{ours}.{i}.ls2.gamma",
                )
            for a, b in BLOCK_MAP:
                names = (
                    [(a, b)]
                    if a.startswith("attn.in_proj")
                    else [(f"{a}.weight", f"{b}.weight"), (f"{a}.bias", f"{b}.bias")]
                )
                for x, y in names:
                    m[f"{theirs}.{i}.{x}"] = f"{ours}.{i}.{y}"
    return m


def _layout_problem(spec: ClipSpec) -> str:
    """'' when OpenCLIP's CLIP computes the spec's function, else what it lacks."""
    v = spec.vision
    vit_variants = (
        getattr(v, "reg_tokens", 0)
        or not getattr(v, "qkv_bias", True)
        or getattr(v, "pre_norm", False)
        or not getattr(v, "final_norm", True)
        or getattr(v, "class_token", None) is False
        or getattr(v, "act", "gelu") != "gelu"
        or getattr(v, "norm_eps", 1e-6) != 1e-6
    )
    if (
        spec.patch_bias
        or spec.proj_bias
        or v.stem != "patch"
        or v.head != "token"
        or v.no_embed_class
        or v.fc_norm
        or vit_variants
    ):
        return (
            "the model lacks OpenCLIP's layout (it needs patch_bias=False, proj_bias=False, the patch stem and a "
            "class token); start from OpenCLIP weights (from_open_clip) to export to OpenCLIP"
        )
    if spec.vision_act != spec.text.act or spec.vision_act not in ("gelu", "quick_gelu"):
        return (
            f"the towers' activations ({spec.vision_act}, {spec.text.act}) are not one GELU or QuickGELU for both, "
            "as OpenCLIP's quick_gelu sets them"
        )
    if v.in_chans != 3:
        return (
            f"the model takes {v.in_chans}-channel images; OpenCLIP's image tower takes RGB "
            "(visual.conv1 has 3 input channels)"
        )
    return ""


# [W] / [N+1, W] / []
RESHAPED = ("visual.class_embedding", "visual.positional_embedding", "logit_scale")


def from_open_clip(
    sd: dict,
    config=None,
    *,
    quick_gelu: bool | None = None,
    vision_heads: int = 0,
    text_heads: int = 0,
    attention: str = "sdpa",
) -> CLIP:
    """vitscale's CLIP holding an OpenCLIP ViT CLIP state dict's weights (the same function, in
    fp32); `config` etc.: as open_clip_spec. `attention` ("sdpa" | "explicit", both towers) changes
    no weights."""
    sd = normalize(sd)
    spec = open_clip_spec(
        sd, config, quick_gelu=quick_gelu, vision_heads=vision_heads, text_heads=text_heads
    )
    return _build(sd, spec, attention)


def _build(sd: dict, spec: ClipSpec, attention: str = "sdpa") -> CLIP:
    spec = replace(
        spec,
        vision=replace(spec.vision, attention=attention),
        text=replace(spec.text, attention=attention),
    )
    with torch.device("meta"):  # no initialization: every parameter comes from the weights
        model = CLIP(spec)
    model.load_state_dict(convert_any(sd, spec, model.state_dict()), strict=True, assign=True)
    rope = model.visual.rope
    if (
        rope is not None
    ):  # its non-persistent buffers: not in the file (interop/timm/vision_transformer.from_timm)
        freqs = {k: v.clone() for k, v in rope.state_dict().items()}
        rope.to_empty(device="cpu")
        rope.reset_parameters()
        if freqs:
            rope.load_state_dict(freqs)
    return model


def convert_any(sd: dict, spec: ClipSpec, ours: dict) -> dict[str, torch.Tensor]:
    """OpenCLIP's (normalized) state dict as the spec's model's: OpenCLIP's ViT (_convert) or a
    timm image tower (timm_tower.from_timm_tower)."""
    return from_timm_tower(sd, spec, ours) if spec.vision_timm else _convert(sd, spec, ours)


def load_open_clip(
    path,
    config=None,
    *,
    quick_gelu: bool | None = None,
    vision_heads: int = 0,
    text_heads: int = 0,
    attention: str = "sdpa",
) -> CLIP:
    """vitscale's CLIP from an OpenCLIP weights file as published: its configuration from `config`
    (a model name, an open_clip_config.json) or else the open_clip_config.json beside the file
    (OpenCLIP's hub folders keep one), else OpenCLIP's defaults, announced. The configuration is
    read, and checked against the file's keys and shapes, before the weights."""
    from ..files import read_state_dict

    path = weights_path(path)
    try:
        spec, assumed, _, _ = resolve(
            _header(path),
            config,
            quick_gelu=quick_gelu,
            vision_heads=vision_heads,
            text_heads=text_heads,
            weights=path,
        )
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    announce(f"OpenCLIP: {path}", assumed, PY_KEYS)
    return _build(normalize(read_state_dict(path)), spec, attention)


def _header(path) -> dict:
    """{key: an object with .shape} from a weights file: a safetensors header alone (meta tensors),
    other formats loaded."""
    from ..files import read_state_dict

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
        parts = ([f"unknown keys {first_keys(unknown)}"] if unknown else []) + (
            [f"missing keys {first_keys(missing)}"] if missing else []
        )
        raise UserError(f"OpenCLIP: {'; '.join(parts)}")
    out = {}
    for theirs, name in kmap.items():
        v = sd[theirs].detach().to("cpu", torch.float32, copy=True)  # the model owns its weights
        if theirs in ("visual.proj", "text_projection"):
            v = v.t().contiguous()
        if theirs in RESHAPED and v.numel() == ours[name].numel():
            v = v.reshape(ours[name].shape)
        if v.shape != ours[name].shape:
            raise UserError(
                f"OpenCLIP: {theirs} has shape {tuple(sd[theirs].shape)}, the model expects "
                f"{tuple(ours[name].shape)} at {name}"
            )
        out[name] = v
    return out


# -- export ----------------------------------------------------------------------------------------
def to_open_clip(model: CLIP) -> dict[str, torch.Tensor]:
    """The state dict OpenCLIP's CLIP of the same configuration (open_clip_config(model.spec)) loads
    with strict=True (fp32, CPU)."""
    spec = getattr(model, "spec", None)
    if not isinstance(spec, ClipSpec):
        raise UserError("export to OpenCLIP: not a vitscale CLIP model")
    ours = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    if spec.vision_timm:
        return to_timm_tower(ours, spec)
    problem = _layout_problem(spec)
    if problem:
        raise UserError(f"export to OpenCLIP: {problem}")
    out = {}
    for theirs, name in _key_map(spec).items():
        v = ours[name]
        if theirs in ("visual.proj", "text_projection"):
            v = v.t()
        elif theirs == "visual.class_embedding":  # [1, 1, W] -> [W]
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
    if spec.vision_timm:
        return {"model_cfg": timm_model_cfg(spec), "preprocess_cfg": dict(preprocess or {})}
    problem = _layout_problem(spec)
    if problem:
        raise UserError(f"export to OpenCLIP: {problem}")
    v, t = spec.vision, spec.text
    vision = {
        "image_size": v.image_size,
        "patch_size": v.patch_size,
        "width": v.dim,
        "layers": v.depth,
        "head_width": v.dim // v.heads,
        "mlp_ratio": v.mlp_ratio,
    }
    if not spec.ln_pre:
        vision["no_ln_pre"] = True
    if getattr(v, "layer_scale", 0):
        vision["ls_init_value"] = v.layer_scale  # (the scales themselves are in the weights)
    if spec.vision_pool == "avg":
        vision["pool_type"] = "avg"
    if spec.vision_norm_after_pool:
        vision["final_ln_after_pool"] = True
    text = {
        "context_length": t.context_length,
        "vocab_size": t.vocab_size,
        "width": t.dim,
        "heads": t.heads,
        "layers": t.depth,
        "mlp_ratio": t.mlp_ratio,
    }
    if not t.causal:
        text["no_causal_mask"] = True
    if t.pool != "argmax":
        text["pool_type"] = t.pool
    if t.pool == "eos":
        text["eos_id"] = t.eos_id
    for cfg, eps in ((vision, spec.vision_norm_eps), (text, t.norm_eps)):
        if eps != 1e-5:  # OpenCLIP's LayerNorm: torch's default
            cfg["norm_kwargs"] = {"eps": eps}
    model_cfg = {
        "embed_dim": spec.embed_dim,
        "quick_gelu": spec.vision_act == "quick_gelu",
        "vision_cfg": vision,
        "text_cfg": text,
    }
    return {"model_cfg": model_cfg, "preprocess_cfg": dict(preprocess or {})}


def save_open_clip(
    model: CLIP, out, preprocess: dict | None = None, metadata: dict | None = None
) -> Path:
    """OpenCLIP's layout on disk: the weights (safetensors) and open_clip_config.json beside them.
    `out`: a folder (the weights go to FOLDER/open_clip_model.safetensors, the name open_clip's
    `local-dir:` loader takes first) or a .safetensors file (open_clip_config.json in its folder).
    Refuses to overwrite an open_clip_config.json that describes another model. Returns the weights'
    path (load_call(path) is the call that loads them)."""
    from ...checkpoint import export_safetensors
    from ..files import SUFFIXES

    sd = to_open_clip(model)
    config = open_clip_config(model.spec, preprocess)
    out = Path(out)
    if out.suffix in SUFFIXES and out.suffix != ".safetensors":
        raise UserError(
            f"export --format open_clip: --out {out}: give a folder or a .safetensors file"
        )
    weights = out if out.suffix == ".safetensors" else out / LOCAL_DIR_PREFERRED[0]
    cfg_path = weights.parent / CONFIG_FILE
    if cfg_path.is_file():
        try:
            same = json.loads(cfg_path.read_text()) == json.loads(json.dumps(config))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            same = False
        if not same:
            raise UserError(
                f"export --format open_clip: {cfg_path} already describes another model; export into a "
                "folder of its own (--out DIR)"
            )
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
    call = (
        f'model, _, preprocess = open_clip.create_model_and_transforms("local-dir:{folder}"); '
        f'tokenizer = open_clip.get_tokenizer("local-dir:{folder}")'
    )
    chosen = local_dir_choice(folder)
    if chosen is not None and chosen.resolve() != path:
        return (
            f"open_clip's local-dir: loader would read {chosen.name} from {folder}, not {path.name}: put "
            f"{path.name} and {CONFIG_FILE} in a folder of their own (or export with --out DIR), then load it: "
            + call.replace(str(folder), "DIR")
        )
    return f"load it in OpenCLIP: {call}"


# -- model.init ------------------------------------------------------------------------------------
INIT_KEYS = {
    "config": "model.init_open_clip=NAME or CONFIG.json",
    "vision_heads": "model.heads=",
    "text_heads": "model.text_heads=",
    "quick_gelu": "model.init_act=",
}
INIT_HINT = (
    "model.init_open_clip=NAME or CONFIG.json, or model.heads / model.text_heads / model.init_act"
)


def _refuse_tokenizer(mc: dict, where: str) -> None:
    """A run tokenizes its captions with CLIP's BPE: weights trained on another tokenizer's ids cannot
    start it (their weights still load and export: load_open_clip, to_open_clip)."""
    t = mc.get("text_cfg") or {}
    for key in ("hf_tokenizer_name", "tokenizer_mode"):
        if t.get(key):
            raise UserError(
                f"OpenCLIP: {where}: the weights were trained with another tokenizer (text_cfg.{key}="
                f"{t[key]!r}), which training and zero-shot evaluation need; vitscale has CLIP's BPE only "
                "(the weights still load and export: interop.open_clip.load_open_clip, to_open_clip)"
            )


# an OpenCLIP hub folder's, in OpenCLIP's order of preference
OPEN_CLIP_WEIGHTS = (
    "open_clip_model.safetensors",
    "open_clip_pytorch_model.bin",
    "model.safetensors",
    "pytorch_model.bin",
)


def weights_path(path) -> Path:
    """model.init's weights file: the path given, or in an OpenCLIP hub folder (open_clip_config.json
    beside it) its weights file."""
    path = Path(path)
    if not path.is_dir():
        return path
    for name in OPEN_CLIP_WEIGHTS:
        if (path / name).is_file():
            return path / name
    raise UserError(
        f"{path}: no OpenCLIP weights file ({', '.join(OPEN_CLIP_WEIGHTS)}) in this folder"
    )


def check_init(path, open_clip: str = "") -> None:
    """config's check of a CLIP model.init: a one-line UserError with the real cause where the file (with
    its configuration) cannot start vitscale's CLIP; reads the configuration and the file's keys only."""
    path = weights_path(path)
    if not Path(path).is_file():
        return  # the run reports a missing file when it reads it
    try:
        sd = _header(path)
        mc, _, where = read_config(open_clip, path)
    except UserError as e:
        raise UserError(f"model.init={path}: {e}") from None
    if mc is not None:
        try:
            refuse_config(mc, where)
            _refuse_tokenizer(mc, where)
        except UserError as e:
            raise UserError(f"model.init={path}: {e}") from None
        if has_timm_tower(mc):  # its keys are read with the weights (timm_tower.py)
            return
    keys = {k[len("text.") :] if k.startswith("text.") else k for k in sd}
    if (
        "pos_embed" in keys
        and "patch_embed.proj.weight" in keys
        and "visual.conv1.weight" not in keys
    ):
        raise UserError(
            f"model.init={path} holds ViT classifier weights (pos_embed, patch_embed); CLIP models cannot "
            "be initialized from ViT classifier weights, only from OpenCLIP CLIP weights"
        )
    try:
        refuse_keys(normalize(sd))
    except UserError as e:
        raise UserError(f"model.init={path}: {e}") from None
    if "visual.conv1.weight" not in keys or "token_embedding.weight" not in keys:
        raise UserError(
            f"model.init={path} holds no OpenCLIP CLIP weights (no visual.conv1.weight / "
            f"token_embedding.weight; its keys begin {first_keys(sd, 3)})"
        )


def uses_quick_gelu(path) -> bool:
    """The activation is not in the weights: without a configuration, files whose name says "quickgelu"
    or "openai" (OpenCLIP's configurations and pretrained tags for OpenAI's weights, e.g.
    timm/vit_base_patch32_clip_224.openai) are read with QuickGELU, others with GELU (announced)."""
    name = str(Path(path)).lower()
    return "quickgelu" in name or "quick_gelu" in name or "openai" in name


def init_weights(
    path,
    *,
    image_size: int,
    in_chans: int,
    context_length: int,
    vocab_size: int,
    vision_heads: int = 0,
    text_heads: int = 0,
    attention: str = "sdpa",
    drop_path: float = 0.0,
    dropout: float = 0.0,
    quick_gelu: bool | None = None,
    open_clip: str = "",
) -> tuple[ClipSpec, dict]:
    """`model.init` for CLIP: (spec, state dict for it) from an OpenCLIP ViT CLIP file, the architecture
    from the weights and their configuration (`open_clip`: model.init_open_clip, a model name or an
    open_clip_config.json; "": the open_clip_config.json beside the file; else OpenCLIP's defaults,
    announced), the geometry from the run: the image position embeddings resampled to the data's patch
    grid (finetune.resample_pos_embed), RGB patch filters summed for grey images, the text position
    embeddings cut to `context_length` (exact: causal attention never looks past a caption's last
    token). `quick_gelu` None: from the configuration, else from the file name (uses_quick_gelu)."""
    path = weights_path(path)
    src, state = _read_init(
        path, open_clip, quick_gelu=quick_gelu, vision_heads=vision_heads, text_heads=text_heads
    )
    _check_init_geometry(
        src, image_size=image_size, context_length=context_length, vocab_size=vocab_size
    )
    v, t = src.vision, src.text
    if src.vision_timm:
        _check_timm_geometry(src, path, image_size, in_chans)
    spec = replace(
        src,
        vision=replace(
            v,
            image_size=v.image_size if src.vision_timm else image_size,
            in_chans=in_chans,
            attention=attention,
            drop_path=drop_path,
            dropout=dropout,
        ),
        text=replace(t, context_length=context_length, attention=attention),
    )
    if src.vision_timm:  # the text positions cut only
        state["text.positional_embedding"] = state["text.positional_embedding"][
            :context_length
        ].contiguous()
        return spec, state
    return spec, _fit_init_state(
        state,
        patch_size=v.patch_size,
        image_size=image_size,
        in_chans=in_chans,
        context_length=context_length,
    )


def _read_init(path, open_clip: str, *, quick_gelu, vision_heads, text_heads):
    """init_weights' reading: (the weights' own spec, their state dict in vitscale's keys), the
    architecture resolved from the weights and their configuration, what was assumed announced."""
    from ..files import read_state_dict

    try:
        mc, _, _ = read_config(open_clip, path)
        note = ""
        if quick_gelu is None and mc is None:  # the file name's word (announced)
            quick_gelu = uses_quick_gelu(path)
            note = f"the file name {'says' if quick_gelu else 'does not say'} quickgelu or openai"
        src, assumed, mc, where = resolve(
            _header(path),
            open_clip,
            quick_gelu=quick_gelu,
            vision_heads=vision_heads,
            text_heads=text_heads,
            weights=path,
            keys=INIT_KEYS,
            act_note=note,
        )
        if mc is not None:
            _refuse_tokenizer(mc, where)
        sd = normalize(read_state_dict(path))
        with torch.device("meta"):
            state = convert_any(sd, src, CLIP(src).state_dict())
    except UserError as e:
        raise UserError(f"model.init: {path}: {str(e).removeprefix('OpenCLIP: ')}") from None
    announce(
        f"model.init: {path}" + (" (no open_clip_config.json beside it)" if mc is None else ""),
        assumed,
        INIT_HINT,
    )
    return src, state


def _check_timm_geometry(src: ClipSpec, path, image_size: int, in_chans: int) -> None:
    """A timm image tower is kept as timm builds it: the run's patch grid and channels are its."""
    v = src.vision
    if (image_size // v.patch_size, in_chans) != (v.image_size // v.patch_size, v.in_chans):
        raise UserError(
            f"model.init: {path}: its timm image tower ({src.vision_timm}) is kept as timm builds it: "
            f"set data.image_size={v.image_size} and {v.in_chans}-channel images (the run has "
            f"{image_size} px, {in_chans} channels)"
        )


def _check_init_geometry(
    src: ClipSpec, *, image_size: int, context_length: int, vocab_size: int
) -> None:
    """Refuse a run whose image size, context length or vocabulary the weights cannot serve."""
    v, t = src.vision, src.text
    if image_size % v.patch_size:
        raise UserError(
            f"model.init: image size {image_size} is not divisible by the weights' patch size "
            f"{v.patch_size} (set data.image_size)"
        )
    if context_length > t.context_length:
        raise UserError(
            f"model.init: model.context_length={context_length} is longer than the weights' "
            f"{t.context_length} positions"
        )
    if context_length < t.context_length and not t.causal:
        raise UserError(
            f"model.init: model.context_length={context_length} is shorter than the weights' "
            f"{t.context_length}: their text tower is bidirectional, so cutting it changes every feature"
        )
    if vocab_size != t.vocab_size:
        raise UserError(
            f"model.init: the weights' vocabulary has {t.vocab_size} tokens, the tokenizer "
            f"{vocab_size}"
        )


def _fit_init_state(
    state: dict, *, patch_size: int, image_size: int, in_chans: int, context_length: int
) -> dict:
    """The weights to this run's geometry: image position embeddings resampled to the patch grid,
    patch filters to `in_chans`, text position embeddings cut to `context_length`."""
    from ..finetune import adapt_in_chans, resample_pos_embed

    state["visual.pos_embed"] = resample_pos_embed(
        state["visual.pos_embed"], image_size // patch_size, 1
    )
    state["visual.patch_embed.proj.weight"] = adapt_in_chans(
        state["visual.patch_embed.proj.weight"], in_chans
    )
    state["text.positional_embedding"] = state["text.positional_embedding"][
        :context_length
    ].contiguous()
    return state


def export_run(model: CLIP, out, metadata: dict, run_dir, preprocess: dict) -> Path:
    """`vitscale export RUN --format open_clip`: save_open_clip with the run's preprocessing
    (`preprocess`: tasks/base.py's run_preprocess; its OpenCLIP keys are written); the default
    `out` (RUN/model_open_clip.safetensors) becomes the folder RUN/open_clip."""
    out = Path(out)
    if out == Path(run_dir) / "model_open_clip.safetensors":
        out = Path(run_dir) / "open_clip"
    return save_open_clip(
        model, out, {k: v for k, v in preprocess.items() if k in PREPROCESS_KEYS}, metadata
    )


# OpenCLIP's
PREPROCESS_KEYS = ("size", "mode", "mean", "std", "interpolation", "resize_mode", "fill_color")
