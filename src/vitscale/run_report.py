"""What a run reports, given the facts rather than the Trainer: the train log record of a log step,
the run in one line, summary.json, and the summary of a run stopped by a signal or resumed at its
end. The Trainer builds its `RunFacts` once it is built; its progress record (run_state.RunProgress)
and its last checkpoint are passed as they stand."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import Config
from .fastpaths import FastPaths
from .metrics import mfu, peak_flops
from .precision import tf32_active
from .run_state import RunProgress
from .strategy import Strategy
from .strategy.mesh import DIMS, mesh_shape
from .tasks.base import Task


@dataclass
class Window:
    """Time, global samples, data-wait time and skipped steps (a device tensor where the strategy
    keeps it there) since the last train log record."""

    seconds: float = 0.0
    images: int = 0
    data_s: float = 0.0
    skipped: int | torch.Tensor = 0  # a count, or a device tensor the strategy keeps

    def add(self, seconds: float, images: int, data_s: float, skipped=False) -> None:
        self.seconds, self.images, self.data_s = (
            self.seconds + seconds,
            self.images + images,
            self.data_s + data_s,
        )
        self.skipped = self.skipped + skipped


@dataclass(frozen=True)
class RunFacts:
    """What a run is once built, fixed from there on: its config (auto keys answered, `fast`: what
    they became and why), strategy, task and model spec, folder, data sizes and evaluation split,
    parameter count, forward FLOPs per training sample, lr (scaled to the global batch), optimizer
    steps in all and per epoch."""

    cfg: Config
    fast: FastPaths
    strategy: Strategy
    task: Task
    spec: Any
    run_dir: Path
    train_size: int
    test_size: int
    eval_split: str
    params: int
    flops_per_image: float
    lr: float
    total_steps: int
    steps_per_epoch: int


def train_record(
    facts: RunFacts, step: int, lr: float, w: Window, images: int, loss: float, info: dict
) -> dict:
    """The train log record of a log step (`step`: optimizer steps taken; `lr`: the schedule's
    current lr; `w`: the window since the last record; `images`: the last step's global samples):
    loss, lr, throughput, gradient norm, skipped steps, the task's and the engine's own numbers.
    Reads the device (the gradient norm, the skipped count)."""
    steps = w.images / images
    return {
        "kind": "train",
        "step": step,
        "epoch": step / facts.steps_per_epoch,
        "loss": loss,
        "lr": lr,
        "images_per_s": w.images / w.seconds,
        "step_time_s": w.seconds / max(1, steps),
        "data_time_s": w.data_s / max(1, steps),
        "grad_norm": float(info["grad_norm"]),
        "skipped": int(w.skipped),
        **facts.task.logs(),
        **facts.strategy.comm_stats(round(steps)),
    }


def end_summary(
    facts: RunFacts, progress: RunProgress, checkpoint: Path | None, stop_reason: str
) -> dict:
    """What `fit()` returns for a run stopped by a signal or the job's end, or resumed when it was
    already finished ("finished"): where it is (`checkpoint`: the last one), no summary.json
    written."""
    cfg = facts.cfg
    return {
        "rank": facts.strategy.rank,
        "stop_reason": stop_reason,
        "step": progress.step,
        "total_steps": facts.total_steps,
        "epoch": progress.step / facts.steps_per_epoch,
        "checkpoint": str(checkpoint),
        "run_dir": str(facts.run_dir),
        "capped": bool(cfg.run.max_steps) and facts.total_steps == cfg.run.max_steps,
    }


def state_bytes(strategy: Strategy, task) -> dict:
    """Bytes this rank holds in parameters (local shards), fp32 master copies, optimizer state and
    the loss's per-sample state; gradients, while they exist, take as many bytes as the
    parameters."""
    return {**strategy.state_bytes(), "loss_state": task.state_bytes()}


def plural(n: int, noun: str) -> str:
    """`n` and `noun` in agreement: 1 process, 2 processes, 1 micro-batch, 4 micro-batches."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun}es" if noun.endswith(("s", "sh", "ch", "x")) else f"{n} {noun}s"


def dp_text(s: Strategy) -> str:
    """The data-parallel count in words: processes, or the mesh's points under tensor parallelism
    ("1 data-parallel group of 2 tensor-parallel processes")."""
    tp = s.world_size // s.dp_size
    if tp == 1:
        return plural(s.dp_size, "process")
    return f"{plural(s.dp_size, 'data-parallel group')} of {tp} tensor-parallel processes"


def mesh_record(cfg: Config, s: Strategy) -> dict:
    """summary.json's mesh: the sizes of its three dimensions (strategy/mesh.py) as the run used
    them (one process: 1 x 1 x 1; DDP and DeepSpeed: replicas): resolved from the config and the
    world size as the engine resolves it."""
    return dict(zip(DIMS, mesh_shape(cfg.strategy, s.world_size).sizes))


def describe_run(facts: RunFacts) -> str:
    """The run in one line: model, data, batch split, lr, steps, device and precision."""
    cfg, s, task = facts.cfg, facts.strategy, facts.task
    scaling = (
        ""
        if cfg.optim.lr_scaling == "none"
        else f" ({cfg.optim.lr_scaling} scaling from {cfg.optim.lr:g} at batch {cfg.optim.lr_ref_batch})"
    )
    return (
        f"run {facts.run_dir}: {task.describe(facts.spec)}, {facts.params / 1e6:.2f}M params, "
        f"{facts.flops_per_image / 1e6:.1f} MFLOPs/{task.sample} fwd; "
        f"{facts.train_size} train / {facts.test_size} {facts.eval_split} {task.samples}; "
        f"global batch {cfg.data.batch_size} = {dp_text(s)} x "
        f"{plural(cfg.train.accum_steps, 'micro-batch')} x "
        f"{cfg.data.batch_size // s.dp_size // cfg.train.accum_steps}; lr {facts.lr:.3g}{scaling}"
        f"; {facts.total_steps} steps on {s.device} in {cfg.train.precision}"
    )


def target_key(target: float) -> str:
    """A target accuracy's key in summary.json's time_to_target: 0.9 -> "0.9"."""
    return repr(float(target))


def percent(target: float) -> str:
    """0.9 -> "90%", 0.915 -> "91.5%"."""
    return f"{100 * target:g}%"


def seconds(x: float) -> str:
    """Training seconds as the target lines say them: 41.2s, 9.73s, 0.0374s."""
    return f"{x:.1f}s" if x >= 10 else f"{x:.3g}s"


def reached(e: dict, metric: str, target: float) -> bool:
    """Whether the evaluation record `e` reached `target` (its `metric` >= it: equal counts)."""
    value = e.get(metric)
    return value is not None and value >= target


def time_to_target(evals: list[dict], targets, metric: str) -> dict:
    """{target key: the training time, step and epoch of the first evaluation in `evals` (in the
    order run) whose `metric` reached the target, or None where none did} (train.targets)."""
    out = {}
    for t in targets:
        hit = next((e for e in evals if reached(e, metric, t)), None)
        keys = ("train_time_s", "step", "epoch")
        out[target_key(t)] = None if hit is None else {k: hit[k] for k in keys}
    return out


def first_reached(evals: list[dict], targets, metric: str) -> list[float]:
    """The targets that the last evaluation of `evals` reached and no earlier one did."""
    if not evals:
        return []
    *before, last = evals
    return [
        t
        for t in dict.fromkeys(targets)
        if reached(last, metric, t) and not any(reached(e, metric, t) for e in before)
    ]


def describe_targets(times: dict) -> str:
    """summary.json's time_to_target in words: "90% at 41.2s (epoch 2), 91% not reached"."""
    said = []
    for key, hit in sorted(times.items(), key=lambda kv: float(kv[0])):
        at = hit and f"at {seconds(hit['train_time_s'])} (epoch {hit['epoch']:.3g})"
        said.append(f"{percent(float(key))} {at or 'not reached'}")
    return ", ".join(said)


def run_summary(
    facts: RunFacts, progress: RunProgress, checkpoint: Path | None, stop_reason: str
) -> dict:
    """summary.json: the last evaluation, throughput (each process's first step left out:
    torch.compile, allocator warm-up), MFU, and what the run was (`checkpoint`: its last one)."""
    s, cfg, task, p = facts.strategy, facts.cfg, facts.task, progress
    t, n = p.steady if p.steady[1] else (p.train_time, p.images_seen)
    images_per_s = n / t if t else 0.0
    peak, peak_src = peak_flops(s.device, cfg.train.precision, cfg.train.tf32)
    last = p.last_eval or {}  # fit() evaluates before the summary
    metrics = {k: v for k, v in last.items() if k not in ("step", "epoch", "train_time_s")}
    return {
        **metrics,
        f"best_{task.metric}": p.best_acc,
        # train.targets: when the evaluations first reached each (the metric above)
        "time_to_target": time_to_target(p.evals, cfg.train.targets, task.metric),
        "train_time_s": p.train_time,
        # each process's first step (summed over resumed segments), left out of images_per_s: with
        # train.compile the compile is in it (bench reports compile_s, over its median step)
        "first_step_s": p.train_time - p.steady[0] if p.steady[1] else None,
        "images_per_s": images_per_s,
        "params": facts.params,
        "flops_per_image": facts.flops_per_image,
        "train_flops_per_image": 3 * facts.flops_per_image,
        "mfu": mfu(facts.flops_per_image, images_per_s, peak, s.world_size),
        "peak_flops": peak,
        "peak_source": peak_src,
        "world_size": s.world_size,
        "strategy": cfg.strategy.name,
        "mesh": mesh_record(cfg, s),
        "steps": p.step,
        "epochs": p.step / facts.steps_per_epoch,
        "eval_split": facts.eval_split,
        "images_seen": p.images_seen,
        "stop_reason": stop_reason,
        "precision": cfg.train.precision,
        "capture": cfg.train.capture,
        "auto": facts.fast.record(),
        "tf32": tf32_active(s.device.type, cfg.train.precision, cfg.train.tf32),
        "lr": facts.lr,
        "device": str(s.device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "checkpoint": str(checkpoint),
        "run_dir": str(facts.run_dir),
        "rank": s.rank,
        "state_bytes_per_rank": s.gather_objects(state_bytes(s, task)),
        "task": task.kind,
        **task.summary_extra(facts.lr),
    }
