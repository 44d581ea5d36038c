"""CLIP losses (OpenCLIP mini-batch InfoNCE, the FastCLIP family) and their builder."""
from __future__ import annotations

import torch
from torch import nn

from .clip import ClipLoss, gamma_at
from .fastclip import VARIANTS, FastClipLoss

__all__ = ["build_clip_loss", "ClipLoss", "FastClipLoss", "gamma_at"]


def build_clip_loss(cfg_clip, *, dataset_size: int, epochs: float, steps_per_epoch: int,
                    device, group=None) -> nn.Module:
    """The loss named by cfg_clip.loss.  group=None: the default process group when
    torch.distributed is initialized, else a single process.  `steps_per_epoch` is accepted for
    schedules that change within an epoch (none yet: gamma is set per epoch by set_epoch)."""
    if cfg_clip.loss == "openclip":
        return ClipLoss(device=device, group=group)
    if cfg_clip.loss not in VARIANTS:
        raise ValueError(f"clip.loss {cfg_clip.loss!r}: expected openclip or one of {VARIANTS}")
    schedule = cfg_clip.gamma_schedule
    if schedule == "auto":
        schedule = "constant" if cfg_clip.loss in ("sogclr", "isogclr") else "cosine"
    decay = cfg_clip.gamma_decay_epochs or epochs / 2
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg_clip.state_dtype]
    return FastClipLoss(cfg_clip.loss, dataset_size=dataset_size, gamma_schedule=schedule,
                        gamma_min=cfg_clip.gamma_min, gamma_decay_epochs=decay,
                        tau_init=cfg_clip.tau_init, tau_lr=cfg_clip.tau_lr, tau_lr_cut=cfg_clip.tau_lr_cut,
                        rho=cfg_clip.rho, eps=cfg_clip.eps, tau_beta1=cfg_clip.tau_beta1,
                        tau_beta2=cfg_clip.tau_beta2, state_dtype=dtype, device=device, group=group)
