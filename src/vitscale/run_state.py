"""A training run's checkpoint: what it holds of a run's parts (`RunParts`: strategy, schedule,
progress, task) and the parts put back from one (`vitscale train --resume`). The files themselves (atomic writes, keep-last-N, RNG
states) are checkpoint.py's; the names of a checkpoint's entries and the one reader of them
(`SavedRun`) are state.py's; whether an engine can resume another's is strategy/resume.py's."""

from __future__ import annotations

import copy
import logging
import math
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from torch.optim.lr_scheduler import LambdaLR

from .checkpoint import list_checkpoints, rng_state, save_checkpoint, set_rng_state
from .config import Config, StrategyConfig, load_config, parse_override, saved_config
from .errors import ConfigError, UserError
from .fastpaths import resolve as resolve_fast_paths
from .launch import launch_env, this_process
from .optim import continue_schedule
from .state import (
    CONFIG,
    ENGINE,
    EVALS,
    FORMAT_VERSION,
    KIND,
    PREPROCESS,
    PROGRESS,
    RNG,
    SCHEDULER,
    SPEC,
    STRATEGY,
    TASK,
    VERSION,
    WORLD_SIZE,
    SavedRun,
)
from .strategy import check_launch
from .strategy.base import Strategy
from .strategy.mesh import mesh_shape
from .strategy.resume import check_resume
from .tasks.base import Task

log = logging.getLogger(__name__)

# What a resumed run may not change, by key (a whole section: "model.*"), with the reason; every
# other key takes effect from the resumed step (the optimizer's hyperparameters are re-applied over
# the checkpoint's, the schedule is rebuilt for the new keys). tests/unit/test_resume.py checks
# that every key of the schema is on one side or the other.
AS_WRITTEN = "DeepSpeed reads its engine checkpoint back only as written"
OWN_FOLDER = "--resume continues its own folder (name another one with --out)"
FIXED_ON_RESUME = {
    "model.*": "the checkpoint's weights have its architecture (start a new run from them with "
    "model.init=<vitscale export of it>)",
    "run.seed": "the data order and augmentation of the resumed epochs follow it",
    "run.name": OWN_FOLDER,
    "run.out_dir": OWN_FOLDER,
    "data.name": "the data position and per-sample state count its samples",
    "data.batch_size": "the checkpoint's data position counts batches of its size",
    "data.drop_last": "the checkpoint's data position counts its batches",
    "data.batch_rule": "the run's batch was fitted to its data once, at its start (saved as fixed)",
    "data.train_size": "the data position and per-sample state count its samples",
    "data.val_fraction": "its split decides which samples train",
    "data.val_seed": "its split decides which samples train",
    "data.test_fraction": "its split decides which samples train",
    "data.captions": "the model was trained on its kind of samples",
    "data.image_size": "the model's position embeddings have its size",
    "data.channels": "the model's patch embedding has its channels",
    "data.num_classes": "the model's head has its classes",
    "data.normalize": "the weights were trained on its inputs",
    "data.reader": "the data position counts its order of samples",
    "data.shuffle_buffer": "the data position counts its order of samples",
    "optim.name": "the optimizer state is its optimizer's",
    "optim.layer_decay": "the optimizer state is kept per parameter group, which it decides",
    "train.master_weights": "the checkpoint's optimizer state belongs to its weights' copy",
    "train.loss_scale": "the fp16 loss scale continues from the checkpoint's scaler",
    "strategy.zero_stage": AS_WRITTEN,
    "strategy.offload_optimizer": AS_WRITTEN,
    "strategy.offload_params": AS_WRITTEN,
    "strategy.ds_config": AS_WRITTEN,
    "clip.*": "the per-sample loss state and the temperature continue from the checkpoint's",
}
# exceptions inside a fixed section: these take effect on a resumed run
CHANGEABLE_ON_RESUME = {
    "model.drop_path",
    "model.drop_path_mode",
    "model.patch_dropout",
    "model.patch_dropout_until",
    "model.dropout",
    "model.attention",
    "clip.prompt_templates",
}
# train.precision: autocast modes share one state; pure_* and fp16 keep other state (half weights,
# a loss scaler)
AUTOCAST_ONLY = {"fp32", "bf16", "bf16_act"}


def fixed_reason(key: str) -> str | None:
    """Why a resumed run may not change `key` (section.key), or None where the change takes effect."""
    if key in CHANGEABLE_ON_RESUME:
        return None
    return FIXED_ON_RESUME.get(key) or FIXED_ON_RESUME.get(key.split(".")[0] + ".*")


def config_changes(saved: dict, cfg: Config) -> list[tuple[str, object, object]]:
    """(key, saved value, new value) of every key where `cfg` differs from a checkpoint's config."""
    old = saved_config(saved).to_dict()
    return [
        (f"{sec}.{k}", old[sec][k], v)
        for sec, values in cfg.to_dict().items()
        for k, v in values.items()
        if old[sec][k] != v
    ]


def check_changes(saved: dict, cfg: Config, path) -> list[str]:
    """A one-line ConfigError naming the first key a resumed run may not change; else the changes
    that take effect, as "key old -> new"."""
    changes = config_changes(saved, cfg)
    for key, old, new in changes:
        reason = fixed_reason(key)
        if key == "train.precision" and {old, new} <= AUTOCAST_ONLY:
            reason = None
        elif key == "train.precision":
            reason = (
                "pure half weights and fp16's loss scaler keep state that the other modes do not"
            )
        if reason:
            raise ConfigError(
                f"resume: {key} cannot change on resume ({old!r} in {path}, {new!r} asked): {reason}"
            )
    return [f"{key} {old!r} -> {new!r}" for key, old, new in changes]


@dataclass
class RunProgress:
    """A Trainer's progress counters, saved in every checkpoint (as top-level keys, one per field:
    state.PROGRESS names them) and restored from one: optimizer steps taken, training seconds
    (evaluation and checkpoints not counted), samples seen, the steady-state time and samples (each
    process's first step left out), the best evaluated metric, the last evaluation and every
    evaluation in order (run_report.time_to_target reads them: train.targets)."""

    step: int = 0
    train_time: float = 0.0
    images_seen: int = 0
    steady: list = field(default_factory=lambda: [0.0, 0])
    best_acc: float | None = None
    last_eval: dict | None = None
    evals: list = field(default_factory=list)

    def state_dict(self) -> dict:
        return asdict(self)

    def record_eval(self, result: dict, metric: str, steps_per_epoch: int) -> dict:
        """An evaluation's `result` at the current step kept as the last one (with its step, epoch
        and training time), its `metric` as the best where it is."""
        epoch = self.step / steps_per_epoch
        self.last_eval = {"step": self.step, "epoch": epoch, "train_time_s": self.train_time}
        self.last_eval.update(result)
        self.evals.append(dict(self.last_eval))
        value = result.get(metric)
        if value is not None:
            self.best_acc = value if self.best_acc is None else max(self.best_acc, value)
        return self.last_eval

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            if f.name != EVALS:
                setattr(self, f.name, state[f.name])
        # a checkpoint from before the record of every evaluation: its last one is all it knows
        old = [dict(self.last_eval)] if self.last_eval else []
        self.evals = [dict(e) for e in state.get(EVALS, old)]


class Resume(SavedRun):
    """A checkpoint to continue from, read once (state.SavedRun: the file and what it holds);
    `changes`: the keys this run changes on resume ("key old -> new"), once they are checked (None
    before)."""

    changes: list[str] | None = None


def open_resume(resume) -> Resume:
    """The checkpoint to resume: a file, or a run folder's newest readable checkpoint
    (checkpoint.newest_readable)."""
    return Resume.open(resume, "resuming from", "vitscale train --resume")


# the keys that shape the mesh (strategy/mesh.py): a strategy's own, taken from its defaults by a
# resume onto another strategy where the command line does not set them
MESH_KEYS = ("dp_replicate", "dp_shard", "tp", "sequence_parallel")
FROM_SAVED, FROM_COMMAND = " (from the saved run)", " (from the command line)"


def resumed_config(r: SavedRun, overrides=()) -> tuple[Config, dict[str, str]]:
    """The run's saved config with the overrides (--set), checked; where they name another
    strategy.name, the mesh keys they do not set take that strategy's defaults (the saved run's
    were its own strategy's: the checkpoint itself moves between meshes). With where the strategy
    keys that shape the mesh got a value other than the default: {key: FROM_SAVED or
    FROM_COMMAND} (mesh_shape's `origin`)."""
    given = dict(parse_override(text) for text in overrides)
    saved = copy.deepcopy(r.config_dict)
    strategy = saved.get("strategy", {})
    name = strategy.get("name", StrategyConfig().name)
    if given.get("strategy.name", name) != name:
        for key in MESH_KEYS:
            if f"strategy.{key}" not in given:
                strategy.pop(key, None)
    cfg = saved_config(saved, overrides, source=str(r.path))
    default = StrategyConfig()
    origin = {
        key: FROM_COMMAND if f"strategy.{key}" in given else FROM_SAVED
        for key in ("name", *MESH_KEYS)
        if getattr(cfg.strategy, key) != getattr(default, key)
    }
    return cfg, origin


def check_mesh(cfg: Config, origin: dict[str, str], world_size: int | None = None) -> None:
    """A resumed run's mesh refusal (check_run asks the same later), its values' origins named;
    `world_size` None: this process's launch."""
    world = launch_env(os.environ).world_size if world_size is None else world_size
    check_launch(cfg.strategy.name, world)
    mesh_shape(cfg.strategy, world, origin=origin)


def resume_request(
    resume, overrides=(), out=None, world_size: int | None = None
) -> tuple[Config, Path, Resume]:
    """`vitscale train --resume RUN [--set KEY=VALUE ...] [--out DIR]` in one step: the checkpoint
    (a file, or the folder's newest readable one) read once, the run's saved config with the
    overrides (resumed_config: onto another strategy, its mesh defaults), checked against the
    checkpoint once (what may change on resume, whether this engine can continue it, the mesh over
    `world_size` processes, None: this launch's), and the run folder (its own, or --out). The
    Trainer takes the result as it is: nothing is read or checked twice."""
    r = open_resume(resume)
    cfg, origin = resumed_config(r, overrides)
    cfg = resolve_fast_paths(cfg).cfg  # an auto asked on resume: this machine's answer
    r.changes = check_resumable(r, cfg)
    check_mesh(cfg, origin, world_size)
    return cfg, Path(out) if out else r.run_dir, r


def train_request(
    config, resume, overrides=(), out=None
) -> tuple[Config, Path | None, Resume | None]:
    """What `vitscale train` runs: (config, run folder or None for a new timestamped one, the
    checkpoint to continue or None). A run restarted by torchrun --max-restarts (its
    TORCHELASTIC_RESTART_COUNT) into a --out folder with checkpoints continues from the last
    complete one, said in one line by the main process."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not resume and out and restarts and list_checkpoints(out):
        resume = out
        if this_process().rank == 0:
            print(
                f"vitscale: restart {restarts}: resuming {out} from its last complete checkpoint",
                file=sys.stderr,
            )
    elif resume and config:
        raise UserError(
            "train: give either a CONFIG or --resume DIR (the run's own config is used)"
        )
    if resume:  # the checkpoint read and checked once; the Trainer runs the config's checks
        return resume_request(resume, overrides, out)
    return load_config(config, overrides), Path(out) if out else None, None


@dataclass
class RunParts:
    """The parts of a run that a checkpoint holds, each with its own state_dict/load_state_dict
    (the strategy: weights, optimizer, scaler, EMA; the lr schedule; the progress counters; the
    task's loss state), with the config and model spec that travel with them. The Trainer wires
    them; saving and resuming receive them, not the Trainer."""

    cfg: Config
    strategy: Strategy
    scheduler: LambdaLR
    progress: RunProgress
    task: Task
    spec: Any


def run_state(p: RunParts) -> dict:
    """The checkpoint of a run at its current step (collective: every rank's RNG goes in)."""
    s, progress = p.strategy, p.progress.state_dict()
    return {
        VERSION: FORMAT_VERSION,
        CONFIG: p.cfg.to_dict(),
        STRATEGY: s.state_dict(),
        SCHEDULER: p.scheduler.state_dict(),
        RNG: s.gather_objects(rng_state()),
        WORLD_SIZE: s.world_size,
        **{k: progress[k] for k in PROGRESS},
        SPEC: asdict(p.spec),
        KIND: p.task.kind,
        TASK: p.task.state_dict(),
        PREPROCESS: p.task.preprocess,
    }


class Checkpoints:
    """A run's checkpoint files: step_N.pt (and the engine's own folder beside it: DeepSpeed's
    .ds, FSDP2's sharded .dcp) written from its parts, and the last one written or resumed from."""

    def __init__(self, run_dir: Path, parts: RunParts, keep_last: int):
        self.run_dir, self.parts, self.keep_last = run_dir, parts, keep_last
        self.last: Path | None = None

    def save(self) -> Path:
        """Collective (every rank's RNG goes in, every rank writes its engine shard); the main
        process writes step_N.pt (atomically; the oldest beyond run.keep_last removed, and what
        interrupted saves left); a save the disk refuses is every rank's SaveError."""
        s, step = self.parts.strategy, self.parts.progress.step
        suffix = s.engine_suffix
        if suffix:
            s.save_engine(self.run_dir / "checkpoints" / f"step_{step:08d}{suffix}")
        state = {**run_state(self.parts), ENGINE: suffix}
        # collective: a write the disk refuses is every rank's SaveError
        path = save_checkpoint(
            self.run_dir, step, state, self.keep_last, s.is_main, s.broadcast_object
        )
        self.last = path
        return path

    def saved_at(self, step: int) -> bool:
        return self.last is not None and self.last.name.endswith(f"{step:08d}.pt")

    def last_good(self) -> str:
        """What an error that stops the run says of its checkpoints."""
        if self.last:
            return f"; last good checkpoint: {self.last}"
        return "; no checkpoint was written before it"


def check_resumable(r: Resume, cfg: Config) -> list[str]:
    """Before an engine starts: one line where this config cannot continue the checkpoint (another
    engine's, a key that cannot change); else the changes that take effect."""
    check_resume(r.strategy_name, r.path, cfg.strategy.name)  # where engines cannot resume others
    return check_changes(r.config_dict, cfg, r.path)


def resume_run(p: RunParts, r: Resume) -> None:
    """Built parts continued from the checkpoint `r`: the engine's own folder (.ds, .dcp) where
    there is one, then everything run_state saved; the optimizer's hyperparameters and the
    schedule are this config's, so that the `changes` (check_resumable's) take effect: announced
    in one line."""
    s = p.strategy
    # what the optimizer was built with from this config (lr, weight decay, betas...): loading its
    # state puts the checkpoint's values back, and a key changed on resume must take effect
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in s.optimizer.param_groups]
    folder = r.engine_folder  # the engine's own folder next to it (.ds, .dcp)
    if folder is not None:
        s.load_engine(folder)
    restore_run(p, r, hyper)
    if r.changes and s.is_main:
        step = p.progress.step
        log.warning("resume: %s from step %d with %s", r.run_dir, step, ", ".join(r.changes))


def restore_run(p: RunParts, saved: SavedRun, hyper: list[dict]) -> None:
    """The parts put back from the checkpoint `saved` (the engine's folder already loaded), the
    optimizer's hyperparameters `hyper` over the checkpoint's."""
    s = p.strategy
    s.load_state_dict(saved.strategy_state)
    for group, h in zip(s.optimizer.param_groups, hyper):
        group.update(h)
    # before the schedule: a time-clock schedule reads it
    p.progress.load_state_dict(saved.progress)
    # this config's base lrs and schedule (a new lr, more epochs) at the restored step
    continue_schedule(p.scheduler, saved.scheduler_state, [h["initial_lr"] for h in hyper])
    set_rng_state(saved.rng_for(s.rank, s.world_size))
    try:
        p.task.load_state_dict(saved.task_state)
    except (ValueError, KeyError) as e:  # e.g. a loss state from another version or dataset
        raise UserError(f"checkpoint: {e}") from None


LENGTH_KEYS = ("train.epochs", "run.max_steps")  # what asks a resumed run for more steps


def check_cap(
    cfg: Config, step: int, steps_per_epoch: int, changes: list[str] | None = None
) -> None:
    """A resumed run asked for more steps (`changes`, check_changes' "key old -> new", name
    train.epochs or run.max_steps) that run.max_steps stops where it already is, short of its
    epochs: refused in one line naming the cap, rather than a run that trains nothing and reports
    the old result. Resumed as it was saved, a capped run at its cap is at its end: `fit` finishes
    it (its final evaluation and summary where they are missing) or says it is finished."""
    cap, epochs = cfg.run.max_steps, math.ceil(cfg.train.epochs * steps_per_epoch)
    asked = any(c.split(" ", 1)[0] in LENGTH_KEYS for c in changes or ())
    if asked and cap and step >= cap and epochs > cap:
        raise UserError(
            f"resume: run.max_steps = {cap} caps this run at step {cap}, where it already is, "
            f"short of its {cfg.train.epochs:g} epochs ({epochs} steps): add --set "
            f"run.max_steps=0 to train them (or a larger cap)"
        )
