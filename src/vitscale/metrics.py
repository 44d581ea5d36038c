"""Run outputs and measures: metrics.jsonl, TensorBoard events, console progress (bar on a
terminal, plain log lines otherwise), the timers' device synchronizer, and MFU with the peak FLOP/s
it divides by (a table of dense peaks for known GPUs, measured on CPUs). Knows no engine: the
number formats come from precision.py."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from .precision import DTYPES, compute_dtype_name, tf32_active

log = logging.getLogger(__name__)


class MetricsLog:
    """Appends one JSON object per line to run_dir/metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, resumed_at: int = 0):
        """`resumed_at`: the step a resumed run continues from. The records of later steps, written
        before the resume (the run had gone further than the checkpoint it resumes), are no longer
        the run's: they move to metrics_superseded.jsonl, and TensorBoard purges them (purge_step)."""
        self.path = Path(run_dir) / "metrics.jsonl"
        if resumed_at:
            self.supersede_after(resumed_at)
        self.file = open(self.path, "a", buffering=1)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(
                    str(Path(run_dir) / "tb"), purge_step=resumed_at + 1 if resumed_at else None
                )
            except ImportError:  # tensorboard not installed: JSONL still has everything
                self.tb = None

    def supersede_after(self, step: int) -> int:
        """Moves the records of steps after `step` to metrics_superseded.jsonl (each with
        "superseded_at": the step resumed from); returns how many, announced in one line."""
        if not self.path.is_file():
            return 0
        records = [
            (x, json.loads(x)) for x in self.path.read_text().splitlines(keepends=True) if x.strip()
        ]
        later = [r for _, r in records if r.get("step", 0) > step]
        if later:
            with open(self.path.with_name("metrics_superseded.jsonl"), "a") as f:
                f.writelines(json.dumps({**r, "superseded_at": step}) + "\n" for r in later)
            kept = [x for x, r in records if r.get("step", 0) <= step]
            tmp = self.path.with_name(".metrics.jsonl.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.path)
            log.warning(
                "metrics.jsonl: %d record(s) of steps after %d, written before this resume, moved to "
                "metrics_superseded.jsonl",
                len(later),
                step,
            )
        return len(later)

    def log(self, record: dict, prefix: str = "train") -> None:
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if (
                    k not in ("step", "kind")
                    and isinstance(v, (int, float))
                    and not isinstance(v, bool)
                ):
                    self.tb.add_scalar(f"{prefix}/{k}", v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


class NullLog:
    """What ranks other than the main one log: nothing."""

    def log(self, record: dict, prefix: str = "train") -> None:
        pass

    def close(self) -> None:
        pass


class Progress:
    """A rich progress bar with loss, throughput and ETA on a terminal; plain lines otherwise."""

    def __init__(self, total: int, mode: str = "auto", start: int = 0, every: int = 50):
        self.total, self.every, self.done = total, every, start
        self.mode = ("bar" if sys.stderr.isatty() else "plain") if mode == "auto" else mode
        self.t0, self.start = time.perf_counter(), start
        self.bar = None
        if self.mode == "bar":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                transient=False,
            )
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def eta(self) -> float:
        rate = (self.done - self.start) / max(1e-9, time.perf_counter() - self.t0)
        return (self.total - self.done) / rate if rate > 0 else float("nan")

    def update(self, step: int, info: str) -> None:
        self.done = step
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif self.mode == "plain" and (step % self.every == 0 or step == self.total):
            print(
                f"step {step}/{self.total} {info} eta {self.eta():.0f}s",
                file=sys.stderr,
                flush=True,
            )

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text)
        elif self.mode != "off":
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def synchronizer(device: torch.device):
    """What a timer calls before reading the clock: torch.cuda.synchronize on a GPU (kernels run
    asynchronously), nothing on a CPU."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


# dense (no sparsity) tensor-core peaks in FLOP/s from NVIDIA's datasheets: {name fragment: {dtype:
# peak}}. The first fragment found in torch.cuda.get_device_name() wins, so the specific variants
# come first ("NVIDIA H100 PCIe" before "H100", "L40S" before "L4", "A100" before "A10").
GPU_PEAKS = {
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12, "tf32": 378e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12, "tf32": 418e12},
    "H200 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12, "tf32": 418e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 494e12},
    # SXM ("H100 80GB HBM3")
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 494e12},
    "B200": {"bf16": 2250e12, "fp16": 2250e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12, "tf32": 156e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12, "tf32": 183e12},
    "L40": {"bf16": 181e12, "fp16": 181e12, "fp32": 90.5e12, "tf32": 90.5e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12, "tf32": 60e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12, "tf32": 62.5e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12, "tf32": 82.6e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},  # V100 and T4 have no TF32: fp32 matmuls stay fp32
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
}
NO_TF32 = ("V100", "T4")  # pre-Ampere: train.tf32 changes nothing there


def gpu_peak_flops(name: str, dtype: str, measure) -> tuple[float, str]:
    """A GPU's peak for `dtype` from the datasheet table by its name, else `measure()`d (a GPU
    the table lacks; TF32 is then measured as fp32 matmuls under the run's TF32 setting)."""
    peak = gpu_peak(name, dtype)
    if peak:
        shown = "fp32 (no TF32 on this GPU)" if table_dtype(name, dtype) != dtype else dtype
        return peak, f"table: {name} dense {shown}"
    return measure(), f"measured {dtype} matmul on {name}"


def table_dtype(name: str, dtype: str) -> str:
    """The number format the GPU really runs `dtype` in: fp32 for TF32 on a GPU without it."""
    return "fp32" if dtype == "tf32" and any(key in name for key in NO_TF32) else dtype


def gpu_peak(name: str, dtype: str) -> float | None:
    dtype = table_dtype(name, dtype)
    for key, peaks in GPU_PEAKS.items():
        if key in name:
            return peaks.get(dtype)
    return None


def fitted_size(n: int, budget: float, seconds_at, smallest: int = 128) -> int:
    """The largest of n, n/2, n/4, ... (not below `smallest`) whose matmul takes at most `budget`
    seconds (`seconds_at(size)` runs one and says how long it took)."""
    while seconds_at(n) > budget and n > smallest:
        n //= 2
    return n


def measure_matmul_peak(
    device: torch.device, dtype: str = "fp32", n: int = 1024, seconds: float = 1.0
) -> float:
    """Best FLOP/s of square n x n matmuls over about `seconds` (the machine's usable peak). Where one
    n x n matmul alone takes over seconds / 8 (bf16 emulated on a CPU without bf16 instructions:
    about 1 s at n = 1024, 1-2 GFLOP/s), n is halved until it does not (down to 128), so that the
    measurement stays near `seconds` instead of costing several seconds at the end of every run."""
    dt = DTYPES[dtype]
    sync = synchronizer(device)

    def operands(size: int):
        return torch.randn(size, size, device=device).to(dt), torch.randn(
            size, size, device=device
        ).to(dt)

    def one_matmul(size: int) -> float:
        a, b = operands(size)
        a @ b  # the first call: library and kernel set-up
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        return time.perf_counter() - t0

    n = fitted_size(n, seconds / 8, one_matmul)
    a, b = operands(n)
    a @ b
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        sync()
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def peak_flops(device: torch.device, precision: str, tf32: bool = False) -> tuple[float, str]:
    """(peak FLOP/s, where it came from) for the precision the model computes in; `tf32`:
    train.tf32 (fp32 matmuls on a GPU then run at the TF32 peak)."""
    dtype = compute_dtype_name(precision, tf32_active(device.type, precision, tf32))
    if device.type == "cuda":
        return gpu_peak_flops(
            torch.cuda.get_device_name(device),
            dtype,
            lambda: measure_matmul_peak(device, "fp32" if dtype == "tf32" else dtype, n=4096),
        )
    return measure_matmul_peak(
        device, dtype
    ), f"measured {dtype} matmul on CPU ({torch.get_num_threads()} threads)"


def mfu(flops_per_sample: float, samples_per_s: float, peak: float, world_size: int) -> float:
    """Model FLOP utilization: training FLOPs (3x forward: forward + backward of activations and
    weights) done per second over the peak of all devices."""
    return 3 * flops_per_sample * samples_per_s / (peak * world_size)
