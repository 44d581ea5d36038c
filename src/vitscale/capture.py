"""train.capture=step: the whole training step as one unit with static shapes.

Forward, backward, gradient clipping, AdamW (its lr read from a device table indexed by a device
step counter; its step count on the device: torch's `capturable`), the EMA and the non-finite
watch run in one function (`WholeStep.body`) that reads nothing from the device and takes nothing
from the host that changes from step to step. On a GPU the function is captured once as a CUDA
graph after a few eager warm-up steps and every later full batch is one copy into the static
input buffers plus one replay; a batch of another shape (a last partial batch) runs the same
function eagerly. On a CPU there is no graph: the function runs eagerly every step, with the
numbers of train.capture=none (the lr from the table is the scheduler's own double).

The graph is one object with three verbs (`warmup`, `capture`, `replay`), so that tests drive the
capture logic on a CPU with a recorder that replays the recorded operations as a graph would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from .step import FiniteWatch


class CudaGraph:
    """torch.cuda.graph capture as torch's docs do it: warm-up steps on a side stream, then one
    capture; `replay()` launches the whole step."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()
        self.stream = torch.cuda.Stream()

    def warmup(self, fn):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def capture(self, fn):
        with torch.cuda.graph(self.graph, stream=self.stream):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


def graph_for(captured: bool):
    """The graph a step is captured into where `captured` (the strategy's decision:
    `strategy.captured`, the one place that decides), or None where the whole step runs eagerly
    (a CPU)."""
    return CudaGraph() if captured else None


class WholeStep:
    """One optimizer step as one unit: `step(batch) -> (loss, info)`, both device tensors (static
    buffers once captured), the non-finite watch updated inside. Built from the parts it uses:
    the step function, the optimizer's parameter groups, the lr table (optim.lr_table), the step
    the run is at and the watch."""

    WARMUP = 3  # eager steps before the capture (optimizer state, EMA and compile warm up)

    def __init__(
        self,
        fn: Callable[[tuple], tuple[torch.Tensor, dict]],
        groups: list[dict],
        table: torch.Tensor,
        start_step: int,
        watch: FiniteWatch,
        *,
        captured: bool = False,
        graph=None,
        eager: bool = False,
    ):
        """`fn(batch) -> (loss, info)`: the training step (step.TrainStep at the run's step);
        `table`: [groups, last step + 1] lrs; `graph`: what the step is captured into (default:
        `graph_for(captured)`); `eager`: never captured, the same function run eagerly every step
        on any device (the GPU test's reference: the captured step must replay exactly this)."""
        self.fn, self.groups, self.table, self.watch = fn, groups, table, watch
        self.last = table.shape[1] - 1
        self.lr = torch.zeros(table.shape[0], dtype=table.dtype, device=table.device)
        self.lrs = list(self.lr.unbind(0))  # 0-dim views, one per group
        self.step_t = torch.tensor(start_step, dtype=torch.int64, device=table.device)
        self.graph = None if eager else graph if graph is not None else graph_for(captured)
        self.eager = 0  # steps run eagerly so far (the warm-up)
        self.static: tuple | None = None  # the captured step's input buffers
        self.out: tuple[torch.Tensor, dict] | None = None  # and its outputs

    def body(self, batch: tuple):
        """The step on `batch`: lr from the table at the device step, the step function, the
        counter and the non-finite watch. Nothing here reads the device."""
        idx = self.step_t.clamp(max=self.last).view(1)
        self.lr.copy_(self.table.index_select(1, idx).view(-1))
        floats = [g["lr"] for g in self.groups]
        for g, t in zip(self.groups, self.lrs):
            g["lr"] = t
        try:
            loss, info = self.fn(batch)
        finally:  # the scheduler and checkpoints keep seeing floats
            for g, f in zip(self.groups, floats):
                g["lr"] = f
        self.step_t += 1
        self.watch.see(self.step_t, loss)
        return loss, info

    def step(self, batch: tuple):
        if self.graph is None or (self.static is not None and not same_shapes(batch, self.static)):
            return self.body(batch)
        if self.eager < self.WARMUP:
            self.eager += 1
            return self.graph.warmup(lambda: self.body(batch))
        if self.static is None:
            static = self.static = tuple(t.clone() for t in batch)
            self.out = self.graph.capture(lambda: self.body(static))
        else:
            for buf, t in zip(self.static, batch):
                buf.copy_(t, non_blocking=True)
        self.graph.replay()
        return cast(tuple[torch.Tensor, dict], self.out)  # set by the capture above


def same_shapes(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))
