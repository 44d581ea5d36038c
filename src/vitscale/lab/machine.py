"""The machine and the software a measurement ran on: the device's name, cores and torch threads,
the versions of Python, torch, vitscale (and DeepSpeed where installed), the process's peak memory."""

from __future__ import annotations

import os
import platform
import resource
from importlib import metadata
from pathlib import Path

import torch


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
    return {
        "device": device.type,
        "name": name,
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
    }


def machine_line(device: torch.device) -> str:
    h = hardware_info(device)
    return (
        f"{h['name']} ({h['cores']} cores, {h['threads']} torch threads), {h['device']}, "
        f"torch {torch.__version__}"
    )


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    # metadata, not an import: deepspeed takes seconds to import
    for pkg in ("vitscale", "deepspeed"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            if pkg == "vitscale":
                out[pkg] = "unknown"
    return out


def max_rss_bytes() -> int:
    """The process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
