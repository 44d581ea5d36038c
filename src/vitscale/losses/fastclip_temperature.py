"""FastCLIP's temperatures and their optimizers (losses/fastclip.py holds one of these two).

GlobalTemperature (v0, v1, v3, SogCLR): one tau, learned (v0, v3) as theta = logit_scale =
log(1/tau) by one Adam (AdamW, weight decay 0) step per optimizer step on d(loss)/d(theta), then
theta clamped to [0, ln 100].  The lr of that step is `tau_lr` times: v0 the model's lr schedule
factor (warm-up + cosine, the reference's default), v3 1/tau_lr_cut while 1/exp(theta) <= 0.03
(re-checked every step from the current theta, not latched).

SampleTemperatures (v2, iSogCLR): tau1_i, tau2_i per dataset index, each an Adam-like step on its
clamped gradient h_k,i, with betas (0, 0) during epoch 0 and the model optimizer's betas after,
bias correction by 1 - beta^(epoch+1), tau clamped to [0.01, 1].  It also keeps the reference's
running bounds of max_j z_ij (fastclip_step.inner_estimate), the other per-sample rows of these
variants.  Its tables are sharded like u (fastclip_state.ShardMap).
"""

from __future__ import annotations

import math

import torch

from .fastclip_state import ShardMap

TAU_MIN, TAU_MAX, TAU_CUT_AT = 0.01, 1.0, 0.03
THETA_MAX = math.log(100.0)  # logit_scale clamp [0, ln 100] = tau in [0.01, 1]


class GlobalTemperature:
    """theta = log(1/tau) and its Adam state, fp64 0-d tensors (no host syncs)."""

    names = ("theta", "theta_m", "theta_v", "theta_step")  # checkpoint keys
    row_names = ()  # per-sample rows a step reads

    def __init__(
        self,
        tau_init: float,
        *,
        lr: float,
        schedule: str,
        lr_factor,
        lr_cut: float,
        betas: tuple[float, float],
        eps: float,
        device,
        steps: int | None = None,
    ):
        f64 = dict(dtype=torch.float64, device=device)
        self.theta = torch.tensor(math.log(1.0 / float(tau_init)), **f64)
        self.theta_m, self.theta_v = torch.zeros((), **f64), torch.zeros((), **f64)
        self.theta_step = torch.zeros((), **f64)
        self.lr, self.schedule, self.lr_factor, self.lr_cut = lr, schedule, lr_factor, lr_cut
        self.betas, self.eps = betas, eps
        self.lr_t = torch.tensor(float(lr), **f64)  # a copy from the host: never inside a step
        # v0 (schedule "model") with the run's step count: tau_lr x the model's factor at every
        # step, a device table a step counter on the device indexes (train.capture=step)
        self.lr_table = (
            torch.tensor([lr * lr_factor(s) for s in range(steps + 1)], **f64)
            if schedule == "model" and lr_factor is not None and steps
            else None
        )

    def tables(self) -> dict:
        return {name: getattr(self, name) for name in self.names}

    @property
    def tau(self) -> torch.Tensor:
        """The global temperature 1/exp(theta) (fp64 0-d)."""
        return torch.exp(-self.theta)

    @property
    def temperature(self) -> float:
        return float(self.tau)

    def scales(self, rows, n: int):
        """(s1, s2): the factor of n anchors' similarity differences, logit_scale = exp(theta)."""
        s = torch.exp(self.theta).float().expand(n)
        return s, s

    def set_epoch(self, epoch: int) -> None:
        """Nothing of the global temperature's step depends on the epoch."""

    def lr_at(self, step: int | torch.Tensor | None = None) -> torch.Tensor:
        """The lr for the step about to be taken (fp64 0-d): tau_lr times the model's schedule factor
        (v0: schedule "model"), or divided by tau_lr_cut while tau <= 0.03 (v3: "threshold").
        `step` a device counter (train.capture=step): v0's lr from the device table, the same
        doubles (tau_lr x factor, one rounding either way)."""
        lr = self.lr_t  # made once: no host-to-device copy inside a CUDA graph's capture
        if self.schedule == "model" and self.lr_factor is not None:
            if torch.is_tensor(step) and self.lr_table is not None:
                at = step.clamp(max=len(self.lr_table) - 1).view(1)  # no host read of the step
                return self.lr_table.index_select(0, at).view(())
            lr = lr * self.lr_factor(int(self.theta_step if step is None else step))
        elif self.schedule == "threshold":
            lr = torch.where(torch.exp(-self.theta) <= TAU_CUT_AT, lr / self.lr_cut, lr)
        return lr

    def adam_step(self, g, lr) -> None:
        """One Adam step of theta on d(loss)/d(theta) = g with learning rate lr, then the clamp."""
        b1, b2 = self.betas
        self.theta_step += 1
        self.theta_m.mul_(b1).add_((1 - b1) * g)
        self.theta_v.mul_(b2).add_((1 - b2) * g * g)
        mhat = self.theta_m / (1 - b1**self.theta_step)
        vhat = self.theta_v / (1 - b2**self.theta_step)
        self.theta.sub_(lr * mhat / (vhat.sqrt() + self.eps)).clamp_(0.0, THETA_MAX)


class SampleTemperatures:
    """tau1_i (image anchors), tau2_i (text anchors), their Adam moments and the bounds, one row per
    dataset index held by this rank."""

    names = ("tau1", "tau2", "m1", "m2", "v1", "v2", "bound1", "bound2")  # checkpoint keys
    row_names = ("tau1", "tau2", "bound1", "bound2")  # per-sample rows a step reads

    def __init__(
        self,
        tau_init: float,
        *,
        shards: ShardMap,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        dtype,
        device,
    ):
        n, dt, dev = shards.size, dtype, device
        self.tau1 = torch.full((n,), float(tau_init), dtype=dt, device=dev)
        self.tau2 = torch.full((n,), float(tau_init), dtype=dt, device=dev)
        self.m1, self.m2, self.v1, self.v2 = (
            torch.zeros(n, dtype=dt, device=dev) for _ in range(4)
        )
        self.bound1, self.bound2 = (torch.zeros(n, dtype=dt, device=dev) for _ in range(2))
        self.shards, self.lr, self.betas, self.eps = shards, lr, betas, eps
        # the epoch's (beta1, beta2, 1 - beta1^(epoch+1), 1 - beta2^(epoch+1)), fp64 on the device:
        # written when an epoch starts, read by every step (a captured step replays with them)
        self.coef = torch.zeros(4, dtype=torch.float64, device=dev)
        self.set_epoch(0)

    def tables(self) -> dict:
        return {name: getattr(self, name) for name in self.names}

    @property
    def temperature(self) -> float:
        """The mean per-sample tau (of this rank's rows when sharded)."""
        rows = self.shards.held
        return float((self.tau1[:rows].float().mean() + self.tau2[:rows].float().mean()) / 2)

    def scales(self, rows: dict, n: int):
        """(s1, s2) = (1/tau1_i, 1/tau2_i) of the anchors whose rows are given."""
        return 1.0 / rows["tau1"], 1.0 / rows["tau2"]

    def batch_taus(self, idx_all, rows_all) -> dict:
        """The per-sample taus of the global batch's anchors (before this step's update): the
        fetched rows `rows_all` when sharded, else this rank's tables at the dataset indices."""
        if self.shards.sharded:
            return {"tau1": rows_all["tau1"], "tau2": rows_all["tau2"]}
        return {"tau1": self.tau1[idx_all].float(), "tau2": self.tau2[idx_all].float()}

    def set_epoch(self, epoch: int) -> None:
        """Betas (0, 0) during epoch 0, the model optimizer's after; bias correction by
        1 - beta^(epoch+1) (host doubles, written in place)."""
        b1, b2 = self.betas if epoch > 0 else (0.0, 0.0)
        for i, v in enumerate((b1, b2, 1 - b1 ** (epoch + 1), 1 - b2 ** (epoch + 1))):
            self.coef[i].fill_(v)

    def adam_step(self, idx, h1, h2) -> None:
        """The step of the dataset indices `idx` (the global batch's) on their gradients h1, h2, with
        the epoch's coefficients (set_epoch); the owner updates its rows. The same fp64 arithmetic
        as with host doubles: the coefficients are those doubles."""
        idx, h1, h2 = self.shards.own(idx, h1, h2)
        b1, b2, c1, c2 = self.coef.unbind()
        for tau, m, v, g in ((self.tau1, self.m1, self.v1, h1), (self.tau2, self.m2, self.v2, h2)):
            mi = b1 * m[idx].double() + (1 - b1) * g
            vi = b2 * v[idx].double() + (1 - b2) * g * g
            m[idx], v[idx] = mi.to(m.dtype), vi.to(v.dtype)
            step_ = self.lr * (mi / c1) / ((vi / c2).sqrt() + self.eps)
            tau[idx] = (tau[idx].double() - step_).clamp(TAU_MIN, TAU_MAX).to(tau.dtype)


def make_temperatures(
    individual: bool,
    tau_init: float,
    *,
    shards: ShardMap,
    lr: float,
    schedule: str,
    lr_factor,
    lr_cut: float,
    betas: tuple[float, float],
    eps: float,
    dtype,
    device,
    steps: int | None = None,
):
    """FastClipLoss's temperatures: per-sample (`individual`: v2, iSogCLR; sharded like u, in
    `dtype`) or the global one (`schedule`, `lr_factor` and `lr_cut` are its lr schedule's; `steps`: the run's step count,
    for v0's device table of lrs)."""
    if individual:
        return SampleTemperatures(
            tau_init, shards=shards, lr=lr, betas=betas, eps=eps, dtype=dtype, device=device
        )
    return GlobalTemperature(
        tau_init,
        lr=lr,
        schedule=schedule,
        lr_factor=lr_factor,
        lr_cut=lr_cut,
        betas=betas,
        eps=eps,
        device=device,
        steps=steps,
    )
