"""PyTorch DistributedDataParallel: one process per device, gradients all-reduced in buckets
during backward; `no_sync` for accumulation micro-steps; optional bf16/fp16 gradient compression
(a comm hook written for gloo too: DDP's built-in bf16_compress_hook refuses gloo)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .dist import Distributed

COMPRESS = {"bf16": torch.bfloat16, "fp16": torch.float16}


class CommStats:
    """Gradient all-reduce accounting: payload bytes, calls, and seconds from launch to completion
    (overlapped with backward where DDP manages to)."""

    def __init__(self):
        self.bytes, self.calls, self.seconds = 0, 0, 0.0

    def take(self, steps: int) -> dict:
        out = {"comm_allreduce_bytes_per_step": self.bytes / max(1, steps),
               "comm_allreduce_calls_per_step": self.calls / max(1, steps),
               "comm_allreduce_s_per_step": self.seconds / max(1, steps)}
        self.__init__()
        return out


def allreduce_hook(stats: CommStats, dtype: torch.dtype | None = None):
    """DDP comm hook: average each gradient bucket with one all-reduce, in `dtype` when given
    (bf16/fp16 compression: half the bytes; works on gloo, unlike DDP's built-in hook), counted."""
    def hook(process_group, bucket):  # no annotations: DDP checks them against real types
        group = process_group if process_group is not None else dist.group.WORLD
        buf = bucket.buffer()
        t0 = time.perf_counter()
        payload = (buf.to(dtype) if dtype is not None else buf).div_(group.size())
        stats.bytes += payload.numel() * payload.element_size()
        stats.calls += 1
        fut = dist.all_reduce(payload, group=group, async_op=True).get_future()

        def finish(f):
            stats.seconds += time.perf_counter() - t0
            if dtype is not None:
                buf.copy_(f.value()[0])
            return buf
        return fut.then(finish)
    return hook


class DDPStrategy(Distributed):
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=self.scfg.bucket_mb,
                                      gradient_as_bucket_view=True)
        self.comm = CommStats()
        ddp.register_comm_hook(None, allreduce_hook(self.comm, COMPRESS.get(self.scfg.grad_compression)))
        return ddp

    def comm_stats(self, steps: int) -> dict:
        return self.comm.take(steps)

    def no_sync(self):
        ddp = getattr(self.model, "_orig_mod", self.model)  # compiled DDP keeps it inside
        return ddp.no_sync()
