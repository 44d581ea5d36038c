"""The recipe as the lab's commands run it: read quietly, its auto keys answered for this machine
(`lab_config`), changed by dotted keys
(`with_overrides`), its dataset swapped for synthetic images (`synthetic_data`); the commands'
count checks and progress lines (`log`)."""

from __future__ import annotations

import copy
import sys

from ..config import check, load_config, set_override, set_value
from ..errors import UserError
from ..fastpaths import resolve as resolve_fast_paths
from ..launch import is_main_process, this_process
from ..strategy import default_for, needs_processes
from ..tasks import build_task, check_config


def log(msg: str) -> None:
    """Progress for humans: stderr, main process only."""
    if is_main_process():
        print(msg, file=sys.stderr, flush=True)


def lab_config(path, overrides, resolve: bool = True):
    """The recipe + overrides, quiet (no progress bar, no TensorBoard); under a multi-process
    launcher a `single` strategy would train N independent copies, so it becomes `ddp`.
    `resolve=False`: its auto keys and [per_device] tables left for `with_overrides` to answer
    after the keys it sets (a search trial's optim.name decides what optim.muon_ns_dtype=auto is)."""
    cfg = load_config(path, overrides)
    set_value(cfg, "run.progress", "off")
    set_value(cfg, "run.tensorboard", False)
    world_size = this_process().world_size
    if world_size > 1 and not needs_processes(cfg.strategy.name):
        log(
            f"launched with several processes and strategy.name={cfg.strategy.name}: using "
            f"strategy.name={default_for(world_size)}"
        )
        set_value(cfg, "strategy.name", default_for(world_size))
    check(cfg)
    # the lab measures what training would run on this machine (its reports hold the resolved config)
    return check_config(resolve_fast_paths(cfg).cfg) if resolve else cfg


def with_overrides(cfg, overrides: dict, resolve: bool = True):
    """A copy of `cfg` with {dotted key: value} set and checked (ConfigError if it does not validate);
    an auto key set here is answered for this machine, as training would (`resolve=False`: left)."""
    out = copy.deepcopy(cfg)
    for k, v in overrides.items():
        set_override(out, k, v)  # over the recipe's [per_device] tables too
    check(out)
    return check_config(resolve_fast_paths(out).cfg) if resolve else out


def check_counts(**counts) -> None:
    for name, (value, lo) in counts.items():
        if value < lo:
            raise UserError(f"--{name.replace('_', '-')} must be >= {lo}, got {value}")


def synthetic_data(cfg):
    """`cfg` with its image dataset swapped for synthetic images of the same shape (image size,
    channels, classes; data/sources/synthetic.py), one global batch of them: what `--synthetic` times, so
    that a machine without the dataset (an ImageNet folder on a rented GPU) measures the recipe's
    step. Image-text recipes (CLIP) get synthetic images captioned from their labels (ClipTask)."""
    overrides = build_task(cfg).synthetic_overrides()
    return cfg if overrides is None else with_overrides(cfg, overrides)
