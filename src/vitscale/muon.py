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
  matrix: its update is gathered (`full_tensor`), iterated on every rank alike, and each rank keeps
  its own shard (`distribute_tensor` with src_data_rank=None: a local slice, no second collective).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from .errors import ConfigError

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) defaults
NS_EPS = 1e-7
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GROUP_KEYS = ("momentum", "nesterov", "ns_steps", "adjust_lr_fn", "ns_dtype")


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """What Muon updates: the 2-D weights inside the transformer blocks (attention's qkv and
    projection, the MLP's two layers). Embeddings, the stem, norms, biases, the class token and the
    head stay with AdamW, as in Keller Jordan's and Moonshot's recipes."""
    from .optim import block_index  # optim imports this module

    return p.ndim == 2 and block_index(name) is not None


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


def whole_orthogonalized(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """`orthogonalize` of a matrix, sharded or not: a DTensor is gathered whole, orthogonalised
    alike on every rank, and this rank's shard of the result returned (a DTensor placed as it was)."""
    if not isinstance(update, DTensor):
        return orthogonalize(update, steps, dtype)
    whole = orthogonalize(update.full_tensor(), steps, dtype)
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


class MuonAdamW(torch.optim.AdamW):
    """One optimizer: groups with `muon` True take Muon's step, the others torch's AdamW step
    (torch.optim.AdamW itself, with its impl: for-loop, foreach or fused). A Muon group carries
    lr, weight_decay and GROUP_KEYS (optim.muon_*); its state is the momentum buffer, as torch's."""

    def __init__(self, groups: list[dict], *, lr: float, muon: dict, **adamw):
        super().__init__(groups, lr=lr, **adamw)
        for g in self.param_groups:
            if g.get("muon"):
                for k in GROUP_KEYS:
                    g.setdefault(k, muon[k])
                bad = [tuple(p.shape) for p in g["params"] if p.ndim != 2]
                if bad:
                    raise ConfigError(f"config: optim.name=muon takes 2-D weights only, got {bad[0]}")

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
        group's ns_dtype and whole matrices (`whole_orthogonalized`)."""
        lr = float(group["lr"])
        momentum, wd = group["momentum"], group["weight_decay"]
        dtype = DTYPES[group["ns_dtype"]]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            update = whole_orthogonalized(update, group["ns_steps"], dtype)
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr * lr_scale(group["adjust_lr_fn"], p.shape))


def auto_ns_dtype(device_type: str, capability=None, cpu_bf16: bool | None = None):
    """optim.muon_ns_dtype=auto: (bf16 or fp32, why), bf16 where train.precision=auto takes it."""
    from .strategy.devices import auto_precision

    precision, why = auto_precision(device_type, capability, cpu_bf16)
    return ("bf16" if precision == "bf16" else "fp32"), why


def muon_settings(cfg, device: torch.device) -> dict:
    """GROUP_KEYS of Muon's groups from the optim section; optim.muon_ns_dtype=auto (which
    fastpaths.resolve answers, and announces, for a run) answered for `device` where it is left."""
    ns_dtype = cfg.muon_ns_dtype
    if ns_dtype == "auto":
        from .strategy.devices import cpu_has_bf16

        if device.type == "cuda":
            ns_dtype = auto_ns_dtype("cuda", torch.cuda.get_device_capability(device))[0]
        else:
            ns_dtype = auto_ns_dtype(device.type, cpu_bf16=cpu_has_bf16())[0]
    return {
        "momentum": cfg.muon_momentum,
        "nesterov": cfg.muon_nesterov,
        "ns_steps": cfg.muon_ns_steps,
        "adjust_lr_fn": cfg.muon_adjust_lr,
        "ns_dtype": ns_dtype,
    }
