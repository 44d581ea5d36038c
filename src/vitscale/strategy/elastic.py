"""`vitscale train --nproc-per-node N`: the ranks started by torch's own elastic launcher (the API
torchrun is built on: torch.distributed.launcher.api.elastic_launch), so that one command owns
their output and its exit status:

- a config refusal is checked once, before any rank starts: one line, exit 2;
- a stop signal to the command (SIGTERM, SIGINT, SIGUSR1, SIGHUP) reaches every rank, which stop
  after the step and save it (rank 0 prints the one stop line); the command exits 128 + the
  signal's number, as one process does;
- a rank that fails: its own line (a config refusal: rank 0's only), then one line here naming the
  rank, its status and the last complete checkpoint; the command exits with that rank's status.

Several nodes: the same command on each, with --nnodes and a rendezvous (--rdzv-endpoint HOST:PORT,
--rdzv-id), as torchrun's.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import uuid
from pathlib import Path

SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# how long the ranks get to finish the step and write its checkpoint after a stop signal
SHUTDOWN_TIMEOUT_S = 600


LAUNCHER_OPTIONS = ("--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--rdzv-id")  # cli.py's


def child_argv(argv: list[str]) -> list[str]:
    """The train command line the ranks run: this one without the launcher's options."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in LAUNCHER_OPTIONS:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch_config(args, nproc: int):
    """torch's LaunchConfig for this command: one node at localhost (a free port), or the
    rendezvous the options name."""
    from torch.distributed.launcher.api import LaunchConfig

    lo, _, hi = str(args.nnodes).partition(":")
    nmin, nmax = int(lo), int(hi or lo)
    endpoint = args.rdzv_endpoint or f"localhost:{_free_port()}"
    return LaunchConfig(
        min_nodes=nmin,
        max_nodes=nmax,
        nproc_per_node=nproc,
        run_id=args.rdzv_id or str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": True} if nmax == 1 else {},
        max_restarts=0,
        signals_to_handle=SIGNALS,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )


def quiet_torch_elastic() -> None:
    """torch's launcher logs its own warnings (the signal it forwards, a worker's failure table):
    what the user needs is the ranks' lines and this command's one."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.")]
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", *names):
        if "elastic" in name or "launcher" in name:
            logging.getLogger(name).setLevel(logging.CRITICAL)


def last_checkpoint(run_dir: Path | None) -> str:
    if run_dir is None:
        return ""
    from ..checkpoint import list_checkpoints

    found = list_checkpoints(run_dir)
    return str(found[-1]) if found else ""


def launch(args, argv: list[str], run_dir: Path | None) -> int:
    """Start args.nproc_per_node ranks of `vitscale ARGV` (without the launcher's options) and
    wait: 0, the first failed rank's status, or 128 + the stop signal's number."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    quiet_torch_elastic()
    config = launch_config(args, args.nproc_per_node)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default per rank
    cmd = ["-u", "-m", "vitscale", *child_argv(argv)]
    try:
        elastic_launch(config, entrypoint=sys.executable)(*cmd)
    except SignalException as e:  # forwarded to every rank, which saved at the step
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        # the root cause: a rank killed by a signal (its peers then lose contact), but not the
        # SIGTERM the launcher itself sends the survivors when one fails; else the first
        def cause(kv):
            code = kv[1].exitcode
            return (code == -signal.SIGTERM, code >= 0, kv[1].timestamp, kv[0])

        rank, failure = min(e.failures.items(), key=cause)
        status = failure.exitcode
        if status == 2:  # an input error: the rank said it in one line already
            return 2
        if status < 0:  # killed by a signal
            status = 128 - status
            what = f"was killed by {signal.Signals(-failure.exitcode).name}"
        else:
            what = f"exited with {status}"
        ckpt = last_checkpoint(run_dir)
        keep = f"the last complete checkpoint is {ckpt}; " if ckpt else ""
        where = f" --resume {run_dir}" if run_dir else " --resume RUN"
        print(
            f"vitscale: error: rank {rank} {what}; {keep}continue with: vitscale train{where}",
            file=sys.stderr,
        )
        return status
    return 0
