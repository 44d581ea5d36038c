"""Communication accounting for every engine: the collectives a training step issues, counted where
they enter `torch.distributed`.

DDP's reducer calls vitscale's comm hook, FSDP2 calls `dist.all_gather_single` /
`dist.reduce_scatter_single`, DeepSpeed's comm backend calls `torch.distributed.all_reduce`,
`reduce_scatter_tensor`, `all_gather_into_tensor`, ...; DTensor reductions (FSDP2's gradient norm)
go through `torch.distributed._functional_collectives.all_reduce`. `install()` wraps those
functions once per process (before an engine captures a reference to them); a wrapped call is
counted only inside `window()`, the training step, so evaluation, checkpoint gathers and vitscale's
own scalar reductions (`paused()`) stay out of the numbers.

On a device mesh (strategy/mesh.py) every count is also kept per mesh dimension, by the process
group the collective runs on (`name_groups`): comm_<dim>_<kind>_{bytes,calls,s}_per_step, e.g.
comm_tp_allreduce_bytes_per_step (tensor parallelism's per-block all-reduces), comm_dp_shard_*
(FSDP2's gathers and reduce-scatters), comm_dp_replicate_allreduce_* (HSDP's level across replicas).

Per collective kind (allreduce, allgather, reducescatter, broadcast, reduce, alltoall):
- bytes: the payload, i.e. the full buffer the collective is about: the reduced tensor for
  all-reduce/reduce/broadcast, the gathered output for all-gather, the input that is reduced and
  scattered for reduce-scatter, the input for all-to-all. A ring moves 2(N-1)/N x payload per link
  for an all-reduce and (N-1)/N x payload for an all-gather or reduce-scatter.
- calls;
- seconds from launch to completion. On CPU tensors (gloo): the host clock, to an async
  collective's future callback or over a synchronous call. On CUDA tensors (NCCL) the host clock
  would time the launch only (a NCCL work's future completes when the kernel is queued): CUDA
  events are recorded instead, one on the issuing stream before the launch and one in the
  future's callback, which runs on a stream ordered after the NCCL kernel (after the call for a
  synchronous one, whose wait orders the current stream after it). They are read at `take()`
  (the log step, where the loop synchronizes anyway): no host sync in the step. Collectives
  overlap compute and one another, so the sum is not the exposed time. The functional
  all-reduce returns before it completes: its time is counted on CPU tensors as the launch only
  and not at all on CUDA ones (its bytes and calls are).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

KINDS = ("allreduce", "allgather", "reducescatter", "broadcast", "reduce", "alltoall")


def _arg(args, kwargs, pos: int, name: str):
    return args[pos] if len(args) > pos else kwargs.get(name)


# function name -> (kind, position and keyword of the payload argument)
SPECS = {
    "all_reduce": ("allreduce", 0, "tensor"),
    "all_reduce_coalesced": ("allreduce", 0, "tensors"),
    "all_gather": ("allgather", 0, "tensor_list"),
    "all_gather_single": ("allgather", 0, "output_tensor"),
    "all_gather_into_tensor": ("allgather", 0, "output_tensor"),
    "_all_gather_base": ("allgather", 0, "output_tensor"),
    "reduce_scatter": ("reducescatter", 1, "input_list"),
    "reduce_scatter_single": ("reducescatter", 1, "input"),
    "reduce_scatter_tensor": ("reducescatter", 1, "input"),
    "_reduce_scatter_base": ("reducescatter", 1, "input"),
    "broadcast": ("broadcast", 0, "tensor"),
    "_broadcast_coalesced": ("broadcast", 1, "tensors"),  # DDP's buffer broadcast (C++ binding)
    "reduce": ("reduce", 0, "tensor"),
    "all_to_all_single": ("alltoall", 1, "input"),
}
# the functional collectives DTensor calls (tensor parallelism: the all-reduces, and under sequence
# parallelism the all-gathers and reduce-scatters of activations); a functional all-gather's
# payload is its input, counted as the gathered output (x the group's size) where the group is known
FUNCTIONAL = {
    "all_reduce": ("allreduce", 0, "self"),
    "all_gather_single": ("allgather", 0, "self"),
    "reduce_scatter_single": ("reducescatter", 0, "self"),
}


def nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(nbytes(t) for t in x)
    return 0


def on_cuda(x) -> bool:
    """The collective's payload is on a GPU (its time must come from CUDA events)."""
    if isinstance(x, torch.Tensor):
        return x.is_cuda
    if isinstance(x, (list, tuple)) and x:
        return on_cuda(x[0])
    return False


class EventTimer:
    """Launch-to-completion time of a collective on the GPU: a CUDA event recorded on the current
    stream when made, one when `stop()` is called; `seconds()` waits for the second."""

    def __init__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()
        self.end: torch.cuda.Event | None = None

    def stop(self) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.end = end

    def seconds(self) -> float:
        assert self.end is not None, "EventTimer.seconds() before stop()"  # settle(): stopped only
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


class Counter:
    """Bytes, calls and seconds per collective kind since the last `take()` (thread-safe: async
    completions arrive on the backend's threads)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active = 0  # > 0 inside window() (global: autograd may run on other threads)
        self.local = threading.local()  # .depth: nested torch.distributed calls count once
        self.pending: list[tuple[str, EventTimer, str | None]] = []  # CUDA timings not read yet
        self.reset()

    # process-group name -> the mesh dimension it is (name_groups): per-dimension counts
    dims: dict[str, str] = {}
    sizes: dict[str, int] = {}  # process-group name -> its processes

    def name_groups(self, groups: dict[str, Any]) -> None:
        """Count the collectives on each of `groups` (dimension name -> ProcessGroup) under that
        name as well."""
        named = {getattr(g, "group_name", ""): (dim, g) for dim, g in groups.items() if g}
        self.dims = {**self.dims, **{n: d for n, (d, _) in named.items()}}
        self.sizes = {**self.sizes, **{n: dist.get_world_size(g) for n, (_, g) in named.items()}}

    def group_name(self, args, kwargs) -> str | None:
        """The name of a collective's process group among its arguments (a ProcessGroup, a group
        name, a DeviceMesh or a (mesh, dim) pair) where it is one of the named groups, or None."""
        if not self.dims:
            return None
        for x in (*args, *kwargs.values()):
            if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], DeviceMesh):
                x = x[0].get_group(x[1])
            elif isinstance(x, DeviceMesh):  # one dimension's
                x = x.get_group()
            name = x if isinstance(x, str) else getattr(x, "group_name", None)
            if isinstance(name, str) and name in self.dims:
                return name
        return None

    def reset(self) -> dict:
        """Start counting afresh; returns what was counted (bytes, calls, seconds per kind, and
        per (dimension, kind) on a mesh)."""
        with self.lock:
            fresh: dict[str | tuple[str, str], list] = {k: [0, 0, 0.0] for k in KINDS}
            stats, self.stats = getattr(self, "stats", {}), fresh
        return stats

    def add(
        self,
        kind: str,
        nbytes: int = 0,
        calls: int = 0,
        seconds: float = 0.0,
        dim: str | None = None,
    ) -> None:
        with self.lock:
            for key in (kind, (dim, kind)) if dim else (kind,):
                s = self.stats.setdefault(key, [0, 0, 0.0])
                s[0] += nbytes
                s[1] += calls
                s[2] += seconds

    def settle(self) -> None:
        """Add the seconds of every CUDA-event timing whose end has been recorded."""
        with self.lock:
            done = [p for p in self.pending if p[1].end is not None]
            self.pending = [p for p in self.pending if p[1].end is None]
        for kind, timer, dim in done:
            self.add(kind, seconds=timer.seconds(), dim=dim)

    def take(self, steps: int) -> dict:
        """Per optimizer step: comm_<kind>_{bytes,calls,s}_per_step for each kind seen, and the
        totals comm_{bytes,calls,s}_per_step (empty when nothing was counted); then reset.
        CUDA-event timings finished so far are read here (waiting for their end events)."""
        self.settle()
        stats = self.reset()
        n = max(1, steps)
        out = {}
        for key, (b, c, s) in stats.items():
            if c:
                label = key if isinstance(key, str) else f"{key[0]}_{key[1]}"
                out.update(
                    {
                        f"comm_{label}_bytes_per_step": b / n,
                        f"comm_{label}_calls_per_step": c / n,
                        f"comm_{label}_s_per_step": s / n,
                    }
                )
        kinds = [v for k, v in stats.items() if isinstance(k, str)]
        if out:
            out.update(
                {
                    "comm_bytes_per_step": sum(v[0] for v in kinds) / n,
                    "comm_calls_per_step": sum(v[1] for v in kinds) / n,
                    "comm_s_per_step": sum(v[2] for v in kinds) / n,
                }
            )
        return out

    def track(self, kind: str, timer: EventTimer, dim: str | None = None) -> None:
        with self.lock:
            self.pending.append((kind, timer, dim))

    @contextlib.contextmanager
    def window(self):
        """Count the collectives issued inside (the training step)."""
        with self.lock:
            self.active += 1
        try:
            yield
        finally:
            with self.lock:
                self.active -= 1

    @contextlib.contextmanager
    def paused(self):
        """Do not count what is issued inside (on this thread): vitscale's own bookkeeping."""
        depth = getattr(self.local, "depth", 0)
        self.local.depth = depth + 1
        try:
            yield
        finally:
            self.local.depth = depth

    def wrap(self, fn, kind: str, pos: int, name: str, completes: bool = True):
        counter = self
        # a functional all-gather's payload argument is its input: the output is the group's
        gathers = not completes and kind == "allgather"

        def counted(*args, **kwargs):
            local = counter.local
            if not counter.active or getattr(local, "depth", 0):
                return fn(*args, **kwargs)
            local.depth = 1
            payload = _arg(args, kwargs, pos, name)
            group = counter.group_name(args, kwargs)  # a named mesh dimension's, or None
            dim = counter.dims.get(group) if group else None
            size = nbytes(payload) * (counter.sizes.get(group, 1) if gathers and group else 1)
            timer = EventTimer() if on_cuda(payload) else None  # start event before the launch
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                local.depth = 0
            counter.add(kind, size, 1, dim=dim)
            if timer is not None and not completes:  # queued, not finished: no honest time
                return out
            if completes and isinstance(out, dist.Work):
                try:  # async: time to completion, reported by the backend's future
                    fut = out.get_future()
                    if timer is None:
                        fut.then(
                            lambda _f: counter.add(kind, seconds=time.perf_counter() - t0, dim=dim)
                        )
                    else:
                        counter.track(kind, timer, dim)
                        fut.then(lambda _f: timer.stop())  # runs on a stream after the kernel
                    return out
                except RuntimeError:  # a Work without a future (e.g. inside coalescing)
                    pass
            if timer is None:
                counter.add(kind, seconds=time.perf_counter() - t0, dim=dim)
            else:  # synchronous: the current stream now waits for the collective
                counter.track(kind, timer, dim)
                timer.stop()
            return out

        counted.__wrapped__ = fn
        counted.__name__ = getattr(fn, "__name__", "collective")
        # torch.compile never traces the counting (a compiled DDP model's forward reaches DDP's
        # buffer broadcast): it runs eagerly around the collective, as the collective itself does
        counted = torch._dynamo.disable(counted, recursive=True)
        # disable() is untyped (its decorator and context-manager forms in one union): a function here
        counted._vitscale_counted = True  # pyright: ignore[reportAttributeAccessIssue]
        return counted


COUNTER = Counter()
_installed = False


def install() -> Counter:
    """Wrap the collectives in `torch.distributed` (both its namespaces) and the functional
    all-reduce; once per process, idempotent."""
    global _installed
    if _installed:
        return COUNTER
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    for name, (kind, pos, arg) in SPECS.items():
        for ns in (dist, c10d):
            fn = getattr(ns, name, None)
            if fn is not None and not getattr(fn, "_vitscale_counted", False):
                setattr(ns, name, COUNTER.wrap(fn, kind, pos, arg))
    for name, (kind, pos, arg) in FUNCTIONAL.items():
        fn = getattr(funcol, name, None)
        if fn is not None and not getattr(fn, "_vitscale_counted", False):
            setattr(funcol, name, COUNTER.wrap(fn, kind, pos, arg, completes=False))
    _installed = True
    return COUNTER


# -- the link between local processes (vitscale.lab.linkbench) -----------------------------------------
def _all_reduce_worker(
    rank: int, world: int, init_file: str, sizes, iters: int, out_file: str
) -> None:
    """One of `world` local gloo processes: each size all-reduced `iters` times after two warm-up
    calls, a barrier before each; rank 0 writes the median seconds per size."""
    import statistics

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    rows = []
    for n in sizes:
        x = torch.ones(n // 4)
        for _ in range(2):
            dist.all_reduce(x)
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        rows.append((n, statistics.median(times)))
    if rank == 0:
        with open(out_file, "w") as f:
            f.write("\n".join(f"{b} {t}" for b, t in rows))
    dist.destroy_process_group()


def time_all_reduce(world: int, sizes: list[int], iters: int) -> list[tuple[int, float]]:
    """[(bytes, median seconds)] of an fp32 gloo all-reduce of each size between `world` local
    processes (spawned here, a file rendezvous in a temporary folder)."""
    import os
    import tempfile

    from torch.multiprocessing.spawn import spawn

    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "out")
        spawn(
            _all_reduce_worker, args=(world, init, list(sizes), iters, out), nprocs=world, join=True
        )
        return [(int(b), float(t)) for b, t in (ln.split() for ln in open(out).read().splitlines())]
