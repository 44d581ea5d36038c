"""FastCLIP's global contrastive losses (GCL / RGCL / RGCL-g) with compositional inner estimators u.

Notation: e1/e2 normalized image/text features, s_ij = <e1_i, e2_j>, global batch B of N = K*b
samples, z1_ij = (s_ij - s_ii)/tau1_i (image anchor i), z2_ij = (s_ji - s_ii)/tau2_i (text anchor i),
g_i = mean_{j != i} exp(z_ij), u_i <- (1-gamma) u_i + gamma g_i (batch indices only).

Log-space scheme (stability): exp(z) overflows fp32 when tau = 0.01 (|z| up to 200), so u is STORED as
lu = log u (u = 0 is lu = -inf):  log g_i = logsumexp_{j != i} z_ij - log(N-1),
lu_i <- logaddexp(log(1-gamma) + lu_i, log(gamma) + log g_i),  L_i = log(eps + u_i) = logaddexp(log eps, lu_i).
Every exponential is exp(z_ij - L_i) = exp(z_ij)/(eps+u_i), which is <= (N-1)/gamma after the update.

Surrogate (exact gradient after the engines' average over K ranks): the target is
G = (1/N) sum_{i in B} [c1_i/(eps+u1_i) grad g1_i + c2_i/(eps+u2_i) grad g2_i],  c = tau (or tau_i).
Rank r gets the features of all ranks by an all_gather WITHOUT autograd and builds
L_r = (1/b) [ (a) sum_{i local} c_i/(N-1) sum_{j != i} exp(z_ij - L_i)   (local anchors vs all
features; the local slice of the gathered features is replaced by the graph-carrying local features)
            + (b) sum_{i not local} c_i/(N-1) sum_{j local} exp(z_ij - L_i) ]  (gathered anchors,
detached, weights from the gathered u, against the local features as negatives).
Rank r's graph reaches exactly the terms of sum_i c_i g_i/(eps+u_i) that depend on its own features,
so (1/K) sum_r grad L_r = (1/(K b)) grad sum_i (...) = G.  The returned loss is L_r - L_r.detach() +
(the objective estimated with u in place of g), so its value is the (global) loss and its gradient G.

Temperature gradients (u in place of g; d/dtau tau log(eps+g) = log(eps+g) + tau g'/(eps+g),
tau g'(tau) = -mean_j exp(z_ij) z_ij):
  h_i = L_i - sum_{j != i} exp(z_ij - L_i) z_ij / (N-1)  (+ rho for RGCL / RGCL-g);
  global tau (v0: GCL, v3: RGCL-g = GCL + 2 rho tau): dF/dtau = mean_{i in B} (h1_i + h2_i);
  individual (v2, iSogCLR: tau1_i (log(eps+g1_i) + rho) + tau2_i (...)): d/dtau1_i = h1_i.
Communication per worker per step (elements sent): features 2(K-1)bd (one all_gather of [b, 2d]);
scalars (K-1)*b*m with m = 3 columns (index, lu1, lu2) + 1 (global learnable tau: h1+h2) or
+ 2 (individual tau: h1, h2), gathered once as a float64 [b, m] tensor (indices exact up to 2^53).
The per-sample state is replicated on every rank (every rank applies the gathered updates).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .clip import StepLogs, gamma_at, gather_no_grad, no_autocast, world

VARIANTS = ("fastclip_v0", "fastclip_v1", "fastclip_v2", "fastclip_v3", "sogclr", "isogclr")
TAU_MIN, TAU_MAX, TAU_CUT_AT, ADAM_EPS = 0.01, 1.0, 0.03, 1e-8


class FastClipLoss(nn.Module):
    def __init__(self, variant: str, *, dataset_size: int, gamma_schedule: str = "cosine",
                 gamma_min: float = 0.2, gamma_decay_epochs: float = 1.0, tau_init: float = 0.07,
                 tau_lr: float = 2e-4, tau_lr_cut: float = 3.0, rho: float = 6.5, eps: float = 1e-14,
                 tau_beta1: float = 0.9, tau_beta2: float = 0.999, state_dtype=torch.float32,
                 device="cpu", group=None):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown FastCLIP variant {variant!r}; expected one of {VARIANTS}")
        self.variant, self.n, self.group = variant, int(dataset_size), group
        self.individual = variant in ("fastclip_v2", "isogclr")      # tau1_i, tau2_i per sample
        self.learn_global = variant in ("fastclip_v0", "fastclip_v3")
        self.rho = float(rho) if variant in ("fastclip_v2", "fastclip_v3", "isogclr") else 0.0
        self.lr_cut = tau_lr_cut if variant == "fastclip_v3" else 1.0
        self.schedule, self.gamma_min, self.decay = gamma_schedule, gamma_min, gamma_decay_epochs
        self.tau_lr, self.eps, self.betas = float(tau_lr), float(eps), (float(tau_beta1), float(tau_beta2))
        self.device, self.dtype = torch.device(device), state_dtype
        self.epoch, self.gamma = 0, 1.0
        n, dev, dt = self.n, self.device, state_dtype
        self.lu1 = torch.full((n,), -math.inf, dtype=dt, device=dev)   # log u1 (image anchors)
        self.lu2 = torch.full((n,), -math.inf, dtype=dt, device=dev)   # log u2 (text anchors)
        if self.individual:
            self.tau1 = torch.full((n,), float(tau_init), dtype=dt, device=dev)
            self.tau2 = torch.full((n,), float(tau_init), dtype=dt, device=dev)
            self.m1, self.m2, self.v1, self.v2 = (torch.zeros(n, dtype=dt, device=dev) for _ in range(4))
            self.count = torch.zeros(n, dtype=torch.int32, device=dev)  # Adam steps per sample
        else:  # global tau and its Adam state, fp64 0-d tensors (no host syncs)
            f64 = dict(dtype=torch.float64, device=dev)
            self.tau = torch.tensor(float(tau_init), **f64)
            self.tau_m, self.tau_v = torch.zeros((), **f64), torch.zeros((), **f64)
            self.tau_step = torch.zeros((), **f64)
            self.tau_lr_now = torch.tensor(self.tau_lr, **f64)
        self._pending = None  # temperature gradient of the last forward, applied by after_step()
        self.comm_elements = {"features": 0, "scalars": 0, "steps": 0}

    # ---- schedule / bookkeeping -------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.gamma = gamma_at(epoch, self.schedule, self.gamma_min, self.decay)

    def _state_names(self):
        names = ["lu1", "lu2"]
        return names + (["tau1", "tau2", "m1", "m2", "v1", "v2", "count"] if self.individual
                        else ["tau", "tau_m", "tau_v", "tau_step", "tau_lr_now"])

    def state_bytes(self) -> int:
        """Bytes of per-sample state on this rank: u1, u2 (+ tau1, tau2, 4 Adam moments, an int32
        step count for the individual-tau variants), each [dataset_size]."""
        per = [getattr(self, k) for k in self._state_names() if getattr(self, k).ndim == 1]
        return sum(t.numel() * t.element_size() for t in per)

    def state_dict(self, *args, **kwargs) -> dict:
        sd = {k: getattr(self, k).clone() for k in self._state_names()}
        sd.update(variant=self.variant, epoch=self.epoch, gamma=self.gamma)
        return sd

    def load_state_dict(self, sd: dict, strict: bool = True):
        if sd.get("variant", self.variant) != self.variant:
            raise ValueError(f"loss state is for {sd['variant']!r}, not {self.variant!r}")
        for k in self._state_names():
            cur = getattr(self, k)
            if sd[k].shape != cur.shape:
                raise ValueError(f"loss state {k}: shape {tuple(sd[k].shape)} != {tuple(cur.shape)} "
                                 "(dataset size changed?)")
            cur.copy_(sd[k].to(cur.device, cur.dtype))
        self.epoch, self.gamma = sd["epoch"], sd["gamma"]
        self._pending = None

    @property
    def temperature(self) -> float:
        if self.individual:
            return float((self.tau1.float().mean() + self.tau2.float().mean()) / 2)
        return float(self.tau)

    # ---- the step ---------------------------------------------------------------------------
    def forward(self, img_f, txt_f, logit_scale=None, index=None):
        k, rank, group = world(self.group)
        dev = img_f.device
        with no_autocast(dev.type):
            return self._forward(img_f.float(), txt_f.float(), index.to(dev), k, rank, group)

    def _forward(self, e1, e2, index, k, rank, group):
        b, d = e1.shape
        n_all, off = k * b, rank * b
        feats = gather_no_grad(torch.cat([e1, e2], 1), k, group)             # [N, 2d], detached
        E1, E2 = feats[:, :d], feats[:, d:]
        E1m = torch.cat([E1[:off], e1, E1[off + b:]])                         # local slice with grad
        E2m = torch.cat([E2[:off], e2, E2[off + b:]])
        if self.individual:
            t1, t2 = self.tau1[index].float(), self.tau2[index].float()      # [b]
        else:
            t1 = t2 = self.tau.float().expand(b)
        pos = (e1 * e2).sum(1)                                                # s_ii [b], with grad
        diag = torch.zeros(b, n_all, dtype=torch.bool, device=e1.device)
        diag[torch.arange(b), off + torch.arange(b)] = True
        z1 = ((e1 @ E2m.T - pos[:, None]) / t1[:, None]).masked_fill(diag, -math.inf)  # [b, N]
        z2 = ((e2 @ E1m.T - pos[:, None]) / t2[:, None]).masked_fill(diag, -math.inf)
        log_nm1 = math.log(n_all - 1)
        lg, log_eps = self.gamma, (math.log(self.eps) if self.eps > 0 else -math.inf)
        log_keep = math.log(1 - lg) if lg < 1 else -math.inf
        log_gam = math.log(lg) if lg > 0 else -math.inf
        cols, L = [index.double()], []
        for z, lu in ((z1, self.lu1), (z2, self.lu2)):
            log_g = torch.logsumexp(z.detach(), 1) - log_nm1                  # log g_i [b]
            lu_new = torch.logaddexp(lu[index].float() + log_keep, log_g + log_gam)
            cols.append(lu_new.double())
            L.append(torch.logaddexp(lu_new, torch.full_like(lu_new, log_eps)))  # log(eps + u)
        if self.learn_global or self.individual:
            h = []
            for z, Li in zip((z1, z2), L):
                zd = z.detach()
                p = torch.exp(zd - Li[:, None]) / (n_all - 1)                 # 0 on the diagonal
                h.append(Li - (p * zd.masked_fill(diag, 0.0)).sum(1) + self.rho)
            cols += [h[0] + h[1]] if self.learn_global else h
        packed = gather_no_grad(torch.stack(cols, 1), k, group)               # [N, m] float64
        if k > 1:
            self.comm_elements["features"] += (k - 1) * b * 2 * d
            self.comm_elements["scalars"] += (k - 1) * b * packed.shape[1]
        self.comm_elements["steps"] += 1
        idx_all = packed[:, 0].long()
        # replicated state: every rank stores the updated u of the whole global batch
        self.lu1[idx_all] = packed[:, 1].to(self.dtype)
        self.lu2[idx_all] = packed[:, 2].to(self.dtype)
        if self.learn_global:
            self._pending = packed[:, 3].mean()
        elif self.individual:
            self._pending = (idx_all, packed[:, 3], packed[:, 4])
        # weights of all N anchors (detached)
        Lall = [torch.logaddexp(packed[:, c].float(), torch.tensor(log_eps, device=e1.device))
                for c in (1, 2)]
        if self.individual:
            c1, c2 = self.tau1[idx_all].float(), self.tau2[idx_all].float()
        else:
            c1 = c2 = self.tau.float().expand(n_all)
        # (a) local anchors vs all features (local ones with grad)
        sur = (t1[:, None] * torch.exp(z1 - L[0][:, None])).sum() \
            + (t2[:, None] * torch.exp(z2 - L[1][:, None])).sum()
        # (b) the other ranks' anchors (detached) vs the local features as negatives
        if k > 1:
            posd = (E1 * E2).sum(1)                                           # [N]
            other = torch.ones(n_all, 1, dtype=torch.bool, device=e1.device)
            other[off:off + b] = False
            for Ea, e_neg, c, La in ((E1, e2, c1, Lall[0]), (E2, e1, c2, Lall[1])):
                zb = (Ea @ e_neg.T - posd[:, None]) / c[:, None]              # [N, b]
                zb = zb.masked_fill(~other, -math.inf)
                sur = sur + (c[:, None] * torch.exp(zb - La[:, None])).sum()
        sur = sur / ((n_all - 1) * b)
        obj = (c1 * Lall[0] + c2 * Lall[1]).mean() + self.rho * (c1 + c2).mean()
        loss = sur - sur.detach() + obj.detach()
        return loss, StepLogs({"loss": obj.detach(), "tau": (c1.mean() + c2.mean()).detach() / 2,
                               "gamma": self.gamma})

    # ---- temperatures -----------------------------------------------------------------------
    @torch.no_grad()
    def after_step(self) -> None:
        """Adam (AdamW with weight decay 0) on the temperatures, clamped to [0.01, 1]; v3 divides the
        tau lr by tau_lr_cut once tau <= 0.03 (sticky).  No-op without learnable temperatures."""
        pend, self._pending = self._pending, None
        if pend is None or self.tau_lr == 0:
            return
        b1, b2 = self.betas
        if self.learn_global:
            g = pend.to(torch.float64)
            self.tau_step += 1
            self.tau_m.mul_(b1).add_((1 - b1) * g)
            self.tau_v.mul_(b2).add_((1 - b2) * g * g)
            mhat = self.tau_m / (1 - b1 ** self.tau_step)
            vhat = self.tau_v / (1 - b2 ** self.tau_step)
            self.tau.sub_(self.tau_lr_now * mhat / (vhat.sqrt() + ADAM_EPS)).clamp_(TAU_MIN, TAU_MAX)
            if self.lr_cut > 1:
                cut = (self.tau <= TAU_CUT_AT) & (self.tau_lr_now == self.tau_lr)
                self.tau_lr_now.copy_(torch.where(cut, self.tau_lr_now / self.lr_cut, self.tau_lr_now))
            return
        idx, h1, h2 = pend
        cnt = self.count[idx] + 1
        self.count[idx] = cnt
        cnt = cnt.double()
        for tau, m, v, g in ((self.tau1, self.m1, self.v1, h1), (self.tau2, self.m2, self.v2, h2)):
            mi = b1 * m[idx].double() + (1 - b1) * g
            vi = b2 * v[idx].double() + (1 - b2) * g * g
            m[idx], v[idx] = mi.to(m.dtype), vi.to(v.dtype)
            step = self.tau_lr * (mi / (1 - b1 ** cnt)) / ((vi / (1 - b2 ** cnt)).sqrt() + ADAM_EPS)
            tau[idx] = (tau[idx].double() - step).clamp(TAU_MIN, TAU_MAX).to(tau.dtype)
