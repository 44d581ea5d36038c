"""A training checkpoint's contents as one part: the names of its top-level entries (the one
writer, run_state.run_state and Checkpoints.save, writes them; nothing else spells them) and the
one reader, `SavedRun`, that answers what resume, `vitscale eval` and `export` ask of a checkpoint:
its config, step, task kind, model spec, preprocessing record, task and RNG state, the engine that
wrote it and its engine folder (.ds, .dcp), and its model weights (the EMA ones where asked).

The files themselves (atomic writes, the newest readable one of a run folder) are checkpoint.py's;
which engine resumes which checkpoint, and reading a sharded folder, are strategy/resume.py's."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import torch

from .checkpoint import newest_readable
from .config import Config, saved_config
from .errors import ConfigError, TrainingError
from .strategy.resume import read_dcp, unnamed_engine_suffix
from .tasks import ClassificationTask

# -- the top-level keys of step_N.pt -------------------------------------------------------------
VERSION = "version"  # the checkpoint layout's version (FORMAT_VERSION)
CONFIG = "config"  # the run's config, as a dict (Config.to_dict)
STRATEGY = "strategy"  # the engine's state (Strategy.state_dict: weights, optimizer, EMA...)
SCHEDULER = "scheduler"  # the lr schedule's state
RNG = "rng"  # every rank's RNG states, a list in rank order (one dict in old checkpoints)
WORLD_SIZE = "world_size"  # the processes that wrote it
STEP = "step"  # the progress counters (run_state.RunProgress, one key per field)
TRAIN_TIME = "train_time"
IMAGES_SEEN = "images_seen"
STEADY = "steady"
BEST_ACC = "best_acc"
LAST_EVAL = "last_eval"
EVALS = "evals"  # every evaluation's record, in order (absent before train.targets: from last_eval)
SPEC = "spec"  # the model's spec, as a dict (asdict)
KIND = "kind"  # the task's kind (absent before CLIP: a classifier's)
TASK = "task"  # the task's own state (Task.state_dict: e.g. a loss's per-sample state)
PREPROCESS = "preprocess"  # how the run's test images reached the model (Task.preprocess)
ENGINE = "engine"  # the suffix of the engine's own folder next to the .pt (".ds", ".dcp"), or None

PROGRESS = (STEP, TRAIN_TIME, IMAGES_SEEN, STEADY, BEST_ACC, LAST_EVAL, EVALS)
# every key of a checkpoint, in the order written (run_state.run_state; Checkpoints.save: ENGINE)
KEYS = (
    *(VERSION, CONFIG, STRATEGY, SCHEDULER, RNG, WORLD_SIZE),
    *PROGRESS,
    *(SPEC, KIND, TASK, PREPROCESS, ENGINE),
)
FORMAT_VERSION = 1

# the engine state's weights (Strategy.state_dict): the model's, and the EMA's (AveragedModel's
# state: module.<name>, plus n_averaged)
MODEL, EMA, EMA_PREFIX = "model", "ema", "module."

S = TypeVar("S", bound="SavedRun")


class SavedRun:
    """One checkpoint as read back (`path`: step_N.pt; `state`: what it holds). Made by `open` from
    a checkpoint file or a run folder (its newest readable checkpoint)."""

    def __init__(self, path: str | Path, state: dict):
        self.path, self.state = Path(path), state

    @classmethod
    def open(cls: type[S], checkpoint: str | Path, doing: str, command: str) -> S:
        """The checkpoint file `checkpoint`, or a run folder's newest readable one
        (checkpoint.newest_readable: a damaged one refused or passed over in one line, `doing`
        and `command` name what reads it); one line where the file is not a training checkpoint."""
        path, state = newest_readable(checkpoint, doing, command)
        if not isinstance(state, dict) or CONFIG not in state or STRATEGY not in state:
            raise ConfigError(f"{path} is not a vitscale training checkpoint")
        return cls(path, state)

    @property
    def run_dir(self) -> Path:
        """The run folder it belongs to (RUN/checkpoints/step_N.pt)."""
        return self.path.parent.parent

    @property
    def config_dict(self) -> dict:
        """The config the run saved, as written."""
        return self.state[CONFIG]

    def config(self, overrides=()) -> Config:
        """The run's saved config with `overrides` (--set), checked (config.saved_config)."""
        return saved_config(self.state[CONFIG], overrides, source=str(self.path))

    @property
    def step(self) -> int:
        return self.state[STEP]

    @property
    def progress(self) -> dict:
        """The progress counters (run_state.RunProgress.load_state_dict takes them)."""
        return {k: self.state[k] for k in PROGRESS if k in self.state}

    @property
    def kind(self) -> str:
        """The task kind it names (checkpoints from before CLIP name none: a classifier's)."""
        return self.state.get(KIND, ClassificationTask.kind)

    @property
    def spec(self) -> dict:
        """The model's saved spec, as a dict (Task.spec_from_dict makes it a spec again)."""
        return self.state[SPEC]

    @property
    def preprocess(self) -> dict | None:
        """How the run's test images reached its model, as the run recorded it; None in
        checkpoints from before the record (Task.run_preprocess derives it then)."""
        return self.state.get(PREPROCESS) or None

    @property
    def task_state(self) -> dict:
        """The task's own state (Task.load_state_dict); empty where the checkpoint holds none."""
        return self.state.get(TASK) or {}

    @property
    def strategy_name(self) -> str:
        """The engine that wrote it (its config's strategy.name; the default in older configs)."""
        section = self.state.get(CONFIG, {}).get("strategy", {})  # the config's [strategy]
        return section.get("name", Config().strategy.name)

    @property
    def strategy_state(self) -> dict:
        """The engine's state (Strategy.load_state_dict takes it)."""
        return self.state[STRATEGY]

    @property
    def scheduler_state(self) -> dict:
        return self.state[SCHEDULER]

    @property
    def engine_folder(self) -> Path | None:
        """The engine folder written next to the .pt (DeepSpeed's step_N.ds, FSDP2's sharded
        step_N.dcp), or None when the .pt holds it all."""
        suffix = self.state.get(ENGINE)
        if suffix is None:  # written before checkpoints named their engine folder
            suffix = unnamed_engine_suffix(self.strategy_name)
        return self.path.with_suffix(suffix) if suffix else None

    def rng_for(self, rank: int, world_size: int) -> dict:
        """The RNG states for process `rank` of `world_size`: its own where the run had as many
        processes, else the first process's."""
        rngs = self.state[RNG] if isinstance(self.state[RNG], list) else [self.state[RNG]]
        return rngs[rank] if len(rngs) == world_size else rngs[0]

    def model_weights(self) -> dict:
        """The model's weights: in the .pt, or consolidated here from a sharded engine folder
        (FSDP2's step_N.dcp; kept in `state` once read)."""
        sd, folder = self.state[STRATEGY], self.engine_folder
        if MODEL not in sd and folder is not None:
            sd[MODEL] = read_dcp(folder, keys={MODEL})[MODEL]
        return sd[MODEL]

    def weights(self, use_ema: bool) -> dict:
        """The model weights for eval and export (the EMA ones where asked and saved, their
        AveragedModel prefix taken off); a one-line refusal where any is not finite (a checkpoint
        written before training checked its state when saving)."""
        sd = self.state[STRATEGY]
        if use_ema and EMA in sd:
            n = len(EMA_PREFIX)
            weights = {k[n:]: v for k, v in sd[EMA].items() if k.startswith(EMA_PREFIX)}
        else:
            weights = self.model_weights()
        bad = [
            k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()
        ]
        if bad:
            raise TrainingError(
                f"{self.path} holds non-finite weights ({len(bad)} of {len(weights)} tensors, "
                f"e.g. {bad[0]}): an update overflowed before it was written; use an earlier "
                "checkpoint of the run"
            )
        return weights
