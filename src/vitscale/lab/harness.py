"""The performance lab's timing harness (bench, ladder, tune share it).

`Bench` wraps one `Trainer` and times its exact training step (`Trainer.train_step`) on real
batches from the loader (or one fixed batch), with synchronized timers; `split()` is a separate,
instrumented pass (syncs between phases) that divides a step into forward / backward /
communication / optimizer. `side_by_side()` times several Benches in interleaved rounds so that
machine noise hits every configuration alike.
"""
from __future__ import annotations

import collections
import copy
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..errors import UserError
from ..strategy.devices import synchronizer

perf = time.perf_counter


def log(msg: str) -> None:
    """Progress for humans: stderr, main process only."""
    if os.environ.get("RANK", "0") == "0":
        print(msg, file=sys.stderr, flush=True)


def lab_config(path, overrides):
    """The recipe + overrides, quiet (no progress bar, no TensorBoard); under a multi-process
    launcher a `single` strategy would train N independent copies, so it becomes `ddp`."""
    from ..config import _set, check, load_config
    cfg = load_config(path, overrides)
    _set(cfg, "run.progress", "off")
    _set(cfg, "run.tensorboard", False)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and cfg.strategy.name == "single":
        log("launched with several processes and strategy.name=single: using strategy.name=ddp")
        _set(cfg, "strategy.name", "ddp")
    check(cfg)
    return cfg


def with_overrides(cfg, overrides: dict):
    """A copy of `cfg` with {dotted key: value} set and checked (ConfigError if it does not validate)."""
    from ..config import _set, check
    out = copy.deepcopy(cfg)
    for k, v in overrides.items():
        _set(out, k, v)
    check(out)
    return out


def check_counts(**counts) -> None:
    for name, (value, lo) in counts.items():
        if value < lo:
            raise UserError(f"--{name.replace('_', '-')} must be >= {lo}, got {value}")


def micros(batch: tuple, accum: int):
    return zip(*(t.chunk(accum) for t in batch))


def synthetic_data(cfg):
    """`cfg` with its image dataset swapped for synthetic images of the same shape (image size,
    channels, classes; data/synthetic.py), one global batch of them: what `--synthetic` times, so
    that a machine without the dataset (an ImageNet folder on a rented GPU) measures the recipe's
    step. Image-text data (CLIP) is kept, one batch of it reused."""
    from ..tasks import build_task
    overrides = build_task(cfg).synthetic_overrides()
    return cfg if overrides is None else with_overrides(cfg, overrides)


def static_compiles() -> None:
    """Several configurations compiled in one process (ladder, tune) share the model's forward code,
    so torch.compile would recompile the second shape as a dynamic-shape graph, a different program
    from the static one each configuration's own training run compiles (and one that inductor has
    failed to lower here: a ValueRangeError in the conv stem at two image sizes), and after 8 shapes
    would fall back to eager silently. Here every configuration gets its own static graph."""
    import torch._dynamo.config as dynamo
    dynamo.automatic_dynamic_shapes = False
    dynamo.recompile_limit = max(dynamo.recompile_limit, 64)


class PhaseTimer:
    """`Trainer.train_step`'s `phase` hook: seconds per phase name, each phase ending where the
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
        from ..loop import Trainer
        self.cfg = cfg = synthetic_data(cfg) if synthetic else cfg
        if cfg.train.compile:
            static_compiles()
        self.tmp = tempfile.TemporaryDirectory(prefix="vitscale-bench-")
        self._attach(Trainer(cfg, Path(self.tmp.name) / "run"))
        self.fixed = self.fetch() if synthetic else None

    @classmethod
    def around(cls, trainer, batch: tuple) -> "Bench":
        """A Bench of an existing trainer (anything with a Trainer's `cfg`, `strategy`, `task` and
        `train_step`) that times one fixed batch; closing it leaves the trainer alone."""
        b = cls.__new__(cls)
        b.cfg, b.tmp = trainer.cfg, None
        b._attach(trainer)
        b.fixed = batch
        return b

    def _attach(self, trainer) -> None:
        self.trainer, self.s = trainer, trainer.strategy
        self.sync = synchronizer(self.s.device)  # the GPU's clock is read only after its queue drains
        self._epoch, self._it = 0, iter(())

    @property
    def global_batch(self) -> int:
        return self.cfg.data.batch_size

    def fetch(self) -> tuple:
        """The loader's next batch, on to the next epoch when one ends."""
        batch = next(self._it, None)
        while batch is None:
            self._it = self.trainer.data.train.iterate(self._epoch)
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
            self.trainer.train_step(batch)
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
        out = {"forward": fwd / n, "optimizer": timer.seconds["optimizer"] / n, "instrumented_step": total / n,
               "notes": []}
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
                out["notes"].append(f"{s.name}: comm_exposed = backward with communication - backward without "
                                    "(no_sync); forward all-gathers are inside forward, so comm_overlapped is "
                                    "not derived; comm_total = all collectives, launch to completion, summed")
        else:
            out.update(backward=bwd / n, comm_exposed=None, comm_overlapped=None, comm_total=comm / n)
            out["notes"].append(f"{s.name}: the engine communicates inside backward/step and has no "
                                "no_sync pass to compare with: backward includes its communication; "
                                "comm_total = all collectives, launch to completion, summed")
        out["notes"].append("the loss all-reduce of a multi-process step is left out of the split")
        return out

    def local_backward(self, batch: tuple) -> float:
        """Seconds of backward compute alone: forward + backward of every micro-batch under
        `no_sync()` (no gradient communication), gradients dropped afterwards."""
        tr, s, A = self.trainer, self.s, self.cfg.train.accum_steps
        seconds = 0.0
        with s.no_sync():
            for micro in micros(batch, A):
                with s.autocast():
                    loss = tr.task.forward_loss(s.model, micro, s.prepare) / A
                self.sync()
                a = perf()
                s.backward(loss)
                self.sync()
                seconds += perf() - a
        s.optimizer.zero_grad(set_to_none=True)
        return seconds

    def close(self) -> None:
        if self.tmp is not None:  # a Bench that built its trainer
            self.trainer.data.close()
            self.tmp.cleanup()
        del self.trainer, self.s, self.fixed


def gather_max(s, times: list) -> list:
    """Per entry, the max across ranks (the slowest rank sets the pace)."""
    per_rank = s.gather_objects(times)
    return [max(vals) for vals in zip(*per_rank)]


def side_by_side(benches: list[Bench], steps: int, rounds: int, warmup: int, label=None) -> list:
    """Interleaved rounds: round r runs `steps` steps of bench 0, 1, ..., n-1. Returns per bench
    the per-round (wall s, data s) (max across ranks), or None where a bench ran out of memory."""
    out: list = [[] for _ in benches]
    for i, b in enumerate(benches):
        if warmup and b is not None:
            t0 = perf()
            try:
                b.steps(warmup)
            except torch.OutOfMemoryError:
                out[i] = None
                torch.cuda.empty_cache()
            if label:
                log(f"  warm-up {label(i)}: {warmup} steps in {perf() - t0:.1f}s")
    for r in range(rounds):
        for i, b in enumerate(benches):
            if b is None or out[i] is None:
                continue
            try:
                out[i].append(b.steps(steps))
            except torch.OutOfMemoryError:
                out[i] = None
                torch.cuda.empty_cache()
    s = next(b.s for b in benches if b is not None)
    flat = [x for o in out if o for x in o]
    flat = gather_max(s, [v for x in flat for v in x])
    it = iter(zip(flat[::2], flat[1::2]))
    return [None if o is None else [next(it) for _ in o] for o in out]


def rate(bench_times: list, steps: int, batch: int) -> dict:
    """images/s from the median round; step time spread over rounds."""
    per_step = sorted(w / steps for w, _ in bench_times)
    med = statistics.median(per_step)
    return {"images_per_s": batch / med, "step_time_s": {"min": per_step[0], "median": med, "max": per_step[-1]},
            "data_s": statistics.median(d / steps for _, d in bench_times)}


def paired_rounds(times: list, batches: list) -> list:
    """Per bench, its speed relative to bench 0 in each round: (bench 0's seconds per image in
    round r) / (this bench's seconds per image in round r), a list over rounds. A drift of the
    machine's speed between rounds cancels in each ratio. `times`: side_by_side's per-bench
    [(wall s, data s) per round] or None; None where a bench or bench 0 has no times."""
    if not times or times[0] is None:
        return [None] * len(times)
    first = [w / batches[0] for w, _ in times[0]]
    return [None if t is None else [f / (w / b) for f, (w, _) in zip(first, t)]
            for t, b in zip(times, batches)]


def paired_speedups(times: list, batches: list) -> list:
    """Per bench, its speed relative to bench 0 round by round: the median over rounds of
    `paired_rounds`, where the ratio of two median rounds would keep the drift between rounds."""
    return [None if r is None else statistics.median(r) for r in paired_rounds(times, batches)]


def rounds_won(ratios: list) -> int:
    """In how many rounds a configuration was faster than the first one (`paired_rounds` > 1)."""
    return sum(r > 1 for r in ratios)


def faster_in_most_rounds(ratios: list | None, share: float = 2 / 3) -> bool:
    """Whether a configuration beat the first one in more than `share` of the rounds (all 3 of 3,
    4 of 5, 7 of 10): a median ratio above 1 from one or two lucky rounds is noise, not a gain."""
    return bool(ratios) and rounds_won(ratios) > share * len(ratios)


def measure_configs(cfgs: list, steps: int, rounds: int, warmup: int, synthetic: bool = False,
                    names: list | None = None) -> list:
    """Build one Bench per config, time them side by side, free them. Per config a dict
    (images_per_s, step_time_s, paired_vs_first, paired_rounds, flops_per_image, ...) or {'error': reason}."""
    names = names or [str(i) for i in range(len(cfgs))]
    benches, results = [], []
    for cfg in cfgs:
        try:
            benches.append(Bench(cfg, synthetic))
            results.append({})
        except torch.OutOfMemoryError:
            benches.append(None)
            results.append({"error": "out of memory"})
            torch.cuda.empty_cache()
        except UserError as e:  # e.g. a batch larger than the training set
            benches.append(None)
            results.append({"error": str(e)})
    times = side_by_side(benches, steps, rounds, warmup, label=lambda i: names[i])
    per_round = paired_rounds(times, [b.global_batch if b is not None else 1 for b in benches])
    for i, (b, t) in enumerate(zip(benches, times)):
        if b is None:
            continue
        if t is None:
            results[i] = {"error": "out of memory"}
        else:
            ratios = per_round[i]
            results[i] = {**rate(t, steps, b.global_batch), "paired_rounds": ratios,
                          "paired_vs_first": statistics.median(ratios) if ratios else None,
                          "flops_per_image": b.trainer.flops_per_image,
                          "world_size": b.s.world_size, "device": b.s.device}
        b.close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


# -- the machine and the software ---------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_info(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return {"device": device.type, "name": name, "threads": torch.get_num_threads(), "cores": os.cpu_count()}


def machine_line(device: torch.device) -> str:
    h = hardware_info(device)
    return (f"{h['name']} ({h['cores']} cores, {h['threads']} torch threads), {h['device']}, "
            f"torch {torch.__version__}")


def versions() -> dict:
    from importlib import metadata
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("vitscale", "deepspeed"):  # metadata, not an import: deepspeed takes seconds to import
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            if pkg == "vitscale":
                out[pkg] = "unknown"
    return out


def max_rss_bytes() -> int:
    """The process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
