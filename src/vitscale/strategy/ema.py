"""train.ema_decay as a part a strategy holds: an exponential moving average of the weights."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

# timm's ModelEmaV3 defaults for use_warmup=True (warmup_gamma, warmup_power)
WARMUP_GAMMA, WARMUP_POWER = 1.0, 2.0 / 3.0


def warmup_ema_multi_avg_fn(decay: float):
    """get_ema_multi_avg_fn's counterpart with timm's ModelEmaV3 warm-up (train.ema_warmup): update k
    (from 0; k = 0 is AveragedModel's copy) averages with decay_k = min(decay, 1 - (1 + k / gamma)
    ^(-power)), gamma 1 and power 2/3 (its defaults), computed on the device from the count
    AveragedModel passes (n_averaged), so that a captured step replays it."""

    @torch.no_grad()
    def ema_update(avg, cur, n: torch.Tensor | int) -> None:
        k = torch.as_tensor(n, device=avg[0].device, dtype=torch.float32)
        w = 1.0 - torch.clamp(1.0 - (1.0 + k / WARMUP_GAMMA) ** (-WARMUP_POWER), max=decay)
        if torch.is_floating_point(avg[0]) or torch.is_complex(avg[0]):
            # the 0-dim tensor weight overload (torch's stubs list the tensor-list one)
            torch._foreach_lerp_(avg, cur, w)  # pyright: ignore
        else:  # as get_ema_multi_avg_fn averages integer buffers (foreach lerp cannot)
            for a, c in zip(avg, cur):
                a.copy_(a * (1 - w) + c * w)

    return ema_update


class Ema:
    """torch's AveragedModel with its EMA function (parameters and buffers), kept on the training
    device (torch's default is the CPU: a copy per step), updated after each optimizer step
    without a host read: the host keeps the count it needs (`updates`), so that the update can be
    captured and replayed."""

    def __init__(self, model: nn.Module, decay: float, device: torch.device, warmup: bool = False):
        """`warmup` (train.ema_warmup): timm's ModelEmaV3(use_warmup=True) schedule of the decay."""
        average = warmup_ema_multi_avg_fn(decay) if warmup else get_ema_multi_avg_fn(decay)
        self.averaged = AveragedModel(model, device=device, multi_avg_fn=average, use_buffers=True)
        self.updates = 0  # the count as the host knows it: no device read per step

    @property
    def module(self) -> nn.Module:
        """The averaged weights, as a model (evaluation, export)."""
        return self.averaged.module

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """AveragedModel.update_parameters' arithmetic (a copy the first time, then one foreach
        lerp per device and dtype) without its two host reads of the count."""
        ema = self.averaged
        mine = [t.detach() for t in (*ema.module.parameters(), *ema.module.buffers())]
        theirs = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if self.updates == 0:
            torch._foreach_copy_(mine, theirs)  # pyright: ignore[reportPrivateImportUsage]
        else:
            pairs = cast(list[list[torch.Tensor | None]], [mine, theirs])
            groups = _group_tensors_by_device_and_dtype(pairs)
            assert ema.multi_avg_fn is not None  # get_ema_multi_avg_fn's, given above
            for (_device, _), (both, _) in groups.items():
                avg, cur = cast(list[list[torch.Tensor]], both)  # no None: every tensor is given
                ema.multi_avg_fn(avg, cur, ema.n_averaged)
        ema.n_averaged += 1
        self.updates += 1

    def state_dict(self) -> dict:
        return self.averaged.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.averaged.load_state_dict(sd)
        self.updates = int(self.averaged.n_averaged)  # one read, at load
