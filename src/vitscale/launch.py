"""Who this process is, from its launcher's environment (torchrun, the deepspeed launcher, srun):
plain parsing, no torch, so that every layer (the CLI's first lines, checkpoint's messages) asks the
same function instead of reading RANK / WORLD_SIZE itself."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "torchrun" (also the deepspeed launcher), "slurm" or "none"
    master_addr: str | None = None
    master_port: int = 29500

    def env(self) -> dict:
        """The env:// variables this launch implies (what torchrun would have set)."""
        out = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_PORT": str(self.master_port),
        }
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
        return Launch(
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            local,
            "torchrun",
            env.get("MASTER_ADDR"),
            port,
        )
    # srun's own step (SLURM_STEP_NUM_TASKS), not the batch script, which has SLURM_NTASKS too
    if "SLURM_PROCID" in env and _int(env, "SLURM_STEP_NUM_TASKS", 1) > 1:
        nodes = (
            env.get("SLURM_STEP_NODELIST")
            or env.get("SLURM_JOB_NODELIST")
            or env.get("SLURM_NODELIST")
        )
        addr = env.get("MASTER_ADDR") or (first_host(nodes) if nodes else None)
        if addr is None:
            raise ConfigError(
                "launcher: srun started several tasks but no node list is set "
                "(SLURM_STEP_NODELIST): set MASTER_ADDR"
            )
        return Launch(
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_STEP_NUM_TASKS"),
            _int(env, "SLURM_LOCALID", 0),
            "slurm",
            addr,
            port,
        )
    return Launch(0, 1, 0, "none", env.get("MASTER_ADDR"), port)


def this_process() -> Launch:
    """launch_env of this process's environment."""
    return launch_env(os.environ)


def is_main_process() -> bool:
    """Rank 0 (or one process): the one that prints what every rank would."""
    return this_process().rank == 0
