"""The training step as a plain function built once from explicit parts (strategy, task, the
number of micro-batches): `TrainStep(batch, step, phase) -> (loss, info)`. The loop calls it, the
captured step (capture.WholeStep) wraps it, and the lab's instrumented split passes it a phase
timer: there is one copy of the micro-batch loop, here.

The non-finite watch (`FiniteWatch`) is the step's companion: it sees every loss on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from .errors import TrainingError
from .strategy.base import Strategy

Phase = Callable[[str], None]


def _no_phase(name: str) -> None:
    pass


class TrainStep:
    """One optimizer step over a batch ((images, labels) or (images, tokens, index)) split into
    `accum_steps` micro-batches. Returns (the loss, the strategy's step info), both left on the
    device: nothing here waits for the GPU (the loop reads them at log steps).

    `phase(name)`, when given, is called as each phase ends ("forward", "backward",
    "loss_reduce", "optimizer"): the lab's step split times the phases with it."""

    def __init__(self, strategy: Strategy, task, accum_steps: int):
        self.strategy, self.task, self.accum_steps = strategy, task, accum_steps

    def forward_backward(
        self, batch: tuple, phase: Phase | None = None, defer_all: bool = False
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch; the gradients stay where the strategy keeps
        them. The last micro-batch communicates its gradients (DDP, FSDP2), unless `defer_all`:
        every micro-batch under `no_sync()` (the lab's backward-compute-alone pass). Returns the
        summed loss of this process (divided by the micro-batch count, as the gradients are)."""
        s, A = self.strategy, self.accum_steps
        mark = phase or _no_phase
        total = torch.zeros((), device=batch[0].device)
        for i, micro in enumerate(zip(*(t.chunk(A) for t in batch))):
            quiet = defer_all or i < A - 1
            with s.no_sync() if quiet else contextlib.nullcontext():
                with s.autocast():
                    loss = self.task.forward_loss(s.model, micro, s.prepare) / A
                mark("forward")
                s.backward(loss)
                mark("backward")
            total += loss.detach()
        return total

    def __call__(
        self, batch: tuple, step: int | torch.Tensor | None = None, phase: Phase | None = None
    ) -> tuple[torch.Tensor, dict]:
        """The step numbered `step + 1` (`step`: the steps taken before it, as the task's
        per-step state counts them)."""
        s, mark = self.strategy, phase or _no_phase
        with s.comm_window():  # the step's collectives are counted (comm_stats)
            total = self.forward_backward(batch, phase)
            if s.world_size > 1:  # the mean over all ranks: every rank sees the same (NaN) loss
                total = s.all_reduce_sum(total) / s.world_size
                mark("loss_reduce")
            info = s.step()
            self.task.after_step(step)
            mark("optimizer")
        return total, info


class FiniteWatch:
    """Non-finite losses noticed without a host sync per step: the first bad step and its loss are
    kept on the device (a few element-wise ops per step) and read by `check()` at log steps and
    before anything is evaluated or saved, so a NaN never reaches a checkpoint."""

    def __init__(self):
        self.first = None  # device tensors: step number (-1: none yet), its loss

    def see(self, step: int | torch.Tensor, loss: torch.Tensor) -> None:
        """`step`: the step just taken (a host int, or a device counter: train.capture=step).
        In place: the same two tensors every step (a captured step replays into them)."""
        loss = loss.detach()
        if self.first is None:
            self.first = (torch.full((), -1, dtype=torch.int64, device=loss.device), loss.clone())
        first, bad_loss = self.first
        new = (first < 0) & ~torch.isfinite(loss)
        bad_loss.copy_(torch.where(new, loss, bad_loss))
        first.copy_(torch.where(new, step, first))

    def bad(self) -> tuple[int, float] | None:
        """(step, loss) of the first non-finite loss, or None (reads the device: a sync)."""
        if self.first is None:
            return None
        step = int(self.first[0])
        return (step, float(self.first[1])) if step >= 0 else None

    def check(self, steps_per_epoch: int, last_good: str) -> None:
        """TrainingError if a loss since the start was non-finite (the same on every rank: the
        loss is the mean over ranks); `last_good`: what the message says of the last checkpoint."""
        bad = self.bad()
        if bad is None:
            return
        step, loss = bad
        raise TrainingError(
            f"loss is {loss} at step {step} (epoch {(step - 1) // steps_per_epoch}): "
            f"training stopped{last_good}"
        )


def check_training_state(strategy: Strategy, step: int, last_good: str) -> None:
    """TrainingError if the training state (weights, masters, optimizer state, EMA) holds a NaN or
    an infinity: an update can overflow although its loss was finite. Collective (one reduction
    per tensor): before anything is evaluated or saved, never per step."""
    bad = strategy.count_nonfinite()
    if bad:
        raise TrainingError(
            f"the training state is not finite after step {step} ({bad} tensors hold "
            "NaN or inf although every loss was finite: an update overflowed; lower "
            f"optim.lr or set optim.grad_clip): training stopped{last_good}"
        )
