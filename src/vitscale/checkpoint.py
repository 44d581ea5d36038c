"""Checkpoints: written atomically (temp file + rename), keep-last-N, RNG states, safetensors export.

A checkpoint is `checkpoints/step_N.pt`; an engine that keeps its big state in a folder of its own
(DeepSpeed: `step_N.ds`, FSDP2 sharded: `step_N.dcp`) writes it next to the .pt first, and the .pt
names its suffix under "engine". One process writes a run folder at a time (RunLock). A save that
did not complete (a kill between the engine folder and its .pt, a temp file or folder) is never
read, and is removed when the run's writer passes it (the next save, a resume); a save the disk
refuses is one line (SaveError), with nothing of it left behind. Optimizer states are index-keyed (torch.optim) or keyed by
parameter name (FSDP2's `torch.distributed.checkpoint.state_dict`); the helpers below convert.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import random
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import Config
from .errors import SaveError, UserError
from .launch import is_main_process

log = logging.getLogger(__name__)
CKPT_RE = re.compile(r"^step_(\d+)\.pt$")
ENGINE_SUFFIXES = (".ds", ".dcp")  # DeepSpeed's engine folder, FSDP2's sharded one
ENGINE_RE = re.compile(r"^step_\d+\.(ds|dcp)$")
# atomic_save's temp file (.step_N.pt.tmpPID), Distributed.write_folder's (.step_N.ds.tmp)
TEMP_RE = re.compile(r"^\.step_\d+\.(pt\.tmp\d+|ds\.tmp|dcp\.tmp)$")


def rng_state() -> dict:
    """This process's RNG states. On a GPU, only its own device's CUDA generator (the current
    device): one process per GPU, and a resume may see fewer GPUs (one GPU, srun
    --gpus-per-task=1), where a list of every visible GPU's state could not be restored."""
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        device = torch.cuda.current_device()
        if isinstance(cuda, (list, tuple)):  # older checkpoints: every visible GPU's state
            if not cuda:
                return
            cuda = cuda[min(device, len(cuda) - 1)]
        torch.cuda.set_rng_state(cuda, device)


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temp file in the same folder, fsync, then rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def list_checkpoints(run_dir: Path) -> list[Path]:
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := CKPT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def incomplete_checkpoints(run_dir: Path) -> list[Path]:
    """What saves that did not complete left in RUN/checkpoints: an engine folder (step_N.ds,
    step_N.dcp) without its step_N.pt (a kill between the two: the .pt is written last), and the
    temp files and folders of interrupted writes. Never read (list_checkpoints lists .pt files)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [
        p
        for p in folder.iterdir()
        if TEMP_RE.match(p.name) or (ENGINE_RE.match(p.name) and not p.with_suffix(".pt").exists())
    ]
    return sorted(found, key=lambda p: p.name.lstrip("."))  # by step


def remove_incomplete(run_dir: Path) -> list[Path]:
    """The run's writer (its main process, holding the RunLock): incomplete_checkpoints removed."""
    gone = incomplete_checkpoints(run_dir)
    for p in gone:
        _remove(p)
    return gone


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def save_checkpoint(
    run_dir: Path,
    step: int,
    state: dict,
    keep_last: int,
    is_main: bool = True,
    broadcast_object: Callable[[Any], Any] | None = None,
) -> Path:
    """The main process writes step_N.pt (atomically), then removes incomplete checkpoints and the
    complete ones beyond the newest `keep_last`. A write the disk refuses is a SaveError with
    nothing of this step left (its engine folder included); with the strategy's
    `broadcast_object` (collective), every rank raises it."""
    path = Path(run_dir) / "checkpoints" / f"step_{step:08d}.pt"
    problem = None
    if is_main:
        try:
            _write_and_prune(path, state, keep_last)
        except SaveError as e:
            problem = str(e)
    if broadcast_object is not None:
        problem = broadcast_object(problem)
    if problem:
        raise SaveError(problem)
    return path


def _write_and_prune(path: Path, state: dict, keep_last: int) -> None:
    run_dir = path.parent.parent
    try:
        atomic_save(state, path)
    except OSError as e:
        engine = [path.with_suffix(s) for s in ENGINE_SUFFIXES if path.with_suffix(s).is_dir()]
        needed = tensor_bytes(state) + sum(disk_bytes(p) for p in engine)
        if not path.exists():  # this step's engine folder, without its .pt
            for p in engine:
                _remove(p)
        raise save_failed(run_dir, e, needed) from None
    remove_incomplete(run_dir)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)  # first: a kill before its folder goes leaves it incomplete
        for suffix in ENGINE_SUFFIXES:  # its engine folder, also one another strategy wrote
            shutil.rmtree(old.with_suffix(suffix), ignore_errors=True)


# -- a save the disk refused: one line ----------------------------------------------------------
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def write_failure(e: BaseException) -> OSError | None:
    """The OSError behind a failed checkpoint write (torch.distributed.checkpoint wraps each
    rank's in a CheckpointException), or None where the failure is not the file system's."""
    if isinstance(e, OSError):
        return e
    for exc, *_ in getattr(e, "failures", {}).values():  # DCP: {rank: (exception, traceback)}
        if isinstance(exc, OSError):
            return exc
    return None


def save_failed(run_dir: Path, e: OSError, needed: int) -> SaveError:
    """The one line of a save that `e` stopped: the folder, why, about how much it needed, the
    last good checkpoint and how to continue."""
    run_dir = Path(run_dir)
    reason = e.strerror or str(e) or type(e).__name__
    if e.errno in NO_SPACE:
        fix = "free space"
    elif e.errno in NOT_WRITABLE:
        fix = "make the folder writable"
    else:
        fix = "fix it"
    found = list_checkpoints(run_dir)
    if found:
        last = f"the last good checkpoint is {found[-1]}"
        then = f"{fix} and continue with: vitscale train --resume {run_dir}"
    else:
        last, then = "no checkpoint of this run was written before it", f"{fix} and start it again"
    return SaveError(
        f"checkpoint save failed: {run_dir / 'checkpoints'}: {reason} (it needed about "
        f"{_mb(needed)}); {last}; {then}"
    )


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 10e6 else f"{max(n / 1e6, 0.1):.1f} MB"


def tensor_bytes(obj) -> int:
    """The bytes of the tensors in a (nested) state: about what torch.save writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def disk_bytes(path: Path) -> int:
    """A file's size, or a folder's files' together."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def last_size(run_dir: Path) -> int:
    """The newest complete checkpoint's bytes on disk (its .pt and engine folder), 0 without one:
    about what the next save needs."""
    found = list_checkpoints(run_dir)
    if not found:
        return 0
    pt = found[-1]
    return disk_bytes(pt) + sum(disk_bytes(pt.with_suffix(s)) for s in ENGINE_SUFFIXES)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or a run folder (its latest checkpoint)."""
    path = Path(path)
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise UserError(f"no checkpoint in {path} (expected {path}/checkpoints/step_*.pt)")
        return found[-1]
    if not path.exists():
        raise UserError(f"checkpoint not found: {path}")
    return path


def load_checkpoint(path: str | Path) -> dict:
    path = resolve_checkpoint(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated / not a checkpoint: the exception's first sentence, short
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        text = text.split(". ")[0][:120]
        raise UserError(
            f"cannot read checkpoint {path}: {type(e).__name__}{': ' + text if text else ''}"
        ) from None


def newest_readable(path: str | Path, doing: str, command: str) -> tuple[Path, dict]:
    """A checkpoint file and its state (a damaged one refused in one line, with the `command` that
    takes the one before it, where there is one), or a run folder's newest READABLE checkpoint: a
    damaged newest one, e.g. from a disk that filled up, is passed over with one line naming both
    (`doing`: "resuming from", "evaluating", "exporting")."""
    path = Path(path)
    if not path.is_dir():
        try:
            return resolve_checkpoint(path), load_checkpoint(path)
        except UserError as e:
            older = [p for p in list_checkpoints(path.parent.parent) if p != path]
            raise UserError(
                f"{e}{f'; take the one before it: `{command} {older[-1]}`' if older else ''}"
            ) from None
    resolve_checkpoint(path)  # one line where the folder holds none
    bad = []
    for candidate in reversed(list_checkpoints(path)):
        try:
            state = load_checkpoint(candidate)
        except UserError as e:
            bad.append(str(e).removeprefix("cannot read checkpoint "))
            continue
        if bad and is_main_process():
            log.warning(
                "cannot read %s; %s %s, the newest readable checkpoint",
                bad[0],
                doing,
                candidate.name,
            )
        return candidate, state
    raise UserError(f"no readable checkpoint in {path}: cannot read checkpoint {bad[0]}")


class RunLock:
    """One writer per run folder: an exclusive flock on RUN/.lock, held while the run trains. The
    kernel releases it when the holder dies, however it dies (kill -9 included), so a live holder
    is refused and a dead one's lock is taken over, with one line naming it; the file names the
    holder (host, process, start time, command) for both messages."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".lock"
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Takes the lock; returns a one-line refusal where a live process holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(os.read(fd, 4096))
            os.close(fd)
            return (
                f"{self.path.parent} is being written by another live run ({holder}): stop it first, "
                "or train into another --out"
            )
        stale = _holder(os.read(fd, 4096))
        if stale:
            log.warning(
                "%s: took over the lock of a run that is no longer running (%s)",
                self.path.parent,
                stale,
            )
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv)[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self.fd = fd
        return None

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # an empty lock file: released cleanly, nothing to take over
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def _holder(raw: bytes) -> str:
    try:
        h = json.loads(raw.decode())
        return f"process {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
    except (ValueError, KeyError, TypeError):
        return ""


def make_run_dir(
    cfg: Config,
    is_main: bool,
    broadcast_object: Callable[[Any], Any],
    run_dir: str | Path | None,
    resume: object | None,
) -> tuple[Path, RunLock | None, list[Path]]:
    """The main process names the run folder, checks it is free and takes its writer lock (one
    live run per folder); every rank gets the folder, the main process also what it made there
    that was not there before (the folder itself last). `is_main`, `broadcast_object`: the
    strategy's; `resume`: the checkpoint a run continues from, None for a new run."""
    problem, lock, made = None, None, []
    if is_main:
        run_dir = (
            Path(run_dir)
            if run_dir
            else Path(cfg.run.out_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        made = [p for p in (run_dir / "config.toml", run_dir / ".lock", run_dir) if not p.exists()]
        if resume is None and list_checkpoints(run_dir):
            problem = (
                f"{run_dir} already holds a run's checkpoints: continue it with "
                f"`vitscale train --resume {run_dir}` or choose another --out"
            )
        else:
            lock = RunLock(run_dir)
            problem = lock.acquire()
            if problem is None:  # what runs: a resumed run's config with its changes
                (run_dir / "config.toml").write_text(cfg.to_toml())
                _passed_over(remove_incomplete(run_dir))
    folder, problem = broadcast_object((str(run_dir), problem))
    if problem:
        raise UserError(problem)
    return Path(folder), lock, made


def _passed_over(gone: list[Path]) -> None:
    if gone:
        more = f" and {len(gone) - 3} more" if len(gone) > 3 else ""
        names = ", ".join(p.name for p in gone[:3]) + more
        log.warning("removed what interrupted checkpoint saves left (never read): %s", names)


def discard_unstarted(run_dir: Path, made: list[Path]) -> None:
    """A new run refused before its first checkpoint (a missing data root, a model.init file): what
    its start made (config.toml, the lock file, the folder) is removed, so that the folder is as
    before the command; files that were there before are left alone."""
    if list_checkpoints(run_dir):
        return
    for p in made:
        with contextlib.suppress(OSError):  # a folder with something else in it stays
            p.rmdir() if p == run_dir else p.unlink(missing_ok=True)


def export_safetensors(state_dict: dict, path: Path, metadata: dict[str, str]) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path


# -- engine folders (step_N.ds, step_N.dcp): written atomically ----------------------------------
def commit_folder(tmp: Path, path: Path) -> Path:
    """Main process, once every rank has finished writing the engine folder `tmp`: it becomes
    `path` (step_N.ds / step_N.dcp, replacing a copy of the same step written before a crash) and
    leftovers of interrupted saves go. A step_N folder is therefore never half written; old ones
    are pruned with their step_N.pt (save_checkpoint)."""
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    for stale in path.parent.glob(f".step_*{path.suffix}.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    return path


# -- optimizer state: index-keyed (torch.optim) <-> parameter-name-keyed (FSDP2) ----------------
def optim_keyed_by_name(osd: dict) -> bool:
    return any(isinstance(k, str) for g in osd["param_groups"] for k in g["params"])


def optim_state_by_name(osd: dict, names: list[str]) -> dict:
    """torch.optim's state dict (parameters numbered in the optimizer's order) keyed by parameter
    names instead; `names[i]` is the name of the optimizer's i-th parameter."""
    _same_count(osd, names)
    return {
        "state": {names[i]: v for i, v in osd["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]
        ],
    }


def optim_state_by_index(osd: dict, names: list[str]) -> dict:
    """The reverse of optim_state_by_name: a name-keyed optimizer state numbered for an optimizer
    whose i-th parameter is `names[i]`."""
    _same_count(osd, names)
    index = {n: i for i, n in enumerate(names)}
    missing = sorted({n for g in osd["param_groups"] for n in g["params"]} - set(index))
    if missing:
        raise UserError(
            f"checkpoint optimizer state names parameters this model lacks: {', '.join(missing[:3])}"
        )
    return {
        "state": {index[n]: v for n, v in osd["state"].items()},
        # torch.optim pairs saved and current parameters by position: number them in its order
        "param_groups": [
            {**g, "params": sorted(index[n] for n in g["params"])} for g in osd["param_groups"]
        ],
    }


def _same_count(osd: dict, names: list[str]) -> None:
    saved = sum(len(g["params"]) for g in osd["param_groups"])
    if saved != len(names):
        raise UserError(
            f"checkpoint optimizer state holds {saved} parameters, this model's optimizer "
            f"{len(names)}: not the same model"
        )
