"""Strategies own devices, precision, wrapping, backward, step and checkpoint state.

Only this package imports autocast, GradScaler or the distributed engines.
"""
from __future__ import annotations

from ..config import Config
from .base import Strategy
from .single import SingleDevice, resolve_device


def build_strategy(cfg: Config):
    device = resolve_device(cfg.run.device)
    if cfg.strategy.name == "single":
        return SingleDevice(cfg.train, cfg.optim, device)
    if cfg.strategy.name == "ddp":
        from .ddp import DDPStrategy
        return DDPStrategy(cfg.train, cfg.optim, cfg.strategy, device.type)
    if cfg.strategy.name == "fsdp":
        from .fsdp import FSDPStrategy
        return FSDPStrategy(cfg.train, cfg.optim, cfg.strategy, device.type)
    if cfg.strategy.name == "deepspeed":
        from .deepspeed import DeepSpeedStrategy
        return DeepSpeedStrategy(cfg.train, cfg.optim, cfg.strategy, device.type, cfg.data.batch_size)
    raise NotImplementedError(cfg.strategy.name)  # unreachable: validated by the config


__all__ = ["Strategy", "build_strategy", "resolve_device", "SingleDevice"]
