"""Run outputs: metrics.jsonl, TensorBoard events, and console progress (bar on a terminal,
plain log lines otherwise)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class MetricsLog:
    """Appends one JSON object per line to run_dir/metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.file = open(self.path, "a", buffering=1)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(Path(run_dir) / "tb"))
            except ImportError:  # tensorboard not installed: JSONL still has everything
                self.tb = None

    def log(self, record: dict, prefix: str = "train") -> None:
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if k not in ("step", "kind") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(f"{prefix}/{k}", v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


class NullLog:
    """What ranks other than the main one log: nothing."""

    def log(self, record: dict, prefix: str = "train") -> None:
        pass

    def close(self) -> None:
        pass


class Progress:
    """A rich progress bar with loss, throughput and ETA on a terminal; plain lines otherwise."""

    def __init__(self, total: int, mode: str = "auto", start: int = 0, every: int = 50):
        self.total, self.every, self.done = total, every, start
        self.mode = ("bar" if sys.stderr.isatty() else "plain") if mode == "auto" else mode
        self.t0, self.start = time.perf_counter(), start
        self.bar = None
        if self.mode == "bar":
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                       TextColumn, TimeElapsedColumn, TimeRemainingColumn)
            self.bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                    TextColumn("ETA"), TimeRemainingColumn(), transient=False)
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def eta(self) -> float:
        rate = (self.done - self.start) / max(1e-9, time.perf_counter() - self.t0)
        return (self.total - self.done) / rate if rate > 0 else float("nan")

    def update(self, step: int, info: str) -> None:
        self.done = step
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif self.mode == "plain" and (step % self.every == 0 or step == self.total):
            print(f"step {step}/{self.total} {info} eta {self.eta():.0f}s", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text)
        elif self.mode != "off":
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
