"""The one resolver of a recipe's `auto` speed keys for the machine it runs on (issue 39).

- train.precision=auto: bf16 where the device computes bf16 in hardware (a CUDA GPU of compute
  capability 8.0+, a CPU with avx512_bf16 or amx_bf16 in its flags), fp32 elsewhere
  (`strategy.devices.auto_precision`).
- optim.muon_ns_dtype=auto (optim.name=muon): Muon's Newton-Schulz iteration in bf16 where
  train.precision=auto would take bf16, in fp32 elsewhere.
- train.capture=auto: the whole step captured as one CUDA graph (`step`) on one CUDA device in one
  process for a recipe the capture takes (config.capture_refusal, the task's `uncapturable`);
  `none` otherwise, with the reason.
- A recipe's [per_device.CLASS.SECTION] tables (config.DEVICE_CLASSES: cpu, cpu_bf16, cuda): the
  keys of the machine's class set first, over the recipe and under the user's --set (load_config
  drops the keys the command line named), announced and recorded as summary.json's
  "auto"."per_device"; the other classes' tables are dropped.

`resolve` returns the config with every `auto` replaced by its answer, which is what the run
saves (config.toml, every checkpoint) and reports (summary.json's "auto"), so a run is reproduced
from its own config on any machine; keys the user named are never touched. Idempotent: a resolved
config resolves to itself. The Trainer, a resumed run's checks (run_state) and the lab's recipes
all ask here, so the decision is made in one place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from .config import PER_DEVICE, Config, capture_refusal, check, with_device_section
from .launch import launch_env
from .strategy import needs_processes, resolve_device
from .strategy.devices import auto_precision, cpu_has_bf16, device_for
from .tasks import build_task, task_capture_refusal


@dataclass(frozen=True)
class Machine:
    """What the auto keys depend on: the device type, its compute capability and name (CUDA),
    whether the CPU has bf16 instructions, and the number of processes."""

    device_type: str
    capability: tuple[int, int] | None = None
    name: str = ""
    cpu_bf16: bool | None = None
    world_size: int = 1

    def describe(self) -> str:
        if self.device_type == "cuda":
            cc = f", sm_{self.capability[0]}{self.capability[1]}" if self.capability else ""
            return f"cuda ({self.name}{cc})" if self.name else "cuda"
        flags = {True: "bf16 instructions", False: "no bf16 instructions", None: "flags unknown"}[
            self.cpu_bf16
        ]
        return f"cpu ({flags})"


def this_machine(cfg: Config, env: Mapping[str, str] = os.environ) -> Machine:
    """The machine this process trains on, as the strategy will choose its device."""
    launch = launch_env(env)
    device_type = resolve_device(cfg.run.device).type
    if device_type == "cuda":
        dev = device_for("cuda", launch.local_rank, torch.cuda.device_count())
        return Machine(
            "cuda",
            tuple(torch.cuda.get_device_capability(dev)),
            torch.cuda.get_device_name(dev),
            world_size=launch.world_size,
        )
    return Machine("cpu", cpu_bf16=cpu_has_bf16(), world_size=launch.world_size)


def device_class(machine: Machine) -> str:
    """The class of config.DEVICE_CLASSES `machine` is in (a recipe's [per_device.CLASS] tables)."""
    if machine.device_type == "cuda":
        return "cuda"
    return "cpu_bf16" if machine.cpu_bf16 else "cpu"


def device_section(cfg: Config, machine: Machine) -> tuple[Config, tuple[str, str]]:
    """`cfg` with the recipe's table for `machine`'s class applied (and none left), and (the class,
    what it set) for the announcement and summary.json."""
    cls = device_class(machine)
    keys = [
        f"{sec}.{k}={v}"
        for sec, values in cfg.per_device.get(cls, {}).items()
        for k, v in values.items()
    ]
    if keys:
        why = f"{PER_DEVICE}.{cls}: " + ", ".join(keys)
    elif cls in cfg.per_device:
        why = f"{PER_DEVICE}.{cls}: nothing the command line did not set"
    else:
        why = f"{PER_DEVICE}: no table for {cls} (the recipe's: {', '.join(cfg.per_device)})"
    return with_device_section(cfg, cls), (cls, why)


def auto_ns_dtype(machine: Machine) -> tuple[str, str]:
    """optim.muon_ns_dtype=auto: (bf16 or fp32, why): bf16 where train.precision=auto takes it."""
    precision, why = auto_precision(machine.device_type, machine.capability, machine.cpu_bf16)
    return ("bf16" if precision == "bf16" else "fp32"), why


def auto_capture(cfg: Config, machine: Machine) -> tuple[str, str]:
    """train.capture=auto on `machine` for `cfg` (its precision already resolved): (step or none, why)."""
    if machine.world_size > 1 or needs_processes(cfg.strategy.name):
        return (
            "none",
            f"{machine.world_size} processes ({cfg.strategy.name}): the captured step is for one device",
        )
    if machine.device_type != "cuda":
        return (
            "none",
            "a CUDA graph needs a GPU (on a CPU capture=step runs the same uncaptured step)",
        )
    why = capture_refusal(
        replace(cfg, train=replace(cfg.train, capture="step"))
    ) or task_capture_refusal(build_task(cfg), auto=True)
    if why:
        return "none", why
    return "step", "one GPU, one process, a step the capture takes"


@dataclass
class FastPaths:
    """A config with its auto keys resolved, what they became and why, and the machine."""

    cfg: Config
    machine: Machine | None = None  # None: not asked (nothing was auto), `line` asks
    # key -> (value, why): auto keys only
    chosen: dict[str, tuple[str, str]] = field(default_factory=dict)
    data_note: str = ""  # what the recipe's data rule chose (datafit.DataFit.note)

    def fitted(self, fit) -> FastPaths:
        """These fast paths with what the data rule chose (`fit`: a datafit.DataFit)."""
        return replace(self, cfg=fit.cfg, chosen={**self.chosen, **fit.chosen}, data_note=fit.note)

    def record(self) -> dict:
        """summary.json's "auto": {key: {"value", "why"}} of the keys resolved from auto."""
        return {k: {"value": v, "why": why} for k, (v, why) in self.chosen.items()}

    def line(self) -> str:
        """The device and the fast paths the run takes, in one line (auto ones with their reason)."""
        t = self.cfg.train

        def say(key: str, value: str) -> str:
            short = key.split(".")[1]
            if key in self.chosen:
                return f"{short} {value} (auto: {self.chosen[key][1]})"
            return f"{short} {value}"

        compile_ = f"compile {t.compile_mode}" if t.compile else "compile off"
        machine = self.machine or this_machine(self.cfg)
        muon = ""
        if self.cfg.optim.name == "muon":
            muon = f"; {say('optim.muon_ns_dtype', self.cfg.optim.muon_ns_dtype)}"
        section = ""
        if PER_DEVICE in self.chosen:
            section = f"; {self.chosen[PER_DEVICE][1]}"
        data = f"; {self.data_note}" if self.data_note else ""
        return (
            f"fast paths on {machine.describe()}: {say('train.precision', t.precision)}; "
            f"{say('train.capture', t.capture)}; {compile_}{muon}{section}{data}"
        )


def resolve(cfg: Config, machine: Machine | None = None) -> FastPaths:
    """`cfg` with its [per_device] table for `machine` (this one by default) applied and
    train.precision=auto and train.capture=auto answered there, checked again (config.check: a
    resolved key meets the others' rules)."""
    t = cfg.train
    muon_auto = cfg.optim.name == "muon" and cfg.optim.muon_ns_dtype == "auto"
    if "auto" not in (t.precision, t.capture) and not muon_auto and not cfg.per_device:
        return FastPaths(cfg, machine)  # the machine is not asked
    machine = machine or this_machine(cfg)
    chosen = {}
    if cfg.per_device:  # first: a device's table may set the keys below, auto or not
        cfg, chosen[PER_DEVICE] = device_section(cfg, machine)
        t = cfg.train
        muon_auto = cfg.optim.name == "muon" and cfg.optim.muon_ns_dtype == "auto"
    if t.precision == "auto":
        chosen["train.precision"] = auto_precision(
            machine.device_type, machine.capability, machine.cpu_bf16
        )
        cfg = replace(cfg, train=replace(cfg.train, precision=chosen["train.precision"][0]))
    if t.capture == "auto":
        chosen["train.capture"] = auto_capture(cfg, machine)
        cfg = replace(cfg, train=replace(cfg.train, capture=chosen["train.capture"][0]))
    if muon_auto:
        chosen["optim.muon_ns_dtype"] = auto_ns_dtype(machine)
        cfg = replace(cfg, optim=replace(cfg.optim, muon_ns_dtype=chosen["optim.muon_ns_dtype"][0]))
    check(cfg)
    return FastPaths(cfg, machine, chosen)
