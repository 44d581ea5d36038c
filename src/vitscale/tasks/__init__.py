"""Tasks: everything that differs between kinds of model (data, spec, loss step, metric,
evaluation, log lines, own state). See tasks/base.py for the interface."""
from __future__ import annotations

from ..config import Config
from ..errors import UserError
from ..models import is_clip_arch
from .base import Task
from .classification import ClassificationTask
from .clip import ClipTask

TASKS: dict[str, type[Task]] = {"vit": ClassificationTask, "clip": ClipTask}


def task_kind(cfg: Config) -> str:
    return "clip" if is_clip_arch(cfg.model.arch) else "vit"


def task_class(kind: str) -> type[Task]:
    try:
        return TASKS[kind]
    except KeyError:
        raise UserError(f"unknown model kind '{kind}' (known: {', '.join(TASKS)})") from None


def build_task(cfg: Config, kind: str | None = None) -> Task:
    """The task for a config (`kind`: the one a checkpoint names, else from model.arch)."""
    return task_class(kind or task_kind(cfg))(cfg)


def model_info(cfg: Config) -> dict:
    return build_task(cfg).info()


def describe_result(r: dict) -> str:
    """One line for a summary or an evaluation result (their "task" key names the task)."""
    return task_class(r.get("task", "vit")).describe_metrics(r)


__all__ = ["Task", "TASKS", "ClassificationTask", "ClipTask", "build_task", "task_class", "task_kind",
           "model_info", "describe_result"]
