"""Process-group set-up from the launcher's environment (torchrun, the deepspeed launcher, SLURM)
and the few collectives the loop needs (through the strategy's verbs, never directly)."""

from __future__ import annotations

import datetime
import os
import shutil
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import commit_folder, last_size, save_failed, write_failure
from ..config import OptimConfig, StrategyConfig, TrainConfig
from ..errors import ConfigError, SaveError
from ..launch import launch_env
from .comm import COUNTER, install
from .devices import device_for, process_group_kwargs
from .single import SingleDevice


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) as torchrun, the deepspeed launcher or srun set them
    (launch.launch_env); (0, 1, 0) alone."""
    launch = launch_env(os.environ)
    return launch.rank, launch.world_size, launch.local_rank


def local_device(device_type: str, local_rank: int) -> torch.device:
    """This process's device: its local rank's GPU among those it sees, or the CPU."""
    return device_for(
        device_type, local_rank, torch.cuda.device_count() if device_type == "cuda" else 0
    )


def launched() -> bool:
    """A launcher started this process (torchrun / deepspeed / srun with several tasks)."""
    return launch_env(os.environ).launcher != "none" or "MASTER_ADDR" in os.environ


def free_port() -> int:
    """A TCP port free on this host now (for a one-host rendezvous; it may be taken again later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_backend(backend: str, cpu_collectives: bool) -> str:
    """The backend string for init_process_group: with `cpu_collectives` (FSDP2's cpu_offload,
    whose gradient norm and full state dict are collectives on CPU DTensors), NCCL for CUDA
    tensors and gloo for CPU ones in the same group, as torchtitan does."""
    return "cuda:nccl,cpu:gloo" if cpu_collectives and backend == "nccl" else backend


def init_process_group(
    device_type: str, backend: str = "auto", timeout_s: float = 600.0, cpu_collectives: bool = False
) -> None:
    """Join the group the launcher describes (launch.launch_env): NCCL on GPUs (bound to this
    process's GPU at init), gloo on CPUs by default; both (group_backend) where `cpu_collectives`.
    Under srun without torchrun, the env:// variables are filled in from SLURM's (for the engines
    that read them, e.g. ZeRO-3's LOCAL_RANK)."""
    if dist.is_initialized():
        return
    launch = launch_env(os.environ)
    if launch.master_addr is None:
        raise ConfigError(
            "strategy: a multi-process strategy needs a launcher: run it with "
            "`torchrun --nproc-per-node N -m vitscale train ...` (MASTER_ADDR is not set)"
        )
    for key, value in launch.env().items():
        os.environ.setdefault(key, value)
    device = local_device(device_type, launch.local_rank)
    kw = process_group_kwargs(launch, device, backend, datetime.timedelta(seconds=timeout_s))
    kw["backend"] = group_backend(kw["backend"], cpu_collectives)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # the store env:// would make, with keys of their own per torchrun restart: after a restart,
    # gloo otherwise now and then reads a dead process's address and fails to connect
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    # the stores are looked up on torch.distributed (public there at runtime, re-exported from
    # torch._C without being marked so in its typing), where the CPU tests replace them
    store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
        launch.master_addr,
        launch.master_port,
        launch.world_size,
        is_master=launch.rank == 0 and not agent,
        timeout=kw["timeout"],
        multi_tenant=not agent,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed = dist.PrefixStore(f"vitscale/attempt_{attempt}", store)  # pyright: ignore[reportPrivateImportUsage]
    dist.init_process_group(store=prefixed, **kw)


def group_started() -> bool:
    """A process group was started in this process: its communication threads (gloo's, NCCL's)
    can abort the interpreter's teardown, so the process should leave with os._exit."""
    return dist.is_available() and dist.is_initialized()


def is_comm_failure(e: BaseException) -> bool:
    """A collective failed: a peer process died, hung past the timeout or the network broke."""
    text = str(e).lower()
    return isinstance(e, getattr(dist, "DistError", ())) or any(
        k in text
        for k in (
            "gloo",
            "nccl",
            "connection reset",
            "connection closed",
            "timed out",
            "timeout",
            "pair closure",
        )
    )


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        with COUNTER.paused():  # vitscale's bookkeeping, not the engine's communication
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        with COUNTER.paused():
            dist.barrier()


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order (on every rank)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    with COUNTER.paused():
        dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    with COUNTER.paused():
        dist.broadcast_object_list(box, src=src)
    return box[0]


class Distributed(SingleDevice):
    """One process per device in a process group: the collectives behind the loop's verbs."""

    # collectives on CPU tensors as well as on the devices' (FSDP2 with cpu_offload)
    cpu_collectives = False
    # set by setup() / setup_eval(), as base.Strategy declares them: what the training step calls
    # (the engine's wrapper, compiled or not) and the plain model
    model: nn.Module
    module: nn.Module

    def __init__(
        self,
        train: TrainConfig,
        optim: OptimConfig,
        scfg: StrategyConfig,
        device_type: str,
        join: bool = True,
        lr: float | None = None,
    ):
        """`join`: join the group the launcher describes; False: one process, no launcher (the
        engine may make a one-process group of its own)."""
        if join:
            init_process_group(device_type, scfg.backend, scfg.timeout_s, self.cpu_collectives)
            install()  # count the engines' collectives (before an engine keeps references to them)
            self.rank, self.world_size, local = env_world()
        else:
            self.rank, self.world_size, local = 0, 1, 0
        self.is_main = self.rank == 0
        self.dp_rank, self.dp_size = self.rank, self.world_size  # a mesh engine narrows them
        self.scfg = scfg
        device = local_device(device_type, local)
        super().__init__(train, optim, device, lr=lr)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t)

    def all_reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_group is None:
            return all_reduce_sum(t)
        with COUNTER.paused():
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dp_group)
        return t

    def gather_objects(self, obj) -> list:
        return gather_objects(obj)

    def gather_dp(self, obj) -> list:
        tp = self.world_size // self.dp_size  # tp innermost: a group's first rank speaks for it
        return gather_objects(obj)[::tp]

    def broadcast_object(self, obj):
        return broadcast_object(obj)

    def write_folder(self, path, write) -> Path:
        """Collective: every rank runs `write(tmp)` into a temp folder next to `path` (an engine's
        step_N.ds / step_N.dcp); once all have written, the main process makes it `path`
        (checkpoint.commit_folder). Never a half-written step_N folder: where the disk refused any
        rank's write (full, read-only), the temp folder goes and every rank raises the same
        SaveError (`write` must return on every rank, or raise on every rank, as DCP does)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # this step's save, interrupted before
        barrier()
        failed = None
        try:
            write(tmp)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            failed = write_failure(e)
            if failed is None:
                raise
        barrier()  # every rank's files are in tmp
        problem = self._folder_failed(path, tmp, failed)
        if problem:
            raise SaveError(problem)
        if self.is_main:
            commit_folder(tmp, path)
        return path

    def _folder_failed(self, path: Path, tmp: Path, failed: OSError | None) -> str | None:
        """Collective: the one line of the first rank's refused write (said by the main process,
        which removes the temp folder), or None where every rank wrote its part."""
        mine = failed and (failed.errno, failed.strerror or str(failed))
        failures = [f for f in gather_objects(mine) if f]
        if not failures:
            return None
        problem = None
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            run_dir = path.parent.parent  # RUN/checkpoints/step_N.ds
            weights = sum(p.numel() * p.element_size() for p in self.module.parameters())
            needed = last_size(run_dir) or 3 * weights  # the last one's size, or Adam's state's
            problem = str(save_failed(run_dir, OSError(*failures[0]), needed))
        return broadcast_object(problem)

    def sync_buffers(self) -> None:
        """Collective: rank 0's buffers on every rank. Each rank's training forwards update its
        BatchNorm running statistics from its own batches (DDP broadcasts rank 0's only at the
        start of the next forward; FSDP2 and DeepSpeed never), so after the last step they differ,
        and each rank would evaluate its test shard with other statistics than the ones saved
        (rank 0's). A plain broadcast, outside the communication counts."""
        modules = {id(m): m for m in (self.module, self.eval_module())}.values()
        buffers = [b for m in modules for b in m.buffers()]
        if not buffers or self.world_size == 1:
            return
        with COUNTER.paused(), torch.no_grad():
            for b in buffers:
                dist.broadcast(b.data, src=0)

    def comm_window(self):
        return COUNTER.window()

    def comm_stats(self, steps: int) -> dict:
        return COUNTER.take(steps)

    def close(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
