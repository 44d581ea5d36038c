"""Every device- and launcher-dependent decision as a function of plain inputs (an environment
mapping, a device type, a backend name, a precision), so that tests drive the CUDA, NCCL and
multi-node branches on a CPU machine; the strategies only apply what these return.

- `launch_env`: rank, world size and local rank from torchrun, the deepspeed launcher, or SLURM's
  `srun` without torchrun (SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID, the rendezvous host from the
  step's node list).
- `process_group_kwargs`: backend (NCCL on GPUs, gloo on CPUs) and, for NCCL, the device bound
  at init (`device_id`: eager NCCL communicator, no "guessing device" warnings, no rank on GPU 0).
- `backend_flags` / `apply_backend_flags`: TF32 and cuDNN autotuning (CUDA only; the CPU's flags are
  never touched, so CPU numerics do not depend on them).
- `compile_kwargs`: torch.compile's mode (CUDA graphs: "reduce-overhead").
- `synchronizer`: what timers call before reading the clock (the GPU runs asynchronously).
- `pin_batches`: whether host batches go through pinned memory (non-blocking copies).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import ConfigError

# torch.compile modes that capture CUDA graphs (replayed as one launch: for launch-bound small models)
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int
    launcher: str               # "torchrun" (also the deepspeed launcher), "slurm" or "none"
    master_addr: str | None = None
    master_port: int = 29500

    def env(self) -> dict:
        """The env:// variables this launch implies (what torchrun would have set)."""
        out = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
               "MASTER_PORT": str(self.master_port)}
        if self.master_addr:
            out["MASTER_ADDR"] = self.master_addr
        return out


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[07-08,12],login1" -> "gpu07" (what
    `scontrol show hostnames | head -n 1` prints; zero padding kept)."""
    nodelist = nodelist.strip()
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m or not m.group(1):
        raise ConfigError(f"launcher: cannot read the SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(env: Mapping, key: str, default: int | None = None) -> int:
    if key not in env and default is not None:
        return default
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"launcher: {key}={env[key]!r} is not an integer") from None


def launch_env(env: Mapping[str, str]) -> Launch:
    """Who this process is, from the launcher's environment. torchrun and the deepspeed launcher
    set RANK / WORLD_SIZE / LOCAL_RANK (they win, also under `srun torchrun`); `srun` alone sets
    SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID and the step's node list, whose first host
    is the rendezvous (MASTER_ADDR, unless set). Nothing set: one process."""
    port = _int(env, "MASTER_PORT", 29500)
    if "RANK" in env and "WORLD_SIZE" in env:
        local = _int(env, "LOCAL_RANK", _int(env, "LOCAL_PROCESS_RANK", 0))
        return Launch(_int(env, "RANK"), _int(env, "WORLD_SIZE"), local, "torchrun", env.get("MASTER_ADDR"), port)
    # srun's own step (SLURM_STEP_NUM_TASKS), not the batch script, which has SLURM_NTASKS too
    if "SLURM_PROCID" in env and _int(env, "SLURM_STEP_NUM_TASKS", 1) > 1:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        addr = env.get("MASTER_ADDR") or (first_host(nodes) if nodes else None)
        if addr is None:
            raise ConfigError("launcher: srun started several tasks but no node list is set "
                              "(SLURM_STEP_NODELIST): set MASTER_ADDR")
        return Launch(_int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS"), _int(env, "SLURM_LOCALID", 0),
                      "slurm", addr, port)
    return Launch(0, 1, 0, "none", env.get("MASTER_ADDR"), port)


def backend_for(device_type: str, backend: str = "auto") -> str:
    """strategy.backend resolved: NCCL for CUDA tensors, gloo for CPU ones; NCCL refused on CPU."""
    if backend == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ConfigError("config: strategy.backend=nccl needs CUDA devices (run.device is cpu; use gloo or auto)")
    return backend


def device_for(device_type: str, local_rank: int, visible: int = 0) -> torch.device:
    """One GPU per process, chosen by the local rank (never the global rank: on node 2 of a
    2 x 8 job, rank 9 is cuda:1), modulo the GPUs this process sees (`visible`: `srun
    --gpus-per-task=1` shows each task its own GPU as cuda:0)."""
    if device_type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", local_rank % visible if visible else local_rank)


def process_group_kwargs(launch: Launch, device: torch.device, backend: str, timeout) -> dict:
    """Arguments for `torch.distributed.init_process_group` (the store added by the caller);
    NCCL's communicator is bound to this process's GPU at init (`device_id`)."""
    kw = {"backend": backend_for(device.type, backend), "rank": launch.rank,
          "world_size": launch.world_size, "timeout": timeout}
    if kw["backend"] == "nccl":
        kw["device_id"] = device
    return kw


def backend_flags(device_type: str, tf32: bool, cudnn_benchmark: bool) -> dict:
    """The torch.backends settings for a run: {} on CPU; on CUDA, TF32 for fp32 matmuls and
    convolutions (`tf32`) and cuDNN autotuning of the convolution algorithms (`cudnn_benchmark`)."""
    if device_type != "cuda":
        return {}
    return {"matmul_tf32": tf32, "conv_tf32": tf32, "cudnn_benchmark": cudnn_benchmark}


def apply_backend_flags(flags: dict) -> None:
    """Set what `backend_flags` chose (process-wide). torch >= 2.9 has the fp32_precision
    settings (the allow_tf32 ones are deprecated there); older versions the allow_tf32 ones."""
    if not flags:
        return
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision") and hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        matmul.fp32_precision = "tf32" if flags["matmul_tf32"] else "ieee"
        cudnn.conv.fp32_precision = "tf32" if flags["conv_tf32"] else "ieee"
    else:  # pragma: no cover (torch < 2.9)
        matmul.allow_tf32 = flags["matmul_tf32"]
        cudnn.allow_tf32 = flags["conv_tf32"]
    cudnn.benchmark = flags["cudnn_benchmark"]


def tf32_active(device_type: str, precision: str, tf32: bool) -> bool:
    """Whether the fp32 matmuls of this run run as TF32 (CUDA, fp32 precision, train.tf32)."""
    return device_type == "cuda" and tf32 and precision == "fp32"


def fp16_refusal(device_type: str, precision: str) -> str | None:
    """Why fp16 (mixed or pure) is refused on this device, or None. The GradScaler path itself
    runs on a CPU too (tests drive it there by replacing this function)."""
    if "fp16" in precision and device_type == "cpu":
        return (f"config: train.precision={precision} is refused on CPU (fp16 matmul has no fast path "
                "there, ~1 GFLOP/s); use bf16 or pure_bf16")
    return None


def compile_kwargs(mode: str) -> dict:
    """torch.compile's arguments for train.compile_mode ("default": none)."""
    return {} if mode == "default" else {"mode": mode}


def synchronizer(device: torch.device):
    """What a timer calls before reading the clock: torch.cuda.synchronize on a GPU (kernels run
    asynchronously), nothing on a CPU."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def pin_batches(device_type: str, pin_memory: bool, on_device: bool) -> bool:
    """Host batches are copied through pinned memory (so `non_blocking=True` really overlaps)
    when they go to a GPU from host memory and data.pin_memory is on."""
    return device_type == "cuda" and pin_memory and not on_device


def to_device(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """A host tensor on `device`: through pinned memory when `pin` (an asynchronous copy)."""
    if pin and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
