"""A training run's checkpoint: what it holds of a `Trainer` (loop.py) and the Trainer put back
from one (`vitscale train --resume`). The files themselves (atomic writes, keep-last-N, RNG
states) are checkpoint.py's; whether an engine can resume another's is strategy/resume.py's."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from .checkpoint import load_checkpoint, resolve_checkpoint, rng_state, set_rng_state
from .errors import UserError
from .strategy.resume import check_resume, engine_folder


def run_state(tr) -> dict:
    """The checkpoint of a Trainer at its current step (collective: every rank's RNG goes in)."""
    s = tr.strategy
    return {"version": 1, "config": tr.cfg.to_dict(), "strategy": s.state_dict(),
            "scheduler": tr.scheduler.state_dict(), "rng": s.gather_objects(rng_state()),
            "world_size": s.world_size, "step": tr.step,
            "train_time": tr.train_time, "images_seen": tr.images_seen, "steady": tr.steady,
            "best_acc": tr.best_acc, "last_eval": tr.last_eval, "spec": asdict(tr.spec),
            "kind": tr.task.kind, "task": tr.task.state_dict(), "preprocess": tr.task.preprocess}


def resume_run(tr, resume: str | Path) -> None:
    """A built Trainer continued from the checkpoint `resume` (a file or a run folder): the
    engine's own folder (.ds, .dcp) where there is one, then everything run_state saved."""
    path = resolve_checkpoint(resume)
    state = load_checkpoint(path)
    check_resume(state, path, tr.strategy.name)  # one line where the engines cannot resume each other
    folder = engine_folder(path, state)  # the engine's own folder next to it (.ds, .dcp)
    if folder is not None:
        tr.strategy.load_engine(folder)
    restore_run(tr, state)


def restore_run(tr, state: dict) -> None:
    s, scheduler = tr.strategy, tr.scheduler
    s.load_state_dict(state["strategy"])
    scheduler.load_state_dict(state["scheduler"])
    # the optimizer's lr came from the checkpoint; a resumed run may have a new schedule
    # (e.g. more epochs), so set the lr this schedule gives at the restored step
    for group, base, fn in zip(s.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in s.optimizer.param_groups]
    rngs = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]
    set_rng_state(rngs[s.rank] if len(rngs) == s.world_size else rngs[0])
    tr.step, tr.train_time = state["step"], state["train_time"]
    tr.images_seen, tr.best_acc = state["images_seen"], state["best_acc"]
    tr.steady = state["steady"]
    tr.last_eval = state["last_eval"]
    try:
        tr.task.load_state_dict(state.get("task", {}))
    except (ValueError, KeyError) as e:  # e.g. a loss state from another version or dataset
        raise UserError(f"checkpoint: {e}") from None
