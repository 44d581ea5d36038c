"""The performance lab's timing harness (bench, ladder, tune share it).

`Bench` wraps one `Trainer` and times its exact training step (`Trainer.train_step`) on real
batches from the loader (or one fixed batch), with synchronized timers; `split()` is a separate,
instrumented pass (syncs between phases) that divides a step into forward / backward /
communication / optimizer. `side_by_side()` times several Benches in interleaved rounds so that
machine noise hits every configuration alike; each Bench's steps run under its own process-wide
settings (TF32 / cuDNN flags, torch threads), which building a later Bench would otherwise
overwrite. `measure_configs()` (tune) builds a few Benches and times them together;
`measure_against_first()` (the ladder) keeps only the first (the baseline) resident and builds,
times and frees every other configuration one at a time, each paired with the baseline.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import gc
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
from ..strategy import devices
from ..metrics import synchronizer

perf = time.perf_counter


def log(msg: str) -> None:
    """Progress for humans: stderr, main process only."""
    if os.environ.get("RANK", "0") == "0":
        print(msg, file=sys.stderr, flush=True)


def lab_config(path, overrides):
    """The recipe + overrides, quiet (no progress bar, no TensorBoard); under a multi-process
    launcher a `single` strategy would train N independent copies, so it becomes `ddp`."""
    from ..config import check, load_config, set_value
    from ..strategy import default_for, needs_processes
    from ..tasks import check_config
    cfg = load_config(path, overrides)
    set_value(cfg, "run.progress", "off")
    set_value(cfg, "run.tensorboard", False)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not needs_processes(cfg.strategy.name):
        log(f"launched with several processes and strategy.name={cfg.strategy.name}: using "
            f"strategy.name={default_for(world_size)}")
        set_value(cfg, "strategy.name", default_for(world_size))
    check(cfg)
    return check_config(cfg)


def with_overrides(cfg, overrides: dict):
    """A copy of `cfg` with {dotted key: value} set and checked (ConfigError if it does not validate)."""
    from ..config import check, set_value
    from ..tasks import check_config
    out = copy.deepcopy(cfg)
    for k, v in overrides.items():
        set_value(out, k, v)
    check(out)
    return check_config(out)


def check_counts(**counts) -> None:
    for name, (value, lo) in counts.items():
        if value < lo:
            raise UserError(f"--{name.replace('_', '-')} must be >= {lo}, got {value}")


def micros(batch: tuple, accum: int):
    return zip(*(t.chunk(accum) for t in batch))


def synthetic_data(cfg):
    """`cfg` with its image dataset swapped for synthetic images of the same shape (image size,
    channels, classes; data/sources/synthetic.py), one global batch of them: what `--synthetic` times, so
    that a machine without the dataset (an ImageNet folder on a rented GPU) measures the recipe's
    step. Image-text recipes (CLIP) get synthetic images captioned from their labels (ClipTask)."""
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
        self.given = cfg  # the recipe as given (a synthetic Bench swaps the dataset)
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
        b.cfg, b.given, b.tmp = trainer.cfg, trainer.cfg, None
        b._attach(trainer)
        b.fixed = batch
        return b

    def _attach(self, trainer) -> None:
        self.trainer, self.s = trainer, trainer.strategy
        self.sync = synchronizer(self.s.device)  # the GPU's clock is read only after its queue drains
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
            self._it = self.trainer.data.train.iterate(self._epoch, ahead=getattr(self.trainer, "ahead", 1))
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
    from torch.profiler import ProfilerActivity, profile
    with b.settings():
        b.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            b.steps(steps)
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / 1e6 / steps if total_us else None


def gather_max(s, times: list) -> list:
    """Per entry, the max across ranks (the slowest rank sets the pace)."""
    per_rank = s.gather_objects(times)
    return [max(vals) for vals in zip(*per_rank)]


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


def side_by_side(benches: list[Bench], steps: int | list, rounds: int, warmup: int | list, label=None) -> list:
    """Interleaved rounds: round r runs `steps` steps of bench 0, 1, ..., n-1, each bench (its
    warm-up too) under its own process-wide settings; `steps` and `warmup` either for all or one
    per bench. Returns per bench the per-round (wall s, data s) (max across ranks), or None where
    a bench ran out of memory (that bench is closed)."""
    out: list = [[] for _ in benches]
    steps = steps if isinstance(steps, list) else [steps] * len(benches)
    warmup = warmup if isinstance(warmup, list) else [warmup] * len(benches)
    for i, b in enumerate(benches):
        if warmup[i] and b is not None:
            t0 = perf()
            if run_steps(b, warmup[i]) is None:
                out[i] = None
            if label:
                log(f"  warm-up {label(i)}: {warmup[i]} steps in {perf() - t0:.1f}s")
    for r in range(rounds):
        for i, b in enumerate(benches):
            if b is None or out[i] is None:
                continue
            t = run_steps(b, steps[i])
            if t is None:
                out[i] = None
            else:
                out[i].append(t)
    flat = [x for o in out if o for x in o]
    # max across ranks through the process group itself: a strategy held here would keep the model
    # of a bench closed for running out of memory alive
    from ..strategy.dist import gather_objects
    flat = [max(vals) for vals in zip(*gather_objects([v for x in flat for v in x]))]
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


@settings_kept()
def measure_configs(cfgs: list, steps: int, rounds: int, warmup: int, synthetic: bool = False,
                    names: list | None = None) -> list:
    """Build one Bench per config, time them side by side, free them. Per config a dict
    (images_per_s, step_time_s, paired_vs_first, paired_rounds, flops_per_image, ...) or {'error': reason}."""
    names = names or [str(i) for i in range(len(cfgs))]
    benches, results = [], []
    for cfg in cfgs:
        b, why = build_bench(cfg, synthetic)
        benches.append(b)
        results.append({} if b is not None else {"error": why})
    if not any(benches):
        return results
    times = side_by_side(benches, steps, rounds, warmup, label=lambda i: names[i])
    batches = [b.global_batch if b is not None else 1 for b in benches]
    per_round = paired_rounds(times, batches)
    for i, (b, t) in enumerate(zip(benches, times)):
        if b is None:
            continue
        if t is None:
            results[i] = {"error": "out of memory"}
        else:
            results[i] = result_of(b, t, steps, per_round[i])
        b.close()
    del benches, b
    free_memory()
    return results


def result_of(b: Bench, times: list, steps: int, ratios: list | None) -> dict:
    """A measured configuration: its rate over its rounds and its round-by-round ratios to the first."""
    return {**rate(times, steps, b.global_batch), "paired_rounds": ratios,
            "paired_vs_first": statistics.median(ratios) if ratios else None,
            "flops_per_image": b.trainer.flops_per_image, "world_size": b.s.world_size, "device": b.s.device}


@settings_kept()
def measure_against_first(cfgs: list, steps: int, rounds: int, warmup: int, synthetic: bool = False,
                          names: list | None = None, on_result=None, reference_steps: int | None = None) -> list:
    """`measure_configs` for a long list compared with its first (the ladder: every rung against
    the baseline), with at most two configurations resident: the first (the reference) is built
    once and stays; every other one is built, warmed up and timed in interleaved rounds with the
    reference (round r: the reference's steps, then its steps, each under its own settings), then
    freed before the next is built. Why pairs rather than one configuration at a time: each ratio
    to the reference stays round by round (the reference and the configuration ran back to back,
    so a drift of the machine's speed cancels), as when all were timed together; what changes is
    that configurations k and k+1 were no longer timed in the same rounds, so a comparison between
    them goes through the reference (the ladder's "vs previous, round by round" is the ratio of
    their per-round ratios to it). The cost: the reference runs in every pair; to keep that small
    (the ladder's baseline, fp32 IEEE, is its slowest rung), once the reference was measured in
    full (`steps` per round, its own result) it runs `reference_steps` per round (default `steps`)
    after a 1-step warm-up in the later pairs: enough to carry the round's drift, the ratios taken
    per image.

    Returns per config the dict of `measure_configs` (for the reference: from its first pair);
    the others also carry `reference_images_per_s`, the reference's rate in their own pair.
    `on_result(i, result)` is called as soon as config i's result is known (after its bench was
    freed), the reference's before the first other's."""
    names = names or [str(i) for i in range(len(cfgs))]
    results: list = [None] * len(cfgs)

    def emit(i: int, r: dict) -> None:
        if results[i] is None:
            results[i] = r
            if on_result is not None:
                on_result(i, r)

    ref, ref_i = first_bench(cfgs, synthetic, emit)
    if ref is None:
        return results
    if ref_i == len(cfgs) - 1:  # nothing to pair it with: timed alone
        t = side_by_side([ref], steps, rounds, warmup, label=lambda k: names[ref_i])[0]
        emit(ref_i, {"error": "out of memory"} if t is None else result_of(ref, t, steps, [1.0] * len(t)))
    fresh = True  # the reference has not run a pair since it was built
    for j in range(ref_i + 1, len(cfgs)):
        if ref is None or ref.closed:  # it ran out of memory next to an earlier configuration: again
            ref, _ = build_bench(cfgs[ref_i], synthetic)
            fresh = True
        full = results[ref_i] is None  # the reference's own result is still to be measured
        ref_steps = steps if full else (reference_steps or steps)
        ref_r, r, ran = beside(ref, cfgs[j], synthetic, [ref_steps, steps], rounds,
                               [warmup if fresh else min(warmup, 1), warmup], (names[ref_i], names[j]))
        fresh = fresh and not ran
        if ref_r is not None and full:
            emit(ref_i, ref_r)
        emit(j, r)
    emit(ref_i, {"error": "out of memory"})  # where it never completed a pair
    if ref is not None:
        ref.close()
    del ref
    free_memory()
    return results


def first_bench(cfgs: list, synthetic: bool, emit) -> tuple:
    """(the first of `cfgs` that builds, its index), or (None, None); `emit(i, error)` for each
    one before it that did not."""
    for i, cfg in enumerate(cfgs):
        ref, why = build_bench(cfg, synthetic)
        if ref is not None:
            return ref, i
        emit(i, {"error": why})
    return None, None


def beside(ref, cfg, synthetic: bool, steps: list, rounds: int, warmups: list, names: tuple) -> tuple:
    """`cfg` built and timed in interleaved rounds beside the resident reference `ref` (None: alone),
    then freed (and its compiled graphs where nothing alive uses them): (the reference's result or
    None, cfg's result, whether it ran). `steps`, `warmups`, `names`: (reference's, cfg's)."""
    b, why = build_bench(cfg, synthetic)
    if b is None:
        return None, {"error": why}, False
    (ref_steps, b_steps), pair = steps, [b] if ref is None else [ref, b]
    times = side_by_side(pair, steps[-len(pair):], rounds, warmups[-len(pair):],
                         label=lambda k: names[1] if pair[k] is b else names[0])
    t_ref, t_b = (None, *times) if ref is None else times
    ref_r = None if t_ref is None else result_of(ref, t_ref, ref_steps, [1.0] * len(t_ref))
    if t_b is None:
        r = {"error": "out of memory"}
    else:  # per image: the two may run different numbers of steps per round
        ratios = None if t_ref is None else paired_rounds(
            [t_ref, t_b], [ref.global_batch * ref_steps, b.global_batch * b_steps])[1]
        r = {**result_of(b, t_b, b_steps, ratios), "reference_images_per_s": ref_r and ref_r["images_per_s"]}
    # freed before anything else runs (the caller may train a model next)
    compiled = b.cfg.train.compile
    b.close()
    del b, pair
    if compiled and (ref is None or ref.closed or not ref.cfg.train.compile):
        import torch._dynamo
        torch._dynamo.reset()  # its compiled graphs and CUDA-graph pools (nothing else alive uses them)
    free_memory()
    return ref_r, r, True


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
