"""Every device- and launcher-dependent decision as a function of plain inputs (an environment
mapping, a device type, a backend name, a precision), so that tests drive the CUDA, NCCL and
multi-node branches on a CPU machine; the strategies only apply what these return.

- who this process is (rank, world size, local rank from torchrun, the deepspeed launcher, or SLURM's
  `srun` without torchrun) is `vitscale.launch.launch_env`, torch-free, below every layer that asks.
- `process_group_kwargs`: backend (NCCL on GPUs, gloo on CPUs) and, for NCCL, the device bound
  at init (`device_id`: eager NCCL communicator, no "guessing device" warnings, no rank on GPU 0).
- `backend_flags` / `apply_backend_flags`: TF32 and cuDNN autotuning (CUDA only; the CPU's flags are
  never touched, so CPU numerics do not depend on them), set through the legacy API only, which
  torch.compile reads (`backend_readers` / `readers_agree` check both kinds of reader);
  `backend_flags_applied`: a block under given flags, restored after (the lab's timed rounds).
- `compile_kwargs`: torch.compile's mode (CUDA graphs: "reduce-overhead").
- `fp16_refusal`, `warn_slow_bf16`: half precisions on a CPU (fp16 refused; bf16 announced where the
  CPU has no bf16 instructions, as /proc/cpuinfo says).
- `auto_precision`: what train.precision=auto means on a device (bf16 where it is hardware, else fp32).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import ConfigError
from ..launch import Launch, launch_env

# torch.compile modes that capture CUDA graphs (replayed as one launch: for launch-bound small models)
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


class LauncherWatch:
    """Notices that the launcher which started this process (torchrun, the deepspeed launcher:
    RANK and WORLD_SIZE in the environment) is gone, killed or preempted: the process was handed to
    another parent, and is an orphan that must not go on training and writing its run folder."""

    def __init__(self, env: Mapping[str, str] = os.environ):
        self.parent = os.getppid() if launch_env(env).launcher == "torchrun" else None

    def gone(self) -> bool:
        """One system call: cheap enough for every step."""
        return self.parent is not None and os.getppid() != self.parent


def backend_for(device_type: str, backend: str = "auto") -> str:
    """strategy.backend resolved: NCCL for CUDA tensors, gloo for CPU ones; NCCL refused on CPU."""
    if backend == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ConfigError(
            "config: strategy.backend=nccl needs CUDA devices (run.device is cpu; use gloo or auto)"
        )
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
    kw = {
        "backend": backend_for(device.type, backend),
        "rank": launch.rank,
        "world_size": launch.world_size,
        "timeout": timeout,
    }
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
    """Set what `backend_flags` chose (process-wide), through ONE API: the legacy one,
    `torch.backends.cuda.matmul.allow_tf32` and `torch.backends.cudnn.allow_tf32`.
    torch >= 2.9 also has per-backend `fp32_precision` settings, but once those are set to TF32 the
    legacy readers raise ("mix of the legacy and new APIs"), and torch.compile reads the legacy ones
    (inductor's autotuning keys: `torch.get_float32_matmul_precision()`; its conv templates:
    `torch.backends.cudnn.allow_tf32`). The legacy setters also update the new settings (torch
    2.13: matmul.allow_tf32 = True is get_float32_matmul_precision() "high" and
    matmul.fp32_precision "tf32"), so after this both kinds of reader work and agree
    (`readers_agree`); this API exists on every torch the project supports. matmul.allow_tf32
    rather than set_float32_matmul_precision("high"): the latter also sets oneDNN's CPU matmuls
    to TF32 on torch 2.13. Settings already in effect are not written again, so re-applying the
    flags a process already runs under (the lab does, before each timed round) changes nothing."""
    if not flags:
        return
    now = current_backend_flags()
    consistent = readers_agree()
    if not consistent or now["matmul_tf32"] != flags["matmul_tf32"]:
        torch.backends.cuda.matmul.allow_tf32 = flags["matmul_tf32"]
    if not consistent or now["conv_tf32"] != flags["conv_tf32"]:
        torch.backends.cudnn.allow_tf32 = flags["conv_tf32"]
    if now["cudnn_benchmark"] != flags["cudnn_benchmark"]:
        torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]


def current_backend_flags() -> dict:
    """The process's settings in `backend_flags`' form (on a CPU too: they are Python-side
    settings). Read from the per-backend `fp32_precision` settings where torch has them (those
    readers never raise, and the kernels follow them); from the allow_tf32 ones on older torch."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision") and hasattr(
        getattr(cudnn, "conv", None), "fp32_precision"
    ):
        m, c = matmul.fp32_precision == "tf32", cudnn.conv.fp32_precision == "tf32"
    else:  # pragma: no cover (torch < 2.9)
        m, c = matmul.allow_tf32, cudnn.allow_tf32
    return {"matmul_tf32": m, "conv_tf32": c, "cudnn_benchmark": cudnn.benchmark}


def backend_readers() -> dict:
    """Every reader of the TF32 settings that torch or torch.compile may call, {name: value, or
    the RuntimeError's text where it raises}: the legacy ones (`get_float32_matmul_precision`,
    `allow_tf32`) and the per-backend `fp32_precision` ones."""
    readers = {
        "get_float32_matmul_precision": torch.get_float32_matmul_precision,
        "cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    }
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        readers.update(
            {
                "cuda.matmul.fp32_precision": lambda: torch.backends.cuda.matmul.fp32_precision,
                # set on torch's CudnnModule at runtime; the module's own annotations omit `conv`
                "cudnn.conv.fp32_precision": lambda: torch.backends.cudnn.conv.fp32_precision,  # pyright: ignore[reportAttributeAccessIssue]
            }
        )
    out = {}
    for name, read in readers.items():
        try:
            out[name] = read()
        except RuntimeError as e:
            out[name] = f"RuntimeError: {e}"
    return out


def readers_agree() -> bool:
    """Whether every reader in `backend_readers` works and they tell the same TF32 state."""
    r = backend_readers()
    if any(isinstance(v, str) and v.startswith("RuntimeError") for v in r.values()):
        return False
    matmul = {r["get_float32_matmul_precision"] != "highest", r["cuda.matmul.allow_tf32"]}
    conv = {r["cudnn.allow_tf32"]}
    if "cuda.matmul.fp32_precision" in r:
        matmul.add(r["cuda.matmul.fp32_precision"] == "tf32")
        conv.add(r["cudnn.conv.fp32_precision"] == "tf32")
    return len(matmul) == 1 and len(conv) == 1


@contextmanager
def backend_flags_applied(flags: dict):
    """Run a block under `flags` (`apply_backend_flags`), the process's settings restored after;
    {} (a CPU run) touches nothing."""
    if not flags:
        yield
        return
    before = current_backend_flags()
    apply_backend_flags(flags)
    try:
        yield
    finally:
        apply_backend_flags(before)


def fp16_refusal(device_type: str, precision: str) -> str | None:
    """Why fp16 (mixed or pure) is refused on this device, or None. The GradScaler path itself
    runs on a CPU too (tests drive it there by replacing this function)."""
    if "fp16" in precision and device_type == "cpu":
        return (
            f"config: train.precision={precision} is refused on CPU (fp16 matmul has no fast path "
            "there, ~1 GFLOP/s); use bf16 or pure_bf16"
        )
    return None


log = logging.getLogger(__name__)
BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 (AVX-512 BF16, AMX), aarch64 (BF16)


@functools.cache
def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU has bf16 matmul instructions (its flags in /proc/cpuinfo); None where
    that cannot be read (not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    flags = {
        f
        for line in text.splitlines()
        if line.startswith(("flags", "Features"))
        for f in line.split()
    }
    return bool(flags & BF16_CPU_FLAGS)


def auto_precision(
    device_type: str, capability: tuple[int, int] | None = None, cpu_bf16: bool | None = None
) -> tuple[str, str]:
    """train.precision=auto: (the precision, why in a few words). bf16 where the device computes
    bf16 in hardware: a CUDA GPU of compute capability 8.0 and up (Ampere and later: bf16 tensor
    cores), a CPU with bf16 instructions (`cpu_bf16`: `cpu_has_bf16()`, AVX512_BF16 or AMX on x86);
    fp32 everywhere else (a CPU without them emulates bf16 matmuls, tens of times slower than fp32)."""
    if device_type == "cuda":
        cc = "compute capability " + (".".join(map(str, capability)) if capability else "unknown")
        if capability is not None and tuple(capability) >= (8, 0):
            return "bf16", f"{cc}: bf16 tensor cores"
        return "fp32", f"{cc}: no bf16 tensor cores (8.0+)"
    if cpu_bf16:
        return "bf16", "the CPU has bf16 instructions"
    if cpu_bf16 is None:
        return "fp32", "the CPU's flags cannot be read (no /proc/cpuinfo)"
    return (
        "fp32",
        "the CPU has no bf16 instructions (avx512_bf16, amx_bf16): bf16 would be emulated",
    )


def warn_slow_bf16(device_type: str, precision: str) -> None:
    """One line, once per process, where bf16 on this CPU has no instructions of its own: torch then
    emulates bf16 matmuls, tens of times slower than fp32 (1.3 vs 91 GFLOP/s measured on an AVX2
    EPYC), and a recipe's bf16 (the default one's) is the slow choice there."""
    if device_type == "cpu" and "bf16" in precision and cpu_has_bf16() is False and not _warned:
        _warned.append(True)
        log.warning(
            "train.precision=%s on a CPU without bf16 instructions (no avx512_bf16 or amx_bf16 in "
            "/proc/cpuinfo): its bf16 matmuls are emulated, tens of times slower than fp32; "
            "--set train.precision=fp32 trains faster on this machine",
            precision,
        )


_warned: list = []


CUDA_SDPA = ("cudnn", "efficient")  # scaled_dot_product_attention kernels that exist on CUDA only


def sdpa_refusal(device_type: str, backend: str) -> str | None:
    """Why train.sdpa_backend cannot run on this device, or None."""
    if backend in CUDA_SDPA and device_type != "cuda":
        return (
            f"config: train.sdpa_backend={backend} is a CUDA kernel; on {device_type} use auto, flash or "
            "math"
        )
    return None


def sdpa_context(backend: str):
    """The context that restricts scaled_dot_product_attention to train.sdpa_backend's kernel
    (a null context for auto)."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [
            {
                "flash": SDPBackend.FLASH_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH,
            }[backend]
        ]
    )


def compile_kwargs(mode: str) -> dict:
    """torch.compile's arguments for train.compile_mode ("default": none)."""
    return {} if mode == "default" else {"mode": mode}
