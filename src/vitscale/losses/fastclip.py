"""FastCLIP's global contrastive losses with compositional inner estimators u, as the authors' code
(Optimization-AI/fast_clip, `src/fast_clip/loss.py` and `src/training/{train,main,scheduler}.py`)
computes them: every output of ../shared/reference/ is reproduced (tests/unit/test_fastclip_reference.py).

Notation: e1/e2 normalized image/text features, s_ij = <e1_i, e2_j>, global batch B of N = K*b
samples, z1_ij = (s_ij - s_ii)/tau1_i (image anchor i), z2_ij = (s_ji - s_ii)/tau2_i (text anchor i),
g_i = mean_{j != i} exp(z_ij), u_i <- (1-gamma) u_i + gamma g_i (batch indices only); a u that is
below 1e-35, inf or nan is replaced by g when gamma < 1 (so a sample first seen after epoch 0
starts at g).  With the updated u (detached),  V = mean_i [g1_i/(eps+u1_i) + g2_i/(eps+u2_i)].

What the reference optimizes (SOURCES.md section 3, ../shared/reference/README.md):
- v0, v1, SogCLR: the loss is V, its feature gradient grad(V/2) (the reference averages a
  local-anchor pass and a gathered-anchor pass, each of value V and each carrying half of the
  graph); the temperature is NOT a multiplier.
- v3 (`multiply_tau`): loss = tau V + rho tau + (tau/2) mean_i (log u1_i + log u2_i) with tau =
  1/logit_scale; the surrogate is divided by the DETACHED logit_scale, so the feature gradient is
  tau grad(V/2).
- v2, iSogCLR: per-sample tau1_i, tau2_i enter only through the exponents; the loss is V and its
  feature gradient grad(V/2) (no tau_i weight).
Global temperatures (v0, v3) are learned as theta = logit_scale = log(1/tau) by Adam
(fastclip_temperature.GlobalTemperature, which also has the lr schedules) on d(loss)/d(theta):
  v0: d/dtheta = mean_i (a1_i + a2_i),  v3: d/dtheta = tau (mean_i (a1_i + a2_i) - rho - mean_i (log u1_i + log u2_i)/2)
  with a_k,i = mean_{j != i} exp(z_k,ij) z_k,ij / (eps + u_k,i).
Per-sample temperatures (v2, iSogCLR; fastclip_temperature.SampleTemperatures): h_k,i =
clamp(log(eps + u_k,i) + rho - a_k,i, -5, 5), an Adam-like step.  The reference stores u exp(-bound)
with bound a running max of max_j z_ij (diagonal included): the bound decides when u counts as
"below 1e-35" and shifts eps (log(eps e^bound + u)); vitscale keeps it for those two effects only.

Log-space scheme (vitscale's stability, same numbers): u is STORED as lu = log u (u = 0 is
lu = -inf): log g_i = logsumexp_{j != i} z_ij - log(N-1), lu_i <- logaddexp(log(1-gamma) + lu_i,
log(gamma) + log g_i), L_i = log(eps + u_i).  Every exponential is exp(z_ij - L_i) = exp(z_ij)/(eps+u_i),
which is <= (N-1)/gamma after the update, so nothing overflows at tau = 0.01.

Surrogate (exact gradient after the engines' average over K ranks): the target is
G = c grad V, c = 1/2 (tau/2 for v3).  Rank r gets the features of all ranks by an all_gather
WITHOUT autograd and builds
L_r = (c / ((N-1) b)) [ (a) sum_{i local} sum_{j != i} exp(z_ij - L_i)   (local anchors vs all
features; the local slice of the gathered features is replaced by the graph-carrying local features)
            + (b) sum_{i not local} sum_{j local} exp(z_ij - L_i) ]  (gathered anchors, detached,
weights from the gathered u, against the local features as negatives).
Rank r's graph reaches exactly the terms of sum_i g_i/(eps+u_i) that depend on its own features,
so (1/K) sum_r grad L_r = G.  The returned loss is L_r - L_r.detach() + (the reference's reported
loss over the local anchors), so its mean over ranks is the reference's value.
Communication per worker per step (elements sent): features 2(K-1)bd (one all_gather of [b, 2d]);
scalars (K-1)*b*m with m = 3 columns (index, lu1, lu2) + 1 (global learnable tau: its theta
gradient per anchor) or + 4 (individual tau: h1, h2, bound1, bound2), gathered once as a float64
[b, m] tensor (indices exact up to 2^53).

Per-sample state is replicated on every rank (default) or sharded by dataset index
(`shard_state=True`): fastclip_state.py.  The arithmetic of a step is in fastclip_step.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .clip import StepLogs, gamma_at, gather_no_grad, no_autocast, world
from .fastclip_state import ShardMap
from .fastclip_step import (
    Gamma,
    add_remote_surrogate,
    anchor_exponents,
    inner_estimates,
    local_surrogate,
    remote_shifts,
    reported_objective,
    reported_value,
    temperature_columns,
)
from .fastclip_temperature import make_temperatures

VARIANTS = ("fastclip_v0", "fastclip_v1", "fastclip_v2", "fastclip_v3", "sogclr", "isogclr")
TAU_LR_SCHEDULES = ("auto", "model", "threshold", "constant")

# The reference's values per variant (README training scripts, CC3M scale; params.py defaults),
# used where the config leaves a key at its "auto" value.  docs/clip.md traces each one.
REFERENCE_DEFAULTS = {
    #               tau_init  tau_lr (None = optim.lr)  tau_lr_schedule  rho   gamma_min
    "fastclip_v0": (0.07, None, "model", 0.0, 0.2),
    "fastclip_v1": (0.07, 0.0, "constant", 0.0, 0.2),
    "fastclip_v2": (0.03, 0.0133, "constant", 7.0, 0.2),
    "fastclip_v3": (0.07, 2e-4, "threshold", 6.5, 0.2),
    "sogclr": (0.07, 0.0, "constant", 0.0, 0.8),
    "isogclr": (0.03, 0.0133, "constant", 7.0, 0.8),
}


def reference_defaults(variant: str) -> dict:
    tau_init, tau_lr, schedule, rho, gamma_min = REFERENCE_DEFAULTS[variant]
    return dict(
        tau_init=tau_init, tau_lr=tau_lr, tau_lr_schedule=schedule, rho=rho, gamma_min=gamma_min
    )


def resolved_tau_lr_schedule(variant: str, tau_lr_schedule: str) -> str:
    """The variant and the temperature's lr schedule checked; "auto": the reference's schedule for
    `variant`."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown FastCLIP variant {variant!r}; expected one of {VARIANTS}")
    if tau_lr_schedule not in TAU_LR_SCHEDULES:
        raise ValueError(f"tau_lr_schedule {tau_lr_schedule!r}: expected one of {TAU_LR_SCHEDULES}")
    if tau_lr_schedule == "auto":
        tau_lr_schedule = REFERENCE_DEFAULTS[variant][2]
    return tau_lr_schedule


def gathered_features(e1, e2, k: int, off: int, group):
    """(E1, E2, E1m, E2m): every rank's image and text features [N, d], gathered WITHOUT autograd in
    one all_gather, and the same with the local slice (rows off..off+b) replaced by the
    graph-carrying local features e1, e2."""
    b, d = e1.shape
    feats = gather_no_grad(torch.cat([e1, e2], 1), k, group)  # [N, 2d], detached
    E1, E2 = feats[:, :d], feats[:, d:]
    E1m = torch.cat([E1[:off], e1, E1[off + b :]])  # local slice with grad
    E2m = torch.cat([E2[:off], e2, E2[off + b :]])
    return E1, E2, E1m, E2m


class EpochState:
    """FastClipLoss's epoch and gamma: host values written through to the device tensors a step
    reads (`gamma_t`, the per-sample temperatures' Adam coefficients) when an epoch starts or a
    state is loaded, never inside a step: a compiled step or a CUDA graph's replay reads them there."""

    temperatures: Any  # GlobalTemperature or SampleTemperatures
    gamma_t: Gamma

    @property
    def epoch(self) -> int:
        return self._epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self._epoch = int(epoch)
        self.temperatures.set_epoch(self._epoch)

    @property
    def gamma(self) -> float:
        return self._gamma

    @gamma.setter
    def gamma(self, gamma: float) -> None:
        self._gamma = float(gamma)
        self.gamma_t.set(self._gamma)


class FastClipLoss(EpochState, nn.Module):
    """The six global losses: the u tables, the gather and the surrogate are shared, and the variants
    differ by three switches (learn_global, individual, multiply_tau) and their temperatures
    (`self.temperatures`: fastclip_temperature.py)."""

    def __init__(
        self,
        variant: str,
        *,
        dataset_size: int,
        gamma_schedule: str = "cosine",
        gamma_min: float = 0.2,
        gamma_decay_epochs: float = 1.0,
        tau_init: float = 0.07,
        tau_lr: float = 2e-4,
        tau_lr_schedule: str = "auto",
        lr_factor: Callable[[int], float] | None = None,
        tau_lr_cut: float = 3.0,
        rho: float = 6.5,
        eps: float = 1e-14,
        tau_beta1: float = 0.9,
        tau_beta2: float = 0.999,
        tau_eps: float = 1e-8,
        shard_state: bool = False,
        state_dtype=torch.float32,
        device="cpu",
        group=None,
        total_steps: int | None = None,
    ):
        super().__init__()
        tau_lr_schedule = resolved_tau_lr_schedule(variant, tau_lr_schedule)
        self.variant, self.n, self.group = variant, int(dataset_size), group
        self.individual = variant in ("fastclip_v2", "isogclr")  # tau1_i, tau2_i per sample
        self.learn_global = variant in ("fastclip_v0", "fastclip_v3")
        self.multiply_tau = variant == "fastclip_v3"
        self.rho = float(rho) if variant in ("fastclip_v2", "fastclip_v3", "isogclr") else 0.0
        # the resolved temperature settings (the temperature object below keeps what it uses)
        self.tau_lr_schedule, self.tau_lr, self.eps = tau_lr_schedule, float(tau_lr), float(eps)
        self.betas, self.tau_eps = (float(tau_beta1), float(tau_beta2)), float(tau_eps)
        self.schedule, self.gamma_min, self.decay = gamma_schedule, gamma_min, gamma_decay_epochs
        self.device, self.dtype = torch.device(device), state_dtype
        k, rank, _ = world(group)
        self.shards = ShardMap(self.n, k, rank, bool(shard_state) and k > 1)
        n, dev, dt = self.shards.size, self.device, state_dtype
        self.lu1 = torch.full((n,), -math.inf, dtype=dt, device=dev)  # log u1 (image anchors)
        self.lu2 = torch.full((n,), -math.inf, dtype=dt, device=dev)  # log u2 (text anchors)
        self.temperatures = make_temperatures(
            self.individual,
            tau_init,
            shards=self.shards,
            lr=self.tau_lr,
            schedule=tau_lr_schedule,
            lr_factor=lr_factor,
            lr_cut=float(tau_lr_cut),
            betas=self.betas,
            eps=self.tau_eps,
            dtype=dt,
            device=dev,
            steps=total_steps,
        )
        self.gamma_t = Gamma.on(dev)  # on the device (set_epoch writes it; every step reads it)
        self.epoch, self.gamma = 0, 1.0
        # the last forward's temperature gradient, which after_step() applies (public: set it to
        self.pending_grad = None  # drive the temperature steps without a forward)
        self.comm_elements = {"features": 0, "scalars": 0, "steps": 0}

    # ---- schedule / state -------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.gamma = gamma_at(epoch, self.schedule, self.gamma_min, self.decay)

    def tables(self) -> dict:
        """Every state tensor by its checkpoint key: lu1, lu2 and the temperatures'."""
        return {"lu1": self.lu1, "lu2": self.lu2, **self.temperatures.tables()}

    def state_bytes(self) -> int:
        """Bytes of per-sample state on this rank: u1, u2 (+ tau1, tau2, 4 Adam moments and 2
        bounds for the individual-tau variants), each [dataset_size] (ceil(dataset_size / K) rows
        when sharded over K ranks)."""
        per = [t for t in self.tables().values() if t.ndim == 1]
        return sum(t.numel() * t.element_size() for t in per)

    def state_dict(self, *args, **kwargs) -> dict:
        """The whole state; sharded tables are gathered on rank 0 (collective: call it on every
        rank; the other ranks get their own rows only, with `shard_of` set)."""
        sd = {k: t.clone() for k, t in self.tables().items()}
        if self.shards.sharded:
            k, rank, group = world(self.group)
            for name in list(sd):
                if sd[name].ndim:
                    sd[name] = self.shards.gather_full(sd[name], group)
            if rank:
                sd["shard_of"] = (rank, k)
        sd.update(variant=self.variant, epoch=self.epoch, gamma=self.gamma)
        return sd

    def load_state_dict(self, sd: dict, strict: bool = True):
        if sd.get("variant", self.variant) != self.variant:
            raise ValueError(f"loss state is for {sd['variant']!r}, not {self.variant!r}")
        self.shards.load_tables(self.tables(), sd)
        self.epoch, self.gamma = sd["epoch"], sd["gamma"]
        self.pending_grad = None

    @property
    def temperature(self) -> float:
        """The global tau, or the mean per-sample tau (of this rank's rows when sharded)."""
        return self.temperatures.temperature

    # ---- the step ---------------------------------------------------------------------------
    def forward(self, img_f, txt_f, logit_scale=None, index=None):
        loss, logs = self.compute(img_f, txt_f, logit_scale, index)
        self.note_step()
        return loss, StepLogs(logs)

    def note_step(self) -> None:
        """One step more in the communication counts (outside `compute`: a compiled step keeps no
        host counter)."""
        self.comm_elements["steps"] += 1

    def compute(self, img_f, txt_f, logit_scale=None, index=None):
        """(loss, {name: 0-d device tensor}): the step with static shapes and no host read, which
        torch.compile traces whole (fullgraph) and a CUDA graph replays (one process)."""
        k, rank, group = world(self.group)
        dev = img_f.device
        with no_autocast(dev.type):
            return self._forward(img_f.float(), txt_f.float(), index.to(dev), k, rank, group)

    def _forward(self, e1, e2, index, k, rank, group):
        """One step, in the order the reference computes it: gather, z, u update, a_i, packed
        exchange, table writes, surrogate, logs (the arithmetic: fastclip_step.py)."""
        b, d = e1.shape
        n_all, off = k * b, rank * b
        E1, E2, E1m, E2m = gathered_features(e1, e2, k, off, group)
        rows, rows_all = self._batch_rows(index, k, off, b, group)
        # 1/tau_i (old taus: updated after the step) or logit_scale = exp(theta)
        s1, s2 = self.temperatures.scales(rows, b)
        z1, z2, diag = anchor_exponents(e1, e2, E1m, E2m, s1, s2, off)
        log_eps = math.log(self.eps) if self.eps > 0 else -math.inf
        sides = inner_estimates(z1, z2, rows, self.gamma_t, n_all, log_eps)
        cols = [index.double(), sides[0].lu.double(), sides[1].lu.double()]
        cols += temperature_columns(
            z1,
            z2,
            sides,
            diag,
            n_all,
            self.rho,
            learn_global=self.learn_global,
            individual=self.individual,
            multiply_tau=self.multiply_tau,
        )
        packed = self._exchange(cols, k, b, d, group)
        idx_all = packed[:, 0].long()  # packed: [N, m] float64
        self._store(idx_all, packed)
        tau = None if self.individual else self.temperatures.tau.float()
        taus_all = self.temperatures.batch_taus(idx_all, rows_all) if self.individual else None
        sur = local_surrogate(z1, z2, sides)  # (a) local anchors vs all features
        if k > 1:  # (b) the other ranks' anchors vs the local features
            sur = add_remote_surrogate(
                sur,
                E1,
                E2,
                e1,
                e2,
                packed,
                self.temperatures.scales(taus_all, n_all),
                remote_shifts(packed, n_all, log_eps, e1.device, self.individual),
                off,
            )
        half = 0.5 * tau if self.multiply_tau else 0.5
        sur = sur * half / ((n_all - 1) * b)
        # the reference's reported loss, over this rank's anchors (its mean over ranks is global)
        value = reported_value(sides, tau, self.rho, self.multiply_tau)
        objective = reported_objective(sides, self.rho, tau, s1, s2)
        tau_log = (
            (taus_all["tau1"].mean() + taus_all["tau2"].mean()) / 2 if self.individual else tau
        )
        loss = sur - sur.detach() + value.detach()
        return loss, {
            "loss": value.detach(),
            "objective": objective.detach(),
            "tau": tau_log.detach(),
            "gamma": self.gamma_t.value,
        }

    def _batch_rows(self, index, k, off, b, group):
        """(rows, rows_all): the per-sample rows a step reads (lu1, lu2; + tau1, tau2, bound1, bound2),
        float32, of the local batch [b] and, with sharded state, of the global batch [N] (fetched from
        their owners; None when replicated)."""
        names = ["lu1", "lu2", *self.temperatures.row_names]
        tables = self.tables()
        if not self.shards.sharded:
            return {name: tables[name][index].float() for name in names}, None
        table = self.shards.fetch(
            [tables[name] for name in names], gather_no_grad(index, k, group), group
        )
        self.comm_elements["scalars"] += 2 * (k - 1) * (len(table) // k) * len(names)
        self.comm_elements["scalars"] += (k - 1) * b
        rows_all = {name: table[:, c].float() for c, name in enumerate(names)}
        return {name: t[off : off + b] for name, t in rows_all.items()}, rows_all

    def _exchange(self, cols: list, k, b, d, group):
        """All ranks' columns (index, lu1, lu2, the temperature columns) in one gather, counted."""
        packed = gather_no_grad(torch.stack(cols, 1).double(), k, group)  # [N, m] float64
        if k > 1:
            self.comm_elements["features"] += (k - 1) * b * 2 * d
            self.comm_elements["scalars"] += (k - 1) * b * packed.shape[1]
        return packed

    def _store(self, idx_all, packed) -> None:
        """Every rank (replicated) or each row's owner (sharded) stores the global batch's updated u
        (and bounds); the temperature gradient waits for after_step()."""
        tables = self.tables()
        for c, name in [(1, "lu1"), (2, "lu2")] + (
            [(5, "bound1"), (6, "bound2")] if self.individual else []
        ):
            self.shards.write(tables[name], idx_all, packed[:, c])
        if self.learn_global:
            self.pending_grad = packed[:, 3].mean()
        elif self.individual:  # the taus change in after_step(): this step uses the old ones
            self.pending_grad = (idx_all, packed[:, 3], packed[:, 4])

    # ---- temperatures -----------------------------------------------------------------------
    def temperature_grad(self):
        """The last forward's temperature gradient, which after_step() applies: d(loss)/d(theta)
        (fp64 0-d) for v0/v3; (dataset indices, h1, h2) with h the clamped d/dtau_i for v2/iSogCLR;
        None for constant temperatures or when there is nothing pending."""
        if self.pending_grad is None:
            return None
        if self.learn_global:
            g = self.pending_grad.to(torch.float64)
            return g * self.temperatures.tau if self.multiply_tau else g
        return self.pending_grad

    @torch.no_grad()
    def after_step(self, step: int | torch.Tensor | None = None) -> None:
        """The temperatures' step after the model's (no-op without learnable temperatures).
        `step` is the 0-based optimizer step (for v0's lr schedule; default: the Adam step count),
        a host int or a device counter (train.capture=step: v0's lr from its device table)."""
        pend = self.temperature_grad()
        self.pending_grad = None
        if pend is None or self.tau_lr == 0:
            return
        if self.learn_global:
            self.temperatures.adam_step(pend, self.temperatures.lr_at(step))
        else:
            self.temperatures.adam_step(*pend)
