"""Strategies own devices, precision, wrapping, backward, step and checkpoint state.

Only this package imports autocast, GradScaler or the distributed engines, and only this package
decides by an engine's name: the loop, `vitscale eval` and the lab ask the functions below.
"""

from __future__ import annotations

import os
from dataclasses import replace

from ..config import Config
from ..errors import ConfigError
from ..launch import launch_env
from ..optim import scaled_lr
from .base import Strategy
from .devices import backend_for
from .mesh import mesh_shape
from .single import SingleDevice, resolve_device

IN_PROCESS = SingleDevice.name  # the engine of one process, no launcher
DATA_PARALLEL = "ddp"  # what a one-process config becomes under a launcher (the lab)


def needs_processes(name: str) -> bool:
    """Whether the engine `name` is one process per device under a launcher (torchrun, srun, the
    deepspeed launcher), which only does what it is for (data parallel, sharding) with several."""
    return name != IN_PROCESS


def default_for(world_size: int) -> str:
    """The engine a run without its own choice gets with `world_size` processes."""
    return DATA_PARALLEL if world_size > 1 else IN_PROCESS


def in_this_process(cfg: Config) -> Config:
    """`cfg` for work in this one process whatever engine trained the model (evaluation, export)."""
    return replace(cfg, strategy=replace(cfg.strategy, name=IN_PROCESS))


def check_launch(name: str, world_size: int) -> None:
    """ConfigError where a one-process engine was started as several processes: each would train
    alone into the same run folder."""
    if world_size > 1 and not needs_processes(name):
        raise ConfigError(
            f"config: strategy.name={name} under a launcher that started {world_size} "
            "processes: each would train alone into the same run folder; use "
            "strategy.name=ddp, fsdp, hsdp or deepspeed (or launch one process)"
        )


def on_mesh(cfg: Config, world: int = 1) -> bool:
    """Whether the run is FSDP2's mesh engine (fsdp.py): shards, replicas of shards, or tensor
    parallelism under any data-parallel form; else DDP, DeepSpeed or one device."""
    shape = mesh_shape(cfg.strategy, world)
    return cfg.strategy.name in ("fsdp", "hsdp") or shape.tp > 1


def check_engine(cfg: Config, world: int = 1) -> Config:
    """The refusals the mesh, the engine and this machine's device make when a run starts, asked
    before any process group or device is set up: `vitscale config` and `vitscale info` refuse
    what `vitscale train` refuses, with the same line (`world`: the processes launched)."""
    from .single import device_refusal

    device = resolve_device(cfg.run.device)
    refusal = None
    # the mesh's refusals (strategy/mesh.py), then the engine's own, then the device's
    if on_mesh(cfg, world):
        from .fsdp import fsdp_refusal

        refusal = fsdp_refusal(cfg.train, cfg.strategy.name)
    if cfg.strategy.name == "deepspeed":
        from .deepspeed import checked_ds_config

        checked_ds_config(cfg.train, cfg.optim, cfg.strategy, cfg.data.batch_size, device.type)
    refusal = refusal or device_refusal(cfg.train, device)
    if refusal is None and needs_processes(cfg.strategy.name):
        backend_for(device.type, cfg.strategy.backend)  # e.g. nccl for CPU tensors
    if refusal:
        raise ConfigError(refusal)
    return cfg


def build_strategy(cfg: Config):
    """The config's engine, its optimizer's base lr scaled to the global batch (optim.scaled_lr: the
    strategy's `lr`, which the optimizer's groups own once built; the config keeps what was written)."""
    device = resolve_device(cfg.run.device)
    lr = scaled_lr(cfg.optim, cfg.data.batch_size)
    if cfg.strategy.name == "single":
        return SingleDevice(cfg.train, cfg.optim, device, lr=lr)
    if on_mesh(cfg, launch_env(os.environ).world_size):
        from .fsdp import FSDPStrategy

        return FSDPStrategy(cfg.train, cfg.optim, cfg.strategy, device.type, lr=lr)
    if cfg.strategy.name == "ddp":
        from .ddp import DDPStrategy

        return DDPStrategy(cfg.train, cfg.optim, cfg.strategy, device.type, lr=lr)
    if cfg.strategy.name == "deepspeed":
        from .deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(
            cfg.train, cfg.optim, cfg.strategy, device.type, cfg.data.batch_size, lr=lr
        )
    raise NotImplementedError(cfg.strategy.name)  # unreachable: validated by the config


__all__ = [
    "Strategy",
    "build_strategy",
    "check_engine",
    "resolve_device",
    "SingleDevice",
    "IN_PROCESS",
    "needs_processes",
    "default_for",
    "in_this_process",
    "check_launch",
]
