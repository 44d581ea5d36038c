"""The training loop: uses only strategy verbs, never an engine name."""
from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .checkpoint import (check_resume, engine_folder, list_checkpoints, load_checkpoint, resolve_checkpoint,
                         rng_state, save_checkpoint, set_rng_state)
from .config import Config, micro_batch
from .errors import ConfigError, DataError, TrainingError, UserError
from .metrics import MetricsLog, NullLog, Progress, mfu, peak_flops
from .models import count_params
from .optim import build_scheduler, scaled_lr
from .strategy import build_strategy
from .tasks import build_task


class Trainer:
    """Builds data, model and strategy from a config; `fit()` trains, evaluates and checkpoints."""

    def __init__(self, cfg: Config, run_dir: Path | None = None, resume: str | Path | None = None):
        self.cfg = cfg
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        torch.manual_seed(cfg.run.seed)
        self.lr = scaled_lr(cfg.optim, cfg.data.batch_size)
        # the strategy builds its optimizer at the lr for this global batch; the saved config
        # keeps what the user wrote (lr, lr_scaling, lr_ref_batch)
        self.strategy = s = build_strategy(replace(cfg, optim=replace(cfg.optim, lr=self.lr)))
        self.run_dir = self._run_dir(run_dir, resume)
        micro_batch(cfg.data.batch_size, s.world_size, cfg.train.accum_steps)
        self.task = task = build_task(cfg)
        self.data = task.build_data(s)
        if cfg.data.batch_size > self.data.train_size:
            raise DataError(f"data.batch_size ({cfg.data.batch_size}) is larger than the training set "
                            f"({self.data.train_size} images)")
        self.spec = task.spec_for(self.data)
        self.flops_per_image = task.flops(self.spec)  # per training sample (image, or image-caption pair)
        torch.manual_seed(cfg.run.seed)
        model = task.build_model(self.spec)  # the same initial weights on every rank
        if s.rank:  # a stream of its own per rank for dropout / stochastic depth
            torch.manual_seed(cfg.run.seed + 1_000_003 * s.rank)
        self.params = count_params(model)
        self.strategy.setup(model)
        self.steps_per_epoch = len(self.data.train)
        if self.steps_per_epoch == 0:
            raise DataError(f"data.batch_size ({cfg.data.batch_size}) gives no full batch per epoch")
        total = math.ceil(cfg.train.epochs * self.steps_per_epoch)
        self.total_steps = min(total, cfg.run.max_steps) if cfg.run.max_steps else total
        task.setup_training(lr=self.lr, dataset_size=self.data.train_size, total_steps=self.total_steps,
                            steps_per_epoch=self.steps_per_epoch, device=s.device)
        self.scheduler = build_scheduler(self.strategy.optimizer, cfg.optim, self.total_steps,
                                         self.steps_per_epoch)
        self.step, self.train_time, self.images_seen = 0, 0.0, 0
        self.steady = [0.0, 0]  # time and images of steps after each process's first (compile, warm-up)
        self.best_acc, self.last_eval = None, None
        self.last_ckpt: Path | None = None
        if resume is not None:
            path = resolve_checkpoint(resume)
            state = load_checkpoint(path)
            check_resume(state, path, s.name)  # one line where the engines cannot resume each other
            folder = engine_folder(path, state)  # the engine's own folder next to it (.ds, .dcp)
            if folder is not None:
                s.load_engine(folder)
            self._restore(state)

    def _run_dir(self, run_dir, resume) -> Path:
        """The main process names the run folder (and checks it is free); every rank gets it."""
        s, problem = self.strategy, None
        if s.is_main:
            cfg = self.cfg
            run_dir = Path(run_dir) if run_dir else \
                Path(cfg.run.out_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            if resume is None and list_checkpoints(run_dir):
                problem = (f"{run_dir} already holds a run's checkpoints: continue it with "
                           f"`vitscale train --resume {run_dir}` or choose another --out")
            else:
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "config.toml").write_text(cfg.to_toml())
        run_dir, problem = s.broadcast_object((str(run_dir), problem))
        if problem:
            raise UserError(problem)
        return Path(run_dir)

    # -- checkpoints ------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {"version": 1, "config": self.cfg.to_dict(), "strategy": self.strategy.state_dict(),
                "scheduler": self.scheduler.state_dict(), "rng": self.strategy.gather_objects(rng_state()),
                "world_size": self.strategy.world_size, "step": self.step,
                "train_time": self.train_time, "images_seen": self.images_seen, "steady": self.steady,
                "best_acc": self.best_acc, "last_eval": self.last_eval, "spec": asdict(self.spec),
                "kind": self.task.kind, "task": self.task.state_dict()}

    def _restore(self, state: dict) -> None:
        self.strategy.load_state_dict(state["strategy"])
        self.scheduler.load_state_dict(state["scheduler"])
        # the optimizer's lr came from the checkpoint; a resumed run may have a new schedule
        # (e.g. more epochs), so set the lr this schedule gives at the restored step
        for group, base, fn in zip(self.strategy.optimizer.param_groups, self.scheduler.base_lrs,
                                   self.scheduler.lr_lambdas):
            group["lr"] = base * fn(self.scheduler.last_epoch)
        self.scheduler._last_lr = [g["lr"] for g in self.strategy.optimizer.param_groups]
        rngs = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]
        set_rng_state(rngs[self.strategy.rank] if len(rngs) == self.strategy.world_size else rngs[0])
        self.step, self.train_time = state["step"], state["train_time"]
        self.images_seen, self.best_acc = state["images_seen"], state["best_acc"]
        self.steady = state["steady"]
        self.last_eval = state["last_eval"]
        try:
            self.task.load_state_dict(state.get("task", {}))
        except (ValueError, KeyError) as e:  # e.g. a loss state from another version or dataset
            raise UserError(f"checkpoint: {e}") from None

    def save(self) -> Path:
        """Collective (every rank's RNG goes in); the main process writes."""
        s = self.strategy
        suffix = s.engine_suffix  # DeepSpeed, FSDP2 sharded: big state in a folder every rank writes
        if suffix:
            s.save_engine(self.run_dir / "checkpoints" / f"step_{self.step:08d}{suffix}")
        state = {**self._state(), "engine": suffix}
        path = self.run_dir / "checkpoints" / f"step_{self.step:08d}.pt"
        if self.strategy.is_main:
            path = save_checkpoint(self.run_dir, self.step, state, self.cfg.run.keep_last)
        self.last_ckpt = path
        return path

    # -- evaluation -------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """The task's metrics over the whole test set (every rank gets the same numbers)."""
        r = self.task.evaluate_all(self.strategy, self.data)
        self.last_eval = {"step": self.step, "epoch": self.step / self.steps_per_epoch,
                          "train_time_s": self.train_time, **r}
        value = r.get(self.task.metric)
        if value is not None:
            self.best_acc = value if self.best_acc is None else max(self.best_acc, value)
        return self.last_eval

    # -- training ---------------------------------------------------------------------------------
    def train_step(self, batch: tuple) -> tuple[float, dict]:
        """One optimizer step over a batch ((images, labels) or (images, tokens, index)) split
        into accum_steps micro-batches; returns the loss."""
        s, A = self.strategy, self.cfg.train.accum_steps
        total = torch.zeros((), device=batch[0].device)
        with s.comm_window():  # the step's collectives are counted (comm_stats)
            for i, micro in enumerate(zip(*(t.chunk(A) for t in batch))):
                with s.no_sync() if i < A - 1 else contextlib.nullcontext():
                    with s.autocast():
                        loss = self.task.forward_loss(s.model, micro, s.prepare) / A
                    s.backward(loss)
                total += loss.detach()
            if s.world_size > 1:  # the mean over all ranks: every rank sees the same (NaN) loss
                total = s.all_reduce_sum(total) / s.world_size
            info = s.step()
            self.task.after_step(self.step)
        return total.item(), info

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` holds on any (so that no rank waits for the others);
        a plain bool on one process: no tensor, no device sync in the step."""
        s = self.strategy
        if s.world_size == 1:
            return flag
        return bool(s.all_reduce_sum(torch.tensor(float(flag), device=s.device)).item())

    def fit(self) -> dict:
        cfg = self.cfg
        s, main = self.strategy, self.strategy.is_main
        log = MetricsLog(self.run_dir, tensorboard=cfg.run.tensorboard) if main else NullLog()
        bar = Progress(self.total_steps, cfg.run.progress if main else "off", start=self.step,
                       every=cfg.run.log_every)
        sync = torch.cuda.synchronize if self.strategy.device.type == "cuda" else (lambda: None)
        bar.message(f"run {self.run_dir}: {self.task.describe(self.spec)}, {self.params / 1e6:.2f}M params, "
                    f"{self.flops_per_image / 1e6:.1f} MFLOPs/{self.task.sample} fwd; "
                    f"{self.data.train_size} train / {self.data.test_size} test {self.task.samples}; "
                    f"global batch {cfg.data.batch_size} = {s.world_size} processes x "
                    f"{cfg.train.accum_steps} micro-batches x "
                    f"{cfg.data.batch_size // s.world_size // cfg.train.accum_steps}; lr {self.lr:.3g}"
                    f"{'' if cfg.optim.lr_scaling == 'none' else f' ({cfg.optim.lr_scaling} scaling from {cfg.optim.lr:g} at batch {cfg.optim.lr_ref_batch})'}"
                    f"; {self.total_steps} steps on "
                    f"{self.strategy.device} in {cfg.train.precision}")
        window_t, window_imgs, window_data = 0.0, 0, 0.0
        stop_reason, first = "done", True
        try:
            while self.step < self.total_steps and stop_reason == "done":
                epoch, start = divmod(self.step, self.steps_per_epoch)
                self.task.set_epoch(epoch)
                batches = self.data.train.iterate(epoch, start_batch=start)
                t_last = time.perf_counter()
                while self.step < self.total_steps:
                    batch = next(batches, None)
                    if batch is None:
                        break
                    n_local = batch[0].shape[0]
                    t_data = time.perf_counter() - t_last
                    # every image of a batch was unreadable (folder data): all ranks skip together
                    if self._any_rank(n_local == 0):
                        bar.message(f"step {self.step + 1}: no readable image in the batch; step skipped")
                        self.scheduler.step()
                        self.step += 1
                        t_last = time.perf_counter()
                        continue
                    loss, info = self.train_step(batch)
                    if not math.isfinite(loss):
                        where = f"; last good checkpoint: {self.last_ckpt}" if self.last_ckpt else \
                            "; no checkpoint was written before it"
                        raise TrainingError(f"loss is {loss} at step {self.step + 1} (epoch {epoch}): "
                                            f"training stopped{where}")
                    self.scheduler.step()
                    self.step += 1
                    now = time.perf_counter()
                    dt, t_last = now - t_last, now
                    self.train_time += dt
                    images = n_local * s.world_size  # global
                    self.images_seen += images
                    if not first:
                        self.steady = [self.steady[0] + dt, self.steady[1] + images]
                    first = False
                    window_t, window_imgs, window_data = window_t + dt, window_imgs + images, window_data + t_data
                    if self.step % cfg.run.log_every == 0 or self.step == self.total_steps:
                        sync()
                        rec = {"kind": "train", "step": self.step, "epoch": self.step / self.steps_per_epoch,
                               "loss": loss, "lr": self.scheduler.get_last_lr()[0],
                               "images_per_s": window_imgs / window_t,
                               "step_time_s": window_t / max(1, window_imgs / images),
                               "data_time_s": window_data / max(1, window_imgs / images),
                               "grad_norm": info["grad_norm"], "skipped": info["skipped"],
                               **self.task.logs(), **s.comm_stats(round(window_imgs / images))}
                        log.log(rec)
                        window_t, window_imgs, window_data = 0.0, 0, 0.0
                    bar.update(self.step, f"loss {loss:.4f} | {self.images_seen / self.train_time:.0f} img/s")
                    if cfg.run.checkpoint_every and self.step % cfg.run.checkpoint_every == 0:
                        self.save()
                    if cfg.train.time_limit_s and self._any_rank(self.train_time >= cfg.train.time_limit_s):
                        stop_reason = "time limit"
                        break
                    t_last = time.perf_counter()  # checkpoint I/O is not training time
                epoch_done = self.step % self.steps_per_epoch == 0
                if epoch_done and cfg.run.eval_every and (self.step // self.steps_per_epoch) % cfg.run.eval_every == 0:
                    ev = self.evaluate()
                    log.log({"kind": "eval", **ev}, prefix="eval")
                    bar.message(f"epoch {ev['epoch']:.2f} step {self.step}: {self.task.describe_eval(ev, self.best_acc)}, "
                                f"{self.train_time:.0f}s training")
                if epoch_done and not cfg.run.checkpoint_every:
                    self.save()
        finally:
            bar.close()
        if self.last_eval is None or self.last_eval["step"] != self.step:
            ev = self.evaluate()
            log.log({"kind": "eval", **ev}, prefix="eval")
        if self.last_ckpt is None or not self.last_ckpt.name.endswith(f"{self.step:08d}.pt"):
            self.save()
        log.close()
        summary = self.summary(stop_reason)
        if main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def state_bytes(self) -> dict:
        """Bytes this rank holds in parameters (local shards), fp32 master copies and optimizer
        state; gradients, while they exist, take as many bytes as the parameters."""
        return {**self.strategy.state_bytes(), "loss_state": self.task.state_bytes()}

    def summary(self, stop_reason: str) -> dict:
        # throughput excludes each process's first step (torch.compile, allocator warm-up)
        t, n = self.steady if self.steady[1] else (self.train_time, self.images_seen)
        images_per_s = n / t if t else 0.0
        peak, peak_src = peak_flops(self.strategy.device, self.cfg.train.precision)
        train_flops = 3 * self.flops_per_image
        metrics = {k: v for k, v in self.last_eval.items() if k not in ("step", "epoch", "train_time_s")}
        return {**metrics, f"best_{self.task.metric}": self.best_acc, "train_time_s": self.train_time,
                "images_per_s": images_per_s, "params": self.params,
                "flops_per_image": self.flops_per_image, "train_flops_per_image": train_flops,
                "mfu": mfu(self.flops_per_image, images_per_s, peak, self.strategy.world_size),
                "peak_flops": peak, "peak_source": peak_src, "world_size": self.strategy.world_size,
                "steps": self.step, "epochs": self.step / self.steps_per_epoch,
                "images_seen": self.images_seen, "stop_reason": stop_reason,
                "precision": self.cfg.train.precision, "lr": self.lr, "device": str(self.strategy.device),
                "threads": torch.get_num_threads(), "torch": torch.__version__,
                "checkpoint": str(self.last_ckpt), "run_dir": str(self.run_dir), "rank": self.strategy.rank,
                "state_bytes_per_rank": self.strategy.gather_objects(self.state_bytes()),
                "task": self.task.kind, **self.task.summary_extra(self.lr)}


def train(cfg: Config, run_dir: Path | None = None, resume: str | Path | None = None) -> dict:
    """Train; `run_dir` None = run.out_dir/run.name-TIMESTAMP. Returns the summary (every rank)."""
    trainer = Trainer(cfg, run_dir, resume)
    try:
        summary = trainer.fit()
    finally:
        trainer.data.close()  # stops decoding workers, also when training stops on an error
    trainer.strategy.close()  # leave the process group cleanly (not after a failure: peers may be gone)
    return summary
