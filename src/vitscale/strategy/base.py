"""The verbs a strategy offers the loop. Engines (DDP, FSDP2, DeepSpeed) implement the same set."""

from __future__ import annotations

from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn


class GradCheckpointing(Protocol):
    """A model that recomputes its blocks' activations in backward (train.activation_checkpointing):
    vitscale's models (models/vit.py, models/clip.py)."""

    def set_grad_checkpointing(self, enable: bool = True) -> None: ...


class Strategy(Protocol):
    """Every member the trainer, the tasks, `vitscale eval` and the lab use. SingleDevice
    (single.py) implements all of them; Distributed (dist.py) adds the process group, DDP, FSDP2
    and DeepSpeed override what their engine does differently. Nothing outside this package
    names an engine or reads an engine's internals: facts such as DeepSpeed's partitioned
    tensors reach the trainer through these methods (e.g. `state_bytes`)."""

    name: str
    device: torch.device
    model: nn.Module  # what the training step calls (wrapped / compiled)
    module: nn.Module  # the plain model: checkpoints, export
    optimizer: torch.optim.Optimizer

    # -- the process group (one process: rank 0 of 1) -------------------------------------------
    rank: int
    world_size: int
    is_main: bool
    # the data-parallel index, count and process group (None: the world): the mesh's replicate x
    # shard points; the ranks of one tensor-parallel group share them and see the same batches
    dp_rank: int
    dp_size: int
    dp_group: Any

    def all_reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks, in place (each tensor-parallel group once)."""
        ...

    def gather_dp(self, obj) -> list:
        """Every data-parallel rank's picklable `obj`, in order, on every rank."""
        ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (bookkeeping: not counted as the engine's communication)."""
        ...

    def gather_objects(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order, on every rank."""
        ...

    def broadcast_object(self, obj):
        """The main process's `obj` on every rank."""
        ...

    def close(self) -> None:
        """Leave the process group cleanly (after a successful run)."""
        ...

    # -- set-up ---------------------------------------------------------------------------------
    def setup(self, model: nn.Module) -> None:
        """Place, cast, wrap and compile the model; build the optimizer (and EMA)."""
        ...

    def setup_eval(self, model: nn.Module) -> None:
        """Place and cast a model for evaluation only (`vitscale eval`): no optimizer, no wrapper."""
        ...

    def autocast(self) -> ContextManager:
        """Context for forward + loss (mixed precision where the strategy uses autocast)."""
        ...

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Cast a batch of inputs to what the model expects (e.g. half weights)."""
        ...

    def no_sync(self) -> ContextManager:
        """Context for accumulation micro-steps that must not communicate gradients."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch loss (scaled where a loss scaler is used)."""
        ...

    def step(self) -> dict:
        """Clip, update, zero gradients; returns {'grad_norm', 'skipped'}: floats / bools or
        0-dim tensors left on the device (the loop reads them only at log steps: no host sync)."""
        ...

    def comm_window(self) -> ContextManager:
        """Context around a training step: the collectives issued inside are counted."""
        ...

    def comm_stats(self, steps: int) -> dict:
        """Bytes moved and time spent in collectives since the last call, per optimizer step."""
        ...

    def eval_module(self) -> nn.Module:
        """The weights to evaluate (EMA ones when chosen)."""
        ...

    def sync_buffers(self) -> None:
        """Collective: the main process's buffers (BatchNorm statistics) in the model and the
        evaluated weights of every rank, so that what each rank evaluates is what is saved."""
        ...

    # what the lab's step split needs to know: no_sync() keeps gradient communication out of
    # backward (DDP, FSDP2); parameters are all-gathered inside forward (FSDP2)
    no_sync_defers_comm: bool
    gathers_in_forward: bool
    # every rank must take part in every forward (FSDP2, ZeRO-3 gather parameters there): a rank
    # whose evaluation shard is shorter runs padding forwards (never on an empty batch)
    forward_is_collective: bool
    # how the step runs, decided here only: as one unit (train.capture=step: capture.WholeStep),
    # and that unit as one CUDA graph (on a GPU; on a CPU the same function eagerly)
    whole_step: bool
    captured: bool
    # the optimizer's base lr (optim.lr scaled to the global batch: build_strategy); its param groups
    # own the lr once built, the schedule moves it there
    lr: float

    def state_bytes(self) -> dict:
        """Bytes this rank holds: {'params', 'master_params', 'optimizer_state'} (local shards)."""
        ...

    def count_nonfinite(self) -> int:
        """Collective: how many tensors of the training state (weights, masters, optimizer state,
        EMA; every rank's shards) hold a NaN or an infinity; called when a checkpoint is written or
        an evaluation runs, never per step."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...

    # an engine that keeps its big state in a folder of its own next to step_N.pt names the
    # folder's suffix (DeepSpeed ".ds", FSDP2 sharded ".dcp"); None: everything is in the .pt
    engine_suffix: str | None

    def save_engine(self, path: str | Path) -> Path | None:
        """Collective: write the engine folder `path` (only when engine_suffix is set; returns it,
        or None where nothing is written); old folders are pruned with their step_N.pt."""
        ...

    def load_engine(self, path: str | Path) -> None:
        """Collective: restore from an engine folder written next to a checkpoint (before
        load_state_dict, which then loads what the .pt holds)."""
        ...
