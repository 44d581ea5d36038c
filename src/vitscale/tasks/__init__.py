"""Tasks: everything that differs between kinds of model (data, spec, loss step, metric,
evaluation, log lines, own state). See tasks/base.py for the interface."""

from __future__ import annotations

from ..config import Config
from ..data import check_data
from ..errors import ConfigError, UserError
from ..models import is_clip_arch
from .base import Task
from .classification import ClassificationTask
from .clip import ClipTask

TASKS: dict[str, type[Task]] = {
    ClassificationTask.kind: ClassificationTask,
    ClipTask.kind: ClipTask,
}


def task_kind(cfg: Config) -> str:
    return (ClipTask if is_clip_arch(cfg.model.arch) else ClassificationTask).kind


def task_class(kind: str) -> type[Task]:
    try:
        return TASKS[kind]
    except KeyError:
        raise UserError(f"unknown model kind '{kind}' (known: {', '.join(TASKS)})") from None


def build_task(cfg: Config, kind: str | None = None) -> Task:
    """The task for a config (`kind`: the one a checkpoint names, else from model.arch)."""
    return task_class(kind or task_kind(cfg))(cfg)


def check_config(cfg: Config) -> Config:
    """The checks of a config that depend on its kind of model (the task's: its model.init options
    and files), after config.check's: every command runs it on its config before anything starts."""
    task = build_task(cfg)
    task.check()
    check_data(cfg.data, task.pairs)  # what the data cannot give this kind of model
    why = task_capture_refusal(task)
    if cfg.train.capture == "step" and why:
        raise ConfigError(f"config: train.capture=step is refused for {why}")
    return cfg


def task_capture_refusal(task: Task, auto: bool = False) -> str | None:
    """Why this kind of model's step cannot be captured as one unit ("<kind> models: why"), or None
    (train.capture=step refuses it; train.capture=auto runs uncaptured with it as the reason).
    `auto`: also why capture=auto leaves a step uncaptured that capture=step takes."""
    why = task.uncapturable or (task.capture_not_auto if auto else "")
    return f"{task.kind} models: {why}" if why else None


def export_use(fmt: str) -> str:
    """The models an export format's layout is for (the task that declares it)."""
    return next((t.exports[fmt] for t in TASKS.values() if fmt in t.exports), "")


def model_info(cfg: Config) -> dict:
    return build_task(cfg).info()


def describe_result(r: dict) -> str:
    """One line for a summary or an evaluation result (their "task" key names the task)."""
    return task_class(r.get("task", ClassificationTask.kind)).describe_metrics(r)


__all__ = [
    "Task",
    "TASKS",
    "ClassificationTask",
    "ClipTask",
    "build_task",
    "check_config",
    "task_capture_refusal",
    "task_class",
    "task_kind",
    "export_use",
    "model_info",
    "describe_result",
]
