"""`vitscale bench CONFIG --peer timm`: the recipe's own training step beside timm's
VisionTransformer of the same function, in the plain loop a skilled timm user writes, timed in
interleaved paired rounds in one process (rounds.side_by_side: machine noise hits both alike).

The peer is built by `timm.create_model` from the recipe's model (interop/timm/vision_transformer.py: the
architecture and model_args that `vitscale export --format timm` writes) and starts from the same
weights, so both sides compute the same function on the same fixed batch. Its loop: the recipe's
precision as autocast (bf16; fp16 with a GradScaler; pure_* as their autocast counterparts, noted),
the recipe's optimizer (AdamW, or SGD with its momentum) in torch's fused implementation at the
recipe's lr, weight decay (timm's groups: none on 1-d parameters and the model's no_weight_decay())
and betas, cross-entropy
with the recipe's label smoothing, gradient clipping at optim.grad_clip, micro-batches of
train.accum_steps, `torch.compile(model)` with the recipe's compile mode when train.compile, channels-
last inputs when train.channels_last, TF32 and cuDNN settings as the recipe's (they are process-wide).
timm is optional: where it does not import, one line says so (exit code 2). vitscale never imports
timm for its own work; only this comparison does.
"""

from __future__ import annotations

import contextlib
import statistics

import torch

from ..errors import UserError
from ..interop.timm.vision_transformer import timm_export_arch, timm_kwargs, to_timm
from ..metrics import mfu
from ..strategy.devices import CUDAGRAPH_MODES, compile_kwargs
from ..tasks import export_use
from .rounds import paired_rounds, rate, rounds_won, side_by_side
from .timing import perf

PEERS = ("timm",)


def import_timm():
    """timm, or a one-line UserError saying why not."""
    try:
        import timm
        import timm.models.vision_transformer  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a CUDA-only torchvision fails with assorted errors
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise UserError(
            f"bench --peer timm: timm does not import here ({type(e).__name__}: {first}); install it "
            "(pip install timm) to compare, or run bench without --peer"
        ) from None
    return timm


def timm_peer(spec, module: torch.nn.Module):
    """timm's VisionTransformer of `spec`'s function holding `module`'s weights, and its
    create_model call as text."""
    timm = import_timm()
    arch = timm_export_arch(spec)  # one line where timm has no counterpart (a conv stem)
    kwargs = {**timm_kwargs(spec, arch), "drop_path_rate": spec.drop_path}
    if spec.dropout:
        kwargs.update(proj_drop_rate=spec.dropout, attn_drop_rate=spec.dropout)
    model = timm.create_model(arch, pretrained=False, **kwargs)
    model.load_state_dict(to_timm(module))
    for m in model.modules():  # the recipe's attention kind (timm's fused_attn = SDPA)
        if hasattr(m, "fused_attn"):
            m.fused_attn = spec.attention == "sdpa"
    call = (
        f"timm.create_model({arch!r}, " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"
    )
    return model, call, timm.__version__


AUTOCAST = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "bf16_act": torch.bfloat16,  # the peer's plain loop: bf16 autocast
    "pure_bf16": torch.bfloat16,
    "fp16": torch.float16,
    "pure_fp16": torch.float16,
}


class PeerBench:
    """The peer's plain training loop on the vitscale Bench's fixed batch and device, with the
    Bench interface side_by_side times (steps, settings, close, global_batch)."""

    def __init__(self, b, peer: str = "timm"):
        if peer not in PEERS:
            raise UserError(f"bench --peer {peer}: peers are {', '.join(PEERS)}")
        cfg, s = b.cfg, b.s
        if s.world_size > 1:
            raise UserError("bench --peer: one process (the peer's loop is one device's)")
        if peer not in b.trainer.task.exports:  # the task says which libraries have its model
            raise UserError(
                f"bench --peer {peer}: compares {export_use(peer)}; this recipe trains a "
                f"{b.trainer.task.kind} model"
            )
        self.cfg, self.device, self.bench = cfg, s.device, b
        self.global_batch, self.sync = b.global_batch, b.sync
        model, self.call, self.version = timm_peer(b.trainer.spec, s.module)
        self.model = model.to(self.device).train()
        self.params = sum(p.numel() for p in self.model.parameters())
        self.fixed = b.fixed
        o, t = cfg.optim, cfg.train
        fused = {"fused": True} if self.device.type in ("cuda", "cpu") else {}
        # timm's train.py: no weight decay on 1-d parameters and the model's no_weight_decay() names
        from timm.optim import (
            param_groups_weight_decay,  # timm is optional: imported where it is compared
        )

        groups = param_groups_weight_decay(
            model, weight_decay=o.weight_decay, no_weight_decay_list=model.no_weight_decay()
        )
        if o.name == "adamw":
            self.opt = torch.optim.AdamW(
                groups, lr=b.trainer.lr, betas=(o.beta1, o.beta2), eps=o.eps, **fused
            )
        elif o.name == "sgd":
            self.opt = torch.optim.SGD(
                groups, lr=b.trainer.lr, momentum=o.momentum, nesterov=o.nesterov, **fused
            )
        else:
            raise UserError(
                f"bench --peer: optim.name={o.name} has no torch optimizer for the peer's loop "
                "(adamw and sgd do)"
            )
        self.loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=t.label_smoothing)
        self.dtype = AUTOCAST[t.precision]
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype is torch.float16)
        if t.compile:
            self.model = torch.compile(self.model, **compile_kwargs(t.compile_mode))
        self.notes = [
            f"peer: {self.call}, same weights as vitscale's at the start; plain loop: "
            f"{type(self.opt).__name__} (fused; timm's weight-decay groups), {'autocast ' + str(self.dtype).split('.')[-1] if self.dtype else 'fp32'}"
            f"{' (the pure_* mode as autocast)' if t.precision.startswith('pure_') else ''}, "
            f"label smoothing {t.label_smoothing}, grad clip {o.grad_clip or 'off'}, "
            f"{t.accum_steps} micro-batch(es){', torch.compile' if t.compile else ''}"
        ]

    def settings(self):
        return self.bench.settings()  # TF32, cuDNN and threads: the recipe's, process-wide

    def autocast(self):
        return (
            torch.autocast(self.device.type, dtype=self.dtype)
            if self.dtype
            else contextlib.nullcontext()
        )

    def step(self) -> torch.Tensor:
        """One optimizer step of the plain loop; the loss stays on the device."""
        x, y = self.fixed[0], self.fixed[1]
        if self.cfg.train.channels_last and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        A, total = self.cfg.train.accum_steps, torch.zeros((), device=x.device)
        if self.cfg.train.compile and self.cfg.train.compile_mode in CUDAGRAPH_MODES:
            torch.compiler.cudagraph_mark_step_begin()
        for xm, ym in zip(x.chunk(A), y.chunk(A)):
            with self.autocast():
                loss = self.loss_fn(self.model(xm), ym) / A
            self.scaler.scale(loss).backward()
            total += loss.detach()
        if self.cfg.optim.grad_clip > 0:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.cfg.optim.grad_clip, foreach=True
            )
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        return total

    def steps(self, n: int) -> tuple[float, float]:
        """n steps: (wall seconds, data seconds = 0: the batch is fixed on the device)."""
        self.sync()
        t0 = perf()
        for _ in range(n):
            self.step()
        self.sync()
        return perf() - t0, 0.0

    def close(self) -> None:
        self.model = self.opt = None


def peer_rounds(
    b, peer: str, steps: int, warmup: int, rounds: int, flops_per_image: float, peak: float
) -> dict:
    """The vitscale Bench `b` and the peer timed in `rounds` interleaved paired rounds; each side's
    img/s and MFU and vitscale's speed over the peer's (the median of the per-round ratios)."""
    p = PeerBench(b, peer)
    try:
        times = side_by_side([b, p], steps, rounds, warmup)
    finally:
        p.close()
    if any(t is None for t in times):
        raise UserError("bench --peer: a side ran out of memory; lower data.batch_size")
    # peer's speed over vitscale's, per round
    ratios = paired_rounds(times, [b.global_batch] * 2)[1]
    ours, theirs = (rate(t, steps, b.global_batch) for t in times)
    speedups = [1 / r for r in ratios]
    return {
        "name": peer,
        "version": p.version,
        "model": p.call,
        "params": p.params,
        "rounds": rounds,
        "steps": steps,
        "warmup": warmup,
        "vitscale": {**ours, "mfu": mfu(flops_per_image, ours["images_per_s"], peak, 1)},
        "peer": {**theirs, "mfu": mfu(flops_per_image, theirs["images_per_s"], peak, 1)},
        "speedup": statistics.median(speedups),
        "speedup_rounds": speedups,
        "rounds_won": rounds_won(speedups),
        "notes": p.notes,
    }


def describe_peer(r: dict) -> list[str]:
    """The comparison as a small table."""
    ms = lambda v: f"{1e3 * v:.1f} ms"  # noqa: E731
    rows = [
        f"peer        {r['name']} {r['version']}: {r['rounds']} interleaved paired rounds x {r['steps']} steps "
        f"after {r['warmup']} warm-up, one fixed batch on both sides",
        "            | candidate | median step | img/s | MFU |",
        "            |---|---:|---:|---:|",
    ]
    for label, side in (
        ("vitscale (the recipe's step)", r["vitscale"]),
        (f"{r['name']} (plain loop)", r["peer"]),
    ):
        rows.append(
            f"            | {label} | {ms(side['step_time_s']['median'])} | {side['images_per_s']:.1f} | "
            f"{100 * side['mfu']:.1f}% |"
        )
    rows.append(
        f"speedup     vitscale / {r['name']}: {r['speedup']:.3f}x (median of the per-round ratios; faster "
        f"in {r['rounds_won']} of {r['rounds']} rounds)"
    )
    return rows
