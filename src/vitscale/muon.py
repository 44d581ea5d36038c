"""optim.name = muon: Muon (Jordan et al. 2024, `torch.optim.Muon`'s arithmetic) on the transformer
blocks' 2-D weights, AdamW (torch's own step) on everything else, in one optimizer, so that the
scheduler, checkpoints and DCP see one set of parameter groups.

Muon's update of a matrix W with gradient G: momentum B <- mu B + (1 - mu) G (as a lerp), the
Nesterov blend G + mu (B - G), five quintic Newton-Schulz iterations that take it to about the
nearest semi-orthogonal matrix, decoupled weight decay W <- (1 - lr wd) W, then W <- W - lr' O with
lr' = lr x the per-shape scale (optim.muon_adjust_lr). Two things differ from torch.optim.Muon, and
neither changes its numbers where it can run:
- the iteration's dtype is a key (optim.muon_ns_dtype): torch's is bf16, which a CPU without bf16
  instructions emulates at about 2 GFLOP/s (ENVIRONMENT.md); fp32 there;
- a sharded parameter (an FSDP2 / HSDP / tensor-parallel DTensor) is orthogonalised as the whole
  matrix: the engine's `whole` (strategy/parallel.py's `on_whole_matrix`) gathers the update,
  the iteration runs on every rank alike, and each rank keeps its own shard.
"""

from __future__ import annotations

import math

import torch

from .errors import ConfigError

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) defaults
NS_EPS = 1e-7
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GROUP_KEYS = ("momentum", "nesterov", "ns_steps", "adjust_lr_fn", "ns_dtype")


def orthogonalize(
    g: torch.Tensor, steps: int, dtype: torch.dtype, coefficients=NS_COEFFICIENTS, eps=NS_EPS
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of torch.optim.Muon (op for op, so bit-equal to it in
    bf16), in `dtype`: about U V^T of G = U S V^T, its singular values spread around 1."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def lr_scale(adjust: str, shape) -> float:
    """The per-matrix lr factor: "original" sqrt(max(1, A / B)), "match_rms_adamw" 0.2 sqrt(max(A, B))."""
    a, b = shape[:2]
    if adjust == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    return math.sqrt(max(1, a / b))


def as_is(update: torch.Tensor, fn):
    """A matrix the optimizer holds whole: `fn` of it (MuonAdamW's default `whole`)."""
    return fn(update)


class MuonAdamW(torch.optim.AdamW):
    """One optimizer: groups with `muon` True take Muon's step, the others torch's AdamW step
    (torch.optim.AdamW itself, with its impl: for-loop, foreach or fused). A Muon group carries
    lr, weight_decay and GROUP_KEYS (optim.muon_*); its state is the momentum buffer, as torch's."""

    def __init__(self, groups: list[dict], *, lr: float, muon: dict, whole=as_is, **adamw):
        super().__init__(groups, lr=lr, **adamw)
        self.whole = whole  # whole(update, fn): fn of the whole matrix, this rank's part back
        for g in self.param_groups:
            if g.get("muon"):
                for k in GROUP_KEYS:
                    g.setdefault(k, muon[k])
                bad = [tuple(p.shape) for p in g["params"] if p.ndim != 2]
                if bad:
                    raise ConfigError(
                        f"config: optim.name=muon takes 2-D weights only, got {bad[0]}"
                    )

    def __setstate__(self, state: dict) -> None:
        """load_state_dict's: AdamW's own over its groups (it expects a step count in their state),
        then all groups in their order."""
        groups = state["param_groups"]
        super().__setstate__({**state, "param_groups": [g for g in groups if not g.get("muon")]})
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        try:  # AdamW's own step over its groups alone
            self.param_groups = [g for g in groups if not g.get("muon")]
            super().step()
        finally:
            self.param_groups = groups
        for g in groups:
            if g.get("muon"):
                self.muon_step(g)
        return loss

    def muon_step(self, group: dict) -> None:
        """torch.optim.Muon's single-tensor step (_single_tensor_muon), with the iteration in the
        group's ns_dtype, on the whole matrix (`self.whole`: the engine's, for sharded ones)."""
        lr = float(group["lr"])
        momentum, wd = group["momentum"], group["weight_decay"]
        dtype = DTYPES[group["ns_dtype"]]
        steps = group["ns_steps"]

        def ortho(m: torch.Tensor) -> torch.Tensor:
            return orthogonalize(m, steps, dtype)

        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            update = self.whole(update, ortho)
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr * lr_scale(group["adjust_lr_fn"], p.shape))


def muon_settings(cfg) -> dict:
    """GROUP_KEYS of Muon's groups from the optim section, optim.muon_ns_dtype resolved
    (fastpaths.resolve answers auto for the machine, and announces it)."""
    if cfg.muon_ns_dtype not in DTYPES:
        raise ConfigError(
            f"config: optim.muon_ns_dtype={cfg.muon_ns_dtype} was not answered for this machine "
            "(fastpaths.resolve); set bf16 or fp32"
        )
    return {
        "momentum": cfg.muon_momentum,
        "nesterov": cfg.muon_nesterov,
        "ns_steps": cfg.muon_ns_steps,
        "adjust_lr_fn": cfg.muon_adjust_lr,
        "ns_dtype": cfg.muon_ns_dtype,
    }
