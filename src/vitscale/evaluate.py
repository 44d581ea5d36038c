"""Model info (params, FLOPs), checkpoint evaluation and safetensors export."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from .checkpoint import engine_folder, export_safetensors, load_checkpoint, read_dcp, resolve_checkpoint
from .config import Config, apply_dict, check, parse_override, _set
from .errors import ConfigError
from .models import VisionTransformer, ViTSpec, count_params, vit_forward_flops, vit_forward_macs

NATIVE = {"fashion_mnist": (28, 1, 10), "cifar10": (32, 3, 10), "cifar100": (32, 3, 100)}


def data_geometry(cfg: Config) -> tuple[int, int, int]:
    """(image_size, channels, num_classes) the model will see, without loading the data."""
    d = cfg.data
    if d.name in NATIVE:
        size, ch, nc = NATIVE[d.name]
    elif d.name in ("openclipart", "csv", "webdataset"):  # image-text pairs, no classes
        size, ch, nc = (64 if d.name == "openclipart" else 224), 3, 0
    elif d.name == "synthetic":
        size, ch, nc = 32, d.channels, d.num_classes
    else:  # folder: classes come from the folder tree unless the model fixes them
        size, ch, nc = 224, 3, cfg.model.num_classes
        if not nc:
            from .data import build_data  # count class folders
            nc = build_data(d, device=torch.device("cpu"), seed=0).num_classes
    return d.image_size or size, ch, cfg.model.num_classes or nc


def meta_model(cfg: Config):
    """(spec, model) of the recipe's model, built on the meta device: its structure and parameter
    counts without memory or initialization."""
    from .loop import clip_spec, model_spec
    from .models import CLIP, is_clip_arch
    if is_clip_arch(cfg.model.arch):
        size, ch, _ = data_geometry(cfg)
        spec, build = clip_spec(cfg, size, ch), CLIP
    else:
        spec, build = model_spec(cfg, *data_geometry(cfg)), VisionTransformer
    with torch.device("meta"):
        return spec, build(spec)


def model_info(cfg: Config) -> dict:
    from .models import clip_forward_flops, is_clip_arch
    spec, model = meta_model(cfg)
    if is_clip_arch(cfg.model.arch):
        params, vision = count_params(model), count_params(model.visual)
        flops = clip_forward_flops(spec)
        return {"arch": cfg.model.arch, "kind": "clip", **asdict(spec), "params": params,
                "vision_params": vision, "text_params": params - vision - 1,
                "tokens": spec.vision.num_tokens, "context_length": spec.text.context_length,
                "macs_per_image": flops // 2, "flops_per_image": flops, "train_flops_per_image": 3 * flops}
    params = count_params(model)
    return {"arch": cfg.model.arch, **asdict(spec), "params": params, "tokens": spec.num_tokens,
            "macs_per_image": vit_forward_macs(spec), "flops_per_image": vit_forward_flops(spec),
            "train_flops_per_image": 3 * vit_forward_flops(spec)}


def _load(checkpoint, overrides=()) -> tuple[dict, Config, Path]:
    path = resolve_checkpoint(checkpoint)
    state = load_checkpoint(path)
    if "config" not in state or "strategy" not in state:
        raise ConfigError(f"{path} is not a vitscale training checkpoint")
    folder = engine_folder(path, state)
    if "model" not in state["strategy"] and folder is not None:  # FSDP2 sharded: consolidate here
        state["strategy"]["model"] = read_dcp(folder, keys={"model"})["model"]
    cfg = apply_dict(Config(), state["config"], source=f"{path} (saved config)")
    for text in overrides:
        _set(cfg, *parse_override(text))
    check(cfg)
    return state, cfg, path


def _weights(state: dict, use_ema: bool) -> dict:
    sd = state["strategy"]
    if use_ema and "ema" in sd:  # AveragedModel keys: module.<name>, plus n_averaged
        return {k[len("module."):]: v for k, v in sd["ema"].items() if k.startswith("module.")}
    return sd["model"]


def evaluate_checkpoint(checkpoint, overrides=()) -> dict:
    """The run's own metrics for a checkpoint: accuracy for a ViT; held-out retrieval and
    zero-shot accuracy for a CLIP model."""
    from .loop import build_task_data
    from .models import CLIP, ClipSpec, TextSpec
    from .strategy import build_strategy
    from .tasks import ClassificationTask
    state, cfg, path = _load(checkpoint, overrides)
    cfg.strategy.name = "single"  # evaluation runs in this one process, whatever trained it
    strategy = build_strategy(cfg)
    data, clip = build_task_data(cfg, strategy)
    if clip:
        from .clip_task import ClipTask
        spec = state["spec"]
        model = CLIP(ClipSpec(vision=ViTSpec(**spec["vision"]), text=TextSpec(**spec["text"]),
                              embed_dim=spec["embed_dim"], init_tau=spec["init_tau"]))
        task = ClipTask(None, cfg.model.context_length, cfg.clip.prompt_templates)
    else:
        model = VisionTransformer(ViTSpec(**state["spec"]))
        task = ClassificationTask(data.num_classes, hflip_tta=cfg.train.eval_hflip_tta)
    model.load_state_dict(_weights(state, cfg.train.ema_decay > 0 and cfg.train.ema_eval))
    model.to(strategy.device)
    if strategy.pure:
        model.to(strategy.half)
    try:
        strategy.module = model  # the single-device strategy's verbs evaluate this plain model
        result = task.evaluate_all(strategy, data)
    finally:
        data.close()
    if "test_count" in result:
        result["count"] = result["test_count"]
    return {**result, "step": state["step"], "checkpoint": str(path)}


def export_checkpoint(checkpoint, out=None, use_ema: bool = True) -> Path:
    state, cfg, path = _load(checkpoint)
    weights = {k: v.float() for k, v in _weights(state, use_ema).items()}
    out = Path(out) if out else path.parent.parent / "model.safetensors"
    meta = {"format": f"vitscale-{state.get('kind', 'vit')}", "spec": json.dumps(state["spec"]), "config": json.dumps(cfg.to_dict()),
            "step": str(state["step"])}
    return export_safetensors(weights, out, meta)
