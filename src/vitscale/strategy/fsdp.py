"""FSDP2 (`fully_shard`): every transformer block sharded (with `train.compile`, its forward
compiled in place first, so parameter names do not change), then the root; parameters, gradients
and optimizer state split across ranks. Precision comes from a MixedPrecisionPolicy (bf16
parameters for compute, fp32 gradient reduction by default), not from autocast.

Checkpoints (`strategy.checkpoint_format`):
- "full" (default): the full (unsharded) model and optimizer state, gathered on every rank's CPU
  through `torch.distributed.checkpoint.state_dict`, written by the main process into step_N.pt.
- "sharded": every rank writes its own shards with `torch.distributed.checkpoint` (`dcp.save` of
  the sharded model and optimizer state dicts) into the folder step_N.dcp (written under a temp
  name, renamed by the main process once complete, keep-last-N like the .pt files); step_N.pt
  then holds only the small state (config, RNG, schedule, step). Nothing is ever gathered: for
  models too large for one host's memory.
Either resumes under any world size (DCP re-shards on load) and under the single-device and DDP
strategies, and FSDP2 resumes their checkpoints: the optimizer state is keyed by parameter name
here, by index there, and `load_state_dict` / SingleDevice convert. `vitscale eval` / `export`
consolidate a sharded folder in one process.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint.state_dict_loader as dcp_loader
import torch.distributed.checkpoint.state_dict_saver as dcp_saver
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    OffloadPolicy,
)

from ..checkpoint import optim_keyed_by_name, optim_state_by_name
from ..compiling import compile_args
from ..errors import ConfigError, UserError
from .amp import MeshPrecision
from .comm import COUNTER
from .dist import Distributed
from .mesh import DIMS, build_mesh, dp_group, mesh_shape
from .parallel import apply_compile, apply_fsdp, apply_tp

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def named(model: nn.Module, method: str, what: str):
    """The model's own `method` (shard_units, tp_plan); a model without it is refused in one line."""
    found = getattr(model, method, None)
    if found is None:
        raise ConfigError(
            f"{what}: {type(model).__name__} has no {method}() method naming its parts"
        )
    return found


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules the model names as its shard units (`model.shard_units()`: its transformer
    blocks); a model without them is refused in one line (FSDP2 would shard it as one unit)."""
    return named(model, "shard_units", "strategy.name=fsdp")()


def fsdp_refusal(train, name: str = "fsdp") -> str | None:
    """What FSDP2's mesh engine does not support of the train section, in one line, or None
    (strategy.check_engine: every command that checks a config asks it)."""
    unsupported = [
        key
        for key, on in (
            ("train.ema_decay", train.ema_decay > 0),
            ("train.precision=fp16", train.precision == "fp16"),
            (f"train.precision={train.precision}", train.precision.startswith("pure_")),
            # FSDP2's bf16 gathers bf16 weights: its norms and residual stream are bf16 already
            (
                "train.precision=bf16_act (its bf16: bf16 norms and stream)",
                train.precision == "bf16_act",
            ),
            (f"train.fp8={train.fp8}", train.fp8 != "none"),
        )
        if on
    ]
    return (
        (
            f"config: strategy.name={name} does not support {', '.join(unsupported)} yet "
            f"(use strategy.name=ddp{' with strategy.tp=1' if name == 'ddp' else ''} or single)"
        )
        if unsupported
        else None
    )


def dcp_layout(tree):
    """`tree` with every DTensor that has a strided shard (_StridedShard) replicated on that mesh
    dimension: a layout DCP can store (chunks at offsets) and reshard on load."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(tree, dict):
        return {k: dcp_layout(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [dcp_layout(v) for v in tree]
    if isinstance(tree, DTensor) and any(isinstance(p, _StridedShard) for p in tree.placements):
        placements = [Replicate() if isinstance(p, _StridedShard) else p for p in tree.placements]
        return tree.redistribute(placements=placements)
    return tree


class FSDPStrategy(Distributed):
    """FSDP2 on a device mesh (strategy/mesh.py): shards, replicas of shard groups (HSDP) and
    tensor parallelism, built by the parallelize pipeline (strategy/parallel.py)."""

    name = "fsdp"
    no_sync_defers_comm = gathers_in_forward = forward_is_collective = True
    precision_part = MeshPrecision  # FSDP2's MixedPrecisionPolicy, not autocast
    amp: MeshPrecision

    def __init__(self, train, optim, scfg, device_type, lr: float | None = None):
        # offloaded shards are CPU DTensors: the gradient norm's full_tensor() and the full state
        # dict are collectives on CPU tensors, which NCCL cannot run (group_backend adds gloo)
        self.cpu_collectives = scfg.cpu_offload
        super().__init__(train, optim, scfg, device_type, lr=lr)
        self.name = scfg.name if scfg.name in ("fsdp", "hsdp") else self.name
        self.shape = shape = mesh_shape(scfg, self.world_size)
        self.mesh = build_mesh(shape, self.device.type)
        # the collectives counted per mesh dimension too (comm.py): tp, dp_shard, dp_replicate
        COUNTER.name_groups(
            {d: self.mesh[d].get_group() for d, n in zip(DIMS, shape.sizes) if n > 1}
        )
        self.dp_group = dp_group(shape)
        self.dp_rank, self.dp_size = shape.dp_rank(self.rank), shape.dp
        self.tp = shape.tp > 1
        # the precision part for this mesh: FSDP2's policy, and the tensor-parallel context
        self.amp = MeshPrecision(train, self.device, self.captured, tp=self.tp)
        # sharded checkpoints: the loop calls save_engine(step_N.dcp) before writing step_N.pt
        self.engine_suffix = ".dcp" if scfg.checkpoint_format == "sharded" else None
        # the engine as data: after activation checkpointing (single.py's set-up), the tensor-
        # parallel plan, each block compiled, then FSDP2; the optimizer is built over the shards
        self.steps = [self.tp_step, self.compile_step, self.shard_step]
        self.compile_whole = False

    def tp_step(self, model: nn.Module) -> None:
        """The model's tensor-parallel plan (models/layers.py: Block.tp_plan) over tp."""
        if self.tp:
            sp = self.scfg.sequence_parallel
            plan = named(model, "tp_plan", "strategy.tp > 1")(sp)
            apply_tp(model, self.mesh["tp"], plan, sp)

    def compile_step(self, model: nn.Module) -> None:
        apply_compile(shard_units(model), self.cfg.compile, compile_args(self.cfg))

    def shard_step(self, model: nn.Module) -> None:
        """FSDP2 over the data-parallel mesh, with the precision part's policy."""
        offload = CPUOffloadPolicy() if self.scfg.cpu_offload else OffloadPolicy()
        kw: dict[str, Any] = dict(
            mp_policy=self.amp.policy(self.scfg.reduce_dtype),
            offload_policy=offload,
            reshard_after_forward=self.scfg.reshard_after_forward,
        )
        apply_fsdp(model, shard_units(model), self.dp_mesh, **kw)

    @property
    def dp_mesh(self):
        """FSDP2's mesh: the shard dimension, or replicate x shard (HSDP) where there are replicas."""
        names = ("dp_replicate", "dp_shard") if self.shape.dp_replicate > 1 else ("dp_shard",)
        return self.mesh[names]

    def no_sync(self):
        @contextlib.contextmanager
        def ctx():
            model = self.model
            assert isinstance(model, FSDPModule)  # fully_shard() made the root one in setup
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return ctx()

    def eval_module(self) -> nn.Module:
        return self.module

    def state_dict(self) -> dict:
        """Collective. Full format: every rank gathers, the full tensors land on the CPU. Sharded:
        only the small state (the shards went to save_engine's folder)."""
        if self.engine_suffix:
            return {"format": "sharded"}
        return {
            "model": get_model_state_dict(self.model, options=FULL),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=FULL),
        }

    def load_state_dict(self, sd: dict) -> None:
        """A full state: this strategy's, or single/DDP's (index-keyed optimizer state, renamed)."""
        if "model" in sd:  # absent when load_engine restored the sharded folder
            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
            set_model_state_dict(self.model, sd["model"], options=opts)
            osd = sd["optimizer"]
            if not optim_keyed_by_name(osd):  # single / DDP: numbered in the same optimizer order
                osd = optim_state_by_name(osd, self.param_names())
            set_optimizer_state_dict(self.model, self.optimizer, osd, options=opts)

    def _sharded_state(self) -> dict:
        """The sharded model and optimizer state as DCP writes and reads it: a tensor-parallel
        strided shard (the fused q, k, v weight and its moments) replicated over the tp dimension,
        since DCP stores contiguous chunks only (loading copies it back into the strided shard)."""
        state = {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
        }
        return {k: dcp_layout(v) for k, v in state.items()}

    def save_engine(self, path: str | Path) -> Path:
        """Collective: every rank writes its shards (torch.distributed.checkpoint) into the folder
        `path` (step_N.dcp), atomically (Distributed.write_folder)."""
        return self.write_folder(
            path, lambda tmp: dcp_saver.save(self._sharded_state(), checkpoint_id=str(tmp))
        )

    def load_engine(self, path: str | Path) -> None:
        """Collective: load a step_N.dcp folder into this run's shards (any world size: DCP
        re-shards)."""
        path = Path(path)
        if path.suffix != ".dcp" or not (path / ".metadata").is_file():
            raise UserError(
                f"sharded checkpoint folder not found or incomplete: {path} (expected the "
                "step_N.dcp folder written next to the .pt checkpoint)"
            )
        sd = self._sharded_state()
        dcp_loader.load(sd, checkpoint_id=str(path))
        set_model_state_dict(self.model, sd["model"])
        set_optimizer_state_dict(self.model, self.optimizer, sd["optimizer"])
