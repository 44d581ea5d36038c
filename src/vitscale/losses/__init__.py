"""CLIP losses (OpenCLIP mini-batch InfoNCE, SigLIP's sigmoid loss, the FastCLIP family) and their
builder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

from ..errors import ConfigError
from ..precision import DTYPES
from .clip import ClipLoss, StepLogs, gamma_at, world
from .fastclip import VARIANTS, FastClipLoss, reference_defaults
from .siglip import SIGLIP_BIAS_INIT, SIGLIP_TAU_INIT, SigLipLoss

__all__ = [
    "build_clip_loss",
    "resolve_clip",
    "ClipLoss",
    "FastClipLoss",
    "SigLipLoss",
    "logit_init",
    "logit_init_note",
    "StepLogs",
    "gamma_at",
    "one_process",
]


def one_process(group) -> bool:
    """The loss runs in one process without a process group (no collective in its step): what
    torch.compile's fullgraph and a CUDA graph of the whole step need."""
    return world(group)[2] is None


def resolve_clip(cfg_clip, *, lr: float, epochs: float) -> dict:
    """The [clip] keys with every "auto" value replaced by the reference's value for the loss
    (fastclip.REFERENCE_DEFAULTS); `lr` is the model's (resolved) base learning rate."""
    loss = cfg_clip.loss
    if 0 < cfg_clip.tau_init < 0.01:
        raise ConfigError(
            f"config: clip.tau_init={cfg_clip.tau_init:g} is below 0.01, the temperature "
            "clamp (0 = the loss's reference value)"
        )
    if loss == "siglip":
        refuse_fastclip_keys(cfg_clip)
    ref = (
        reference_defaults(loss)
        if loss in VARIANTS
        else dict(
            tau_init=SIGLIP_TAU_INIT if loss == "siglip" else 0.07,
            tau_lr=0.0,
            tau_lr_schedule="constant",
            rho=0.0,
            gamma_min=0.0,
        )
    )
    schedule = cfg_clip.gamma_schedule
    if schedule == "auto":
        schedule = "constant" if loss in ("sogclr", "isogclr") else "cosine"
    tau_lr = cfg_clip.tau_lr if cfg_clip.tau_lr >= 0 else ref["tau_lr"]
    return dict(
        loss=loss,
        gamma_schedule=schedule,
        gamma_min=cfg_clip.gamma_min if cfg_clip.gamma_min >= 0 else ref["gamma_min"],
        gamma_decay_epochs=cfg_clip.gamma_decay_epochs or epochs / 2,
        tau_init=cfg_clip.tau_init or ref["tau_init"],
        tau_lr=lr if tau_lr is None else tau_lr,
        tau_lr_schedule=ref["tau_lr_schedule"]
        if cfg_clip.tau_lr_schedule == "auto"
        else cfg_clip.tau_lr_schedule,
        tau_lr_cut=cfg_clip.tau_lr_cut,
        rho=cfg_clip.rho if cfg_clip.rho >= 0 else ref["rho"],
        eps=cfg_clip.eps,
    )


# the [clip] keys only FastCLIP's losses read
FASTCLIP_KEYS = (
    "gamma_schedule",
    "gamma_min",
    "gamma_decay_epochs",
    "tau_lr",
    "tau_lr_schedule",
    "tau_lr_cut",
    "rho",
    "eps",
    "state_dtype",
    "shard_state",
)


def refuse_fastclip_keys(cfg_clip) -> None:
    """clip.loss=siglip with a FastCLIP-only key set away from its default: one line naming it."""
    for f in fields(cfg_clip):
        value = getattr(cfg_clip, f.name)
        if f.name in FASTCLIP_KEYS and value != f.default:
            raise ConfigError(
                f"config: clip.{f.name}={_toml(value)} is a FastCLIP key; clip.loss=siglip does "
                f"not read it (leave it out, or --set clip.{f.name}={_toml(f.default)})"
            )


def _toml(v) -> str:
    """A value as --set writes it."""
    if isinstance(v, bool):
        return str(v).lower()
    return f"{v:g}" if isinstance(v, float) else str(v)


def logit_init(cfg_clip) -> tuple[float, float | None]:
    """(tau_init, logit_bias init) of the CLIP model's logit parameters for the configured loss:
    siglip: OpenCLIP's SigLIP init (logit_scale = log 10, logit_bias = -10), clip.tau_init when
    named; the others: 1 / clip.tau_init (0: 0.07) and no bias (None: no parameter)."""
    if cfg_clip.loss == "siglip":
        return cfg_clip.tau_init or SIGLIP_TAU_INIT, SIGLIP_BIAS_INIT
    return cfg_clip.tau_init or 0.07, None


def logit_init_note(cfg_clip) -> str | None:
    """The line a run prints when clip.tau_init replaces the loss's own logit_scale init (siglip's)."""
    if cfg_clip.loss == "siglip" and cfg_clip.tau_init:
        return (
            f"clip.loss=siglip: logit_scale starts at log(1/{cfg_clip.tau_init:g}) "
            f"(clip.tau_init), not SigLIP's log(10); logit_bias at {SIGLIP_BIAS_INIT:g}"
        )
    return None


def build_clip_loss(
    cfg_clip,
    cfg_optim,
    *,
    lr: float,
    dataset_size: int,
    epochs: float,
    lr_factor: Callable[[int], float] | None = None,
    device,
    group=None,
    total_steps: int | None = None,
) -> ClipLoss | SigLipLoss | FastClipLoss:
    """The loss named by cfg_clip.loss.  group=None: the default process group when
    torch.distributed is initialized, else a single process.  `lr` is the model's base lr and
    `lr_factor(step)` its schedule (v0's temperature follows it); the temperature optimizers use
    the model optimizer's betas and eps, as the reference does; `total_steps`: the run's, for
    v0's device table of temperature lrs (a step counter on the device indexes it)."""
    if cfg_clip.loss == "openclip":
        return ClipLoss(device=device, group=group)
    if cfg_clip.loss == "siglip":
        resolve_clip(cfg_clip, lr=lr, epochs=epochs)  # its refusals
        return SigLipLoss(device=device, group=group)
    if cfg_clip.loss not in VARIANTS:
        raise ValueError(
            f"clip.loss {cfg_clip.loss!r}: expected openclip, siglip or one of {VARIANTS}"
        )
    r = resolve_clip(cfg_clip, lr=lr, epochs=epochs)
    dtype = DTYPES[cfg_clip.state_dtype]
    return FastClipLoss(
        r["loss"],
        dataset_size=dataset_size,
        gamma_schedule=r["gamma_schedule"],
        gamma_min=r["gamma_min"],
        gamma_decay_epochs=r["gamma_decay_epochs"],
        tau_init=r["tau_init"],
        tau_lr=r["tau_lr"],
        tau_lr_schedule=r["tau_lr_schedule"],
        lr_factor=lr_factor,
        tau_lr_cut=r["tau_lr_cut"],
        rho=r["rho"],
        eps=r["eps"],
        tau_beta1=cfg_optim.beta1,
        tau_beta2=cfg_optim.beta2,
        tau_eps=cfg_optim.eps,
        shard_state=cfg_clip.shard_state,
        state_dtype=dtype,
        device=device,
        group=group,
        total_steps=total_steps,
    )
