"""train.ema_decay as a part a strategy holds: an exponential moving average of the weights."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype


class Ema:
    """torch's AveragedModel with its EMA function (parameters and buffers), kept on the training
    device (torch's default is the CPU: a copy per step), updated after each optimizer step
    without a host read: the host keeps the count it needs (`updates`), so that the update can be
    captured and replayed."""

    def __init__(self, model: nn.Module, decay: float, device: torch.device):
        self.averaged = AveragedModel(
            model, device=device, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True
        )
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
