"""Checkpoint evaluation and safetensors export (model info: tasks.model_info)."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from .checkpoint import export_safetensors, load_checkpoint, resolve_checkpoint
from .config import Config, saved_config
from .errors import ConfigError
from .strategy import build_strategy
from .strategy.resume import engine_folder, read_dcp
from .tasks import build_task


def _load(checkpoint, overrides=()) -> tuple[dict, Config, Path]:
    path = resolve_checkpoint(checkpoint)
    state = load_checkpoint(path)
    if "config" not in state or "strategy" not in state:
        raise ConfigError(f"{path} is not a vitscale training checkpoint")
    folder = engine_folder(path, state)
    if "model" not in state["strategy"] and folder is not None:  # FSDP2 sharded: consolidate here
        state["strategy"]["model"] = read_dcp(folder, keys={"model"})["model"]
    cfg = saved_config(state["config"], overrides, source=str(path))
    return state, cfg, path


def _weights(state: dict, use_ema: bool) -> dict:
    sd = state["strategy"]
    if use_ema and "ema" in sd:  # AveragedModel keys: module.<name>, plus n_averaged
        return {k[len("module."):]: v for k, v in sd["ema"].items() if k.startswith("module.")}
    return sd["model"]


def _rebuild(task, state: dict, weights: dict):
    """The checkpoint's model, built from its saved spec, holding `weights`."""
    model = task.build_model(task.spec_from_dict(state["spec"]))
    model.load_state_dict(weights)
    return model


def evaluate_checkpoint(checkpoint, overrides=()) -> dict:
    """The run's own metrics for a checkpoint: accuracy for a ViT; held-out retrieval and
    zero-shot accuracy for a CLIP model."""
    state, cfg, path = _load(checkpoint, overrides)
    cfg.strategy.name = "single"  # evaluation runs in this one process, whatever trained it
    strategy = build_strategy(cfg)
    task = build_task(cfg, state.get("kind", "vit"))
    data = task.build_data(strategy)
    model = _rebuild(task, state, _weights(state, cfg.train.ema_decay > 0 and cfg.train.ema_eval))
    strategy.setup_eval(model)
    try:
        result = task.evaluate_all(strategy, data)
    finally:
        data.close()
    if "test_count" in result:
        result["count"] = result["test_count"]
    return {**result, "step": state["step"], "checkpoint": str(path), "task": task.kind}


DEFAULT_OUT = {"vitscale": "model.safetensors", "timm": "timm/model.safetensors"}  # under the run folder


def run_normalization(state: dict, cfg: Config) -> tuple[list, list]:
    """The mean and std the run's images were normalized with: recorded in the checkpoint (the
    classification task's state), else (older checkpoints) from its data, built as evaluation does."""
    rec = (state.get("task") or {}).get("normalization")
    if rec:
        return list(rec["mean"]), list(rec["std"])
    cfg.strategy.name = "single"
    data = build_task(cfg, state.get("kind", "vit")).build_data(build_strategy(cfg))
    data.close()
    return list(data.mean), list(data.std)


def _export_timm(model, state: dict, cfg: Config, out: Path, meta: dict) -> Path:
    """timm's hub folder layout: the weights (model.safetensors when `out` is a folder) and, beside
    them, config.json: the architecture and model_args that rebuild the trained function, and the
    run's input size, mean/std, interpolation and crop as its pretrained config."""
    from .interop.timm_vit import hub_config_path, timm_hub_config, to_timm
    if out.is_dir() or not out.suffix:
        out = out / "model.safetensors"
    mean, std = run_normalization(state, cfg)
    jpeg = cfg.data.name in ("folder", "webdataset")  # their evaluation crops the centre 87.5% (data/jpeg.py)
    hub = timm_hub_config(model.spec, mean=mean, std=std, interpolation="bilinear", crop_pct=0.875 if jpeg else 1.0)
    meta["timm_config"] = json.dumps(hub)
    path = export_safetensors(to_timm(model), out, meta)
    hub_config_path(path).write_text(json.dumps(hub, indent=2) + "\n")
    return path


def export_checkpoint(checkpoint, out=None, use_ema: bool = True, fmt: str = "vitscale") -> Path:
    """The checkpoint's weights as safetensors: vitscale's keys and spec (`fmt="vitscale"`),
    timm's VisionTransformer layout (`fmt="timm"`: with timm's hub-style config.json beside it, also
    in the file's metadata) or OpenCLIP's CLIP layout (`fmt="open_clip"`)."""
    state, cfg, path = _load(checkpoint)
    weights = {k: v.float() for k, v in _weights(state, use_ema).items()}
    out = Path(out) if out else path.parent.parent / DEFAULT_OUT.get(fmt, f"model_{fmt}.safetensors")
    if fmt != "vitscale":  # another library's layout: rebuild the model, let interop convert it
        from .interop import to_timm
        from .interop.open_clip import to_open_clip
        kind, convert, what = {"timm": ("vit", to_timm, "ViT classifiers"),
                               "open_clip": ("clip", to_open_clip, "CLIP models")}[fmt]
        if state.get("kind", "vit") != kind:
            raise ConfigError(f"export --format {fmt}: {path} holds a {state.get('kind', 'vit')} model; "
                              f"{fmt}'s layout is for {what}")
        model = _rebuild(build_task(cfg, kind), state, weights)
        meta = {"format": fmt, "step": str(state["step"])}
        if fmt == "open_clip":  # the weights and open_clip_config.json (model and preprocess config), in a folder
            from .interop.open_clip import export_run
            return export_run(model, cfg, out, meta, run_dir=path.parent.parent)
        if fmt == "timm":  # the weights and timm's hub-style config.json beside them
            return _export_timm(model, state, cfg, out, meta)
        return export_safetensors(convert(model), out, meta)
    meta = {"format": f"vitscale-{state.get('kind', 'vit')}", "spec": json.dumps(state["spec"]), "config": json.dumps(cfg.to_dict()),
            "step": str(state["step"])}
    return export_safetensors(weights, out, meta)
