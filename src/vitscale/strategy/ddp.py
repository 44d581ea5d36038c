"""PyTorch DistributedDataParallel: one process per device, gradients all-reduced in buckets
during backward; `no_sync` for accumulation micro-steps; optional bf16/fp16 gradient compression
(a comm hook written for gloo too: DDP's built-in bf16_compress_hook refuses gloo)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..precision import DTYPES
from .dist import Distributed


def allreduce_hook(dtype: torch.dtype | None = None):
    """DDP comm hook: average each gradient bucket with one all-reduce, in `dtype` when given
    (bf16/fp16 compression: half the bytes; works on gloo, unlike DDP's built-in hook). The
    all-reduce goes through `torch.distributed`, where comm.py counts it."""

    def hook(process_group, bucket):  # no annotations: DDP checks them against real types
        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None  # DDP was built in an initialized process group: WORLD is set
        buf = bucket.buffer()
        payload = (buf.to(dtype) if dtype is not None else buf).div_(group.size())
        work = dist.all_reduce(payload, group=group, async_op=True)
        assert work is not None  # async_op on a group this rank belongs to returns its Work
        fut = work.get_future()

        def finish(f):
            if dtype is not None:
                buf.copy_(f.value()[0])
            return buf

        return fut.then(finish)

    return hook


def ddp_wrap(model: nn.Module, device: torch.device, scfg) -> nn.Module:
    """DistributedDataParallel around the plain model, its buckets all-reduced by allreduce_hook
    (in strategy.grad_compression's dtype where it compresses)."""
    ids = [device.index] if device.type == "cuda" else None
    # a weight that is contiguous in two orders (one input channel, or a 1x1 conv, as in the conv
    # stem that computes channels-last) gets a gradient whose strides differ from its bucket view's
    # while still obeying autograd's layout contract; DDP copies it into the view and warns once
    # per process about that copy's speed (a few KB here), not about the result
    warnings.filterwarnings(
        "ignore", message="Grad strides do not match bucket view strides", category=UserWarning
    )
    ddp = DistributedDataParallel(
        model, device_ids=ids, bucket_cap_mb=scfg.bucket_mb, gradient_as_bucket_view=True
    )
    ddp.register_comm_hook(None, allreduce_hook(DTYPES.get(scfg.grad_compression)))
    return ddp


class DDPStrategy(Distributed):
    """Replicas: the one set-up (single.py) with DDP as the wrapper the training step calls."""

    name = "ddp"
    no_sync_defers_comm = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.wrapper = lambda model: ddp_wrap(model, self.device, self.scfg)

    def no_sync(self):
        ddp = getattr(self.model, "_orig_mod", self.model)  # compiled DDP keeps it inside
        assert isinstance(ddp, DistributedDataParallel)  # what wrap() made of the model in setup
        return ddp.no_sync()
