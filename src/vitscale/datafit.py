"""The recipe's keys that follow the data (issue 59): data.batch_rule=min_steps fits the global batch
(and, at the smallest batch it takes, the epochs) to the training set's size, so that a recipe
searched on 60,000 images still gives a set of a few thousand the optimizer steps it needs
(train.min_steps). Resolved once, before the engine starts (the lr follows the batch by
optim.lr_scaling), announced on the fast-paths line, recorded in summary.json's "auto" and saved
in the run's config.toml as the batch and epochs it gave, with the rule set to fixed: a resume or
a rerun from that file does the same on any machine. A batch that is fixed (the recipe's, or one
named on the command line) is never changed: where it gives fewer steps than train.min_steps, that
is said in one line."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from .config import Config
from .errors import DataError


@dataclass(frozen=True)
class DataFit:
    """`cfg` with the batch and epochs the rule chose; `chosen`: {key: (value, why)} of the keys it
    changed (summary.json's "auto"); `note`: what the fast-paths line says of it ("" = nothing)."""

    cfg: Config
    chosen: dict
    note: str = ""


def epoch_batches(train_size: int, batch: int, drop_last: bool) -> int:
    """Optimizer steps per epoch of `train_size` samples at global batch `batch` (the sampler's)."""
    return train_size // batch if drop_last else -(-train_size // batch)


def total_steps(epochs: float, per_epoch: int) -> int:
    """The run's optimizer steps over `epochs` (loop.plan_steps' count, before run.max_steps)."""
    return math.ceil(epochs * per_epoch)


def candidates(batch: int, unit: int) -> list[int]:
    """The batches the rule may take, largest first: `batch`, its half, quarter, ... while each is
    a whole number of per-process micro-batches (`unit` = data-parallel processes x accumulation
    steps)."""
    out = [batch]
    while out[-1] % 2 == 0 and (out[-1] // 2) % unit == 0:
        out.append(out[-1] // 2)
    return out


def fit_batch(
    train_size: int,
    batch: int,
    epochs: float,
    min_steps: int,
    min_batch: int,
    unit: int,
    drop_last: bool,
) -> tuple[int, float]:
    """(batch, epochs) by data.batch_rule=min_steps: the largest candidate batch, not above the
    training set's size nor below `min_batch`, whose `epochs` give `min_steps` optimizer steps;
    where none does, the smallest such batch and the epochs that give `min_steps`. A set smaller
    than `min_batch` takes the largest candidate that fits it; a set smaller than any candidate
    (fewer samples than one micro-batch per process) is a one-line DataError."""
    fits = [b for b in candidates(batch, unit) if b <= train_size]
    if not fits:
        raise DataError(
            f"data.batch_rule=min_steps: the training set has {train_size} samples, fewer than "
            f"the smallest batch the rule can take from data.batch_size={batch} "
            f"({candidates(batch, unit)[-1]}: one micro-batch of each of {unit} processes x "
            "accumulation steps)"
        )
    usable = [b for b in fits if b >= min_batch] or fits[:1]
    for b in usable:
        if total_steps(epochs, epoch_batches(train_size, b, drop_last)) >= min_steps:
            return b, epochs
    b = usable[-1]
    per_epoch = epoch_batches(train_size, b, drop_last)
    longer = min_steps / per_epoch
    # exactly min_steps steps, whichever way the division rounded
    while total_steps(longer, per_epoch) > min_steps:
        longer = math.nextafter(longer, -math.inf)
    while total_steps(longer, per_epoch) < min_steps:
        longer = math.nextafter(longer, math.inf)
    return b, longer


def fit_to_data(cfg: Config, train_size: int | None, dp_size: int) -> DataFit:
    """`cfg` with data.batch_rule applied for a training set of `train_size` samples (None: not
    known before the run) split over `dp_size` data-parallel processes."""
    d, t = cfg.data, cfg.train
    if d.batch_rule == "fixed":
        return DataFit(cfg, {}, fixed_note(cfg, train_size))
    if train_size is None:
        note = (
            f"batch {d.batch_size} as the recipe names it (data.batch_rule=min_steps: data.name="
            f"{d.name} tells its size only when read)"
        )
        return DataFit(replace(cfg, data=replace(d, batch_rule="fixed")), {}, note)
    unit = dp_size * t.accum_steps
    batch, epochs = fit_batch(
        train_size, d.batch_size, t.epochs, t.min_steps, d.min_batch_size, unit, d.drop_last
    )
    steps = total_steps(epochs, epoch_batches(train_size, batch, d.drop_last))
    said = (
        f"data.batch_rule=min_steps: {train_size} training samples, {steps} steps over "
        f"{epochs:.4g} epochs for train.min_steps={t.min_steps}"
    )
    chosen = {}
    if batch != d.batch_size:
        chosen["data.batch_size"] = (batch, said)
    if epochs != t.epochs:
        chosen["train.epochs"] = (epochs, said)
    out = replace(
        cfg, data=replace(d, batch_size=batch, batch_rule="fixed"), train=replace(t, epochs=epochs)
    )
    was = "" if batch == d.batch_size else f" (of data.batch_size={d.batch_size})"
    longer = "" if epochs == t.epochs else f", {epochs:.4g} epochs (of train.epochs={t.epochs:g})"
    return DataFit(out, chosen, f"batch {batch}{was}{longer} ({said})")


def fixed_note(cfg: Config, train_size: int | None) -> str:
    """A fixed batch that gives fewer than train.min_steps steps, said (the batch is kept)."""
    d, t = cfg.data, cfg.train
    if not t.min_steps or not train_size or d.batch_size > train_size:
        return ""  # loop.plan_steps refuses a batch larger than the set in its own words
    steps = total_steps(t.epochs, epoch_batches(train_size, d.batch_size, d.drop_last))
    if steps >= t.min_steps:
        return ""
    return (
        f"data.batch_size={d.batch_size} gives {steps} steps over {t.epochs:g} epochs of "
        f"{train_size} training samples, fewer than train.min_steps={t.min_steps}: the batch is "
        "kept as named (data.batch_rule=min_steps would fit it to the data)"
    )


def world_dp_size(cfg: Config) -> int:
    """The data-parallel processes this launch gives `cfg`'s mesh (tensor-parallel groups share a
    batch), known before any engine starts."""
    from .launch import launch_env
    from .strategy.mesh import mesh_shape

    return mesh_shape(cfg.strategy, launch_env(os.environ).world_size).dp


def fit_run(cfg: Config) -> DataFit:
    """`fit_to_data` for this launch: the training set counted (data.build.train_count) only where
    the rule or train.min_steps asks."""
    if cfg.data.batch_rule == "fixed" and not cfg.train.min_steps:
        return DataFit(cfg, {})
    from .data.build import train_count

    return fit_to_data(cfg, train_count(cfg.data, cfg.run.seed), world_dp_size(cfg))
