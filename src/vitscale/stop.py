"""Stop requests (issue 44): what tells a run to stop before its end, read by the loop between steps
and never inside one.

- Signals: SIGTERM (SLURM, Kubernetes, the cloud spot services, torchrun forwarding its own), SIGUSR1
  (SLURM's `--signal=USR1@90`) and SIGINT (Ctrl-C) set a flag; the handler does nothing else (a
  first Ctrl-C alone says so, with how to stop at once: CTRL_C_HINT), so a step, a checkpoint write
  or an evaluation in progress completes, and the run's one line is the stop's, at the step
  (`vitscale: stopped by SIGTERM at step ...; checkpoint ...; continue with: ...`). A second
  SIGINT a second or more later means "stop now": it raises KeyboardInterrupt, and the last
  complete checkpoint stays the newest.
- The scheduler's wall clock: SLURM_JOB_END_TIME (a Unix time; SLURM sets it in a job's environment),
  less a margin for the checkpoint write.
- train.time_limit_s: training time, counted across resumes (the checkpoint carries it).

Several processes agree on the request at log steps, through one small all-reduce (Agreement), so
every rank stops and saves at the same step; one process checks at every step (no collective).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
SLURM_MARGIN_S = 120.0  # stop this long before SLURM_JOB_END_TIME: the checkpoint write, the exit
# the reasons after which the run saves and exits at once, unevaluated
PREEMPTED = (*SIGNALS, "job end")
REASONS = ("time limit", *PREEMPTED)  # the order of Agreement's flags
# what a first Ctrl-C says at once (the run's other line is the stop's, at the step): nothing else
# is said on receipt, and never this after SIGTERM or SIGUSR1, which no one at a terminal sent
CTRL_C_HINT = (
    "vitscale: Ctrl-C: stopping after the current step with a checkpoint (Ctrl-C again to stop "
    "now, without it)"
)


def exit_status(reason: str) -> int:
    """The exit status of a run stopped for `reason`: 128 + the signal's number, as a shell reports
    a process ended by that signal (143 for SIGTERM, 138 for SIGUSR1 on Linux, 130 for SIGINT); 143
    for the scheduler's end time. Schedulers and job scripts read these as "stopped, not failed"."""
    if reason in SIGNALS:
        return 128 + int(getattr(signal, reason))
    return 128 + int(signal.SIGTERM) if reason == "job end" else 0


def slurm_deadline(env=None) -> float | None:
    """When the run should stop to leave SLURM_MARGIN_S before the job's end (SLURM_JOB_END_TIME, a
    Unix time), or None where it is not set or not a number."""
    value = (os.environ if env is None else env).get("SLURM_JOB_END_TIME", "").strip()
    try:
        return float(value) - SLURM_MARGIN_S if value else None
    except ValueError:
        return None


def announce_deadline(deadline: float | None, main: bool = True) -> None:
    """The one line a run whose job has an end time prints at its start (the main process, whatever
    run.progress is); nothing where there is no deadline."""
    if deadline is None or not main:
        return
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(deadline))
    print(
        f"SLURM_JOB_END_TIME is set: the run stops with a checkpoint {SLURM_MARGIN_S:.0f} s "
        f"before the job's end, at {at}",
        file=sys.stderr,
        flush=True,
    )


class StopRequest:
    """The signal handlers, installed for the loop's lifetime (`with StopRequest() as stop:`); where
    they cannot be installed (not the main thread) the run goes on without them."""

    def __init__(self, quiet: bool = False, announce=None, signals: bool = True):
        self.signal: str | None = None  # the first stop signal received
        self._old: dict = {}
        self._install = signals  # False: the signals keep their handlers (the lab's trainers)
        self._announce = (
            (lambda text: None)
            if quiet
            else announce or (lambda text: print(text, file=sys.stderr, flush=True))
        )

    def __enter__(self) -> StopRequest:
        if self._install and threading.current_thread() is threading.main_thread():
            for name in SIGNALS:
                sig = getattr(signal, name, None)
                # a signal this process was started ignoring stays ignored (a background job's
                # SIGINT: Ctrl-C in the terminal is not meant for it, as Python itself decides)
                if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    # a SIGINT this long after the first request is a person's second Ctrl-C (stop now); sooner, it
    # is the same Ctrl-C again (a launcher may forward the terminal's SIGINT to processes that got it)
    SECOND_SIGINT_S = 1.0

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if (
            self.signal is not None
            and name == "SIGINT"
            and time.monotonic() - self._since >= self.SECOND_SIGINT_S
        ):
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, the last complete checkpoint kept
        if self.signal is None:
            self.signal, self._since = name, time.monotonic()
            if name == "SIGINT":  # a person at a terminal, who may want it now: the one hint
                self._announce(CTRL_C_HINT)
            # SIGTERM, SIGUSR1 (a scheduler's): the run's one line is the stop's, at the step


class Agreement:
    """Whether to stop, and why: `reason(step_end)` on every rank, with `collective` True at steps that
    are the same on every rank (log steps, epoch ends). One process decides from its own flags at
    every step; several sum a flag per reason over the ranks at collective steps only (a host sync
    where the loop already has one) and stop on any rank's reason."""

    def __init__(
        self,
        strategy,
        stop: StopRequest,
        time_limit_s: float,
        deadline: float | None,
        clock=time.time,
    ):
        self.s, self.stop, self.limit, self.deadline, self.clock = (
            strategy,
            stop,
            time_limit_s,
            deadline,
            clock,
        )

    def local_flags(self, train_time: float) -> list[bool]:
        return [
            bool(self.limit) and train_time >= self.limit,
            *(self.stop.signal == n for n in SIGNALS),
            self.deadline is not None and self.clock() >= self.deadline,
        ]

    def reason(self, train_time: float, collective: bool) -> str | None:
        if self.s.world_size > 1 and not collective:
            return None
        flags = self.local_flags(train_time)
        if self.s.world_size > 1:
            total = self.s.all_reduce_sum(
                torch.tensor([float(f) for f in flags], device=self.s.device)
            )
            flags = [v > 0 for v in total.tolist()]
        return next((r for r, f in zip(REASONS, flags) if f), None)
