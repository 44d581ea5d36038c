"""State dict files as published: `.safetensors`, or torch pickles (`.bin`, `.pt`, `.pth`, read
with `weights_only=True`), possibly wrapped ({"state_dict": ...}, {"model": ...}) or saved from a
DDP module ("module." prefixes). Every problem is a one-line UserError naming the file."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError

WRAPPERS = ("state_dict", "model", "module", "model_state_dict")
SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """{name: tensor} on the CPU from a weights file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"weights file not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise UserError(f"{path}: not a readable safetensors file ({e})") from None
    if path.suffix not in SUFFIXES:
        raise UserError(f"{path}: unknown weights format (expected one of {', '.join(SUFFIXES)})")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickle with objects, a truncated file, not a torch file at all
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: not a torch state dict file ({first[:200]})") from None
    for _ in range(2):  # {"state_dict": {...}} or {"model": {"state_dict"...}}
        if isinstance(obj, dict) and not _is_state_dict(obj):
            inner = next((obj[k] for k in WRAPPERS if isinstance(obj.get(k), dict)), None)
            if inner is not None:
                obj = inner
    if not (isinstance(obj, dict) and obj and _is_state_dict(obj)):
        raise UserError(f"{path}: does not hold a state dict (a mapping of parameter names to tensors)")
    if all(k.startswith("module.") for k in obj):
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return obj


def _is_state_dict(obj: dict) -> bool:
    return all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items())


def write_state_dict(sd: dict[str, torch.Tensor], path: str | Path) -> Path:
    """A safetensors file (contiguous CPU tensors) or, for .bin/.pt/.pth, a torch file."""
    path = Path(path)
    sd = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file(sd, str(path))
    else:
        torch.save(sd, path)
    return path


def first_keys(names, n: int = 4) -> str:
    """The first `n` of `names`, sorted, and how many more: for one-line errors."""
    names = sorted(names)
    return ", ".join(names[:n]) + (f" (and {len(names) - n} more)" if len(names) > n else "")


def refuse_unsupported(sd: dict, table: dict, source: str, target: str) -> None:
    """One line naming the first variant in `table` ({key fragment: what it is}) that the keys show."""
    for marker, what in table.items():
        hits = [k for k in sd if marker in k]
        if hits:
            raise UserError(f"{source}: {what} ({first_keys(hits, 2)}) is not implemented by {target}")
