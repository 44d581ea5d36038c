"""Timing one trainer (bench, ladder, tune share it).

`Bench` wraps one `Trainer` and times its exact training step (its step function, step.TrainStep) on real
batches from the loader (or one fixed batch), with synchronized timers; `split()` is a separate,
instrumented pass (syncs between phases) that divides a step into forward / backward /
communication / optimizer. A Bench keeps the process-wide settings its configuration applied
(TF32 / cuDNN flags, torch threads) and puts them back around its own steps (`Bench.settings`);
`run_steps` runs them and closes a Bench that ran out of memory. Several Benches side by side:
rounds.py.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ..errors import UserError
from ..loop import Trainer
from ..metrics import synchronizer
from ..strategy import devices
from .recipes import synthetic_data

perf = time.perf_counter


def static_compiles() -> None:
    """Several configurations compiled in one process (ladder, tune) share the model's forward code,
    so torch.compile would recompile the second shape as a dynamic-shape graph, a different program
    from the static one each configuration's own training run compiles (and one that inductor has
    failed to lower here: a ValueRangeError in the conv stem at two image sizes), and after 8 shapes
    would fall back to eager silently. Here every configuration gets its own static graph."""
    import torch._dynamo.config as dynamo  # here: seconds to import, and only a compiled configuration needs it

    dynamo.automatic_dynamic_shapes = False
    dynamo.recompile_limit = max(dynamo.recompile_limit, 64)


class PhaseTimer:
    """The step function.s `phase` hook (step.TrainStep): seconds per phase name, each phase ending where the
    step calls the hook (the device synchronized there) and starting where the last one ended."""

    def __init__(self, sync):
        self.sync, self.seconds, self.last = sync, collections.defaultdict(float), 0.0

    def start(self) -> float:
        self.sync()
        self.last = perf()
        return self.last

    def __call__(self, name: str) -> None:
        self.sync()
        now = perf()
        self.seconds[name] += now - self.last
        self.last = now


class Bench:
    """One Trainer (run folder in a temp dir: no checkpoints, no eval) and a batch source;
    `synthetic`: the config's dataset replaced by synthetic_data, and one batch of it reused."""

    def __init__(self, cfg, synthetic: bool = False):
        self.given = cfg  # the recipe as given (a synthetic Bench swaps the dataset)
        self.cfg = cfg = synthetic_data(cfg) if synthetic else cfg
        if cfg.train.compile:
            static_compiles()
        self.tmp = tempfile.TemporaryDirectory(prefix="vitscale-bench-")
        self._attach(Trainer(cfg, Path(self.tmp.name) / "run"))
        self.fixed = self.fetch() if synthetic else None

    @classmethod
    def around(cls, trainer, batch: tuple) -> Bench:
        """A Bench of an existing trainer (anything with a Trainer's `cfg`, `strategy`, `task` and
        `train_step`) that times one fixed batch; closing it leaves the trainer alone."""
        b = cls.__new__(cls)
        b.cfg, b.given, b.tmp = trainer.cfg, trainer.cfg, None
        b._attach(trainer)
        b.fixed = batch
        return b

    def _attach(self, trainer) -> None:
        self.trainer, self.s = trainer, trainer.strategy
        # the GPU's clock is read only after its queue drains
        self.sync = synchronizer(self.s.device)
        self._epoch, self._it = 0, iter(())
        # the process-wide settings this configuration's strategy applied when it was built (TF32,
        # cuDNN autotuning: {} on a CPU) and its thread count; a Bench built later overwrites them,
        # so `settings()` puts them back around each of this Bench's timed rounds
        train = self.cfg.train
        self.flags = devices.backend_flags(self.s.device.type, train.tf32, train.cudnn_benchmark)
        self.threads = torch.get_num_threads()

    @contextlib.contextmanager
    def settings(self):
        """This Bench's process-wide settings for a block (its warm-up, each timed round), the
        ones before restored after."""
        threads = torch.get_num_threads()
        if threads != self.threads:
            torch.set_num_threads(self.threads)
        try:
            with devices.backend_flags_applied(self.flags):
                yield
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    @property
    def global_batch(self) -> int:
        return self.cfg.data.batch_size

    def fetch(self) -> tuple:
        """The loader's next batch, on to the next epoch when one ends."""
        batch = next(self._it, None)
        while batch is None:
            # as training iterates (train.capture=step: many batches prepared at once)
            self._it = self.trainer.data.train.iterate(
                self._epoch, ahead=getattr(self.trainer, "ahead", 1)
            )
            self._epoch += 1
            batch = next(self._it, None)
        return batch

    def steps(self, n: int) -> tuple[float, float]:
        """n training steps exactly as the loop runs them: (wall seconds incl. data, data seconds)."""
        self.sync()
        t0, data = perf(), 0.0
        for _ in range(n):
            a = perf()
            batch = self.fixed if self.fixed is not None else self.fetch()
            data += perf() - a
            self.trainer.run_step(batch)
        self.sync()
        return perf() - t0, data

    def split(self, n: int) -> dict:
        """Instrumented pass over one batch, seconds per step: the trainer's own `train_step`
        with a `PhaseTimer` that synchronizes the device at each phase boundary. DDP/FSDP: each
        step first runs forward+backward under `no_sync()` (backward compute alone), then the
        real step; exposed communication = real backward - no_sync backward."""
        s = self.s
        batch = self.fixed if self.fixed is not None else self.fetch()
        can_nosync = s.world_size > 1 and s.no_sync_defers_comm
        timer, local, total, comm = PhaseTimer(self.sync), 0.0, 0.0, 0.0
        s.comm_stats(1)  # drop what the timed steps counted
        for _ in range(n):
            if can_nosync:
                local += self.local_backward(batch)
                s.comm_stats(1)
            t0 = timer.start()
            self.trainer.train_step(batch, phase=timer)
            total += timer.last - t0
            comm += s.comm_stats(1).get("comm_s_per_step", 0.0)
        fwd, bwd = timer.seconds["forward"], timer.seconds["backward"]
        out = {
            "forward": fwd / n,
            "optimizer": timer.seconds["optimizer"] / n,
            "instrumented_step": total / n,
            "notes": [],
        }
        if s.world_size == 1:
            out.update(backward=bwd / n, comm_exposed=0.0, comm_overlapped=0.0)
            out["notes"].append("one process: no communication")
        elif can_nosync:
            compute = min(local, bwd) / n  # noise must not make the phases outgrow the step
            out.update(backward=compute, comm_exposed=bwd / n - compute, comm_total=comm / n)
            if not s.gathers_in_forward:
                out["comm_overlapped"] = max(0.0, comm / n - out["comm_exposed"])
            else:
                out["comm_overlapped"] = None
                out["notes"].append(
                    f"{s.name}: comm_exposed = backward with communication - backward without "
                    "(no_sync); forward all-gathers are inside forward, so comm_overlapped is "
                    "not derived; comm_total = all collectives, launch to completion, summed"
                )
        else:
            out.update(
                backward=bwd / n, comm_exposed=None, comm_overlapped=None, comm_total=comm / n
            )
            out["notes"].append(
                f"{s.name}: the engine communicates inside backward/step and has no "
                "no_sync pass to compare with: backward includes its communication; "
                "comm_total = all collectives, launch to completion, summed"
            )
        out["notes"].append("the loss all-reduce of a multi-process step is left out of the split")
        return out

    def local_backward(self, batch: tuple) -> float:
        """Seconds of backward compute alone: the step function's forward + backward of every
        micro-batch under `no_sync()` (no gradient communication), gradients dropped afterwards."""
        timer = PhaseTimer(self.sync)
        timer.start()
        self.trainer.step_fn.forward_backward(batch, phase=timer, defer_all=True)
        self.s.optimizer.zero_grad(set_to_none=True)
        return timer.seconds["backward"]

    @property
    def closed(self) -> bool:
        return getattr(self, "trainer", None) is None

    def close(self) -> None:
        """Drop the trainer (and close its data, remove its run folder if this Bench built it);
        a second call does nothing."""
        if self.closed:
            return
        if self.tmp is not None:  # a Bench that built its trainer
            self.trainer.close()
            self.tmp.cleanup()
        self.trainer = self.s = self.fixed = None


@contextlib.contextmanager
def settings_kept():
    """The process-wide settings that building Benches changes (TF32 / cuDNN flags, torch threads)
    put back as they were when the block ends (writing only what differs: nothing on a CPU)."""
    flags, threads = devices.current_backend_flags(), torch.get_num_threads()
    try:
        yield
    finally:
        devices.apply_backend_flags(flags)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def free_memory() -> None:
    """Collect what was just dropped (a closed Bench's trainer, reference cycles, the frames of an
    out-of-memory error's traceback) and hand CUDA's cached blocks back. Called after the
    `except` block: inside it, the traceback still holds the failed step's tensors."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_bench(cfg, synthetic: bool = False) -> tuple:
    """(Bench, None), or (None, why) where building it ran out of memory or the configuration
    cannot run here (e.g. a batch larger than the training set)."""
    why = None
    try:
        return Bench(cfg, synthetic), None
    except torch.OutOfMemoryError:
        why = "out of memory"
    except UserError as e:
        return None, str(e)
    free_memory()  # the half-built trainer is garbage only now, outside the except block
    return None, why


def kernel_seconds(b: Bench, steps: int) -> float | None:
    """GPU kernel time per step over `steps` of Bench `b`'s steps (torch.profiler's CUDA activity:
    the kernels and copies the GPU ran): beside the wall step time, how much of a step the GPU
    computes and how much is launch overhead. None on a CPU or where the profiler gives nothing."""
    if b.s.device.type != "cuda":
        return None
    with b.settings():
        b.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            b.steps(steps)
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / 1e6 / steps if total_us else None


def run_steps(b: Bench, n: int):
    """`b.steps(n)` under b's own settings (`Bench.settings`), or None where it ran out of
    memory: then b is closed and the memory freed."""
    oom = False
    try:
        with b.settings():
            return b.steps(n)
    except torch.OutOfMemoryError:
        oom = True
    if oom:  # outside the except block (its traceback holds the step's tensors)
        b.close()
        free_memory()
    return None
