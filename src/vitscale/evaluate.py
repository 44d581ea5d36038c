"""Checkpoint evaluation and safetensors export (model info: tasks.model_info). Knows no task,
engine or dataset by name: the checkpoint's task evaluates, exports and says how its images were
preprocessed (tasks/base.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoint import export_safetensors, newest_readable
from .config import Config, saved_config
from .errors import ConfigError, TrainingError
from .fastpaths import resolve as resolve_fast_paths
from .strategy import build_strategy, in_this_process
from .strategy.resume import engine_folder, read_dcp
from .tasks import build_task, check_config, export_use, kind_of


def _load(checkpoint, overrides=(), command: str = "eval") -> tuple[dict, Config, Path]:
    """A checkpoint file, or a run folder's newest readable checkpoint (a damaged newer one named)."""
    doing = {"eval": "evaluating", "export": "exporting"}[command]
    path, state = newest_readable(checkpoint, doing, f"vitscale {command}")
    if "config" not in state or "strategy" not in state:
        raise ConfigError(f"{path} is not a vitscale training checkpoint")
    folder = engine_folder(path, state)
    if "model" not in state["strategy"] and folder is not None:  # FSDP2 sharded: consolidate here
        state["strategy"]["model"] = read_dcp(folder, keys={"model"})["model"]
    cfg = check_config(saved_config(state["config"], overrides, source=str(path)))
    return state, cfg, path


def _weights(state: dict, use_ema: bool, path: Path | str = "the checkpoint") -> dict:
    """The checkpoint's model weights (the EMA ones where chosen); a one-line refusal where any is
    not finite (a checkpoint written before training checked its state when saving)."""
    sd = state["strategy"]
    if use_ema and "ema" in sd:  # AveragedModel keys: module.<name>, plus n_averaged
        weights = {k[len("module.") :]: v for k, v in sd["ema"].items() if k.startswith("module.")}
    else:
        weights = sd["model"]
    bad = [k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise TrainingError(
            f"{path} holds non-finite weights ({len(bad)} of {len(weights)} tensors, e.g. {bad[0]}): "
            "an update overflowed before it was written; use an earlier checkpoint of the run"
        )
    return weights


def _rebuild(task, state: dict, weights: dict):
    """The checkpoint's model, built from its saved spec, holding `weights`."""
    model = task.build_model(task.spec_from_dict(state["spec"]))
    model.load_state_dict(weights)
    return model


def evaluate_checkpoint(checkpoint, overrides=()) -> dict:
    """The run's own metrics for a checkpoint (the task's: accuracy for a ViT; held-out retrieval
    and zero-shot accuracy for a CLIP model), in this one process whatever trained it."""
    state, cfg, path = _load(checkpoint, overrides)
    # an auto asked here: this machine's
    strategy = build_strategy(resolve_fast_paths(in_this_process(cfg)).cfg)
    task = build_task(cfg, kind_of(state))
    data = task.build_data(strategy)
    model = _rebuild(
        task, state, _weights(state, cfg.train.ema_decay > 0 and cfg.train.ema_eval, path)
    )
    strategy.setup_eval(model)
    try:
        result = task.evaluate_all(strategy, data)
    finally:
        data.close()
    if "test_count" in result:
        result["count"] = result["test_count"]
    return {**result, "step": state["step"], "checkpoint": str(path), "task": task.kind}


DEFAULT_OUT = {
    "vitscale": "model.safetensors",
    "timm": "timm/model.safetensors",
}  # under the run folder


def export_checkpoint(checkpoint, out=None, use_ema: bool = True, fmt: str = "vitscale") -> Path:
    """The checkpoint's weights as safetensors: vitscale's keys and spec (`fmt="vitscale"`), or
    another library's layout that the checkpoint's task declares (`Task.exports`: timm's
    VisionTransformer with its hub-style config.json, OpenCLIP's CLIP), with the preprocessing
    the run evaluated with (`Task.run_preprocess`)."""
    state, cfg, path = _load(checkpoint, command="export")
    weights = {k: v.float() for k, v in _weights(state, use_ema, path).items()}
    out = (
        Path(out) if out else path.parent.parent / DEFAULT_OUT.get(fmt, f"model_{fmt}.safetensors")
    )
    kind = kind_of(state)
    if fmt == "vitscale":
        meta = {
            "format": f"vitscale-{kind}",
            "spec": json.dumps(state["spec"]),
            "config": json.dumps(cfg.to_dict()),
            "step": str(state["step"]),
        }
        return export_safetensors(weights, out, meta)
    # another library's layout: rebuild the model, let the task convert it
    task = build_task(cfg, kind)
    if fmt not in task.exports:
        raise ConfigError(
            f"export --format {fmt}: {path} holds a {kind} model; {fmt}'s layout is for "
            f"{export_use(fmt)}"
        )
    model = _rebuild(task, state, weights)
    meta = {"format": fmt, "step": str(state["step"])}
    return task.export(fmt, model, task.run_preprocess(state), out, meta, path.parent.parent)
