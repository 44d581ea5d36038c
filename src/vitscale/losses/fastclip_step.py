"""The arithmetic of one FastCLIP step (FastClipLoss._forward in losses/fastclip.py), as functions
of tensors: no state, no collectives.

Notation (fastclip.py's docstring): z_ij the scaled similarity differences of anchor i against
sample j (-inf on the diagonal), u_i its inner estimator stored as lu = log u, L_i = log(eps + u_i),
a_i = mean_{j != i} exp(z_ij) z_ij / (eps + u_i).  Every function keeps the order of operations the
loss has always had, so the numbers (and the gradients) are the same bit for bit; the reference's
numbers check them in tests/unit/test_fastclip_reference.py.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

U_RESET_BELOW = math.log(1e-35)  # the reference's "u < 1e-35, inf or nan" -> u = g
GRAD_CLAMP = 5.0  # per-sample temperature gradient clamp


class Side(NamedTuple):
    """One anchor side's (image anchors: 1, text anchors: 2) inner estimate for the local anchors [b]."""

    log_g: torch.Tensor  # log g_i = logsumexp_{j != i} z_ij - log(N-1)
    lu: torch.Tensor  # the updated log u_i
    L: torch.Tensor  # log(eps + u_i); per-sample temperatures: log(eps e^bound_i + u_i)
    bound: torch.Tensor | None  # the running max of max_j z_ij (per-sample temperatures only)


class Gamma(NamedTuple):
    """The inner estimators' gamma as 0-d fp64 device tensors, written when an epoch starts
    (FastClipLoss.set_epoch), read by every step: a step replayed as a CUDA graph (train.capture=
    step) or compiled reads the epoch's gamma from them, never a host value frozen in the step."""

    value: torch.Tensor  # gamma
    log: torch.Tensor  # log gamma (-inf at gamma = 0)
    log_1m: torch.Tensor  # log(1 - gamma) (-inf at gamma = 1)

    @classmethod
    def on(cls, device) -> Gamma:
        return cls(*(torch.zeros((), dtype=torch.float64, device=device) for _ in range(3)))

    def set(self, gamma: float) -> None:
        """In place (the tensors a captured step reads); the logs in the host's double, as the
        step's arithmetic always took them."""
        self.value.fill_(gamma)
        self.log.fill_(math.log(gamma) if gamma > 0 else -math.inf)
        self.log_1m.fill_(math.log(1 - gamma) if gamma < 1 else -math.inf)


def new_log_u(lu_old, log_g, shift, gamma: Gamma):
    """The reference's u update in log space, u <- (1-gamma) u + gamma g, with a u below 1e-35, inf
    or nan replaced by g, and u = g at gamma = 1 (epoch 0); `shift` = the bound before the step
    (the reference compares its stored u exp(-bound) with 1e-35). Static: no branch on gamma's
    value (the fp32 sums take the fp64 logs rounded to fp32, as a Python float is)."""
    lu_new = torch.logaddexp(lu_old + gamma.log_1m, log_g + gamma.log)
    bad = (lu_old - shift < U_RESET_BELOW) | torch.isnan(lu_old) | (lu_old == math.inf)
    return torch.where(bad | (gamma.value >= 1), log_g, lu_new)


def anchor_exponents(e1, e2, E1m, E2m, s1, s2, off: int):
    """(z1, z2, diag): z1_ij = (s_ij - s_ii) s1_i (image anchor i), z2_ij = (s_ji - s_ii) s2_i (text
    anchor i), [b, N], for the local anchors against all features (E1m, E2m: the gathered features
    with the local slice, at rows off..off+b, carrying the graph); -inf where j is i (diag)."""
    b, n_all = e1.shape[0], E1m.shape[0]
    pos = (e1 * e2).sum(1)  # s_ii [b], with grad
    diag = torch.zeros(b, n_all, dtype=torch.bool, device=e1.device)
    diag[torch.arange(b), off + torch.arange(b)] = True
    z1 = ((e1 @ E2m.T - pos[:, None]) * s1[:, None]).masked_fill(diag, -math.inf)  # [b, N]
    z2 = ((e2 @ E1m.T - pos[:, None]) * s2[:, None]).masked_fill(diag, -math.inf)
    return z1, z2, diag


def inner_estimate(z, lu_old, bound_old, gamma: Gamma, log_nm1: float, log_eps: float) -> Side:
    """g_i from the detached z, the updated u_i and L_i.  `bound_old` None: a global temperature,
    L = log(eps + u); else the reference's running bound (the diagonal's z = 0 included) decides
    when u counts as below 1e-35 and shifts eps: L = log(eps e^bound + u)."""
    zd = z.detach()
    log_g = torch.logsumexp(zd, 1) - log_nm1  # log g_i [b]
    if bound_old is None:
        lu_new = new_log_u(lu_old, log_g, 0.0, gamma)
        return Side(log_g, lu_new, torch.logaddexp(lu_new, torch.full_like(lu_new, log_eps)), None)
    bound = torch.maximum(bound_old, zd.max(1).values.clamp_min(0.0))
    lu_new = new_log_u(lu_old, log_g, bound_old, gamma)
    return Side(log_g, lu_new, torch.logaddexp(lu_new, log_eps + bound), bound)


def inner_estimates(z1, z2, rows: dict, gamma: Gamma, n_all: int, log_eps: float) -> list[Side]:
    """Both sides' inner estimates: image anchors (z1, rows lu1, bound1), then text anchors (z2,
    lu2, bound2); the bounds None with a global temperature."""
    return [
        inner_estimate(
            z,
            rows[f"lu{side}"],
            rows.get(f"bound{side}"),
            gamma,
            math.log(n_all - 1),
            log_eps,
        )
        for side, z in ((1, z1), (2, z2))
    ]


def weighted_z(z, L, diag, n_all: int):
    """a_i = mean_{j != i} exp(z_ij) z_ij / (eps + u_i), detached [b] (the temperatures' gradients)."""
    zd = z.detach()
    p = torch.exp(zd - L[:, None]) / (n_all - 1)  # 0 on the diagonal
    return (p * zd.masked_fill(diag, 0.0)).sum(1)


def temperature_columns(
    z1, z2, sides, diag, n_all: int, rho: float, *, learn_global, individual, multiply_tau
) -> list:
    """The per-anchor temperature gradients exchanged with u: d(loss)/d(theta) (v0, v3: before
    v3's tau factor), or h1, h2 and the bounds (per-sample temperatures); none for a constant tau."""
    if not (learn_global or individual):
        return []
    a = [weighted_z(z, side.L, diag, n_all) for z, side in zip((z1, z2), sides)]
    if learn_global:
        q = a[0] + a[1]
        if multiply_tau:
            q = q - rho - (sides[0].lu + sides[1].lu) / 2
        return [q]
    return [(side.L + rho - ai).clamp(-GRAD_CLAMP, GRAD_CLAMP) for side, ai in zip(sides, a)] + [
        side.bound for side in sides
    ]


def remote_shifts(packed, n_all: int, log_eps: float, device, individual: bool):
    """log eps per gathered anchor, plus its bound for per-sample temperatures (L = log(eps e^bound
    + u)); `packed`: the gathered columns (the bounds at 5 and 6)."""
    if individual:
        return log_eps + packed[:, 5].float(), log_eps + packed[:, 6].float()
    sh = torch.full((n_all,), log_eps, device=device)
    return sh, sh


def local_surrogate(z1, z2, sides):
    """Part (a) of the surrogate: sum_{i local} sum_{j != i} exp(z_ij - L_i), both sides, with the
    graph of the local features."""
    return torch.exp(z1 - sides[0].L[:, None]).sum() + torch.exp(z2 - sides[1].L[:, None]).sum()


def add_remote_surrogate(sur, E1, E2, e1, e2, packed, scales, shifts, off: int):
    """`sur` plus part (b): the other ranks' anchors (detached, their log u from the gathered
    `packed` columns 1 and 2, scaled by `scales` and with L = logaddexp(log u, `shifts`)) against the
    local features as negatives, image side then text side."""
    n_all, b = E1.shape[0], e1.shape[0]
    posd = (E1 * E2).sum(1)  # [N]
    other = torch.ones(n_all, 1, dtype=torch.bool, device=e1.device)
    other[off : off + b] = False
    for Ea, e_neg, c, col, sh in (
        (E1, e2, scales[0], 1, shifts[0]),
        (E2, e1, scales[1], 2, shifts[1]),
    ):
        La = torch.logaddexp(packed[:, col].float(), sh)
        zb = (Ea @ e_neg.T - posd[:, None]) * c[:, None]  # [N, b]
        zb = zb.masked_fill(~other, -math.inf)
        sur = sur + torch.exp(zb - La[:, None]).sum()
    return sur


def reported_value(sides, tau, rho: float, multiply_tau: bool):
    """The reference's reported loss over the local anchors: V = mean_i [g1_i/(eps+u1_i) +
    g2_i/(eps+u2_i)]; v3 (multiply_tau): tau V + rho tau + (tau/2) mean_i (log u1_i + log u2_i)."""
    v = (torch.exp(sides[0].log_g - sides[0].L) + torch.exp(sides[1].log_g - sides[1].L)).mean()
    if multiply_tau:
        return tau * v + rho * tau + tau * (sides[0].lu + sides[1].lu).mean() / 2
    return v


def reported_objective(sides, rho: float, tau, s1, s2):
    """The compositional objective logged beside the loss: with a global tau, tau mean_i (L1_i +
    L2_i) + 2 rho tau (GCL / RGCL-g); per-sample (tau None, s = 1/tau_i), mean_i tau1_i (L1_i + rho)
    + tau2_i (L2_i + rho) (RGCL)."""
    if tau is None:
        t1, t2 = 1.0 / s1, 1.0 / s2
        return (t1 * (sides[0].L + rho) + t2 * (sides[1].L + rho)).mean()
    return tau * (sides[0].L + sides[1].L).mean() + 2 * rho * tau
