"""The training loop: uses only strategy verbs, never an engine name."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar, cast, overload

import torch

from .capture import WholeStep
from .checkpoint import discard_unstarted, make_run_dir
from .checks import check_run
from .config import Config
from .datafit import fit_run
from .errors import DataError, TrainingError
from .fastpaths import resolve as resolve_fast_paths
from .metrics import MetricsLog, NullLog, Progress, synchronizer
from .models import count_params
from .optim import build_scheduler, lr_table
from .run_report import (
    RunFacts,
    Window,
    describe_run,
    end_summary,
    first_reached,
    percent,
    run_summary,
    seconds,
    train_record,
)
from .run_state import (
    Checkpoints,
    Resume,
    RunParts,
    RunProgress,
    check_cap,
    check_resumable,
    open_resume,
    resume_run,
)
from .step import FiniteWatch, TrainStep, check_training_state
from .stop import PREEMPTED, Agreement, StopRequest, announce_deadline, slurm_deadline
from .strategy import Strategy, build_strategy
from .strategy.devices import LauncherWatch
from .tasks import build_task

T = TypeVar("T")


class StepLog:
    """What a run records as its steps finish: training seconds and samples into its progress
    counters (each process's first step left out of the steady-state throughput: compile,
    warm-up), the window since the last train record, the record itself and the progress text."""

    def __init__(self, progress: RunProgress, log):
        self.progress, self.log = progress, log
        self.window, self.first, self.text = Window(), True, ""

    def account(self, dt: float, t_data: float, images: int, info: dict) -> Window:
        p = self.progress
        p.train_time += dt
        p.images_seen += images
        if not self.first:
            p.steady = [p.steady[0] + dt, p.steady[1] + images]
        self.first = False
        self.window.add(dt, images, t_data, info["skipped"])
        return self.window

    def write(self, record: dict) -> None:
        """The train record of a log step; a new window from here."""
        self.log.log(record)
        self.window = Window()
        p = self.progress
        self.text = f"loss {record['loss']:.4f} | {p.images_seen / p.train_time:.0f} img/s"


def seeded_model(task, spec, seed: int, rank: int):
    """The task's model from `seed` (the same initial weights on every rank); then a random stream
    of each data-parallel rank's own for dropout and stochastic depth (`rank`: its index; the
    ranks of a tensor-parallel group draw the same)."""
    torch.manual_seed(seed)
    model = task.build_model(spec)
    if rank:
        torch.manual_seed(seed + 1_000_003 * rank)
    return model


def plan_steps(cfg: Config, data, world_size: int) -> tuple[int, bool]:
    """(total optimizer steps, whether the epoch's last global batch leaves some rank an empty
    share: data.drop_last=false with fewer samples left than processes); a one-line DataError
    where the global batch is larger than the training set or gives no full batch."""
    if cfg.data.batch_size > data.train_size:
        raise DataError(
            f"data.batch_size ({cfg.data.batch_size}) is larger than the training set "
            f"({data.train_size} images)"
        )
    if len(data.train) == 0:
        raise DataError(f"data.batch_size ({cfg.data.batch_size}) gives no full batch per epoch")
    total = math.ceil(cfg.train.epochs * len(data.train))
    remainder = data.train_size % cfg.data.batch_size
    empty_share = not cfg.data.drop_last and 0 < remainder < world_size
    return min(total, cfg.run.max_steps) if cfg.run.max_steps else total, empty_share


def open_logs(cfg: Config, run_dir: Path, step: int, total_steps: int, main: bool):
    """The run's metrics log (metrics.jsonl, TensorBoard; records past `step` of a resumed run
    superseded) and progress line; on the other ranks a log that writes nothing, and no line."""
    log = (
        MetricsLog(run_dir, tensorboard=cfg.run.tensorboard, resumed_at=step) if main else NullLog()
    )
    progress = cfg.run.progress if main else "off"
    return log, Progress(total_steps, progress, start=step, every=cfg.run.log_every)


def check_orphan(launcher: LauncherWatch, agreement: Agreement, step: int, ckpts) -> None:
    """An orphan must not go on training (and writing) the run; one told to stop saves first (a
    launcher that a stop signal ended: torchrun does not handle SIGUSR1)."""
    if launcher.gone() and agreement.stop.signal is None:
        raise TrainingError(
            f"step {step + 1}: the launcher that started this process is gone "
            "(killed or preempted): this rank stops; the last complete checkpoint "
            f"is kept{ckpts.last_good()}"
        )


class Progressed(Generic[T]):
    """An attribute kept in the progress record (`progress`, run_state.RunProgress), which saves
    and restores itself with the checkpoint."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, tr: None, owner=None) -> Progressed[T]: ...
    @overload
    def __get__(self, tr: ProgressView, owner=None) -> T: ...
    def __get__(self, tr, owner=None):
        return self if tr is None else getattr(tr.progress, self.name)

    def __set__(self, tr: ProgressView, value: T) -> None:
        setattr(tr.progress, self.name, value)


class ProgressView:
    """The progress record's counters as attributes of the object that holds it (the Trainer):
    optimizer steps taken, training seconds, samples seen, the steady-state [seconds, samples]
    (each process's first step left out), the best evaluated metric and the last evaluation."""

    progress: RunProgress
    step: Progressed[int] = Progressed()
    train_time: Progressed[float] = Progressed()
    images_seen: Progressed[int] = Progressed()
    steady: Progressed[list] = Progressed()
    best_acc: Progressed[float | None] = Progressed()
    last_eval: Progressed[dict | None] = Progressed()


class Epochs(ProgressView):
    """The steps of a run's epochs, as the Trainer (below) wires them: the step function, the whole
    step as one unit, the epoch's loop with its logging, checkpoints and stop requests."""

    cfg: Config
    strategy: Strategy
    task: Any
    data: Any
    scheduler: Any
    steps_per_epoch: int
    total_steps: int
    empty_last_share: bool
    ahead: int
    step_fn: TrainStep
    watch: FiniteWatch
    whole: WholeStep | None
    checkpoints: Checkpoints
    launcher: LauncherWatch
    agreement: Agreement
    steps_log: StepLog
    bar: Any
    facts: RunFacts

    def check_state(self, state: bool = True) -> None:
        raise NotImplementedError

    def save(self) -> Path:
        raise NotImplementedError

    def train_step(self, batch: tuple, phase=None, step=None) -> tuple[torch.Tensor, dict]:
        """The step function (step.TrainStep) at this run's step (`step`: a device counter that
        stands for it, train.capture=step): (loss, info) on the device."""
        return self.step_fn(batch, self.step if step is None else step, phase)

    def whole_fn(self, batch: tuple) -> tuple[torch.Tensor, dict]:
        """The step the captured unit runs: at the unit's device step counter, so that what the
        task's state counts by step (CLIP v0's temperature lr) moves in every replay."""
        return self.train_step(batch, step=cast(WholeStep, self.whole).step_t)

    def run_step(self, batch: tuple) -> tuple[torch.Tensor, dict]:
        """One step as training runs it (and the lab times it): `train_step`, or the whole step as
        one unit (train.capture=step: capture.WholeStep, a graph replay on a GPU); the non-finite
        watch sees its loss either way. Nothing here reads the device."""
        s = self.strategy
        if s.whole_step:
            if self.whole is None:  # the parts the captured step uses
                table = lr_table(self.scheduler, self.total_steps, s.device)
                parts = (self.whole_fn, s.optimizer.param_groups, table, self.step, self.watch)
                self.whole = WholeStep(*parts, captured=s.captured)
            return self.whole.step(batch)  # the watch is updated inside
        loss, info = self.train_step(batch)
        self.watch.see(self.step + 1, loss)
        return loss, info

    def skip_empty_share(self) -> bool:
        """data.drop_last=false: the epoch's last global batch is partial, and where it has fewer
        samples than processes some rank's share is empty: every rank skips that step, decided
        from the sizes alone (no collective, no host sync)."""
        if not (self.empty_last_share and (self.step + 1) % self.steps_per_epoch == 0):
            return False
        said = "the epoch's last batch has fewer samples than processes"
        self.bar.message(f"step {self.step + 1}: {said}; step skipped on every rank")
        self.scheduler.step()
        self.step += 1
        return True

    def train_epoch(self) -> str:
        """Steps from the current one to the end of its epoch (or of training); returns the stop
        reason: "done", or "time limit"."""
        cfg, s = self.cfg, self.strategy
        epoch, start = divmod(self.step, self.steps_per_epoch)
        self.task.set_epoch(epoch)
        batches = self.data.train.iterate(epoch, start_batch=start, ahead=self.ahead)
        t_last = time.perf_counter()
        while self.step < self.total_steps:
            batch = next(batches, None)
            if batch is None:
                break
            n_local = batch[0].shape[0]
            t_data = time.perf_counter() - t_last
            if self.skip_empty_share():
                t_last = time.perf_counter()
                continue
            if n_local == 0:  # the loaders replace unreadable samples (data/): never an empty batch
                raise DataError(f"step {self.step + 1}: the loader gave an empty batch")
            check_orphan(self.launcher, self.agreement, self.step, self.checkpoints)
            loss, info = self.run_step(batch)
            self.scheduler.step()
            self.step += 1
            log_now = self.step % cfg.run.log_every == 0 or self.step == self.total_steps
            if log_now:  # the GPU catches up here (and only here) before the clock is read
                synchronizer(s.device)()
            # time and samples; at log steps the train record (loss, norm, skips read there)
            n = n_local * s.dp_size  # a tensor-parallel group shares its batch
            w = self.steps_log.account(time.perf_counter() - t_last, t_data, n, info)
            if log_now:
                self.check_state(state=False)
                lr = self.scheduler.get_last_lr()[0]
                self.steps_log.write(
                    train_record(self.facts, self.step, lr, w, n, float(loss), info)
                )
            self.bar.update(self.step, self.steps_log.text)
            if cfg.run.checkpoint_every and self.step % cfg.run.checkpoint_every == 0:
                self.save()
            # a stop request (time limit, signal, the job's end): one process reads its flags every
            # step; several agree through a collective (a host sync) at log steps only
            reason = self.agreement.reason(self.train_time, collective=log_now)
            if reason:
                return reason
            t_last = time.perf_counter()  # checkpoint I/O is not training time
        return "done"


class Trainer(Epochs):
    """Wires a run's parts (data, model, strategy, task, schedule, progress, step function); `fit()`
    trains, evaluates and checkpoints. `on_eval(result)`: after every evaluation (a search reports
    there); `signals`: stop signals end the run with a checkpoint (False: the lab's trainers leave
    them, and SLURM_JOB_END_TIME, to their command)."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path | None = None,
        resume: Resume | None = None,
        *,
        on_eval: Callable[[dict], None] | None = None,
        signals: bool = True,
    ):
        """`resume`: a checkpoint opened and checked (run_state.open_resume / resume_request)."""
        self.on_eval, self.stop_on_signals = on_eval, signals
        # train.precision / train.capture = auto answered for this machine: what the run saves
        self.fast = resolve_fast_paths(cfg)
        # data.batch_rule: the batch (and epochs) fitted to the training set's size, before the
        # engine starts (its lr follows the batch); what the run saves
        self.fast = self.fast.fitted(fit_run(self.fast.cfg))
        self.cfg = cfg = self.fast.cfg
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        torch.manual_seed(cfg.run.seed)
        check_run(cfg)  # before an engine starts (DeepSpeed's config divides the batch)
        if resume is not None and resume.changes is None:  # before anything is written
            resume.changes = check_resumable(resume, cfg)
        # the strategy builds its optimizer at the lr for this global batch (optim.scaled_lr); the
        # config keeps what the user wrote (lr, lr_scaling, lr_ref_batch) and is never rewritten
        self.strategy = s = build_strategy(cfg)
        self.lr = s.lr
        self.run_dir, self.lock, made = make_run_dir(
            cfg, s.is_main, s.broadcast_object, run_dir, resume
        )
        self.launcher = LauncherWatch()
        try:
            self.build(cfg, s)
            self.facts = self.run_facts()
            if resume is not None:
                resume_run(self.parts, resume)
                self.checkpoints.last = resume.path
                check_cap(cfg, self.step, self.steps_per_epoch, resume.changes)
        except BaseException:  # a half-built run: its data workers stopped, its folder released
            self.close()
            if resume is None and s.is_main:
                discard_unstarted(self.run_dir, made)
            raise

    def close(self) -> None:
        """After training or an error (also half-built): data workers stopped, run folder freed."""
        if hasattr(self, "data"):
            self.data.close()
        if self.lock is not None:
            self.lock.release()

    def run_facts(self) -> RunFacts:
        """What the run is once built, for its report (run_report): fixed from here on."""
        return RunFacts(
            cfg=self.cfg,
            fast=self.fast,
            strategy=self.strategy,
            task=self.task,
            spec=self.spec,
            run_dir=self.run_dir,
            train_size=self.data.train_size,
            test_size=self.data.test_size,
            eval_split=self.data.eval_split,
            params=self.params,
            flops_per_image=self.flops_per_image,
            lr=self.lr,
            total_steps=self.total_steps,
            steps_per_epoch=self.steps_per_epoch,
        )

    def build(self, cfg: Config, s: Strategy) -> None:
        """Data, model, engine, schedule, counters and the step function of a new run."""
        self.task = task = build_task(cfg)
        self.data = task.build_data(s)
        self.total_steps, self.empty_last_share = plan_steps(cfg, self.data, s.dp_size)
        self.steps_per_epoch = len(self.data.train)
        self.spec = task.spec_for(self.data)
        self.flops_per_image = task.flops(self.spec)  # per training sample (image, or pair)
        model = seeded_model(task, self.spec, cfg.run.seed, s.dp_rank)
        self.params = count_params(model)
        s.setup(model)
        self.progress = RunProgress()  # step, training time, samples, best metric, last eval
        # the run's one schedule (optim.schedule_clock=time: its decay follows self.train_time to
        # train.time_limit_s); what else follows the lr (FastCLIP v0's temperature) reads its factor
        self.scheduler = build_scheduler(
            s.optimizer,
            cfg.optim,
            self.total_steps,
            self.steps_per_epoch,
            clock=lambda: self.train_time,
            budget_s=cfg.train.time_limit_s,
        )
        task.setup_training(
            lr=self.lr,
            dataset_size=self.data.train_size,
            total_steps=self.total_steps,
            steps_per_epoch=self.steps_per_epoch,
            device=s.device,
            group=s.dp_group,
            lr_factor=self.scheduler.lr_lambdas[0],
        )
        self.parts = RunParts(cfg, s, self.scheduler, self.progress, task, self.spec)
        self.checkpoints = Checkpoints(self.run_dir, self.parts, cfg.run.keep_last)
        self.step_fn = TrainStep(s, task, cfg.train.accum_steps)
        self.watch = FiniteWatch()
        # train.capture=step: the whole step as one unit (built at the first step: after a resume
        # has loaded the state it captures), its batches prepared many at a time
        self.whole: WholeStep | None = None
        self.ahead = ahead_batches(cfg, self.data) if s.whole_step else 1

    # -- checks, checkpoints, evaluation ----------------------------------------------------------
    def check_state(self, state: bool = True) -> None:
        """TrainingError if a loss since the start was non-finite; with `state`, also if the
        training state is (collective: one reduction per tensor). Before anything is logged,
        evaluated or saved: no checkpoint ever holds a NaN."""
        last_good = self.checkpoints.last_good()
        self.watch.check(self.steps_per_epoch, last_good)
        if state:
            check_training_state(self.strategy, self.step, last_good)

    def save(self) -> Path:
        """Collective: the state checked, then written (run_state.Checkpoints)."""
        self.check_state()
        return self.checkpoints.save()

    def evaluate(self) -> dict:
        """The task's metrics over the whole test set (every rank gets the same numbers)."""
        self.check_state()
        self.strategy.sync_buffers()  # every rank evaluates the buffers that are saved (rank 0's)
        r = self.task.evaluate_all(self.strategy, self.data)
        metric = self.task.metric
        ev = self.progress.record_eval(r, metric, self.steps_per_epoch)
        for t in first_reached(self.progress.evals, self.cfg.train.targets, metric):
            self.bar.message(
                f"target {percent(t)} {metric.replace('_', ' ')} reached at "
                f"{seconds(ev['train_time_s'])} training (step {ev['step']}, epoch {ev['epoch']:.2f})"
            )
        if self.on_eval is not None:
            self.on_eval(ev)
        return ev

    def end_of_epoch(self) -> None:
        """At an epoch's end: evaluate every run.eval_every epochs; checkpoint unless
        run.checkpoint_every checkpoints by steps."""
        cfg = self.cfg
        if self.step % self.steps_per_epoch:
            return
        if cfg.run.eval_every and (self.step // self.steps_per_epoch) % cfg.run.eval_every == 0:
            ev = self.evaluate()
            self.log.log({"kind": "eval", **ev}, prefix="eval")
            said = f"{self.task.describe_eval(ev, self.best_acc)}, {self.train_time:.0f}s training"
            self.bar.message(f"epoch {ev['epoch']:.2f} step {self.step}: {said}")
        if not cfg.run.checkpoint_every:
            self.save()

    def train_until_stopped(self, stop: StopRequest) -> str:
        """Epochs until the end or a stop request; the reason ("done", "time limit", a signal's name,
        "job end"). A request that arrives during an evaluation or a checkpoint is handled at the
        epoch's end, before another step."""
        deadline = slurm_deadline() if self.stop_on_signals else None  # the lab's: its command's
        announce_deadline(deadline, self.strategy.is_main)  # said whatever run.progress is
        self.agreement = Agreement(self.strategy, stop, self.cfg.train.time_limit_s, deadline)
        stop_reason = "done"
        try:
            while self.step < self.total_steps and stop_reason == "done":
                stop_reason = self.train_epoch()
                if stop_reason in PREEMPTED:
                    break
                self.end_of_epoch()
                if stop_reason == "done" and self.step < self.total_steps:
                    late = self.agreement.reason(self.train_time, collective=True)
                    stop_reason = late if late in PREEMPTED else stop_reason
        finally:
            self.bar.close()
        return stop_reason

    def finished(self) -> bool:
        """Whether every step and the final evaluation are done (a resumed run at its end)."""
        return self.step >= self.total_steps and (self.last_eval or {}).get("step") == self.step

    def finish(self, stop_reason: str) -> str:
        """After the last step (or the time limit): the final evaluation where the last step has
        none yet, then the exact state saved where it is not (again where the evaluation came after
        its checkpoint, so that the checkpoint carries it); the stop signals stay handled throughout,
        and one that arrived meanwhile is the reason returned (collective)."""
        evaluated = self.last_eval is None or self.last_eval["step"] != self.step
        if evaluated:
            self.log.log({"kind": "eval", **self.evaluate()}, prefix="eval")
        if evaluated or not self.checkpoints.saved_at(self.step):
            self.save()
        late = self.agreement.reason(self.train_time, collective=True)
        return late if late in PREEMPTED else stop_reason

    def fit(self) -> dict:
        """Train to the end (or the time limit), evaluating and checkpointing as configured;
        returns the summary (every rank), written to summary.json by the main process. A resumed
        run that is finished (its steps, final evaluation and summary.json) trains and writes
        nothing: its summary's stop_reason is "finished"."""
        s = self.strategy
        summary_file = self.run_dir / "summary.json"
        if self.finished() and s.broadcast_object(s.is_main and summary_file.is_file()):
            return end_summary(self.facts, self.progress, self.checkpoints.last, "finished")
        self.log, self.bar = open_logs(
            self.cfg, self.run_dir, self.step, self.total_steps, s.is_main
        )
        self.bar.message(self.fast.line())
        self.bar.message(describe_run(self.facts))
        self.steps_log = StepLog(self.progress, self.log)
        # the signals stay handled through the final evaluation and checkpoint: a stop there saves
        # the state of the last step and ends with the stop's line (the resume writes the summary)
        with StopRequest(quiet=not s.is_main, signals=self.stop_on_signals) as stop:
            stop_reason = self.train_until_stopped(stop)
            if stop_reason in PREEMPTED:  # the exact state saved at once, no evaluation
                if not self.checkpoints.saved_at(self.step):
                    self.save()
            else:
                stop_reason = self.finish(stop_reason)
        self.log.close()
        if stop_reason in PREEMPTED:
            return end_summary(self.facts, self.progress, self.checkpoints.last, stop_reason)
        summary = run_summary(self.facts, self.progress, self.checkpoints.last, stop_reason)
        if s.is_main:
            summary_file.write_text(json.dumps(summary, indent=2))
        return summary


# train.capture=step prepares this many bytes of float32 images at a time (the whole epoch of a
# small set: Fashion-MNIST's at 32 px is 245 MiB), never fewer than one batch
AHEAD_BYTES = 512 * 2**20


def ahead_batches(cfg: Config, data) -> int:
    """Batches a train loader prepares at once under train.capture=step."""
    per_batch = 4 * data.train.batch_size * data.channels * data.image_size**2
    return max(1, AHEAD_BYTES // max(1, per_batch))


def train(
    cfg: Config,
    run_dir: Path | None = None,
    resume: Resume | str | Path | None = None,
    *,
    on_eval: Callable[[dict], None] | None = None,
    signals: bool = True,
) -> dict:
    """Train; `run_dir` None = run.out_dir/run.name-TIMESTAMP; `resume`: a checkpoint file or run
    folder (its newest readable checkpoint), or one already opened. Returns the summary (every
    rank). `on_eval`, `signals`: as the Trainer takes them."""
    if resume is not None and not isinstance(resume, Resume):
        resume = open_resume(resume)
    trainer = Trainer(cfg, run_dir, resume, on_eval=on_eval, signals=signals)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()  # stops decoding workers and releases the folder, also after an error
    trainer.strategy.close()  # leave the process group cleanly (not after a failure: peers may be gone)
    return summary
