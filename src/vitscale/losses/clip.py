"""CLIP losses: the OpenCLIP mini-batch InfoNCE loss, the gamma schedule and the collectives helpers.

Collectives outside `strategy/` live only here, in `fastclip.py` and in `fastclip_state.py`; the
process group is passed in (None = the default group when torch.distributed is initialized, else a
single process).
Communication is counted per worker in elements SENT under the ring model: an all_gather of a [b, d]
tensor over K ranks sends (K-1)*b*d; the autograd all_gather's backward (a reduce-scatter, emulated by
all_to_all on gloo) sends (K-1)*b*d as well.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class StepLogs(Mapping):
    """A loss's per-step logs kept as one detached device tensor until read. The loop reads them
    only on logging steps, so the other steps pay no host-device sync for them."""

    def __init__(self, values: dict):
        self._keys = list(values)
        device = next(v.device for v in values.values() if torch.is_tensor(v))
        self._tensor = torch.stack(
            [
                torch.as_tensor(v, dtype=torch.float64, device=device).reshape(())
                for v in values.values()
            ]
        )

    def _values(self) -> dict:
        """Read now (one device read): under train.capture=step a replay rewrites the tensor of
        the logs the capture made, so nothing read before is kept."""
        return dict(zip(self._keys, self._tensor.tolist()))

    def read(self) -> dict:
        """Every value, in one read of the device."""
        return self._values()

    def __getitem__(self, key):
        return self._values()[key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def gamma_at(epoch: float, schedule: str, gamma_min: float, decay_epochs: float) -> float:
    """Inner-estimator gamma: 1 at epoch 0; "cosine": 0.5(1+cos(pi e/E))(1-gamma_min)+gamma_min for
    0 < e < E, then gamma_min; "constant": gamma_min after epoch 0."""
    if epoch <= 0:
        return 1.0
    if schedule == "constant":
        return float(gamma_min)
    if schedule != "cosine":
        raise ValueError(f"gamma schedule {schedule!r}: expected 'cosine' or 'constant'")
    if decay_epochs <= 0 or epoch >= decay_epochs:
        return float(gamma_min)
    return 0.5 * (1 + math.cos(math.pi * epoch / decay_epochs)) * (1 - gamma_min) + gamma_min


def world(group) -> tuple[int, int, object]:
    """(K, rank, group) of the loss's process group; (1, 0, None) for a single process."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return 1, 0, None
        group = dist.group.WORLD
    return dist.get_world_size(group), dist.get_rank(group), group


# torch >= 2.13 names them *_single and deprecates *_into_tensor / *_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_no_grad(x: torch.Tensor, k: int, group) -> torch.Tensor:
    """[b, ...] -> [k*b, ...] in rank order, no autograd (sends (k-1)*numel(x))."""
    if k == 1:
        return x.detach()
    out = torch.empty((k * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.detach().contiguous(), group=group)
    return out


class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward is a reduce-scatter (sum): rank r gets sum_q dL_q/dx_r.  gloo has no
    reduce-scatter, so there it is an all_to_all followed by a local sum (same elements sent)."""

    @staticmethod
    def forward(ctx, x, k, group):
        ctx.k, ctx.group = k, group
        out = torch.empty((k * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "gloo":
            parts = list(torch.empty_like(grad).chunk(ctx.k))
            dist.all_to_all(parts, list(grad.chunk(ctx.k)), group=ctx.group)
            return torch.stack(parts).sum(0), None, None
        out = torch.empty_like(grad.chunk(ctx.k)[0])
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
            out, grad, group=ctx.group
        )
        return out, None, None


def no_autocast(device_type: str):
    """The losses compute in fp32 even inside the strategy's autocast region."""
    return torch.autocast(device_type=device_type, enabled=False)


class ClipLoss(nn.Module):
    """OpenCLIP's mini-batch loss: local rows vs all gathered columns (`local_loss` + `gather_with_grad`).

    loss_r = (CE(img_r -> txt_all) + CE(txt_r -> img_all)) / 2 with labels arange(b) + b*rank, so the
    mean over ranks of loss_r is the full-batch InfoNCE; the all_gather's backward sums the feature
    gradients of all ranks, so after the engines average parameter gradients over K ranks the gradient
    is that of the full-batch InfoNCE.  comm per step: 4(K-1)bd feature elements (2 forward gathers
    of [b, d] + their 2 backward reduce-scatters).
    """

    def __init__(self, *, device=None, group=None):
        super().__init__()
        self.group = group
        self._labels: dict = {}
        self.comm_elements = {"features": 0, "scalars": 0, "steps": 0}
        self._logs: StepLogs | None = None

    # no per-sample state, no learnable temperature here (logit_scale is a model parameter)
    def set_epoch(self, epoch: int) -> None:
        pass

    def after_step(self, step: int | torch.Tensor | None = None) -> None:
        pass

    def state_bytes(self) -> int:
        return 0

    def state_dict(self, *args, **kwargs) -> dict:
        return {}

    def load_state_dict(self, sd: dict, strict: bool = True):
        pass

    @property
    def temperature(self) -> float:
        return self._logs["tau"] if self._logs is not None else float("nan")

    def labels(self, device, b: int, rank: int) -> torch.Tensor:
        key = (str(device), b, rank)
        if torch.compiler.is_compiling():  # made in the graph: no cache the trace would guard on
            return torch.arange(b, device=device) + b * rank
        if key not in self._labels:
            self._labels[key] = torch.arange(b, device=device) + b * rank
        return self._labels[key]

    @staticmethod
    def gather_with_grad(x: torch.Tensor, k: int, group) -> torch.Tensor:
        """[b, d] -> [k*b, d]; the backward sums the gathered gradients of all ranks into x's."""
        return _GatherWithGrad.apply(x, k, group)

    def forward(self, img_f, txt_f, logit_scale, index=None):
        loss, logs = self.compute(img_f, txt_f, logit_scale, index)
        self.note_step()
        self._logs = StepLogs(logs)
        return loss, self._logs

    def note_step(self) -> None:
        """One step more in the communication counts (outside `compute`: a compiled step keeps no
        host counter)."""
        self.comm_elements["steps"] += 1

    def compute(self, img_f, txt_f, logit_scale, index=None):
        """(loss, {name: 0-d device tensor}): static shapes, no host read (torch.compile's
        fullgraph, a CUDA graph's replay)."""
        k, rank, group = world(self.group)
        with no_autocast(img_f.device.type):
            e1, e2 = img_f.float(), txt_f.float()
            b, d = e1.shape
            scale = logit_scale.float().reshape(()).exp().clamp(max=100.0)
            if k > 1:
                all1 = self.gather_with_grad(e1, k, group)  # [N, d]
                all2 = self.gather_with_grad(e2, k, group)
                sent = 2 * (k - 1) * b * d * (2 if torch.is_grad_enabled() else 1)
                self.comm_elements["features"] += sent
                logits_i = scale * e1 @ all2.T  # [b, N] local rows vs all columns
                logits_t = scale * e2 @ all1.T  # [b, N]
                labels = self.labels(e1.device, b, rank)
            else:
                logits_i = scale * e1 @ e2.T
                logits_t = logits_i.T
                labels = self.labels(e1.device, b, 0)
            loss = (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels)) / 2
        logs = {"loss": loss.detach(), "tau": 1.0 / scale.detach(), "logit_scale": scale.detach()}
        return loss, logs
