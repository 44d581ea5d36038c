"""Precision as a part a strategy is built with (issue 42: strategies by composition).

- `Autocast` (one device, DDP): fp32 does nothing; bf16 / fp16 autocast around forward and loss,
  fp16 with a dynamic GradScaler (GPU only); pure_bf16 / pure_fp16 make the weights themselves half
  precision (Meta's O2/O3-like modes): with train.master_weights the optimizer updates fp32 copies
  that are cast back after each step, without it the half weights directly.
  bf16_act: bf16 autocast with the norms and the residual stream in bf16 too, parameters fp32
  (lowprec.py: applied to the placed model from outside).
- `EngineOwned` (FSDP2, DeepSpeed): the engine keeps precision itself (FSDP2's
  MixedPrecisionPolicy, DeepSpeed's ds_config): no autocast, no scaler, no copies.

A strategy names its part (`SingleDevice.precision_part`) instead of inheriting one and undoing it.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ..config import TrainConfig
from ..precision import half_dtype
from .devices import sdpa_context
from .lowprec import apply_bf16_act
from .parallel import tp_context


def clip_norm(params: list[torch.Tensor] | torch.optim.Optimizer, clip: float) -> torch.Tensor:
    """The gradients' total norm, clipped to `clip` (0: no clipping, the norm still measured);
    `params`: the tensors, or an optimizer's parameters."""
    if isinstance(params, torch.optim.Optimizer):
        params = [p for g in params.param_groups for p in g["params"]]
    return torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"), foreach=True)


class Autocast:
    """train.precision by autocast, half weights and a loss scaler (one device, DDP)."""

    def __init__(self, train: TrainConfig, device: torch.device, captured: bool):
        """`captured`: the step is recorded as a CUDA graph (autocast's weight-cast cache off)."""
        self.half = half_dtype(train.precision)
        self.pure = train.precision.startswith("pure_")
        self.act = train.precision == "bf16_act"  # bf16 norms and residual stream (lowprec.py)
        self.master_weights, self.sdpa_backend = train.master_weights, train.sdpa_backend
        self.device_type, self.captured = device.type, captured
        self.scaler = torch.amp.GradScaler(
            device.type, init_scale=train.loss_scale, enabled=self.half is torch.float16
        )
        self.master: list[torch.Tensor] | None = None  # fp32 copies the optimizer updates
        self.model_params: list[torch.Tensor] = []  # the half weights they are cast back to

    def place(self, model: nn.Module) -> None:
        """pure_*: the model's weights cast to half precision; bf16_act: its norms and residual
        stream computed in bf16 (the weights stay fp32)."""
        if self.pure:
            model.to(self.half)
        if self.act:
            apply_bf16_act(model)

    def optimizer_groups(self, groups: list[dict]) -> list[dict]:
        """The parameter groups the optimizer gets: with pure_* and train.master_weights, fp32
        copies of the model's (half) parameters, which stay half and are refreshed from them."""
        if not (self.pure and self.master_weights):
            return groups
        self.model_params = [p for g in groups for p in g["params"]]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        it = iter(self.master)
        return [{**g, "params": [next(it) for _ in g["params"]]} for g in groups]

    def autocast(self):
        """The context of a micro-batch's forward and loss (with train.sdpa_backend's kernel)."""
        kernel = sdpa_context(self.sdpa_backend)  # train.sdpa_backend (null for auto)
        if self.half is None or self.pure:
            return kernel
        # a CUDA graph capture (train.capture=step) must not keep autocast's cached weight casts
        cast = torch.autocast(self.device_type, dtype=self.half, cache_enabled=not self.captured)
        if self.sdpa_backend == "auto":
            return cast
        stack = contextlib.ExitStack()
        stack.enter_context(kernel)
        stack.enter_context(cast)
        return stack

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.half) if self.pure else x

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, clip: float):
        """Unscale, clip to `clip` (0: no clipping, the norm still measured), update: (the
        gradient norm, whether the step was skipped), both left on the device. With masters,
        the gradients move to them first and the weights are refreshed from them after."""
        if self.master is not None:
            for p, m in zip(self.model_params, self.master):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        self.scaler.unscale_(optimizer)
        norm = clip_norm(self.master if self.master is not None else optimizer, clip)
        # the scale as a device tensor (get_scale() would read it on the host): a skipped step
        # (non-finite gradients) is one whose update cut the scale
        scale = getattr(self.scaler, "_scale", None) if self.scaler.is_enabled() else None
        scale_before = scale.clone() if scale is not None else None
        self.scaler.step(optimizer)
        self.scaler.update()
        skipped = self.scaler._scale < scale_before if scale_before is not None else False
        if self.master is not None:  # after a skipped step the masters are unchanged: same copy
            with torch.no_grad():
                torch._foreach_copy_(self.model_params, self.master)  # pyright: ignore[reportPrivateImportUsage]
        return norm, skipped

    def state_dict(self) -> dict:
        sd: dict = {"scaler": self.scaler.state_dict()}
        if self.master is not None:
            sd["master"] = [m.detach().clone() for m in self.master]
        return sd

    def load_state_dict(self, sd: dict, names: list[str]) -> None:
        """The scaler where the checkpoint has one (the engines that own precision save none);
        the masters from the checkpoint's, or from another strategy's fp32 weights (`names`: the
        parameter name of each master)."""
        if "scaler" in sd:
            self.scaler.load_state_dict(sd["scaler"])
        if self.master is None:
            return
        with torch.no_grad():
            if "master" in sd:
                for m, saved in zip(self.master, sd["master"]):
                    m.copy_(saved)
            elif "model" in sd:
                for m, name in zip(self.master, names):
                    m.copy_(sd["model"][name])


class EngineOwned:
    """Precision the engine keeps (FSDP2's MixedPrecisionPolicy, DeepSpeed's ds_config): the loop's
    verbs pass through; `master`: the fp32 copies the engine keeps, where the strategy sets them
    (DeepSpeed's ZeRO masters), for the state's byte count and finiteness check."""

    half = None
    pure = False

    def __init__(self, train: TrainConfig, device: torch.device, captured: bool):
        self.sdpa_backend = train.sdpa_backend
        self.master: list[torch.Tensor] | None = None
        self.model_params: list[torch.Tensor] = []  # the engine casts its own weights

    def place(self, model: nn.Module) -> None:
        pass

    def optimizer_groups(self, groups: list[dict]) -> list[dict]:
        return groups

    def autocast(self):
        return sdpa_context(self.sdpa_backend)

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer, clip: float):
        """Clip to `clip` (0: no clipping, the norm still measured), update: (the gradient norm,
        False: no step is skipped without a scaler). FSDP2's sharded gradients give a sharded
        norm, gathered here (a collective on every rank)."""
        norm = clip_norm(optimizer, clip)
        full = getattr(norm, "full_tensor", None)  # a DTensor: the norm over every rank's shards
        norm = full() if full is not None else norm
        optimizer.step()
        return norm, False

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict, names: list[str]) -> None:
        pass


class MeshPrecision(EngineOwned):
    """FSDP2's mesh (fsdp.py): precision is the MixedPrecisionPolicy this part gives FSDP2
    (`policy`: parameters gathered and computed in bf16 for train.precision=bf16, gradients
    reduced in strategy.reduce_dtype); under tensor parallelism (`tp`) forward, backward and the
    step mix plain tensors with the replicated DTensor parameters (parallel.tp_context)."""

    def __init__(self, train: TrainConfig, device: torch.device, captured: bool, tp: bool = False):
        super().__init__(train, device, captured)
        self.precision, self.tp = train.precision, tp

    def policy(self, reduce_dtype: str):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from ..precision import DTYPES, half_dtype

        return MixedPrecisionPolicy(
            param_dtype=half_dtype(self.precision), reduce_dtype=DTYPES[reduce_dtype]
        )

    def autocast(self):
        if not self.tp:
            return super().autocast()
        stack = contextlib.ExitStack()
        stack.enter_context(super().autocast())
        stack.enter_context(tp_context(True))
        return stack

    def backward(self, loss: torch.Tensor) -> None:
        with tp_context(self.tp):
            super().backward(loss)

    def step(self, optimizer: torch.optim.Optimizer, clip: float):
        with tp_context(self.tp):
            return super().step(optimizer, clip)


class DeepSpeedPrecision(EngineOwned):
    """DeepSpeed's precision (deepspeed.py): the ds_config's bf16 / fp16 keys for train.precision
    (`ds_keys`), the dtype the engine's weights hold and that the inputs are cast to (`prepare`; the
    caller casts them under DeepSpeed's bf16), and the fp32 masters ZeRO keeps (`adopt`)."""

    input_dtype: torch.dtype | None = None

    @staticmethod
    def ds_keys(train: TrainConfig) -> dict:
        """The ds_config's precision keys: bf16 or fp16 enabled, fp16 with dynamic loss scaling
        from train.loss_scale (initial_scale_power = log2 of it)."""
        keys: dict = {
            "bf16": {"enabled": train.precision == "bf16"},
            "fp16": {"enabled": train.precision == "fp16"},
        }
        if train.precision == "fp16":
            power = int(round(math.log2(train.loss_scale)))
            keys["fp16"].update(loss_scale=0, initial_scale_power=power)
        return keys

    def adopt(self, engine, optimizer: torch.optim.Optimizer, stage: int) -> None:
        """What the built engine keeps: its weights' dtype, and this rank's fp32 master shards that
        the optimizer updates (None: it updates the weights themselves)."""
        if engine.bfloat16_enabled():
            self.input_dtype = torch.bfloat16
        elif engine.fp16_enabled():
            self.input_dtype = torch.float16
        # ZeRO-3 fills the optimizer's groups only while it steps: its own flat shards
        if stage == 3:
            self.master = list(engine.optimizer.fp32_partitioned_groups_flat)
        elif stage > 0 or self.input_dtype is not None:
            self.master = [p for g in optimizer.param_groups for p in g["params"]]
        else:
            self.master = None

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        half = self.input_dtype is not None and x.is_floating_point()
        return x.to(self.input_dtype) if half else x
