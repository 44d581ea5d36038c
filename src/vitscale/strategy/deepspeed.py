"""DeepSpeed ZeRO (stages 0-3): optimizer state, gradients and parameters sharded by DeepSpeed's
engine, precision (fp32 / bf16 / fp16 on GPUs) from the ds_config this strategy writes.

- The ds_config comes from the vitscale config (batch, accumulation, clipping, ZeRO stage,
  offload, diagnostics); `strategy.ds_config` names a JSON file merged over it (its keys win,
  then the batch keys are checked against the vitscale config).
- The optimizer is vitscale's own (`build_optimizer` + `param_groups`, so the no-weight-decay
  groups hold) handed to `deepspeed.initialize`: no FusedAdam compile, and the same arithmetic
  as the single-process run. The LR schedule stays vitscale's LambdaLR on that optimizer;
  DeepSpeed gets no scheduler, so nothing else steps it.
- Accumulation: the loop divides each micro-batch loss by accum_steps, so `backward` calls
  `engine.backward(loss, scale_wrt_gas=False)`; this strategy tells the engine which micro-batch
  ends the accumulation (`set_gradient_accumulation_boundary`), so the loop's single `step()`
  per global batch is DeepSpeed's one optimizer step.
- Checkpoints: `state_dict()` holds the consolidated fp32 weights under "model" (plain keys,
  full tensors: `vitscale eval` / `export` read them); the resumable state (partitioned optimizer
  state, fp32 masters) is DeepSpeed's own checkpoint folder, written by `save_engine(dir)` and
  read by `load_engine(dir)`, which the loop calls next to its .pt file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

from ..compiling import compile_args
from ..config import OptimConfig, StrategyConfig, TrainConfig
from ..errors import ConfigError, UserError
from ..optim import build_optimizer, param_groups, with_lr
from .amp import DeepSpeedPrecision
from .base import GradCheckpointing
from .devices import backend_for
from .dist import Distributed, env_world, free_port, launched

if TYPE_CHECKING:  # DeepSpeed is optional: imported when setup() builds the engine
    from deepspeed import DeepSpeedEngine

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`, recursively for dicts (over's keys win)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_user_config(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config: strategy.ds_config: file not found: {path}")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config: strategy.ds_config: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: strategy.ds_config: {path} must hold a JSON object")
    return data


def build_ds_config(
    train: TrainConfig,
    optim: OptimConfig,
    scfg: StrategyConfig,
    batch_size: int,
    world: int,
    device_type: str,
) -> dict:
    """The ds_config for this run: generated from the vitscale config, the user's file merged over
    it, then checked. Raises ConfigError (one line) on a conflict."""
    A = train.accum_steps
    micro = batch_size // (world * A)  # it splits evenly: the Trainer checked (config.micro_batch)
    stage = scfg.zero_stage
    zero: dict = {"stage": stage}
    if scfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device_type == "cuda"}
    if scfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": device_type == "cuda"}
    cfg = {
        "train_batch_size": batch_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": A,
        "gradient_clipping": optim.grad_clip,  # DeepSpeed's default is 1.0: always explicit
        "zero_optimization": zero,
        **DeepSpeedPrecision.ds_keys(train),  # bf16 / fp16 and the loss scale: the precision part's
        "zero_allow_untested_optimizer": True,  # SGD: elementwise, exact on flat shards
        "zero_force_ds_cpu_optimizer": False,  # offload may step a torch optimizer
        "steps_per_print": 2**31 - 1,  # vitscale logs its own metrics
        "wall_clock_breakdown": scfg.wall_clock_breakdown,
        "comms_logger": {"enabled": scfg.comms_logger, "verbose": False, "prof_all": True},
        "flops_profiler": {"enabled": scfg.flops_profiler, "profile_step": 2, "detailed": False},
    }
    if scfg.wall_clock_breakdown:
        cfg["steps_per_print"] = 50
    if scfg.ds_config:
        user = read_user_config(scfg.ds_config)
        for key, why in (
            ("optimizer", "the optimizer is built from [optim]"),
            ("scheduler", "the LR schedule is vitscale's (optim.schedule), stepped by the loop"),
        ):
            if key in user:
                raise ConfigError(
                    f"config: strategy.ds_config: remove '{key}' from {scfg.ds_config} ({why})"
                )
        cfg = merge(cfg, user)
    check_ds_config(cfg, train, scfg, batch_size, world, device_type)
    return cfg


def check_ds_config(
    cfg: dict,
    train: TrainConfig,
    scfg: StrategyConfig,
    batch_size: int,
    world: int,
    device_type: str,
) -> None:
    src = f"strategy.ds_config ({scfg.ds_config})" if scfg.ds_config else "the ds_config"
    want = {
        "train_batch_size": (batch_size, "data.batch_size"),
        "gradient_accumulation_steps": (train.accum_steps, "train.accum_steps"),
        "train_micro_batch_size_per_gpu": (
            batch_size // (world * train.accum_steps),
            f"data.batch_size / (processes ({world}) x train.accum_steps)",
        ),
    }
    for key in BATCH_KEYS:
        if cfg.get(key) != want[key][0]:
            raise ConfigError(
                f"config: {src}: {key}={cfg.get(key)!r} conflicts with {want[key][1]} = "
                f"{want[key][0]} (set the batch in the vitscale config; the loop splits it)"
            )
    for half in ("bf16", "fp16"):
        on = bool(cfg.get(half, {}).get("enabled", False))
        if on != (train.precision == half):
            raise ConfigError(
                f"config: {src}: {half}.enabled={str(on).lower()} conflicts with "
                f"train.precision={train.precision} (choose the precision in [train])"
            )
    zero = cfg.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"config: {src}: zero_optimization.stage must be 0-3, got {stage!r}")
    if zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None) and stage == 0:
        raise ConfigError("config: strategy.offload_optimizer needs strategy.zero_stage >= 1")
    if zero.get("offload_param", {}).get("device", "none") not in ("none", None) and stage != 3:
        raise ConfigError("config: strategy.offload_params needs strategy.zero_stage=3")


def disable_shm_comm_op() -> None:
    """DeepSpeed's CPU accelerator compiles a shared-memory all-reduce op (35-115 s) at every
    communication init; only tensor-parallel inference (`inference_all_reduce`) uses it. Marking
    it incompatible in `deepspeed.ops.__compatible_ops__`, the table `build_shm_op` consults (a
    module dict that keeps edits), skips the build; training communicates through the torch
    process group (gloo) as before. No environment variable or ds_config key turns it off."""
    import deepspeed.ops as ops

    table = ops.__compatible_ops__  # probes the ops once (cheap compiler checks), then cached
    table["deepspeed_shm_comm"] = False


def deepspeed_refusal(
    train: TrainConfig, optim: OptimConfig, device_type: str, stage: int
) -> str | None:
    """What DeepSpeed does not support of the config at ZeRO `stage`, in one line, or None
    (strategy.check_engine: every command that checks a config asks it)."""
    refused = [
        why
        for why, on in (
            (
                "train.precision=fp16 on CPU (fp16 matmul has no fast path there; use bf16)",
                train.precision == "fp16" and device_type != "cuda",
            ),
            (
                f"train.precision={train.precision} (DeepSpeed's bf16, train.precision=bf16, already keeps "
                "bf16 weights with fp32 master weights in the optimizer)",
                train.precision.startswith("pure_"),
            ),
            (
                "train.precision=bf16_act (DeepSpeed's bf16 holds bf16 weights: its norms and residual "
                "stream are bf16 already; use train.precision=bf16)",
                train.precision == "bf16_act",
            ),
            (
                "train.ema_decay > 0 (no EMA of ZeRO-sharded weights; use strategy.name=ddp or single)",
                train.ema_decay > 0,
            ),
            (
                f"train.fp8={train.fp8} (its partitioned weights are not float8-converted; use strategy.name=ddp "
                "or single)",
                train.fp8 != "none",
            ),
            (
                f"optim.name=lamb with ZeRO stage {stage} (LAMB's per-tensor trust ratio would see flat "
                "shards; use strategy.zero_stage=0)",
                optim.name == "lamb" and stage > 0,
            ),
            (
                "optim.name=muon (ZeRO flattens and partitions the parameters, Muon orthogonalises "
                "whole matrices; use strategy.name=fsdp or hsdp, where Muon gathers each sharded one)",
                optim.name == "muon",
            ),
        )
        if on
    ]
    return f"config: strategy.name=deepspeed does not support {refused[0]}" if refused else None


def checked_ds_config(
    train: TrainConfig, optim: OptimConfig, scfg: StrategyConfig, batch_size: int, device_type: str
) -> dict:
    """The run's DeepSpeed config for this launch's processes, or a one-line ConfigError: its own
    conflicts (build_ds_config), then what DeepSpeed does not support at its ZeRO stage."""
    ds = build_ds_config(train, optim, scfg, batch_size, env_world()[1], device_type)
    refusal = deepspeed_refusal(train, optim, device_type, ds["zero_optimization"].get("stage", 0))
    if refusal:
        raise ConfigError(refusal)
    return ds


def import_deepspeed(device_type: str, scfg: StrategyConfig):
    """deepspeed, imported for this device (its accelerator checked), quiet unless one of its own
    reports is asked; a one-line ConfigError where it is not installed or runs elsewhere."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # also on a GPU machine with run.device=cpu
    try:
        import deepspeed
    except ImportError as e:
        raise ConfigError(
            "config: strategy.name=deepspeed needs DeepSpeed: "
            "DS_BUILD_OPS=0 pip install 'vitscale[deepspeed]' "
            f"({type(e).__name__}: {e})"
        ) from None
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    assert accelerator is not None  # get_accelerator() makes one when none is set yet
    if accelerator.device_name() != device_type:
        raise ConfigError(
            f"config: DeepSpeed runs on its '{accelerator.device_name()}' accelerator but "
            f"the run wants {device_type} (set DS_ACCELERATOR={device_type})"
        )
    if not (scfg.wall_clock_breakdown or scfg.comms_logger or scfg.flops_profiler):
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its config dump, timers
    disable_shm_comm_op()
    # DeepSpeed calls these collectives on every ZeRO step; torch 2.13 warns each time
    warnings.filterwarnings(
        "ignore",
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
        "is deprecated",
        FutureWarning,
    )
    return deepspeed


@contextlib.contextmanager
def refused_writes(engine):
    """While DeepSpeed saves: its file writes (the checkpoint engine's `save`, the recovery
    scripts' copy) through a Python file, so that a full disk is an OSError with its errno (not
    torch's C++ writer's bare RuntimeError), and recorded in the list this yields instead of raised:
    a rank that raised would leave the others waiting in DeepSpeed's barrier. Once one write is
    refused, this rank writes nothing more of the save."""
    refused: list[OSError] = []
    ckpt_engine = engine.checkpoint_engine
    plain = type(ckpt_engine).__name__ == "TorchCheckpointEngine"  # torch.save to a path
    zipfile = getattr(ckpt_engine, "zipfile_serialization", True)
    real_save, real_copy = ckpt_engine.save, engine._copy_recovery_script

    def save(state_dict, path, *args, **kwargs) -> None:
        if refused:
            return
        try:
            if not plain:
                return real_save(state_dict, path, *args, **kwargs)
            with open(path, "wb") as f:
                torch.save(state_dict, f, _use_new_zipfile_serialization=zipfile)
        except OSError as e:
            refused.append(e)

    def copy_scripts(save_path) -> None:
        if not refused:
            try:
                real_copy(save_path)
            except OSError as e:
                refused.append(e)

    ckpt_engine.save, engine._copy_recovery_script = save, copy_scripts
    try:
        yield refused
    finally:  # DeepSpeed's own methods back (the instance attributes go)
        del ckpt_engine.save, engine._copy_recovery_script


class DeepSpeedStrategy(Distributed):
    name = "deepspeed"
    precision_part = DeepSpeedPrecision  # the ds_config's precision keys and the input dtype
    amp: DeepSpeedPrecision
    engine_suffix: str | None = ".ds"  # the loop calls save_engine(step_N.ds) before step_N.pt
    model: nn.Module  # the engine once set up, typed as base.Strategy declares it (an nn.Module)

    def __init__(
        self,
        train: TrainConfig,
        optim: OptimConfig,
        scfg: StrategyConfig,
        device_type: str,
        batch_size: int,
        lr: float | None = None,
    ):
        self.ds_config = checked_ds_config(train, optim, scfg, batch_size, device_type)
        self.stage = self.ds_config["zero_optimization"].get("stage", 0)
        self.forward_is_collective = self.stage == 3  # ZeRO-3's hooks gather parameters in forward
        # launched (torchrun / deepspeed): join that group; else one process without a launcher
        # (one GPU with offload), whose group setup() makes for the engine
        super().__init__(train, optim, scfg, device_type, join=launched(), lr=lr)
        self.engine: DeepSpeedEngine | None = None  # built by setup()
        self._micro = 0

    @property
    def ds_engine(self) -> DeepSpeedEngine:
        """The engine setup() built (a RuntimeError before setup)."""
        if self.engine is None:
            raise RuntimeError("deepspeed strategy: the engine is built by setup(), not called yet")
        return self.engine

    # -- set-up ---------------------------------------------------------------------------------
    def _ensure_process_group(self) -> None:
        if dist.is_initialized():
            return
        os.environ.setdefault("LOCAL_RANK", "0")  # ZeRO-3 reads it
        dist.init_process_group(
            backend_for(self.device.type, self.scfg.backend),
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
        )

    def setup(self, model: nn.Module) -> None:
        deepspeed = import_deepspeed(self.device.type, self.scfg)
        self._ensure_process_group()
        self.place(model)
        if self.cfg.activation_checkpointing:
            cast(GradCheckpointing, model).set_grad_checkpointing(True)
        groups = param_groups(model, self.optim_cfg.weight_decay, self.optim_cfg.layer_decay)
        if (
            self.scfg.offload_optimizer
            and self.device.type == "cuda"
            and self.optim_cfg.name == "adamw"
        ):
            # the optimizer steps on the CPU: DeepSpeed's vectorized CPU Adam (compiled once, ~1 min)
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            o = self.optim_cfg
            optimizer = DeepSpeedCPUAdam(
                with_lr(groups, self.lr),
                lr=self.lr,
                betas=(o.beta1, o.beta2),
                eps=o.eps,
                adamw_mode=True,
            )
        else:
            optimizer = build_optimizer(model, self.optim_cfg, params=groups, lr=self.lr)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.ds_config, dist_init_required=False
        )
        self.optimizer = (
            optimizer  # the torch optimizer ZeRO steps: the loop's LambdaLR drives its lr
        )
        # the precision part takes what the engine keeps: its weights' dtype and the fp32 masters
        self.amp.adopt(self.engine, optimizer, self.stage)
        if self.cfg.compile:  # DeepSpeed's own: the wrapped module compiled, hooks kept outside
            self.cache.load()  # train.compile_cache
            self.engine.compile(compile_kwargs=compile_args(self.cfg))
        self.model = self.engine  # callable: forward through the engine (ZeRO-3 gathers parameters)
        module = self.engine.module
        assert isinstance(module, nn.Module)  # the model initialize() wrapped
        self.module = module

    # -- the step -------------------------------------------------------------------------------
    def no_sync(self):
        # the boundary is set per micro-batch in backward(); DeepSpeed's own no_sync refuses ZeRO 2/3
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch. The loop already divided the loss by accum_steps (no second scaling);
        the last of the accum_steps micro-batches is DeepSpeed's accumulation boundary."""
        self._micro += 1
        engine = self.ds_engine
        engine.set_gradient_accumulation_boundary(self._micro == self.cfg.accum_steps)
        engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> dict:
        if self._micro != self.cfg.accum_steps:
            raise RuntimeError(
                f"deepspeed strategy: step() after {self._micro} backward calls, expected "
                f"train.accum_steps={self.cfg.accum_steps}"
            )
        norm = None
        if self.stage == 0 and self.amp.input_dtype is None:
            # plain fp32 data parallel: the engine clips without keeping the norm; measure it here
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = (
                torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                if grads
                else torch.zeros(())
            )
        engine = self.ds_engine
        skipped_before = engine.skipped_steps
        engine.step()
        self.cache.saved()
        self._micro = 0
        if norm is None:
            norm = engine.get_global_grad_norm()
        # the norm stays as the engine gives it (a tensor is read at the loop's log steps)
        return {
            "grad_norm": norm if norm is not None else 0.0,
            "skipped": engine.skipped_steps != skipped_before,
        }

    def eval_module(self) -> nn.Module:
        # ZeRO-3: its hooks gather the parameters in forward (every rank runs it)
        return self.module

    def local_tensors(self, p: torch.Tensor) -> list[torch.Tensor]:
        # ZeRO-3: `p` is an empty placeholder while released; the rank's slice is `p.ds_tensor`
        # (ds_tensor: an attribute ZeRO-3 sets on the parameters it partitions)
        return super().local_tensors(p) + ([p.ds_tensor] if hasattr(p, "ds_tensor") else [])  # pyright: ignore[reportAttributeAccessIssue]

    # -- checkpoints ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict:
        """Collective: the model's fp32 weights (the optimizer's masters where ZeRO keeps them),
        full tensors with plain module keys, on the CPU (every rank gets them)."""
        from deepspeed.utils import safe_get_full_fp32_param

        names = {id(p): n for n, p in self.module.named_parameters()}
        out = {}
        for key, t in self.module.state_dict(keep_vars=True).items():
            if id(t) in names:
                full = safe_get_full_fp32_param(t)  # ZeRO 1-3 and bf16: gathered from the shards
                t = full if full is not None else t.detach().float()
            out[key] = t.detach().cpu().clone()
        return out

    def state_dict(self) -> dict:
        """Collective. "model": consolidated fp32 weights (eval/export); the optimizer state is in
        the engine checkpoint that `save_engine` writes."""
        sd = {
            "model": self.full_state_dict(),
            "zero_stage": self.stage,
            "world_size": self.world_size,
            "ds_config": self.ds_config,
        }
        if self.scfg.comms_logger:
            import deepspeed.comm as ds_comm

            ds_comm.log_summary()  # collective: communication volume and time so far, on rank 0
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if not getattr(self, "_engine_loaded", False):
            raise UserError(
                "resuming a DeepSpeed run needs its engine checkpoint: the loop must call "
                "strategy.load_engine(<checkpoint>.ds) before load_state_dict"
            )

    def save_engine(self, path: str | Path) -> Path:
        """Collective: DeepSpeed's own checkpoint (module, partitioned optimizer state, fp32
        masters; one file per rank) in the folder `path` (e.g. checkpoints/step_00000100.ds),
        atomically (Distributed.write_folder)."""
        path = Path(path)

        def write(tmp: Path) -> None:
            with refused_writes(self.ds_engine) as refused:
                self.ds_engine.save_checkpoint(str(path.parent), tag=tmp.name, save_latest=False)
            if refused:  # after DeepSpeed's own barriers, which every rank reached
                raise refused[0]

        return self.write_folder(path, write)

    def load_engine(self, path: str | Path) -> None:
        """Collective: restore the engine (weights, optimizer state) from `save_engine`'s folder.
        Same ZeRO stage and number of processes (DeepSpeed's universal checkpoint converts otherwise)."""
        path = Path(path)
        if not (path.is_dir() and any(path.glob("*model_states.pt"))):
            raise UserError(
                f"DeepSpeed engine checkpoint not found: {path} (expected the folder that "
                "save_engine wrote next to the .pt checkpoint)"
            )
        try:
            load_path, _ = self.ds_engine.load_checkpoint(
                str(path.parent),
                tag=path.name,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
            )
        except (
            Exception
        ) as e:  # e.g. another world size: ZeRO shards do not re-partition themselves
            if type(e).__name__ != "ZeRORuntimeException":
                raise
            raise UserError(
                f"cannot resume from {path}: {str(e).splitlines()[0]} (resume with the same number "
                "of processes, or convert it with DeepSpeed's ds_to_universal)"
            ) from None
        if load_path is None:
            raise UserError(f"DeepSpeed could not load the engine checkpoint {path}")
        self._engine_loaded = True
