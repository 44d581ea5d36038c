"""Checkpoints: written atomically (temp file + rename), keep-last-N, RNG states, safetensors export."""
from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

from .errors import UserError

CKPT_RE = re.compile(r"^step_(\d+)\.pt$")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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


def save_checkpoint(run_dir: Path, step: int, state: dict, keep_last: int) -> Path:
    path = Path(run_dir) / "checkpoints" / f"step_{step:08d}.pt"
    atomic_save(state, path)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


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
    except Exception as e:  # truncated / not a checkpoint
        raise UserError(f"cannot read checkpoint {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def export_safetensors(state_dict: dict, path: Path, metadata: dict[str, str]) -> Path:
    from safetensors.torch import save_file
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path
