"""Optimizers (AdamW for-loop/foreach/fused, SGD, LAMB), weight-decay groups, LR schedules."""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from .config import OptimConfig
from .errors import ConfigError
from .muon import MuonAdamW, as_is, muon_settings


def block_index(name: str) -> int | None:
    """The transformer block a parameter belongs to ("blocks.3.attn..." or "visual.blocks.3..."
    -> 3), None outside the blocks."""
    m = re.search(r"(?:^|\.)blocks\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def layer_id(name: str, depth: int) -> int:
    """A parameter's layer for layer-wise lr decay (BEiT / timm's numbering): embeddings 0,
    transformer block i -> i + 1, everything after the blocks (final norm, head) depth + 1."""
    block = block_index(name)
    if block is not None:
        return block + 1
    if re.search(
        r"(?:^|\.)(patch_embed|cls_token|pos_embed|token_embed|positional_embedding)", name
    ):
        return 0
    return depth + 1


def optimizer_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """The parameter groups of the optim section: `param_groups`, and with optim.name=muon a third
    group (`muon`: True) of the blocks' 2-D weights that Muon updates, with its weight decay."""
    if cfg.name != "muon":
        return param_groups(model, cfg.weight_decay, cfg.layer_decay)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if is_muon_param(n, p)]
    if not hidden:
        raise ConfigError(
            "config: optim.name=muon found no 2-D weights inside transformer blocks to update "
            "(all frozen, or a model without blocks): use adamw"
        )
    wd = cfg.weight_decay if cfg.muon_weight_decay < 0 else cfg.muon_weight_decay
    keep = frozenset(id(p) for p in hidden)
    rest = param_groups(model, cfg.weight_decay, cfg.layer_decay, exclude=keep)
    return [*rest, {"params": hidden, "weight_decay": wd, "muon": True}]


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """What Muon updates: the 2-D weights inside the transformer blocks (attention's qkv and
    projection, the MLP's two layers). Embeddings, the stem, norms, biases, the class token and the
    head stay with AdamW, as in Keller Jordan's and Moonshot's recipes."""
    return p.ndim == 2 and block_index(name) is not None


def optimizer_split(model: nn.Module, cfg: OptimConfig) -> dict:
    """`vitscale info`'s record of which optimizer updates what (optim.name=muon only): tensors and
    parameters of Muon's group and of AdamW's."""
    if cfg.name != "muon":
        return {}
    groups = optimizer_groups(model, cfg)
    split: dict = {"muon": {"tensors": 0, "params": 0}, "adamw": {"tensors": 0, "params": 0}}
    for g in groups:
        part = split["muon" if g.get("muon") else "adamw"]
        part["tensors"] += len(g["params"])
        part["params"] += sum(p.numel() for p in g["params"])
    return {"optimizer_split": split}


def split_line(split: dict) -> str:
    """The split in one line."""
    m, a = split["muon"], split["adamw"]
    return (
        f"optimizer: Muon on {m['tensors']} matrices ({m['params']:,} params: the blocks' attention "
        f"and MLP weights), AdamW on {a['tensors']} tensors ({a['params']:,} params: embeddings, "
        "stem, norms, biases, head)"
    )


def param_groups(
    model: nn.Module,
    weight_decay: float,
    layer_decay: float = 1.0,
    exclude: frozenset[int] = frozenset(),
) -> list[dict]:
    """No weight decay on norms, biases, position embeddings and the class token. With
    `layer_decay` < 1, one pair of groups per layer, each with `lr_scale` = layer_decay ** (depth + 1
    - layer) (build_optimizer multiplies the lr by it). Frozen parameters are left out, and those
    whose id is in `exclude` (Muon's)."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    named = [
        (n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in exclude
    ]
    depth = 1 + max((b for n, _ in named if (b := block_index(n)) is not None), default=-1)
    groups: dict = {}
    for name, p in named:
        no_wd = p.ndim <= 1 or name in skip or name.split(".")[-1] in skip
        layer = layer_id(name, depth) if layer_decay < 1 else 0
        groups.setdefault((layer, no_wd), []).append(p)
    # the two groups as always (also when one is empty: checkpoints expect two)
    if layer_decay >= 1:
        return [
            {"params": groups.get((0, False), []), "weight_decay": weight_decay},
            {"params": groups.get((0, True), []), "weight_decay": 0.0},
        ]
    return [
        {
            "params": ps,
            "weight_decay": 0.0 if no_wd else weight_decay,
            "lr_scale": layer_decay ** (depth + 1 - layer),
        }
        for (layer, no_wd), ps in sorted(groups.items())
    ]


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019): Adam direction with weight decay, scaled per tensor by the trust
    ratio ||w|| / ||update|| (1 where either norm is 0). Bias-corrected moments."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where(
                    (w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm)
                )
                p.add_(update * trust, alpha=-group["lr"])
        return loss


def with_lr(groups: list[dict], lr: float, muon_lr: float | None = None) -> list[dict]:
    """Groups with an `lr_scale` (layer-wise decay) get their own lr: lr x scale; Muon's group
    `muon_lr` where given."""
    out = []
    for g in groups:
        if "lr_scale" in g:
            g = {**g, "lr": lr * g["lr_scale"]}
        elif g.get("muon") and muon_lr is not None:
            g = {**g, "lr": muon_lr}
        out.append(g)
    return out


def muon_lr(cfg: OptimConfig, lr: float) -> float:
    """Muon's group lr for a base lr `lr` (optim.lr as scaled to the batch): optim.muon_lr scaled
    alike, or `lr` itself where muon_lr is 0."""
    if not cfg.muon_lr:
        return lr
    return cfg.muon_lr * (lr / cfg.lr) if cfg.lr else cfg.muon_lr


MUON_KEYS = tuple(k for k in OptimConfig.__dataclass_fields__ if k.startswith("muon_"))


def check_optimizer(cfg: OptimConfig) -> None:
    """What the optimizer section asks that no optimizer here has, in one line (checks.check_run
    asks it before anything starts; build_optimizer again)."""
    if cfg.name == "lamb" and cfg.impl not in ("auto", "forloop"):
        raise ConfigError(
            f"config: optim.impl={cfg.impl} is not available for LAMB (use auto or forloop)"
        )
    if cfg.name != "muon":
        default = OptimConfig()
        changed = [k for k in MUON_KEYS if getattr(cfg, k) != getattr(default, k)]
        if changed:
            raise ConfigError(
                f"config: optim.{changed[0]} is a key of optim.name=muon, unused by {cfg.name}: "
                "drop it or set optim.name=muon"
            )
    elif cfg.layer_decay < 1:
        raise ConfigError(
            "config: optim.name=muon with optim.layer_decay < 1 is refused: layer-wise lr decay "
            "groups AdamW's parameters by layer, Muon's group has one lr; use adamw or layer_decay=1"
        )


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    params=None,
    capturable: bool = False,
    lr: float | None = None,
    whole=as_is,
) -> torch.optim.Optimizer:
    """`params` (param groups) defaults to `param_groups(model)`; the strategy may pass master copies.
    `capturable`: AdamW keeps its step count on the device and takes its lr as a device tensor, so
    that a CUDA graph of the whole step replays it (train.capture=step on a GPU). `lr`: the base lr
    (default optim.lr; a run passes it scaled to its global batch, `scaled_lr`). `whole`: how
    Muon makes a matrix whole (the engine's, for sharded parameters: muon.MuonAdamW)."""
    lr = cfg.lr if lr is None else lr
    groups = with_lr(
        params if params is not None else optimizer_groups(model, cfg), lr, muon_lr(cfg, lr)
    )
    impl = {
        "forloop": dict(foreach=False),
        "foreach": dict(foreach=True),
        "fused": dict(fused=True),
        "auto": {},
    }[cfg.impl]
    if cfg.name == "adamw":
        extra = {"capturable": True} if capturable else {}
        return torch.optim.AdamW(
            groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl, **extra
        )
    if cfg.name == "muon":
        check_optimizer(cfg)
        return MuonAdamW(
            groups,
            lr=lr,
            muon=muon_settings(cfg),
            whole=whole,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            **impl,
        )
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **impl)
    if cfg.name == "lamb":
        check_optimizer(cfg)
        return Lamb(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    raise ConfigError(f"config: unknown optimizer {cfg.name}")  # unreachable: validated


def scaled_lr(cfg: OptimConfig, global_batch: int) -> float:
    """optim.lr adjusted to the global batch: linear (Goyal et al.) or square-root scaling."""
    ratio = global_batch / cfg.lr_ref_batch
    return cfg.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.lr_scaling]


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based): linear warmup, then decay."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    return decay_factor(min(1.0, (step - warmup) / max(1, total - warmup)), schedule, min_ratio)


def decay_factor(progress: float, schedule: str, min_ratio: float) -> float:
    """The decay part of the multiplier at `progress` in [0, 1] (1 = the schedule's end: min_ratio)."""
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        decay = 0.5 * (1 + math.cos(math.pi * progress))
    else:  # linear
        decay = 1.0 - progress
    return min_ratio + (1 - min_ratio) * decay


def warmup_steps(cfg: OptimConfig, steps_per_epoch: int) -> int:
    """optim.warmup_steps, else optim.warmup_epochs in optimizer steps (both schedule clocks warm up in steps)."""
    return cfg.warmup_steps or int(round(cfg.warmup_epochs * steps_per_epoch))


def schedule(cfg: OptimConfig, total_steps: int, steps_per_epoch: int):
    """The recipe's lr multiplier as a function of the 0-based optimizer step."""
    warmup = warmup_steps(cfg, steps_per_epoch)
    return lambda s: lr_factor(s, total_steps, warmup, cfg.schedule, cfg.min_lr_ratio)


def time_schedule(cfg: OptimConfig, budget_s: float, steps_per_epoch: int, clock):
    """optim.schedule_clock = time: the multiplier at optimizer step `s` is the warm-up ramp (in steps,
    as `schedule`'s) times the decay at progress = clock() / budget_s, `clock()` being the training
    seconds spent so far (the trainer's: evaluation and checkpoints do not count). The decay reaches
    its end (min_lr_ratio) when the time budget ends, however many steps fit in it; stateless, so a
    resumed run continues from its restored training time."""
    warmup = warmup_steps(cfg, steps_per_epoch)

    def factor(step: int) -> float:
        ramp = (step + 1) / warmup if warmup and step < warmup else 1.0
        return ramp * decay_factor(min(1.0, clock() / budget_s), cfg.schedule, cfg.min_lr_ratio)

    return factor


def continue_schedule(scheduler, state: dict, base_lrs: list[float]) -> None:
    """A scheduler put back at a checkpoint's step (its saved `state`) with this run's base lrs and
    schedule: one step from the step before sets every group's lr, and the last lr it reports,
    from them (a resumed run whose lr or schedule changed takes the change from that step on)."""
    scheduler.load_state_dict(state)
    scheduler.base_lrs = list(base_lrs)
    scheduler.last_epoch -= 1
    scheduler.step()


def lr_table(scheduler, total_steps: int, device: torch.device) -> torch.Tensor:
    """The lr of each parameter group at steps 0..total_steps, as `scheduler` (a LambdaLR) computes
    it: its base lr times its lambda, in double, exactly the float the scheduler would set. The
    device table a captured step reads its lr from (capture.WholeStep): [groups, total_steps + 1],
    float64 on a CPU, float32 on a GPU (CUDA's fused AdamW reads fp32)."""
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    factors: dict[int, list[float]] = {}
    rows = []
    for lam, base in zip(scheduler.lr_lambdas, scheduler.base_lrs):
        f = factors.setdefault(id(lam), [lam(i) for i in range(total_steps + 1)])
        rows.append([base * x for x in f])
    return torch.tensor(rows, dtype=dtype).to(device)


def build_scheduler(
    optimizer,
    cfg: OptimConfig,
    total_steps: int,
    steps_per_epoch: int,
    *,
    clock=None,
    budget_s: float = 0.0,
):
    """A LambdaLR of `schedule` (steps), or of `time_schedule` (optim.schedule_clock = time: `clock`
    and `budget_s`, the training seconds spent and train.time_limit_s)."""
    if cfg.schedule_clock == "time":
        if clock is None or budget_s <= 0:
            raise ConfigError("config: optim.schedule_clock=time needs train.time_limit_s > 0")
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, time_schedule(cfg, budget_s, steps_per_epoch, clock)
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(cfg, total_steps, steps_per_epoch))
