"""timm's VisionTransformer weights <-> vitscale's ViT.

vitscale's ViT uses timm's parameter names (cls_token, reg_token, pos_embed, patch_embed.proj,
norm_pre, blocks.N.{norm1, attn.qkv, attn.proj, ls1, norm2, mlp.fc1, mlp.fc2, ls2}, norm, fc_norm,
head) and its attention, so a state dict maps one to one. What the weights do not hold (the head
count, the activation, the LayerNorm eps, and whether a class token is read or the patch tokens
averaged) comes from what travels with published weights, in this order:
- the hub-style `config.json` next to the weights file (timm's hub folders: "architecture",
  "model_args", "pretrained_cfg");
- a timm architecture name (`model.init_arch`, `arch=`), read from timm/archs.py: the arguments each
  of timm's `vision_transformer` / `deit` entry points gives the model, generated from timm's source;
- else the keys, with timm's defaults for the rest, announced in one line (logger
  "vitscale.interop") naming each assumption and the key that changes it.
timm's arguments map to ViTSpec options: class_token and global_pool ("token" / "avg", fc_norm),
reg_tokens, init_values (layer scale), qkv_bias, no_embed_class, pre_norm (and no patch bias),
final_norm, norm_layer's eps, act_layer (gelu, gelu_tanh, quick_gelu). The other variants are
refused in one line naming what they are (distillation token, attention pooling, parallel blocks,
gated MLPs, RMSNorm, q/k norm, ...).

Export (`to_timm`, `timm_hub_config`) writes the same keys and a hub-style config.json whose
architecture and model_args rebuild exactly the function, with the run's input size, mean/std and
interpolation as its pretrained config. Nothing here imports timm.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import replace
from pathlib import Path

import torch

from ...errors import UserError, did_you_mean
from ...models.vit import VisionTransformer, ViTSpec
from ..files import first_keys, refuse_unsupported
from .args import mlp_kind, mlp_ratio_for, norm_kind, parse_layer, short_name
from .eva import (
    eva_export_arch,
    eva_kwargs,
    eva_spec,
    eva_to_vitscale,
    uses_eva,
    vitscale_to_eva,
)

log = logging.getLogger("vitscale.interop")

HEADS_BY_DIM = {96: 3, 128: 4, 192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}  # timm's tiny..huge
IMPLEMENTED = "is not implemented by vitscale's ViT"
# what the keys show, for a file that comes without config.json or architecture name
UNSUPPORTED: dict[str, str] = {}
# parallel blocks: computed, but what their keys leave open (the block type's options) is read from
# config.json or the architecture name only
PARALLEL_KEYS = {
    ".attns.": "parallel blocks (ParallelThingsBlock",
    ".in_proj.": "parallel blocks (ParallelScalingBlock",
    "lambda_q1": "differential attention (attn_layer='diff'",
}
# timm's VisionTransformer arguments and their defaults (timm 1.0.31)
ARG_DEFAULTS = dict(
    img_size=224,
    patch_size=16,
    in_chans=3,
    num_classes=1000,
    global_pool="token",
    embed_dim=768,
    depth=12,
    num_heads=12,
    mlp_ratio=4.0,
    qkv_bias=True,
    qk_norm=False,
    scale_attn_norm=False,
    scale_mlp_norm=False,
    proj_bias=True,
    init_values=None,
    class_token=True,
    pos_embed="learn",
    no_embed_class=False,
    reg_tokens=0,
    pre_norm=False,
    final_norm=True,
    fc_norm=None,
    pool_include_prefix=False,
    dynamic_img_size=False,
    dynamic_img_pad=False,
    embed_layer=None,
    embed_norm_layer=None,
    norm_layer=None,
    act_layer=None,
    block_fn=None,
    mlp_layer=None,
    attn_layer=None,
)
# arguments that change nothing in the function the weights compute at their own image size
NEUTRAL = {
    "drop_rate",
    "pos_drop_rate",
    "patch_drop_rate",
    "proj_drop_rate",
    "attn_drop_rate",
    "drop_path_rate",
    "weight_init",
    "fix_init",
    "dynamic_img_size",
    "dynamic_img_pad",
    "out_indices",
    "pretrained_strict",
    "device",
    "dtype",
}
ACTS = {
    "silu": "silu",
    "SiLU": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_tanh": "gelu_tanh",
    "quick_gelu": "quick_gelu",
    "GELU": "gelu",
    "GELUTanh": "gelu_tanh",
    "QuickGELU": "quick_gelu",
}
# what the export's model_args always give (the rest only where it differs from timm's default)
CORE_ARGS = (
    "img_size",
    "patch_size",
    "in_chans",
    "num_classes",
    "embed_dim",
    "depth",
    "num_heads",
    "mlp_ratio",
)
EXPORT_ARGS = CORE_ARGS + (
    "qkv_bias",
    "class_token",
    "global_pool",
    "fc_norm",
    "no_embed_class",
    "reg_tokens",
    "init_values",
    "pre_norm",
    "final_norm",
    "act_layer",
    "norm_layer",
    "mlp_layer",
    "block_fn",
    "qk_norm",
    "scale_attn_norm",
    "scale_mlp_norm",
    "proj_bias",
    "embed_norm_layer",
    "pos_embed",
    "pool_include_prefix",
    "attn_layer",
)
# timm's preferred names
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth")


# -- what travels with the weights -----------------------------------------------------------------
def hub_config_path(weights: str | Path) -> Path:
    """Where timm's hub-style config.json for a weights file (or a hub folder) lies."""
    p = Path(weights)
    return (p if p.is_dir() else p.parent) / "config.json"


def read_hub_config(weights: str | Path) -> dict | None:
    """The config.json next to a weights file (timm's hub folders), None when there is none; a file
    that is not such a config is a one-line error."""
    path = hub_config_path(weights)
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(cfg, dict) or "architecture" not in cfg:
        raise UserError(
            f'{path}: not timm\'s hub config (no "architecture"); move it away or give '
            "model.init_arch"
        )
    return cfg


def weights_in_folder(folder: str | Path) -> Path:
    """The weights file timm's `local-dir:` load reads in a hub folder (its preferred names first)."""
    folder = Path(folder)
    for name in HF_WEIGHTS:
        if (folder / name).is_file():
            return folder / name
    for ext in (".safetensors", ".pth", ".pth.tar", ".bin"):
        found = sorted(folder.glob(f"*{ext}"))
        if found:
            return found[0]
    raise UserError(
        f"{folder}: no weights file (model.safetensors, pytorch_model.bin, ...) in this folder"
    )


def split_arch(name: str) -> tuple[str, str]:
    """ "vit_base_patch16_224.augreg_in21k" -> ("vit_base_patch16_224", "augreg_in21k"); an old name
    timm still accepts is its new name and tag ("vit_base_patch16_224_in21k" -> the same pair)."""
    from .archs import DEPRECATED

    base, _, tag = name.partition(".")
    if base in DEPRECATED:
        new_base, _, new_tag = DEPRECATED[base].partition(".")
        return new_base, tag or new_tag
    return base, tag


def arch_entry(name: str, where: str = "model.init_arch") -> tuple[str, bool, dict]:
    """(module, distilled, entry point arguments) of a timm ViT architecture name (a tag allowed)."""
    from .archs import ARCHS, TIMM_VERSION

    base, _ = split_arch(name)
    if base not in ARCHS:
        raise UserError(
            f"{where}: '{name}' is not one of timm {TIMM_VERSION}'s vision_transformer / deit / "
            f"eva architectures{did_you_mean(base, ARCHS)}"
        )
    return ARCHS[base]


def arch_pretrained_cfg(name: str) -> dict:
    """The pretrained config timm has for an architecture name's tag (its default tag without one)."""
    from .archs import PRETRAINED

    base, tag = split_arch(name)
    tags = PRETRAINED.get(base, [])
    if tag and tag not in dict(tags):
        raise UserError(
            f"model.init_arch: {base} has no pretrained tag '{tag}'{did_you_mean(tag, dict(tags))}"
        )
    return dict(tags).get(tag) if tag else (tags[0][1] if tags else {})


def timm_source(config: dict | None = None, arch: str = "") -> tuple[dict | None, bool, str, dict]:
    """(model arguments, distilled, where they come from, pretrained config) from a hub config.json
    and/or an architecture name; (None, False, "", {}) when neither is given."""
    if config is None and not arch:
        return None, False, "", {}
    if config is None:
        _, distilled, args = arch_entry(arch)
        return dict(args), distilled, arch, arch_pretrained_cfg(arch)
    name = str(config["architecture"])
    if arch and split_arch(arch)[0] != split_arch(name)[0]:
        raise UserError(f"model.init_arch={arch}, but the weights' config.json names {name}")
    _, distilled, args = arch_entry(name, "config.json")
    model_args = config.get("model_args") or {}
    if not isinstance(model_args, dict):
        raise UserError("config.json: model_args is not a mapping of timm arguments")
    pcfg = config.get("pretrained_cfg", {k: v for k, v in config.items() if k != "architecture"})
    if "num_classes" in config:
        pcfg = {**pcfg, "num_classes": config["num_classes"]}
    return {**args, **model_args}, distilled, f"{name} (config.json)", pcfg


# -- reading timm's arguments ------------------------------------------------------------------------
def _refusal(label: str, what: str) -> UserError:
    return UserError(f"timm ViT{label}: {what} {IMPLEMENTED}")


def _check_args(a: dict, label: str) -> None:
    """One line naming the first argument vitscale does not know."""
    unknown = sorted(set(a) - set(ARG_DEFAULTS) - NEUTRAL)
    if unknown:
        raise UserError(
            f"timm ViT{label}: the argument {unknown[0]}={a[unknown[0]]!r} is not known to vitscale"
        )


def _layer_options(a: dict, label: str) -> dict:
    """The ViTSpec options of timm's layer classes (block_fn, attn_layer, mlp_layer, norm_layer,
    embed_layer, embed_norm_layer); one line for one vitscale's ViT does not compute."""
    block = short_name(parse_layer(a["block_fn"])[0])
    if block not in BLOCK_KINDS:
        raise _refusal(label, f"the block type {block} (block_fn)")
    attn = parse_layer(a["attn_layer"])[0]
    if short_name(attn) not in ("", "Attention", "attention", "diff", "DiffAttention"):
        raise _refusal(label, f"the attention {attn!r} (attn_layer)")
    mlp = mlp_kind(a["mlp_layer"])
    if mlp is None:
        raise _refusal(label, f"the MLP {a['mlp_layer']} (mlp_layer)")
    norm = norm_kind(a["norm_layer"])
    if norm is None:
        raise _refusal(
            label, f"the norm {short_name(parse_layer(a['norm_layer'])[0])} (norm_layer)"
        )
    if a["embed_norm_layer"] is not None and norm_kind(a["embed_norm_layer"]) != norm:
        raise _refusal(
            label,
            f"a patch-embedding norm ({a['embed_norm_layer']}) unlike the blocks' ({a['norm_layer']})",
        )
    if short_name(parse_layer(a["embed_layer"])[0]) not in ("", "PatchEmbed"):
        raise _refusal(
            label,
            f"the patch embedding {short_name(parse_layer(a['embed_layer'])[0])} (embed_layer)",
        )
    return dict(
        post_norm=block == "ResPostBlock",
        parallel=BLOCK_KINDS[block],
        diff_attn=block == "DiffParallelScalingBlock"
        or short_name(attn) in ("diff", "DiffAttention"),
        mlp=mlp,
        norm=norm[0],
        norm_eps=norm[1],
        embed_norm=a["embed_norm_layer"] is not None,
    )


def _options(a: dict, label: str) -> dict:
    """The ViTSpec options of the remaining arguments: norms, biases, pooling, position embedding,
    activation."""
    pool = a["global_pool"]
    if pool == "prr":
        raise _refusal(label, "attention pooling with a projection (global_pool='prr')")
    if pool not in ("token", "avg", "map"):
        raise _refusal(
            label, f"global_pool={pool!r} ({'no pooling' if not pool else 'max pooling'})"
        )
    if a["pos_embed"] not in ("learn", "", "none"):
        raise _refusal(label, f"pos_embed={a['pos_embed']!r}")
    act = short_name(parse_layer(a["act_layer"])[0]) or "gelu"
    if act not in ACTS:
        raise _refusal(label, f"the activation {act} (act_layer)")
    return dict(
        qk_norm=bool(a["qk_norm"]),
        attn_norm=bool(a["scale_attn_norm"]),
        mlp_norm=bool(a["scale_mlp_norm"]),
        proj_bias=bool(a["proj_bias"]),
        pos_embed=a["pos_embed"] == "learn",
        pool_prefix=bool(a["pool_include_prefix"]) and pool != "token",
        act=ACTS[act],
    )


# timm's block_fn -> ViTSpec.parallel ("" for the sequential blocks, ResPostBlock's post_norm)
BLOCK_KINDS = {"": "", "Block": "", "ResPostBlock": "", "ParallelThingsBlock": "branches"}
BLOCK_KINDS |= {"ParallelScalingBlock": "fused", "DiffParallelScalingBlock": "fused"}
# the first block's attention input, by block type: what says a state dict is a ViT's
FIRST_ATTN = (
    "blocks.0.attn.qkv.weight",
    "blocks.0.attns.0.attn.qkv.weight",
    "blocks.0.in_proj.weight",
)


def _shape_facts(sd: dict) -> tuple[int, int, int, int]:
    """(width, input channels, patch size, depth) from the keys; one line when they are not a ViT's."""
    if "patch_embed.proj.weight" not in sd or not any(k in sd for k in FIRST_ATTN):
        raise UserError(
            "timm ViT: not a timm VisionTransformer state dict (no patch_embed.proj.weight / "
            f"blocks.0.attn.qkv.weight; its keys begin {first_keys(sd, 3)})"
        )
    w = sd["patch_embed.proj.weight"]
    if w.ndim != 4 or w.shape[-1] != w.shape[-2]:
        raise UserError(
            f"timm ViT: patch_embed.proj.weight has shape {tuple(w.shape)}; expected a square "
            "[dim, channels, patch, patch] convolution"
        )
    grouped = sorted(k for k in sd if re.match(r"blocks\.\d+\.\d+\.", k))
    if grouped:
        raise _refusal(
            "",
            f"blocks in groups ({first_keys(grouped, 1)}: timm's ParallelThingsBlock / "
            "checkpoint_seq layouts)",
        )
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))}
    last = f"blocks.{len(layers) - 1}."
    ends = ("mlp.fc2.weight", "ffns.0.mlp.fc2.weight", "mlp_out_proj.weight", "out_proj.weight")
    if not layers or layers != set(range(len(layers))) or not any(last + e in sd for e in ends):
        raise UserError("timm ViT: the blocks are missing or not numbered 0..N-1")
    return w.shape[0], w.shape[1], w.shape[-1], len(layers)


def mlp_hidden(sd: dict) -> int:
    """timm's hidden_features = int(dim * mlp_ratio) of the first block's MLP (a packed SwiGLU's
    fc1 gives all of them, a split one's fc1_x as many)."""
    if "blocks.0.mlp_out_proj.weight" in sd:  # ParallelScalingBlock: [dim, hidden]
        return sd["blocks.0.mlp_out_proj.weight"].shape[1]
    if "blocks.0.out_proj.weight" in sd:  # DiffParallelScalingBlock: [dim, dim + hidden]
        w = sd["blocks.0.out_proj.weight"]
        return w.shape[1] - w.shape[0]
    for mlp in ("blocks.0.mlp.", "blocks.0.ffns.0.mlp."):
        if mlp + "fc1_x.weight" in sd or mlp + "fc1.weight" in sd:
            return sd.get(mlp + "fc1_x.weight", sd.get(mlp + "fc1.weight")).shape[0]
    raise UserError("timm ViT: the first block has no MLP weights (mlp.fc1 / fc1_x)")


def _grid(sd: dict, prefix_rows: int, what: str, size: int = 0) -> int:
    """The patch grid's side: from pos_embed's rows, or without one `size` (img_size // patch)."""
    if "pos_embed" not in sd:
        return size
    rows = sd["pos_embed"].shape[1]
    g = math.isqrt(max(0, rows - prefix_rows))
    if rows <= prefix_rows or g * g != rows - prefix_rows:
        raise UserError(
            f"timm ViT: pos_embed has {rows} rows, which is no square patch grid ({what})"
        )
    return g


def _num_classes(sd: dict, num_classes: int) -> int:
    if "head.weight" in sd:
        return sd["head.weight"].shape[0]
    if num_classes <= 0:
        raise UserError(
            "timm ViT: the checkpoint has no classifier head (timm's num_classes=0): "
            "give the number of classes of the new head"
        )
    return num_classes


def _spec_from_args(
    sd: dict, args: dict, distilled: bool, source: str, heads: int, num_classes: int
) -> ViTSpec:
    a = {**ARG_DEFAULTS, **args}
    label = f" {source}"
    _check_args(a, label)
    layers, options = _layer_options(a, label), _options(a, label)
    dim, in_chans, patch, depth = _shape_facts(sd)
    patch_arg = a["patch_size"] if isinstance(a["patch_size"], int) else tuple(a["patch_size"])
    hidden = mlp_hidden(sd)
    for what, theirs, ours in (
        ("width (embed_dim)", a["embed_dim"], dim),
        ("depth", a["depth"], depth),
        ("patch size", patch_arg, patch),
        ("MLP width", int(dim * a["mlp_ratio"]), hidden),
    ):
        if theirs != ours and not (isinstance(theirs, tuple) and set(theirs) == {ours}):
            raise UserError(
                f"timm ViT{label}: the architecture has {what} {theirs}, the weights {ours}"
            )
    if heads and heads != a["num_heads"]:
        raise UserError(
            f"timm ViT{label}: model.heads={heads}, but the architecture has {a['num_heads']} heads"
        )
    heads = a["num_heads"]
    if dim % heads:
        raise UserError(f"timm ViT: width {dim} is not divisible by {heads} heads")
    token, reg = bool(a["class_token"]) or distilled, int(a["reg_tokens"] or 0)
    pool = a["global_pool"]
    head = {"token": "token", "map": "map"}.get(pool, "pool")
    fc_norm = pool == "avg" if a["fc_norm"] is None else bool(a["fc_norm"])
    prefix_rows = 0 if a["no_embed_class"] else int(token) + int(distilled) + reg
    size = a["img_size"] if isinstance(a["img_size"], int) else a["img_size"][0]
    grid = _grid(sd, prefix_rows, f"{prefix_rows} rows for the prefix tokens", size // patch)
    return ViTSpec(
        image_size=grid * patch,
        patch_size=patch,
        in_chans=in_chans,
        num_classes=_num_classes(sd, num_classes),
        dim=dim,
        depth=depth,
        heads=heads,
        mlp_ratio=mlp_ratio_for(dim, hidden, a["mlp_ratio"]),
        head=head,
        fc_norm=fc_norm and a["final_norm"],
        no_embed_class=bool(a["no_embed_class"]),
        class_token=None if token == (head == "token") else token,
        reg_tokens=reg,
        layer_scale=0.0 if layers["post_norm"] else float(a["init_values"] or 0.0),
        qkv_bias=bool(a["qkv_bias"]),
        pre_norm=bool(a["pre_norm"]),
        final_norm=bool(a["final_norm"]),
        distilled=distilled,
        **layers,
        **options,
    )


def _refuse_keys_only(sd: dict) -> None:
    """One line for what the keys alone cannot say: what vitscale lacks, a parallel block's type,
    an image size without pos_embed."""
    refuse_unsupported(sd, UNSUPPORTED, "timm ViT", "vitscale's ViT")
    for marker, block in PARALLEL_KEYS.items():
        hits = [k for k in sd if marker in k]
        if hits:
            raise UserError(
                f"timm ViT: {block}: {first_keys(hits, 1)}) is read from its config.json or "
                "model.init_arch only; put the hub's config.json next to the file"
            )
    _shape_facts(sd)  # a ViT's state dict at all
    if "pos_embed" not in sd:
        raise UserError(
            "timm ViT: no pos_embed and no config.json: the image size (and any rotary "
            "embedding) cannot be read from the keys; put the hub's config.json next to the file "
            "or set model.init_arch"
        )


def _spec_from_keys(sd: dict, heads: int, num_classes: int, announce: str) -> ViTSpec:
    """The spec the keys show, timm's defaults for what they leave open, announced in one line."""
    _refuse_keys_only(sd)
    dim, in_chans, patch, depth = _shape_facts(sd)
    layers, assumed = _layers_from_keys(sd)
    token, distilled = "cls_token" in sd, "dist_token" in sd
    reg = sd["reg_token"].shape[1] if "reg_token" in sd else 0
    fc_norm = "fc_norm.weight" in sd
    rows, prefix = sd["pos_embed"].shape[1], int(token) + int(distilled) + reg
    square = lambda n: n > 0 and math.isqrt(n) ** 2 == n  # noqa: E731
    no_embed_class = prefix > 0 and not square(rows - prefix) and square(rows)
    grid = _grid(
        sd,
        0 if no_embed_class else prefix,
        f"with {'a class token' if token else 'no class token'} and {reg} register tokens",
    )
    head = "map" if "attn_pool.latent" in sd else "pool" if fc_norm or not token else "token"
    if prefix > 0 and square(rows - prefix) and square(rows):  # tiny grids only: 2x2 + 5 rows = 3x3
        assumed.append(
            f"rows for the class and register tokens in pos_embed (a {grid}x{grid} grid)"
        )
    if not heads:
        heads = HEADS_BY_DIM.get(dim, max(1, dim // 64))
        assumed.append(f"{heads} attention heads (model.heads)")
    if dim % heads:
        raise UserError(f"timm ViT: width {dim} is not divisible by {heads} heads")
    _announce_defaults(announce, assumed, head=head, token=token, fc_norm=fc_norm)
    return ViTSpec(
        image_size=grid * patch,
        patch_size=patch,
        in_chans=in_chans,
        num_classes=_num_classes(sd, num_classes),
        dim=dim,
        depth=depth,
        heads=heads,
        mlp_ratio=mlp_ratio_for(dim, mlp_hidden(sd)),
        head=head,
        fc_norm=fc_norm,
        no_embed_class=no_embed_class,
        class_token=None if token == (head == "token") else token,
        reg_tokens=reg,
        layer_scale=1e-5 if "blocks.0.ls1.gamma" in sd else 0.0,
        qkv_bias="blocks.0.attn.qkv.bias" in sd,
        pre_norm="norm_pre.weight" in sd,
        final_norm=fc_norm or "norm.weight" in sd,
        distilled=distilled,
        **layers,
    )


def _layers_from_keys(sd: dict) -> tuple[dict, list[str]]:
    """The block options the keys show (norms, MLP, biases), and what they leave open for the
    announcement: an RMSNorm's eps, a gated MLP's activation."""
    assumed = []
    rms = "blocks.0.norm1.weight" in sd and "blocks.0.norm1.bias" not in sd
    if rms:
        assumed.append("RMSNorm eps 1e-6")
    fc1, fc2 = sd.get("blocks.0.mlp.fc1.weight"), sd["blocks.0.mlp.fc2.weight"]
    mlp = "swiglu" if "blocks.0.mlp.fc1_g.weight" in sd else "mlp"
    if fc1 is not None and fc1.shape[0] == 2 * fc2.shape[1]:
        mlp = "swiglu_packed"
    if mlp != "mlp":
        assumed.append(f"a SiLU gate in the {'packed ' if mlp == 'swiglu_packed' else ''}SwiGLU")
    options = dict(
        norm="rmsnorm" if rms else "layernorm",
        mlp=mlp,
        act="silu" if mlp != "mlp" else "gelu",
        qk_norm="blocks.0.attn.q_norm.weight" in sd,
        attn_norm="blocks.0.attn.norm.weight" in sd,
        mlp_norm="blocks.0.mlp.norm.weight" in sd,
        proj_bias="blocks.0.attn.proj.bias" in sd,
        embed_norm="patch_embed.norm.weight" in sd,
    )
    return options, assumed


def _announce_defaults(
    announce: str, assumed: list, *, head: str, token: bool, fc_norm: bool
) -> None:
    """The one warning of _spec_from_keys: what was `assumed`, then timm's defaults the keys
    cannot show (activation, norm eps, pooling, pre-norm)."""
    if head == "token":
        pooling = "the class token's features, not the patch tokens' average"
    elif head == "map":
        pooling = (
            "attention pooling (MAP) over the patch tokens, the class and register tokens left out"
        )
    else:  # fc_norm keys (or no class token) say pooling, not which: 'avg', 'max' and fc_norm with 'token' all fit
        pooling = (
            f"the average of the patch tokens{', then fc_norm' if fc_norm else ''} as the feature "
            f"(global_pool='avg', not 'max'{' or the class token' if token else ''}, nor per-token outputs)"
        )
    assumed = [
        *assumed,
        "exact GELU (not GELU-tanh or QuickGELU)" if not any("SiLU" in a for a in assumed) else "",
        "LayerNorm eps 1e-6" if not any("RMSNorm" in a for a in assumed) else "",
        pooling,
        "pre-norm blocks",
        "no rotary position embedding (timm's eva family has one that no key shows)",
    ]
    log.warning(
        "%s: no config.json beside the weights and no architecture name, so what the weights leave open "
        "is assumed, and the file cannot confirm it: %s (timm's defaults; set model.init_arch to the timm "
        "architecture, e.g. vit_base_patch16_224, or put the hub's config.json next to the file)",
        announce,
        ", ".join(a for a in assumed if a),
    )


def check_keys(sd: dict, spec: ViTSpec, where: str = "timm ViT") -> None:
    """One line for keys the spec's model lacks or needs (a missing head is allowed) and for shapes
    that differ."""
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in VisionTransformer(spec).state_dict().items()}
    unknown = set(sd) - set(want)
    missing = (
        set(want) - set(sd) - ({"head.weight", "head.bias"} if "head.weight" not in sd else set())
    )
    if unknown or missing:
        parts = ([f"unknown keys {first_keys(unknown)}"] if unknown else []) + (
            [f"missing keys {first_keys(missing)}"] if missing else []
        )
        raise UserError(f"{where}: {'; '.join(parts)}")
    for k, shape in want.items():
        if k in sd and tuple(sd[k].shape) != shape:
            raise UserError(
                f"{where}: {k} has shape {tuple(sd[k].shape)}, the model expects {shape}"
            )


def source_module(config: dict | None = None, arch: str = "") -> str:
    """timm's module of the architecture the config.json or name gives ("vision_transformer",
    "deit", "eva"); "" without either."""
    name = str(config["architecture"]) if config is not None else arch
    return (
        arch_entry(name, "config.json" if config is not None else "model.init_arch")[0]
        if name
        else ""
    )


def timm_state_dict(sd: dict, config: dict | None = None, arch: str = "") -> dict:
    """The state dict in vitscale's names: timm's vision_transformer / deit keys are already, the
    eva family's are converted (timm_eva.eva_to_vitscale)."""
    if source_module(config, arch) == "eva":
        return eva_to_vitscale(sd)
    return sd


def _eva_spec(sd: dict, args: dict, source: str, heads: int, num_classes: int) -> ViTSpec:
    label = f" {source}"
    dim, in_chans, patch, depth = _shape_facts(sd)
    norm = norm_kind(args.get("norm_layer"))
    if norm is None:
        raise UserError(f"timm Eva{label}: the norm {args.get('norm_layer')} is not implemented")
    n = args.get("num_heads", 12)
    if heads and heads != n:
        raise UserError(f"timm Eva{label}: model.heads={heads}, but the architecture has {n} heads")
    if dim % n:
        raise UserError(f"timm Eva{label}: width {dim} is not divisible by {n} heads")
    facts = (dim, in_chans, patch, depth, mlp_hidden(sd), norm, n)
    return eva_spec(sd, args, label, facts, _num_classes(sd, num_classes))


def timm_vit_spec(
    sd: dict,
    heads: int = 0,
    num_classes: int = 0,
    *,
    config: dict | None = None,
    arch: str = "",
    announce: str = "timm ViT",
) -> ViTSpec:
    """The ViTSpec that computes what timm's model with these weights computes. What the weights
    leave open comes from `config` (timm's hub config.json) or `arch` (a timm architecture name);
    without either, from timm's defaults, announced in one line (prefixed with `announce`).
    `heads`: model.heads (refused when it contradicts the architecture). `num_classes`: for a
    checkpoint without a classifier (timm's num_classes=0); a head it has wins. `sd` in timm's
    names (an eva model's converted here)."""
    args, distilled, source, _ = timm_source(config, arch)
    sd = timm_state_dict(sd, config, arch)
    if args is None:
        eva = [k for k in sd if re.search(r"gamma_1|q_bias|rope\.|\.q_proj\.", k)]
        if eva:
            raise UserError(
                f"timm Eva weights ({first_keys(eva, 1)}): their rotary embedding, pooling and "
                "norms are not in the keys; put the hub's config.json next to the file or set "
                "model.init_arch (e.g. eva02_base_patch14_224, vit_base_patch16_dinov3)"
            )
        spec = _spec_from_keys(sd, heads, num_classes, announce)
    elif source_module(config, arch) == "eva":
        spec = _eva_spec(sd, args, source, heads, num_classes)
    else:
        spec = _spec_from_args(sd, args, distilled, source, heads, num_classes)
    check_keys(sd, spec, "timm ViT" + (f" {source}" if source else ""))
    return spec


def from_timm(
    sd: dict,
    heads: int = 0,
    num_classes: int = 0,
    *,
    config: dict | None = None,
    arch: str = "",
    **spec_overrides,
) -> VisionTransformer:
    """vitscale's ViT holding a timm ViT state dict's weights (the same function, in fp32): timm's
    vision_transformer, deit and eva families. `config` / `arch`: see timm_vit_spec.
    `spec_overrides` (e.g. attention="explicit", drop_path=0.1) change nothing in the weights."""
    spec = replace(
        timm_vit_spec(sd, heads, num_classes, config=config, arch=arch), **spec_overrides
    )
    sd = timm_state_dict(sd, config, arch)
    theirs = {k: v.detach().to(torch.float32, copy=True) for k, v in sd.items()}
    if "head.weight" not in sd:  # a new head: initialized as vitscale initializes one
        model = VisionTransformer(spec)
        model.load_state_dict(theirs, strict=False)
        return model
    # every parameter comes from the file: no initialization to overwrite
    with torch.device("meta"):
        model = VisionTransformer(spec)
    model.load_state_dict(theirs, strict=True, assign=True)
    if model.rope is not None:  # its non-persistent buffers: not in the file
        model.rope.to_empty(device="cpu")
        model.rope.reset_parameters()
        if "rope.freqs" in theirs:
            model.rope.load_state_dict({"freqs": theirs["rope.freqs"]})
    return model


# -- export ----------------------------------------------------------------------------------------------
def _check_exportable(spec: ViTSpec) -> None:
    if spec.stem != "patch":
        raise UserError(
            "export to timm: model.stem=conv has no timm ViT counterpart (use the patch stem)"
        )


def _class_args(spec: ViTSpec) -> tuple:
    """What only an entry point can give timm's model (classes and an eps, which no JSON argument
    can): the block type, the MLP, the norm and its eps."""
    fused = "DiffParallelScalingBlock" if spec.diff_attn else "ParallelScalingBlock"
    block = {"branches": "ParallelThingsBlock", "fused": fused}.get(spec.parallel)
    return (block or ("ResPostBlock" if spec.post_norm else ""), spec.mlp, spec.norm, spec.norm_eps)


def _named_norm(spec: ViTSpec) -> bool:
    """The spec's norm is one timm builds from its name alone (get_norm_layer: eps 1e-6)."""
    return spec.norm_eps == 1e-6


def _arch_class_args(args: dict) -> tuple | None:
    block = short_name(parse_layer(args.get("block_fn"))[0])
    block = "" if block == "Block" else block
    mlp = mlp_kind(args.get("mlp_layer"))
    norm = norm_kind(args.get("norm_layer"))
    if block not in BLOCK_KINDS or mlp is None or norm is None:
        return None
    return (block, mlp, *norm)


def timm_export_arch(spec: ViTSpec) -> str:
    """A timm architecture whose entry point gives nothing that timm_kwargs does not override, except
    what no JSON argument can give (_class_args: the norm layer and its eps, the MLP and block
    classes): vit_base_patch16_224 for the 2021 ViT with LayerNorm eps 1e-6,
    vit_base_patch16_clip_224 for 1e-5, else the first that fits (e.g. aimv2_* for RMSNorm and
    SwiGLU)."""
    from .archs import ARCHS

    _check_exportable(spec)
    want = _class_args(spec)
    for name in ["vit_base_patch16_224", "vit_base_patch16_clip_224", *ARCHS]:
        module, distilled, args = ARCHS[name]
        theirs = _arch_class_args(args)
        if (
            module != "eva"
            and distilled == spec.distilled
            and set(args) <= set(EXPORT_ARGS)
            and theirs is not None
            and (theirs == want or (theirs[:2] == want[:2] and _named_norm(spec)))
        ):
            return name
    raise UserError(
        f"export to timm: no timm ViT architecture has {spec.norm} eps {spec.norm_eps:g} with "
        f"the {spec.mlp} MLP{' in post-norm blocks' if spec.post_norm else ''}"
        f"{' and a distillation token' if spec.distilled else ''}"
    )


def timm_kwargs(spec: ViTSpec, arch: str = "vit_base_patch16_224") -> dict:
    """The `model_args` with which `timm.create_model(arch, **model_args)` builds the function of
    `spec` (arch from timm_export_arch): the sizes, plus every option that differs from timm's default
    or that arch's entry point sets (the classes come from the arch: timm_export_arch)."""
    from .archs import ARCHS

    _check_exportable(spec)
    pool = {"token": "token", "map": "map"}.get(spec.head, "avg")
    full = dict(
        img_size=spec.image_size,
        patch_size=spec.patch_size,
        in_chans=spec.in_chans,
        num_classes=spec.num_classes,
        embed_dim=spec.dim,
        depth=spec.depth,
        num_heads=spec.heads,
        mlp_ratio=spec.mlp_ratio,
        qkv_bias=spec.qkv_bias,
        class_token=spec.has_class_token and not spec.distilled,
        global_pool=pool,
        fc_norm=spec.fc_norm,
        no_embed_class=spec.no_embed_class,
        reg_tokens=spec.reg_tokens,
        init_values=(spec.layer_scale or None) if not spec.post_norm else None,
        pre_norm=spec.pre_norm,
        final_norm=spec.final_norm,
        act_layer=spec.act,
        qk_norm=spec.qk_norm,
        scale_attn_norm=spec.attn_norm,
        scale_mlp_norm=spec.mlp_norm,
        proj_bias=spec.proj_bias,
        pos_embed="learn" if spec.pos_embed else "none",
        pool_include_prefix=spec.pool_prefix,
        attn_layer="diff" if spec.diff_attn and spec.parallel != "fused" else "attn",
    )
    if spec.distilled:
        full.pop("class_token")
    defaults = {**ARG_DEFAULTS, "fc_norm": pool == "avg", "act_layer": "gelu", "attn_layer": "attn"}
    set_by_arch = set(ARCHS.get(split_arch(arch)[0], ("", False, {}))[2])
    out = {k: v for k, v in full.items() if k in CORE_ARGS or k in set_by_arch or v != defaults[k]}
    args = ARCHS.get(split_arch(arch)[0], ("", False, {}))[2]
    if norm_kind(args.get("norm_layer")) != (spec.norm, spec.norm_eps):
        out["norm_layer"] = spec.norm  # timm's get_norm_layer name: eps 1e-6 (_named_norm)
    if spec.embed_norm and norm_kind(args.get("embed_norm_layer")) != (spec.norm, spec.norm_eps):
        if not _named_norm(spec):
            raise UserError(
                f"export to timm: no timm ViT architecture norms the patch embeddings with "
                f"{spec.norm} eps {spec.norm_eps:g}"
            )
        out["embed_norm_layer"] = spec.norm
    if not spec.embed_norm and "embed_norm_layer" in set_by_arch:
        out["embed_norm_layer"] = None
    return out


def to_timm(model: VisionTransformer) -> dict[str, torch.Tensor]:
    """The state dict timm's VisionTransformer (or Eva: timm_eva.uses_eva) of the same configuration
    loads (fp32, CPU): a ViT's keys are timm's already, an Eva's are converted; see timm_hub_config
    for the model that takes them."""
    _check_exportable(model.spec)
    sd = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    return vitscale_to_eva(sd, eva_kwargs(model.spec)) if uses_eva(model.spec) else sd


def timm_hub_config(
    spec: ViTSpec, *, mean, std, interpolation: str = "bilinear", crop_pct: float = 1.0
) -> dict:
    """timm's hub config.json for weights of `spec`: the architecture and model_args that rebuild its
    function, and a pretrained config with its input size, mean/std, interpolation and crop, which
    `timm.data.resolve_data_config` hands to a timm user."""
    if uses_eva(spec):
        kw = eva_kwargs(spec)
        arch = eva_export_arch(spec, kw)
    else:
        arch = timm_export_arch(spec)
        kw = timm_kwargs(spec, arch)
    size = [spec.in_chans, spec.image_size, spec.image_size]
    return {
        "architecture": arch,
        "num_classes": spec.num_classes,
        "num_features": spec.dim,
        "global_pool": {"token": "token", "map": "map"}.get(spec.head, "avg"),
        "model_args": kw,
        "pretrained_cfg": {
            "input_size": size,
            "fixed_input_size": True,
            "interpolation": interpolation,
            "crop_pct": crop_pct,
            "crop_mode": "center",
            "mean": [float(m) for m in mean],
            "std": [float(s) for s in std],
            "num_classes": spec.num_classes,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
        },
    }


def timm_load_call(config: dict, weights: str | Path) -> str:
    """The timm call that builds the model of `config` holding `weights` with its preprocessing
    config: a `local-dir:` load where timm would read this very file from its folder, else the
    architecture with pretrained_cfg_overlay and model_args."""
    weights = Path(weights)
    folder = weights.parent
    if weights.name == HF_WEIGHTS[0] and hub_config_path(weights).is_file():
        return f"timm.create_model({'local-dir:' + str(folder)!r}, pretrained=True)"
    p = config["pretrained_cfg"]
    overlay = (
        f"file={str(weights)!r}, num_classes={config['num_classes']}, input_size={tuple(p['input_size'])}, "
        f"mean={tuple(p['mean'])}, std={tuple(p['std'])}, interpolation={p['interpolation']!r}, "
        f"crop_pct={p['crop_pct']}"
    )
    args = ", ".join(f"{k}={v!r}" for k, v in config["model_args"].items())
    return (
        f"timm.create_model({config['architecture']!r}, pretrained=True, "
        f"pretrained_cfg_overlay=dict({overlay}), {args})"
    )
