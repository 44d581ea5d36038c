"""FSDP2 (`fully_shard`): every transformer block sharded, then the root; parameters, gradients
and optimizer state split across ranks. Precision comes from a MixedPrecisionPolicy (bf16
parameters for compute, fp32 gradient reduction by default), not from autocast.

Checkpoints hold the full (unsharded) model and optimizer state, gathered through
`torch.distributed.checkpoint.state_dict`, so they resume under any world size and under the
single-device and DDP strategies too.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ..errors import ConfigError
from ..optim import build_optimizer, param_groups
from .dist import Distributed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class FSDPStrategy(Distributed):
    name = "fsdp"

    def __init__(self, train, optim, scfg, device_type):
        unsupported = [name for name, on in (("train.ema_decay", train.ema_decay > 0),
                                             ("train.compile", train.compile),
                                             ("train.precision=fp16", train.precision == "fp16"),
                                             (f"train.precision={train.precision}", train.precision.startswith("pure_")))
                       if on]
        if unsupported:
            raise ConfigError(f"config: strategy.name=fsdp does not support {', '.join(unsupported)} yet "
                              "(use strategy.name=ddp or single)")
        super().__init__(train, optim, scfg, device_type)
        self.param_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(train.precision)
        self.half = None  # precision lives in the MixedPrecisionPolicy, not in autocast

    def setup(self, model: nn.Module) -> None:
        model.to(self.device)
        if self.cfg.activation_checkpointing:
            model.set_grad_checkpointing(True)
        mp = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=DTYPES[self.scfg.reduce_dtype])
        offload = CPUOffloadPolicy() if self.scfg.cpu_offload else OffloadPolicy()
        kw = dict(mp_policy=mp, offload_policy=offload, reshard_after_forward=self.scfg.reshard_after_forward)
        from ..models.layers import Block
        for block in [m for m in model.modules() if isinstance(m, Block)]:  # both towers of a CLIP
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        self.module = self.model = model
        self.optimizer = build_optimizer(model, self.optim_cfg, params=param_groups(model, self.optim_cfg.weight_decay))

    def no_sync(self):
        @contextlib.contextmanager
        def ctx():
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        return ctx()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> dict:
        clip = self.optim_cfg.grad_clip
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"), foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm), "skipped": False}

    def eval_module(self) -> nn.Module:
        return self.module

    def state_dict(self) -> dict:
        """Collective: every rank gathers; the full tensors land on CPU."""
        return {"model": get_model_state_dict(self.model, options=FULL),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=FULL),
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        set_model_state_dict(self.model, sd["model"], options=opts)
        set_optimizer_state_dict(self.model, self.optimizer, sd["optimizer"], options=opts)
