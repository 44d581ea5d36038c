"""One device (CPU or one GPU): optimizer step, EMA, compile, checkpoint state; precision is the
part it is built with (amp.Autocast: autocast, half weights, the loss scaler)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from ..compiling import compile_args
from ..config import OptimConfig, TrainConfig
from ..errors import ConfigError
from ..optim import build_optimizer, optimizer_groups
from .amp import Autocast, EngineOwned
from .devices import (
    CUDAGRAPH_MODES,
    apply_backend_flags,
    backend_flags,
    fp16_refusal,
    sdpa_refusal,
    warn_slow_bf16,
)
from .ema import Ema
from .fp8 import convert_fp8, fp8_refusal
from .inductor import CompileCache, knob_note, knob_refusal
from .parallel import apply_ac, on_whole_matrix

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "config: run.device=cuda but no CUDA GPU is visible (use run.device=cpu or auto)"
        )
    return torch.device(name)


def device_refusal(train: TrainConfig, device: torch.device) -> str | None:
    """What the device refuses of the train section (fp16 on a CPU, fp8 below its compute capability,
    a CUDA attention kernel on a CPU), in one line, or None; every engine runs these checks."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return (
        fp16_refusal(device.type, train.precision)
        or fp8_refusal(train.fp8, device.type, capability)
        or sdpa_refusal(device.type, train.sdpa_backend)
        or knob_refusal(train, device.type)
    )


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded DTensor; any other tensor as it is."""
    local = getattr(t, "to_local", None)
    return local() if local is not None else t


class OneProcess:
    """The process-group verbs of one process (rank 0 of 1); Distributed (dist.py) has the group's."""

    rank, world_size, is_main = 0, 1, True
    # the data-parallel index and count (the mesh's replicate x shard points: the ranks of one
    # tensor-parallel group share them and see the same batches) and their process group (None:
    # the world)
    dp_rank, dp_size, dp_group = 0, 1, None

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (each tensor-parallel group counted once)."""
        return t

    def gather_dp(self, obj) -> list:
        """Every data-parallel rank's `obj`, in order (one per tensor-parallel group)."""
        return [obj]

    def gather_objects(self, obj) -> list:
        return [obj]

    def broadcast_object(self, obj):
        return obj

    def comm_window(self):
        """Context around a training step: its collectives are counted (none on one device)."""
        return contextlib.nullcontext()

    def comm_stats(self, steps: int) -> dict:
        """Communication counted since the last call, per optimizer step (none on one device)."""
        return {}

    def close(self) -> None:
        """Release what the strategy holds (the process group, for multi-process strategies)."""


class SingleDevice(OneProcess):  # implements base.Strategy
    """The strategy verbs the loop uses: setup, autocast, backward, step, state_dict."""

    name = "single"
    # no_sync() keeps gradient communication out of backward (DDP, FSDP2): the lab's step split
    # times backward with and without it to find the exposed communication
    no_sync_defers_comm = False
    # parameters are gathered inside forward (FSDP2): overlapped communication is not derivable
    gathers_in_forward = False
    # every rank must run every forward (parameters gathered there: FSDP2, ZeRO-3)
    forward_is_collective = False
    # the step as one unit (train.capture=step), and that unit as one CUDA graph: set from the
    # config and the device in __init__, the one place that decides
    whole_step = captured = False
    # the precision part (amp.py): autocast and a loss scaler here and under DDP; the engines that
    # keep precision themselves (FSDP2, DeepSpeed) name amp.EngineOwned
    precision_part: type[Autocast] | type[EngineOwned] = Autocast
    model: nn.Module  # what training calls (the engine's wrapper, compiled or not)

    def __init__(
        self, train: TrainConfig, optim: OptimConfig, device: torch.device, lr: float | None = None
    ):
        """`lr`: the optimizer's base lr (default optim.lr; build_strategy gives the run's, scaled to
        its global batch): the optimizer's groups own it from then on."""
        self.cfg, self.optim_cfg, self.device = train, optim, device
        self.lr = optim.lr if lr is None else lr
        # what the device refuses (fp16 on a CPU, fp8 below its capability) was asked at config
        # time (strategy.check_engine: train, config, info and eval ask it): not again here
        warn_slow_bf16(device.type, train.precision)
        note = knob_note(train, device.type)  # Triton-only knobs in a CPU compile: said, no effect
        if note:
            log.warning(note)
        self.cache = CompileCache(train.compile_cache if train.compile else "", self.is_main)
        self.ema: Ema | None = None
        # TF32 and cuDNN autotuning (process-wide; nothing on a CPU)
        apply_backend_flags(backend_flags(device.type, train.tf32, train.cudnn_benchmark))
        self.cudagraphs = train.compile and train.compile_mode in CUDAGRAPH_MODES
        # the one place that decides how the step runs: as one unit (train.capture=step; on a CPU the
        # same function eagerly), and as one CUDA graph (that unit on a GPU)
        self.whole_step = train.capture == "step"
        self.captured = self.whole_step and device.type == "cuda"
        self.amp = self.precision_part(train, device, self.captured)
        # the engine as data (issue 49): its parallelize steps, in order, on the placed model;
        # the wrapper the training step calls; whether the whole (wrapped) model is compiled
        self.steps: list[Callable[[nn.Module], None]] = []
        self.wrapper: Callable[[nn.Module], nn.Module] = lambda m: m
        self.compile_whole = True

    @property
    def master(self) -> list[torch.Tensor] | None:
        """The fp32 copies of the weights that the optimizer updates (None: it updates them)."""
        return self.amp.master

    # -- set-up ---------------------------------------------------------------------------------
    def place(self, model: nn.Module) -> None:
        """Move (and cast, for pure half) the model to this strategy's device; its conv weights
        to channels-last memory when train.channels_last."""
        model.to(self.device)
        self.amp.place(model)
        if self.cfg.channels_last:
            model.to(memory_format=torch.channels_last)  # pyright: ignore[reportCallIssue] (torch stubs)

    def setup(self, model: nn.Module) -> None:
        """The one set-up every engine but DeepSpeed (its own adapter) runs: place and cast, the
        EMA copy, activation checkpointing, then the engine's parallelize steps in their order
        (`steps`: parallel.py's, none here), the optimizer over the parameters they leave, and the
        wrapper the training step calls (`wrapper`: DDP's, none here), compiled whole unless the
        steps compiled the blocks."""
        self.place(model)
        if self.cfg.fp8 != "none":  # the blocks' Linear layers in float8 (torchao); same parameters
            convert_fp8(model, self.cfg.fp8)
        if self.cfg.ema_decay > 0:
            self.ema = Ema(model, self.cfg.ema_decay, self.device, self.cfg.ema_warmup)
        apply_ac(model, self.cfg.activation_checkpointing)
        for step in self.steps:
            step(model)
        groups = optimizer_groups(model, self.optim_cfg)
        groups = self.amp.optimizer_groups(groups)  # pure_* with master weights: fp32 copies
        self.optimizer = build_optimizer(
            model,
            self.optim_cfg,
            params=groups,
            capturable=self.captured,
            lr=self.lr,
            whole=on_whole_matrix,  # Muon's sharded matrices made whole
        )
        self.module = model  # plain module: checkpoints, export, eval
        wrapped = self.wrapper(model)
        # compiled: an OptimizedModule, an nn.Module whose forward is the compiled one (with the
        # train.inductor_* options, and the Mega Cache loaded first where train.compile_cache names it)
        compiled = self.cfg.compile and self.compile_whole
        self.cache.load()
        kw = compile_args(self.cfg)
        self.model = cast(nn.Module, torch.compile(wrapped, **kw)) if compiled else wrapped

    def setup_eval(self, model: nn.Module) -> None:
        """Place and cast a model for evaluation only (no optimizer, no wrapper): `vitscale eval`."""
        self.place(model)
        self.module = self.model = model

    # -- the step -------------------------------------------------------------------------------
    def autocast(self):
        """Entered once per micro-batch forward: with CUDA graphs (train.compile_mode), it also
        marks the start of a new step, so that the graphs' output buffers may be reused."""
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return self.amp.autocast()

    def layout(self, x: torch.Tensor) -> torch.Tensor:
        """Images in channels-last memory when train.channels_last (other tensors unchanged)."""
        return (
            x.contiguous(memory_format=torch.channels_last)
            if self.cfg.channels_last and x.ndim == 4
            else x
        )

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        return self.amp.prepare(self.layout(x))

    def no_sync(self):
        """Context for accumulation micro-steps that must not communicate (no-op on one device)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.amp.backward(loss)

    def step(self) -> dict:
        """Unscale, clip, update, zero grads. Returns {'grad_norm': 0-dim tensor, 'skipped': bool
        or 0-dim bool tensor}, left on the device: the loop reads them at its log steps, so that
        the step itself never waits for the GPU (fp16 with EMA is the exception: whether to
        average the weights is decided on the host)."""
        norm, skipped = self.amp.step(self.optimizer, self.optim_cfg.grad_clip)
        self.optimizer.zero_grad(set_to_none=True)
        self.cache.saved()  # train.compile_cache: written once, after the first step compiled
        if self.ema is not None and not bool(skipped):
            self.ema.update(self.module)
        return {"grad_norm": norm.detach(), "skipped": skipped}

    def sync_buffers(self) -> None:
        """One process: its buffers are the saved ones."""

    def eval_module(self) -> nn.Module:
        """The weights to evaluate: the EMA copy when EMA is on and chosen, else the model."""
        return self.ema.module if (self.ema is not None and self.cfg.ema_eval) else self.module

    @staticmethod
    def _local_bytes(t: torch.Tensor) -> int:
        t = local_part(t)
        return t.numel() * t.element_size()

    def local_tensors(self, p: torch.Tensor) -> list[torch.Tensor]:
        """The tensors this rank holds of parameter `p` (its shard of a sharded DTensor)."""
        return [local_part(p)]

    def param_bytes(self, p: torch.Tensor) -> int:
        """Bytes this rank holds of parameter `p`."""
        return sum(self._local_bytes(t) for t in self.local_tensors(p))

    def held_tensors(self):
        """Every floating-point tensor of the training state this rank holds: parameters (local
        shards), fp32 masters, optimizer state and EMA weights."""
        for p in self.module.parameters():
            yield from self.local_tensors(p)
        state = [
            v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)
        ]
        ema = list(self.ema.module.parameters()) if self.ema is not None else []
        for t in [*(self.master or []), *state, *ema]:
            yield local_part(t)

    def count_nonfinite(self) -> int:
        """Collective: how many tensors of the training state, over all ranks, hold a NaN or an
        infinity. One reduction per tensor and one read: for checkpoints, never per step."""
        flags = [
            (~torch.isfinite(t).all()).to(self.device)
            for t in self.held_tensors()
            if t.is_floating_point() and t.numel()
        ]
        n = torch.stack(flags).float().sum() if flags else torch.zeros((), device=self.device)
        return int(self.all_reduce_sum(n).item())

    def state_bytes(self) -> dict:
        """Bytes this rank holds in parameters (local shards), fp32 master copies and optimizer
        state; gradients, while they exist, take as many bytes as the parameters."""
        local = self._local_bytes
        return {
            "params": sum(self.param_bytes(p) for p in self.module.parameters()),
            "master_params": sum(local(m) for m in self.master or []),
            "optimizer_state": sum(
                local(v)
                for st in self.optimizer.state.values()
                for v in st.values()
                if torch.is_tensor(v) and v.ndim
            ),
        }

    # -- checkpoint state -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **self.amp.state_dict(),  # the loss scaler, the fp32 masters
        }
        if self.ema is not None:
            sd["ema"] = self.ema.state_dict()
        return sd

    # no engine folder of its own next to step_N.pt (DeepSpeed: ".ds", FSDP2 sharded: ".dcp")
    engine_suffix: str | None = None

    def param_names(self) -> list[str]:
        """The name of each parameter the optimizer updates, in the optimizer's order."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        params = (
            self.amp.model_params
            if self.master is not None
            else [p for g in self.optimizer.param_groups for p in g["params"]]
        )
        return [names[id(p)] for p in params]

    def save_engine(self, path) -> None:
        """Nothing to write: everything is in step_N.pt (engine_suffix is None)."""

    def load_engine(self, path) -> None:
        """Resume from FSDP2's sharded checkpoint folder (step_N.dcp): consolidated in this
        process, optimizer state renumbered from parameter names."""
        from .resume import read_dcp

        self.load_state_dict(read_dcp(path))

    def load_state_dict(self, sd: dict) -> None:
        from ..checkpoint import optim_keyed_by_name, optim_state_by_index

        if "model" in sd:  # absent when an engine folder held it (load_engine)
            self.module.load_state_dict(sd["model"])
            osd = sd["optimizer"]
            if optim_keyed_by_name(osd):  # written by FSDP2: keyed by parameter name
                osd = optim_state_by_index(osd, self.param_names())
            self.optimizer.load_state_dict(osd)
            if self.whole_step:  # a run saved uncaptured: the step counts to the device
                for st in self.optimizer.state.values():
                    if torch.is_tensor(st.get("step")):
                        st["step"] = st["step"].to(self.device)
        self.amp.load_state_dict(sd, self.param_names() if self.master is not None else [])
        if self.ema is not None and "ema" in sd:
            self.ema.load_state_dict(sd["ema"])
