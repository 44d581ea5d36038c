"""Every refusal that needs no data and no engine, in one place (`check_run`): `vitscale train`
(the Trainer, before an engine starts), `config` and `info` ask it, so they refuse with the same
line."""

from __future__ import annotations

import os

from .config import Config, micro_batch
from .errors import ConfigError
from .launch import launch_env
from .models.layers import tp_widths
from .optim import check_optimizer
from .strategy import check_engine, check_launch
from .strategy.mesh import mesh_shape, tp_refusal
from .tasks import build_task, check_config


def check_run(cfg: Config, world_size: int | None = None) -> Config:
    """Every refusal that needs no data and no engine, in one place: the task's checks (model.init
    files), the engine's (strategy.check_engine), the launch (N copies into one run folder) and
    that the global batch splits over processes x micro-batches. `vitscale train`, `config` and
    `info` ask it; `world_size` None: this process's launch (1 outside a launcher)."""
    world = launch_env(os.environ).world_size if world_size is None else world_size
    check_launch(check_config(cfg).strategy.name, world)
    check_engine(cfg, world)
    check_optimizer(cfg.optim)
    shape = mesh_shape(cfg.strategy, world)
    if shape.tp > 1:  # what tensor parallelism splits: the model's heads and widths
        refusal = tp_refusal(shape, tp_widths(build_task(cfg).meta_model()[1]))
        if refusal:
            raise ConfigError(refusal)
    micro_batch(cfg.data.batch_size, shape.dp, cfg.train.accum_steps)
    return cfg
