"""PyTorch DistributedDataParallel: one process per device, gradients all-reduced in buckets
during backward; `no_sync` for accumulation micro-steps; optional bf16/fp16 gradient compression
(a comm hook written for gloo too: DDP's built-in bf16_compress_hook refuses gloo)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..config import OptimConfig, StrategyConfig, TrainConfig
from . import dist as vdist
from .single import SingleDevice

COMPRESS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compress_hook(dtype: torch.dtype):
    """All-reduce each gradient bucket in `dtype` (half the bytes), averaged, then cast back."""
    def hook(process_group, bucket):  # no annotations: DDP checks them against real types
        group = process_group if process_group is not None else dist.group.WORLD
        buf = bucket.buffer()
        compressed = buf.to(dtype).div_(group.size())
        fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(f):
            buf.copy_(f.value()[0])
            return buf
        return fut.then(decompress)
    return hook


class DDPStrategy(SingleDevice):
    name = "ddp"

    def __init__(self, train: TrainConfig, optim: OptimConfig, scfg: StrategyConfig, device_type: str):
        vdist.init_process_group(device_type, scfg.backend, scfg.timeout_s)
        self.rank, self.world_size, local = vdist.env_world()
        self.is_main = self.rank == 0
        device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
        self.scfg = scfg
        super().__init__(train, optim, device)

    def wrap(self, model: nn.Module) -> nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=self.scfg.bucket_mb,
                                      gradient_as_bucket_view=True)
        if self.scfg.grad_compression != "none":
            ddp.register_comm_hook(None, compress_hook(COMPRESS[self.scfg.grad_compression]))
        return ddp

    def no_sync(self):
        return self.model.no_sync() if hasattr(self.model, "no_sync") else \
            getattr(self.model, "_orig_mod").no_sync()  # compiled DDP

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return vdist.all_reduce_sum(t)

    def gather_objects(self, obj) -> list:
        return vdist.gather_objects(obj)

    def broadcast_object(self, obj):
        return vdist.broadcast_object(obj)
