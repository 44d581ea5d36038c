"""The verbs a strategy offers the loop. Engines (DDP, FSDP2, DeepSpeed) implement the same set."""
from __future__ import annotations

from typing import ContextManager, Protocol

import torch
from torch import nn


class Strategy(Protocol):
    name: str
    device: torch.device
    model: nn.Module          # what the training step calls (wrapped / compiled)
    module: nn.Module         # the plain model: checkpoints, export
    optimizer: torch.optim.Optimizer

    def setup(self, model: nn.Module) -> None:
        """Place, cast, wrap and compile the model; build the optimizer (and EMA)."""

    def autocast(self) -> ContextManager:
        """Context for forward + loss (mixed precision where the strategy uses autocast)."""

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Cast a batch of inputs to what the model expects (e.g. half weights)."""

    def no_sync(self) -> ContextManager:
        """Context for accumulation micro-steps that must not communicate gradients."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch loss (scaled where a loss scaler is used)."""

    def step(self) -> dict:
        """Clip, update, zero gradients; returns {'grad_norm': float, 'skipped': bool}."""

    def comm_window(self) -> ContextManager:
        """Context around a training step: the collectives issued inside are counted."""

    def comm_stats(self, steps: int) -> dict:
        """Bytes moved and time spent in collectives since the last call, per optimizer step."""

    def eval_module(self) -> nn.Module:
        """The weights to evaluate (EMA ones when chosen)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...

    # an engine that keeps its big state in a folder of its own next to step_N.pt names the
    # folder's suffix (DeepSpeed ".ds", FSDP2 sharded ".dcp"); None: everything is in the .pt
    engine_suffix: str | None

    def save_engine(self, path):
        """Collective: write the engine folder `path` (only when engine_suffix is set); old folders
        are pruned with their step_N.pt."""

    def load_engine(self, path) -> None:
        """Collective: restore from an engine folder written next to a checkpoint (before
        load_state_dict, which then loads what the .pt holds)."""
