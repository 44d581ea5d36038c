"""Checkpoint evaluation and safetensors export (model info: tasks.model_info). Knows no task,
engine or dataset by name: the checkpoint is read through state.SavedRun, and its task evaluates,
exports and says how its images were preprocessed (tasks/base.py)."""

from __future__ import annotations

import json
from pathlib import Path

from .checkpoint import export_safetensors
from .config import Config
from .errors import ConfigError
from .fastpaths import resolve as resolve_fast_paths
from .state import SavedRun
from .strategy import build_strategy, check_engine, in_this_process
from .tasks import build_task, check_config, export_use


def _open(checkpoint, overrides=(), command: str = "eval") -> tuple[SavedRun, Config]:
    """A checkpoint file, or a run folder's newest readable checkpoint (a damaged newer one named),
    and its config with `overrides`, checked."""
    doing = {"eval": "evaluating", "export": "exporting"}[command]
    saved = SavedRun.open(checkpoint, doing, f"vitscale {command}")
    return saved, check_config(saved.config(overrides))


def _rebuild(task, spec: dict, weights: dict):
    """The checkpoint's model, built from its saved `spec`, holding `weights`."""
    model = task.build_model(task.spec_from_dict(spec))
    model.load_state_dict(weights)
    return model


def evaluate_checkpoint(checkpoint, overrides=()) -> dict:
    """The run's own metrics for a checkpoint (the task's: accuracy for a ViT; held-out retrieval
    and zero-shot accuracy for a CLIP model), in this one process whatever trained it."""
    saved, cfg = _open(checkpoint, overrides)
    # read before anything is built (a sharded run's from its .dcp folder), non-finite ones refused
    weights = saved.weights(cfg.train.ema_decay > 0 and cfg.train.ema_eval)
    # an auto asked here: this machine's; what this machine refuses of it, in one line
    here = check_engine(resolve_fast_paths(in_this_process(cfg)).cfg)
    strategy = build_strategy(here)
    task = build_task(cfg, saved.kind)
    data = task.build_data(strategy)
    model = _rebuild(task, saved.spec, weights)
    strategy.setup_eval(model)
    try:
        result = task.evaluate_all(strategy, data)
    finally:
        data.close()
    if "test_count" in result:
        result["count"] = result["test_count"]
    return {**result, "step": saved.step, "checkpoint": str(saved.path), "task": task.kind}


# under the run folder
DEFAULT_OUT = {"vitscale": "model.safetensors", "timm": "timm/model.safetensors"}


def export_checkpoint(checkpoint, out=None, use_ema: bool = True, fmt: str = "vitscale") -> Path:
    """The checkpoint's weights as safetensors: vitscale's keys and spec (`fmt="vitscale"`), or
    another library's layout that the checkpoint's task declares (`Task.exports`: timm's
    VisionTransformer with its hub-style config.json, OpenCLIP's CLIP), with the preprocessing
    the run evaluated with (`Task.run_preprocess`)."""
    saved, cfg = _open(checkpoint, command="export")
    weights = {k: v.float() for k, v in saved.weights(use_ema).items()}
    run_dir = saved.run_dir
    out = Path(out) if out else run_dir / DEFAULT_OUT.get(fmt, f"model_{fmt}.safetensors")
    kind = saved.kind
    if fmt == "vitscale":  # the export's own metadata keys (interop/finetune.py reads them back)
        meta = {
            "format": f"vitscale-{kind}",
            "spec": json.dumps(saved.spec),
            "config": json.dumps(cfg.to_dict()),
            "step": str(saved.step),
        }
        return export_safetensors(weights, out, meta)
    # another library's layout: rebuild the model, let the task convert it
    task = build_task(cfg, kind)
    if fmt not in task.exports:
        raise ConfigError(
            f"export --format {fmt}: {saved.path} holds a {kind} model; {fmt}'s layout is for "
            f"{export_use(fmt)}"
        )
    model = _rebuild(task, saved.spec, weights)
    meta = {"format": fmt, "step": str(saved.step)}
    preprocess = task.run_preprocess(saved.spec, saved.preprocess, saved.task_state)
    return task.export(fmt, model, preprocess, out, meta, run_dir)
