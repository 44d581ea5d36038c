"""torch.compile's keyword arguments for a run's train section: the one place both compiles take
them from, the engines' (strategy/: a model, its blocks, DeepSpeed's engine) and CLIP's whole
step (tasks/clip_step.py), which the layers keep apart."""

from __future__ import annotations

from .config import TrainConfig, inductor_options


def compile_args(train: TrainConfig) -> dict:
    """torch.compile's keyword arguments: {"mode": ...} alone without knobs, else {"options": the
    mode's options with the train.inductor_* knobs over them} (torch.compile takes a mode or an
    options dict, never both)."""
    opts = inductor_options(train)
    if not opts:
        return {} if train.compile_mode == "default" else {"mode": train.compile_mode}
    from torch._inductor import list_mode_options

    return {"options": {**list_mode_options(train.compile_mode), **opts}}
