"""Peak matmul throughput for MFU: a table of dense peaks for known GPUs, measured on CPUs."""
from __future__ import annotations

import time

import torch

# dense (no sparsity) tensor-core peaks in FLOP/s from NVIDIA's datasheets: {name fragment: {dtype:
# peak}}. The first fragment found in torch.cuda.get_device_name() wins, so the specific variants
# come first ("NVIDIA H100 PCIe" before "H100", "L40S" before "L4", "A100" before "A10").
GPU_PEAKS = {
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12, "tf32": 378e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12, "tf32": 418e12},
    "H200 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12, "tf32": 418e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 494e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 494e12},  # SXM ("H100 80GB HBM3")
    "B200": {"bf16": 2250e12, "fp16": 2250e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12, "tf32": 156e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "L40": {"bf16": 181e12, "fp16": 181e12, "fp32": 90.5e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
}


def precision_dtype(precision: str) -> str:
    return "bf16" if "bf16" in precision else "fp16" if "fp16" in precision else "fp32"


def gpu_peak(name: str, dtype: str) -> float | None:
    for key, peaks in GPU_PEAKS.items():
        if key in name:
            return peaks.get(dtype)
    return None


def measure_matmul_peak(device: torch.device, dtype: str = "fp32", n: int = 1024, seconds: float = 1.0) -> float:
    """Best FLOP/s of square n x n matmuls over about `seconds` (the machine's usable peak)."""
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        a @ b
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        sync()
        best = max(best, 4 * 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s, where it came from) for the precision the model computes in."""
    dtype = precision_dtype(precision)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name, dtype)
        if peak:
            return peak, f"table: {name} dense {dtype}"
        return measure_matmul_peak(device, dtype, n=4096), f"measured {dtype} matmul on {name}"
    return measure_matmul_peak(device, dtype), f"measured {dtype} matmul on CPU ({torch.get_num_threads()} threads)"
