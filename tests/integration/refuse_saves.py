"""`vitscale` with a checkpoint save refused or killed, as torchrun's script (issue 62 items 4, 5):

- REFUSE_STEP=N, REFUSE_ERRNO=E (28: ENOSPC), REFUSE_RANK=R (every rank where unset): opening a file
  for writing whose path names step N (step_N.pt's temp file, a file in step_N.ds's or step_N.dcp's
  temp folder) raises OSError(E) on that rank, as a full disk, a quota or a read-only folder do.
- KILL_STEP=N: once the main process has committed step N's engine folder (step_N.ds, step_N.dcp),
  it kills the launch with SIGKILL (torchrun first, then every rank: each runs in a session of its
  own), before step_N.pt is written."""

import builtins
import io
import os
import signal
import sys

from vitscale import checkpoint
from vitscale.cli import main
from vitscale.launch import this_process


def refuse(step: int, code: int) -> None:
    real = builtins.open

    def refusing_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and f"step_{step:08d}" in os.fspath(file):
            raise OSError(code, os.strerror(code), os.fspath(file))
        return real(file, mode, *args, **kwargs)

    builtins.open = io.open = refusing_open


def kill_the_launch() -> None:
    """SIGKILL to torchrun (this process's parent), then to its other children, then to this one."""
    launcher = os.getppid()
    ranks = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == launcher:
                        ranks.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    os.kill(launcher, signal.SIGKILL)
    for pid in ranks:
        if pid != os.getpid():
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_after_commit(step: int) -> None:
    real = checkpoint.commit_folder

    def commit_then_kill(tmp, path):
        out = real(tmp, path)
        if path.name.startswith(f"step_{step:08d}."):
            kill_the_launch()
        return out

    checkpoint.commit_folder = commit_then_kill
    from vitscale.strategy import dist  # imported the name before this ran

    dist.commit_folder = commit_then_kill


if "REFUSE_STEP" in os.environ:
    rank = os.environ.get("REFUSE_RANK")
    if rank is None or int(rank) == this_process().rank:
        refuse(int(os.environ["REFUSE_STEP"]), int(os.environ.get("REFUSE_ERRNO", "28")))
if "KILL_STEP" in os.environ:
    kill_after_commit(int(os.environ["KILL_STEP"]))
sys.exit(main(sys.argv[1:]))
