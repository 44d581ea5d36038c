"""FastCLIP's global contrastive losses with compositional inner estimators u, as the authors' code
(Optimization-AI/fast_clip, `src/fast_clip/loss.py` and `src/training/{train,main,scheduler}.py`)
computes them: every output of ../shared/reference/ is reproduced (tests/test_fastclip_reference.py).

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
Global temperatures (v0, v3) are learned as theta = logit_scale = log(1/tau): one Adam (AdamW,
weight decay 0) step per optimizer step on d(loss)/d(theta), then theta is clamped to [0, ln 100]:
  v0: d/dtheta = mean_i (a1_i + a2_i),  v3: d/dtheta = tau (mean_i (a1_i + a2_i) - rho - mean_i (log u1_i + log u2_i)/2)
  with a_k,i = mean_{j != i} exp(z_k,ij) z_k,ij / (eps + u_k,i).  The lr of that step is
  `tau_lr` times: v0 the model's lr schedule factor (warm-up + cosine, the reference's default),
  v3 1/tau_lr_cut while 1/exp(theta) <= 0.03 (re-checked every step from the current theta, not
  latched), v2/iSogCLR no factor.
Per-sample temperatures (v2, iSogCLR): h_k,i = clamp(log(eps + u_k,i) + rho - a_k,i, -5, 5), an
Adam-like step with betas (0, 0) during epoch 0 and the model optimizer's betas after, bias
correction by 1 - beta^(epoch+1), tau clamped to [0.01, 1].  The reference stores u exp(-bound)
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

Per-sample state, replicated (default): every rank keeps the whole table and applies the gathered
updates.  Sharded (`shard_state=True`): rank r keeps the rows of the dataset indices i with
i % K == r (1/K of the table, at i // K).  Each step then first all-gathers the batch's indices
((K-1)b elements) and fetches the batch's rows (lu1, lu2; + tau1, tau2, bound1, bound2 for
per-sample temperatures) with one all_reduce of an [N, c] float64 table in which each owner fills
its rows (the other entries are 0, so the sum is the owner's value, exactly); the gathered
updates are written by their owners only.  Every number equals the replicated run's bit for bit.
Checkpoints hold the whole table (gathered on rank 0), so a run can resume at any world size and
in either mode.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

import torch.distributed as dist

from .clip import StepLogs, gamma_at, gather_no_grad, no_autocast, world

VARIANTS = ("fastclip_v0", "fastclip_v1", "fastclip_v2", "fastclip_v3", "sogclr", "isogclr")
TAU_MIN, TAU_MAX, TAU_CUT_AT = 0.01, 1.0, 0.03
THETA_MAX = math.log(100.0)              # logit_scale clamp [0, ln 100] = tau in [0.01, 1]
U_RESET_BELOW = math.log(1e-35)          # the reference's "u < 1e-35, inf or nan" -> u = g
GRAD_CLAMP = 5.0                         # per-sample temperature gradient clamp
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
    return dict(tau_init=tau_init, tau_lr=tau_lr, tau_lr_schedule=schedule, rho=rho, gamma_min=gamma_min)


class FastClipLoss(nn.Module):
    """All six global losses in one class (over 250 lines by choice): like the reference's one
    loss class, the variants share the u tables, the gather and the surrogate and differ by three
    switches (learn_global, individual, multiply_tau); one class keeps each variant's path
    readable against tests/test_fastclip_reference.py."""

    def __init__(self, variant: str, *, dataset_size: int, gamma_schedule: str = "cosine",
                 gamma_min: float = 0.2, gamma_decay_epochs: float = 1.0, tau_init: float = 0.07,
                 tau_lr: float = 2e-4, tau_lr_schedule: str = "auto",
                 lr_factor: Callable[[int], float] | None = None, tau_lr_cut: float = 3.0,
                 rho: float = 6.5, eps: float = 1e-14, tau_beta1: float = 0.9, tau_beta2: float = 0.999,
                 tau_eps: float = 1e-8, shard_state: bool = False, state_dtype=torch.float32, device="cpu",
                 group=None):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown FastCLIP variant {variant!r}; expected one of {VARIANTS}")
        if tau_lr_schedule not in TAU_LR_SCHEDULES:
            raise ValueError(f"tau_lr_schedule {tau_lr_schedule!r}: expected one of {TAU_LR_SCHEDULES}")
        self.variant, self.n, self.group = variant, int(dataset_size), group
        self.individual = variant in ("fastclip_v2", "isogclr")      # tau1_i, tau2_i per sample
        self.learn_global = variant in ("fastclip_v0", "fastclip_v3")
        self.multiply_tau = variant == "fastclip_v3"
        self.rho = float(rho) if variant in ("fastclip_v2", "fastclip_v3", "isogclr") else 0.0
        if tau_lr_schedule == "auto":
            tau_lr_schedule = REFERENCE_DEFAULTS[variant][2]
        self.tau_lr_schedule, self.lr_factor, self.lr_cut = tau_lr_schedule, lr_factor, float(tau_lr_cut)
        self.schedule, self.gamma_min, self.decay = gamma_schedule, gamma_min, gamma_decay_epochs
        self.tau_lr, self.eps = float(tau_lr), float(eps)
        self.betas, self.tau_eps = (float(tau_beta1), float(tau_beta2)), float(tau_eps)
        self.device, self.dtype = torch.device(device), state_dtype
        self.epoch, self.gamma = 0, 1.0
        k, rank, _ = world(group)
        self.sharded = bool(shard_state) and k > 1
        # rows of this rank: all (replicated) or the indices i % K == rank, at i // K (sharded)
        self.shards, self.shard_rank = (k, rank) if self.sharded else (1, 0)
        n, dev, dt = -(-self.n // self.shards), self.device, state_dtype
        self.lu1 = torch.full((n,), -math.inf, dtype=dt, device=dev)   # log u1 (image anchors)
        self.lu2 = torch.full((n,), -math.inf, dtype=dt, device=dev)   # log u2 (text anchors)
        if self.individual:
            self.tau1 = torch.full((n,), float(tau_init), dtype=dt, device=dev)
            self.tau2 = torch.full((n,), float(tau_init), dtype=dt, device=dev)
            self.m1, self.m2, self.v1, self.v2 = (torch.zeros(n, dtype=dt, device=dev) for _ in range(4))
            self.bound1, self.bound2 = (torch.zeros(n, dtype=dt, device=dev) for _ in range(2))
        else:  # theta = logit_scale = log(1/tau) and its Adam state, fp64 0-d tensors (no host syncs)
            f64 = dict(dtype=torch.float64, device=dev)
            self.theta = torch.tensor(math.log(1.0 / float(tau_init)), **f64)
            self.theta_m, self.theta_v = torch.zeros((), **f64), torch.zeros((), **f64)
            self.theta_step = torch.zeros((), **f64)
        # the last forward's raw temperature gradient, which after_step() applies (public: set it to
        # drive the temperature steps without a forward)
        self.pending_grad = None
        self.comm_elements = {"features": 0, "scalars": 0, "steps": 0}

    # ---- schedule / bookkeeping -------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.gamma = gamma_at(epoch, self.schedule, self.gamma_min, self.decay)

    def _state_names(self):
        names = ["lu1", "lu2"]
        return names + (["tau1", "tau2", "m1", "m2", "v1", "v2", "bound1", "bound2"] if self.individual
                        else ["theta", "theta_m", "theta_v", "theta_step"])

    def _row_names(self):
        """The per-sample columns a step reads."""
        return ["lu1", "lu2"] + (["tau1", "tau2", "bound1", "bound2"] if self.individual else [])

    def _fetch(self, idx_all, k, group) -> dict:
        """Sharded state: the rows of the global batch's dataset indices [N] from their owners, by
        one all_reduce of [N, c] float64 in which the other ranks add 0: x + 0 = x exactly, for
        x = -inf (never seen) and nan too."""
        mine = idx_all % self.shards == self.shard_rank
        pos = idx_all[mine] // self.shards
        names = self._row_names()
        table = torch.zeros(len(idx_all), len(names), dtype=torch.float64, device=idx_all.device)
        table[mine] = torch.stack([getattr(self, name)[pos].double() for name in names], 1)
        dist.all_reduce(table, group=group)
        self.comm_elements["scalars"] += 2 * (k - 1) * (len(idx_all) // k) * len(names)
        return {name: table[:, c].float() for c, name in enumerate(names)}

    def _write(self, name: str, idx_all, values) -> None:
        """Store the gathered values of the batch's indices (owned rows only when sharded)."""
        if self.sharded:
            mine = idx_all % self.shards == self.shard_rank
            idx_all, values = idx_all[mine] // self.shards, values[mine]
        getattr(self, name)[idx_all] = values.to(self.dtype)

    def state_bytes(self) -> int:
        """Bytes of per-sample state on this rank: u1, u2 (+ tau1, tau2, 4 Adam moments and 2
        bounds for the individual-tau variants), each [dataset_size] (ceil(dataset_size / K) rows
        when sharded over K ranks)."""
        per = [getattr(self, k) for k in self._state_names() if getattr(self, k).ndim == 1]
        return sum(t.numel() * t.element_size() for t in per)

    def state_dict(self, *args, **kwargs) -> dict:
        """The whole state; sharded tables are gathered on rank 0 (collective: call it on every
        rank; the other ranks get their own rows only, with `shard_of` set)."""
        sd = {k: getattr(self, k).clone() for k in self._state_names()}
        if self.sharded:
            k, rank, group = world(self.group)
            for name in self._state_names():
                t = sd[name]
                if t.ndim == 0:
                    continue
                parts = [torch.empty_like(t) for _ in range(k)] if rank == 0 else None
                dist.gather(t, parts, dst=dist.get_global_rank(group, 0) if group is not None else 0,
                            group=group)
                if rank == 0:
                    full = torch.empty(self.n, dtype=t.dtype, device=t.device)
                    for r, part in enumerate(parts):
                        full[r::k] = part[:len(range(r, self.n, k))]
                    sd[name] = full
            if rank:
                sd["shard_of"] = (rank, k)
        sd.update(variant=self.variant, epoch=self.epoch, gamma=self.gamma)
        return sd

    def load_state_dict(self, sd: dict, strict: bool = True):
        if sd.get("variant", self.variant) != self.variant:
            raise ValueError(f"loss state is for {sd['variant']!r}, not {self.variant!r}")
        missing = [k for k in self._state_names() if k not in sd]
        if missing:
            raise ValueError(f"loss state lacks {', '.join(missing)} (written by an older vitscale, "
                             "before the reference-parity temperatures?)")
        for k in self._state_names():
            cur, new = getattr(self, k), sd[k]
            if new.ndim and new.shape != (self.n,):
                raise ValueError(f"loss state {k}: shape {tuple(new.shape)} != ({self.n},) "
                                 "(dataset size changed?)")
            if new.ndim and self.sharded:    # this rank's rows of the whole table
                mine = new[self.shard_rank::self.shards]
                cur.zero_()
                cur[:len(mine)] = mine.to(cur.device, cur.dtype)
                continue
            cur.copy_(new.to(cur.device, cur.dtype))
        self.epoch, self.gamma = sd["epoch"], sd["gamma"]
        self.pending_grad = None

    @property
    def tau(self) -> torch.Tensor:
        """The global temperature 1/exp(theta) (fp64 0-d)."""
        return torch.exp(-self.theta)

    @property
    def temperature(self) -> float:
        """The global tau, or the mean per-sample tau (of this rank's rows when sharded)."""
        if self.individual:
            rows = len(range(self.shard_rank, self.n, self.shards))
            return float((self.tau1[:rows].float().mean() + self.tau2[:rows].float().mean()) / 2)
        return float(self.tau)

    # ---- the step ---------------------------------------------------------------------------
    def forward(self, img_f, txt_f, logit_scale=None, index=None):
        k, rank, group = world(self.group)
        dev = img_f.device
        with no_autocast(dev.type):
            return self._forward(img_f.float(), txt_f.float(), index.to(dev), k, rank, group)

    def _new_lu(self, lu_old, log_g, shift):
        """The reference's u update in log space; `shift` = the bound before the step (the
        reference compares its stored u exp(-bound) with 1e-35)."""
        g = self.gamma
        if g >= 1:
            return log_g
        lu_new = torch.logaddexp(lu_old + math.log(1 - g), log_g + (math.log(g) if g > 0 else -math.inf))
        bad = (lu_old - shift < U_RESET_BELOW) | torch.isnan(lu_old) | (lu_old == math.inf)
        return torch.where(bad, log_g, lu_new)

    def _forward(self, e1, e2, index, k, rank, group):
        # Long by choice (109 lines): one pass over the step's quantities in the order the
        # reference computes them (gather, z, u update, a_i, packed exchange, table writes,
        # surrogate, logs); a dozen intermediates are shared across these parts, and each part is
        # checked against the reference's numbers (tests/test_fastclip_reference.py).
        b, d = e1.shape
        n_all, off = k * b, rank * b
        feats = gather_no_grad(torch.cat([e1, e2], 1), k, group)             # [N, 2d], detached
        E1, E2 = feats[:, :d], feats[:, d:]
        E1m = torch.cat([E1[:off], e1, E1[off + b:]])                         # local slice with grad
        E2m = torch.cat([E2[:off], e2, E2[off + b:]])
        if self.sharded:      # the batch's rows from their owners
            rows_all = self._fetch(gather_no_grad(index, k, group), k, group)
            self.comm_elements["scalars"] += (k - 1) * b
            rows = {name: t[off:off + b] for name, t in rows_all.items()}
        else:
            rows_all = None
            rows = {name: getattr(self, name)[index].float() for name in self._row_names()}
        if self.individual:   # the reference scales by 1/tau_i (old taus: updated after the step)
            s1, s2 = 1.0 / rows["tau1"], 1.0 / rows["tau2"]                    # [b]
        else:                 # ... and by logit_scale = exp(theta)
            s1 = s2 = torch.exp(self.theta).float().expand(b)
        pos = (e1 * e2).sum(1)                                                # s_ii [b], with grad
        diag = torch.zeros(b, n_all, dtype=torch.bool, device=e1.device)
        diag[torch.arange(b), off + torch.arange(b)] = True
        z1 = ((e1 @ E2m.T - pos[:, None]) * s1[:, None]).masked_fill(diag, -math.inf)  # [b, N]
        z2 = ((e2 @ E1m.T - pos[:, None]) * s2[:, None]).masked_fill(diag, -math.inf)
        log_nm1 = math.log(n_all - 1)
        log_eps = math.log(self.eps) if self.eps > 0 else -math.inf
        cols, L, log_gs, lus, bounds = [index.double()], [], [], [], []
        for side, z in ((1, z1), (2, z2)):
            lu_old = rows[f"lu{side}"]
            zd = z.detach()
            log_g = torch.logsumexp(zd, 1) - log_nm1                            # log g_i [b]
            if self.individual:  # running max of max_j z_ij, the diagonal (z = 0) included
                old = rows[f"bound{side}"]
                bound = torch.maximum(old, zd.max(1).values.clamp_min(0.0))
                lu_new = self._new_lu(lu_old, log_g, old)
                bounds.append(bound)
                L.append(torch.logaddexp(lu_new, log_eps + bound))              # log(eps e^bound + u)
            else:
                lu_new = self._new_lu(lu_old, log_g, 0.0)
                L.append(torch.logaddexp(lu_new, torch.full_like(lu_new, log_eps)))  # log(eps + u)
            log_gs.append(log_g)
            lus.append(lu_new)
            cols.append(lu_new.double())
        if self.learn_global or self.individual:
            a = []   # a_i = mean_{j != i} exp(z_ij) z_ij / (eps + u_i)
            for z, Li in zip((z1, z2), L):
                zd = z.detach()
                p = torch.exp(zd - Li[:, None]) / (n_all - 1)                 # 0 on the diagonal
                a.append((p * zd.masked_fill(diag, 0.0)).sum(1))
            if self.learn_global:  # d(loss)/d(theta) per anchor (v3: before the tau factor)
                q = a[0] + a[1]
                if self.multiply_tau:
                    q = q - self.rho - (lus[0] + lus[1]) / 2
                cols.append(q)
            else:
                cols += [(Li + self.rho - ai).clamp(-GRAD_CLAMP, GRAD_CLAMP) for Li, ai in zip(L, a)]
                cols += bounds
        packed = gather_no_grad(torch.stack(cols, 1).double(), k, group)      # [N, m] float64
        if k > 1:
            self.comm_elements["features"] += (k - 1) * b * 2 * d
            self.comm_elements["scalars"] += (k - 1) * b * packed.shape[1]
        self.comm_elements["steps"] += 1
        idx_all = packed[:, 0].long()
        # every rank (replicated) or each row's owner (sharded) stores the batch's updated u (and bounds)
        for c, name in [(1, "lu1"), (2, "lu2")] + ([(5, "bound1"), (6, "bound2")] if self.individual else []):
            self._write(name, idx_all, packed[:, c])
        tau = None if self.individual else torch.exp(-self.theta).float()
        if self.learn_global:
            self.pending_grad = packed[:, 3].mean()
        elif self.individual:     # the taus change in after_step(): this step uses the old ones
            self.pending_grad = (idx_all, packed[:, 3], packed[:, 4])
            tau_all = (rows_all["tau1"], rows_all["tau2"]) if self.sharded else \
                (self.tau1[idx_all].float(), self.tau2[idx_all].float())
        # (a) local anchors vs all features (local ones with grad)
        sur = torch.exp(z1 - L[0][:, None]).sum() + torch.exp(z2 - L[1][:, None]).sum()
        # (b) the other ranks' anchors (detached) vs the local features as negatives
        if k > 1:
            if self.individual:
                c1, c2 = 1.0 / tau_all[0], 1.0 / tau_all[1]
                sh1 = log_eps + packed[:, 5].float()
                sh2 = log_eps + packed[:, 6].float()
            else:
                c1 = c2 = torch.exp(self.theta).float().expand(n_all)
                sh1 = sh2 = torch.full((n_all,), log_eps, device=e1.device)
            posd = (E1 * E2).sum(1)                                           # [N]
            other = torch.ones(n_all, 1, dtype=torch.bool, device=e1.device)
            other[off:off + b] = False
            for Ea, e_neg, c, col, sh in ((E1, e2, c1, 1, sh1), (E2, e1, c2, 2, sh2)):
                La = torch.logaddexp(packed[:, col].float(), sh)
                zb = (Ea @ e_neg.T - posd[:, None]) * c[:, None]              # [N, b]
                zb = zb.masked_fill(~other, -math.inf)
                sur = sur + torch.exp(zb - La[:, None]).sum()
        half = 0.5 * tau if self.multiply_tau else 0.5
        sur = sur * half / ((n_all - 1) * b)
        # the reference's reported loss, over this rank's anchors (its mean over ranks is global)
        v = (torch.exp(log_gs[0] - L[0]) + torch.exp(log_gs[1] - L[1])).mean()
        if self.multiply_tau:
            value = tau * v + self.rho * tau + tau * (lus[0] + lus[1]).mean() / 2
        else:
            value = v
        if self.individual:
            t1, t2 = 1.0 / s1, 1.0 / s2
            objective = (t1 * (L[0] + self.rho) + t2 * (L[1] + self.rho)).mean()        # RGCL
            tau_log = (tau_all[0].mean() + tau_all[1].mean()) / 2
        else:
            objective = tau * (L[0] + L[1]).mean() + 2 * self.rho * tau                 # GCL / RGCL-g
            tau_log = tau
        loss = sur - sur.detach() + value.detach()
        return loss, StepLogs({"loss": value.detach(), "objective": objective.detach(),
                               "tau": tau_log.detach(), "gamma": self.gamma})

    # ---- temperatures -----------------------------------------------------------------------
    def tau_lr_at(self, step: int | None = None) -> torch.Tensor:
        """The global temperature's lr for the step about to be taken (fp64 0-d): tau_lr times the
        model's schedule factor (v0), or divided by tau_lr_cut while tau <= 0.03 (v3)."""
        lr = torch.tensor(self.tau_lr, dtype=torch.float64, device=self.theta.device)
        if self.tau_lr_schedule == "model" and self.lr_factor is not None:
            lr = lr * self.lr_factor(int(self.theta_step) if step is None else step)
        elif self.tau_lr_schedule == "threshold":
            lr = torch.where(torch.exp(-self.theta) <= TAU_CUT_AT, lr / self.lr_cut, lr)
        return lr

    def temperature_grad(self):
        """The last forward's temperature gradient, which after_step() applies: d(loss)/d(theta)
        (fp64 0-d) for v0/v3; (dataset indices, h1, h2) with h the clamped d/dtau_i for v2/iSogCLR;
        None for constant temperatures or when there is nothing pending."""
        if self.pending_grad is None:
            return None
        if self.learn_global:
            g = self.pending_grad.to(torch.float64)
            return g * torch.exp(-self.theta) if self.multiply_tau else g
        return self.pending_grad

    @torch.no_grad()
    def after_step(self, step: int | None = None) -> None:
        """The temperatures' step after the model's (no-op without learnable temperatures).
        `step` is the 0-based optimizer step (for v0's lr schedule; default: this loss's count)."""
        pend = self.temperature_grad()
        self.pending_grad = None
        if pend is None or self.tau_lr == 0:
            return
        if self.learn_global:
            g = pend
            lr = self.tau_lr_at(step)
            b1, b2 = self.betas
            self.theta_step += 1
            self.theta_m.mul_(b1).add_((1 - b1) * g)
            self.theta_v.mul_(b2).add_((1 - b2) * g * g)
            mhat = self.theta_m / (1 - b1 ** self.theta_step)
            vhat = self.theta_v / (1 - b2 ** self.theta_step)
            self.theta.sub_(lr * mhat / (vhat.sqrt() + self.tau_eps)).clamp_(0.0, THETA_MAX)
            return
        idx, h1, h2 = pend
        if self.sharded:              # the owner updates its rows
            mine = idx % self.shards == self.shard_rank
            idx, h1, h2 = idx[mine] // self.shards, h1[mine], h2[mine]
        b1, b2 = self.betas if self.epoch > 0 else (0.0, 0.0)
        c1, c2 = 1 - b1 ** (self.epoch + 1), 1 - b2 ** (self.epoch + 1)
        for tau, m, v, g in ((self.tau1, self.m1, self.v1, h1), (self.tau2, self.m2, self.v2, h2)):
            mi = b1 * m[idx].double() + (1 - b1) * g
            vi = b2 * v[idx].double() + (1 - b2) * g * g
            m[idx], v[idx] = mi.to(m.dtype), vi.to(v.dtype)
            step_ = self.tau_lr * (mi / c1) / ((vi / c2).sqrt() + self.tau_eps)
            tau[idx] = (tau[idx].double() - step_).clamp(TAU_MIN, TAU_MAX).to(tau.dtype)
