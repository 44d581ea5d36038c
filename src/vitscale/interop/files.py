"""State dict files as published: `.safetensors`, or torch pickles (`.bin`, `.pt`, `.pth`, `.ckpt`,
timm's training checkpoints `.pth.tar`, read with `weights_only=True`), possibly wrapped
({"state_dict": ...}, {"model": ...}) or saved from a DDP module ("module." prefixes). A training
checkpoint may hold the weights and their EMA (timm: `state_dict` and `state_dict_ema`; others
`model_ema`): which is read is chosen (`model.init_weights`) and said in one line; its pickled
`args` (an argparse.Namespace) are read as plain data, never as code, and its `arch` entry (or
`args.model`) names the architecture. Every problem is a one-line UserError naming the file."""

from __future__ import annotations

import argparse
import functools
import logging
import re
import zipfile
from pathlib import Path

import torch

from ..errors import UserError

log = logging.getLogger(__name__)
WRAPPERS = ("state_dict", "model", "module", "model_state_dict")
EMA_WRAPPERS = ("state_dict_ema", "model_ema", "ema", "ema_state_dict")
SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pth.tar")
WHICH = ("auto", "raw", "ema")  # model.init_weights
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def read_state_dict(path: str | Path, which: str = "auto") -> dict[str, torch.Tensor]:
    """{name: tensor} on the CPU from a weights file (`which`: model.init_weights)."""
    return read_weights(path, which)[0]


def read_weights(path: str | Path, which: str = "auto") -> tuple[dict[str, torch.Tensor], str]:
    """({name: tensor} on the CPU, the architecture the file names or ""). `which`: "raw" or "ema"
    weights of a training checkpoint that holds both; "auto": the raw ones where both are there
    (what timm's validate.py reads without --use-ema), the EMA ones where only they are, announced."""
    path = Path(path)
    if not path.is_file():
        raise missing_weights(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path)), ""
        except (SafetensorError, OSError) as e:
            raise UserError(f"{path}: not a readable safetensors file ({e})") from None
    if not path.name.endswith(SUFFIXES):
        raise UserError(f"{path}: unknown weights format (expected one of {', '.join(SUFFIXES)})")
    obj = _torch_load(path)
    arch = _arch_of(obj)
    obj = _choose(obj, which, path)
    for _ in range(2):  # {"state_dict": {...}} or {"model": {"state_dict"...}}
        if isinstance(obj, dict) and not _is_state_dict(obj):
            inner = next((obj[k] for k in WRAPPERS if isinstance(obj.get(k), dict)), None)
            if inner is not None:
                obj = inner
    if not (isinstance(obj, dict) and obj and _is_state_dict(obj)):
        raise UserError(
            f"{path}: does not hold a state dict (a mapping of parameter names to tensors)"
        )
    if all(k.startswith("module.") for k in obj):
        obj = {k[len("module.") :]: v for k, v in obj.items()}
    return obj, arch


@functools.lru_cache(maxsize=8)
def named_arch(path: str | Path) -> str:
    """The architecture a torch training checkpoint names (its `arch` entry, else `args.model`), or ""
    (safetensors files and plain state dicts name none)."""
    path = Path(path)
    if not path.is_file() or path.suffix == ".safetensors" or not path.name.endswith(SUFFIXES):
        return ""
    return _arch_of(_torch_load(path))


def _torch_load(path: Path):
    """torch.load without running pickled code: tensors, containers and argparse.Namespace (the
    `args` of timm's and many training scripts' checkpoints) only; one line where the file wants
    more, naming the object that a weights-only load refused."""
    if _is_torchscript(path):
        raise UserError(
            f"{path}: a TorchScript archive (a program, as OpenAI's original CLIP .pt files are), which "
            "vitscale does not read; save its state dict (torch.jit.load(path).state_dict()) to a "
            "safetensors file, or take OpenCLIP's converted weights"
        )
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickle with other objects, a truncated file, not a torch file at all
        text = ANSI.sub("", str(e)).strip()
        blocked = re.search(r"GLOBAL ([\w.]+)", text)
        if blocked:
            raise UserError(
                f"{path}: holds a pickled {blocked.group(1)}, which a weights-only load does not "
                "run (arbitrary code); save its state dict alone (torch.save(model.state_dict()) or "
                "safetensors) to use it"
            ) from None
        first = text.splitlines()[0] if text else type(e).__name__
        raise UserError(f"{path}: not a torch state dict file ({first[:200]})") from None


def _is_torchscript(path: Path) -> bool:
    """A TorchScript archive: a zip whose record holds compiled code (code/, constants.pkl)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any(n.endswith("/constants.pkl") or "/code/" in n for n in z.namelist())


def missing_weights(path) -> UserError:
    """The one line for a model.init that names nothing on disk: vitscale reads local files; a hub
    name (timm's vit_small_patch16_224.augreg_in21k_ft_in1k, hf-hub:org/name) must be downloaded."""
    name = str(path).removeprefix("hf-hub:").removeprefix("hf_hub:")
    repo = name if "/" in name else f"timm/{name}"
    hint = (
        ""
        if str(path).endswith(SUFFIXES)
        else (
            f"; vitscale reads local files, not a hub: download it first, e.g. `huggingface-cli download {repo} "
            f"--local-dir {Path(name).name}`, and give that folder"
        )
    )
    return UserError(f"weights file not found: {path}{hint}")


def _arch_of(obj) -> str:
    """The architecture a training checkpoint names: its `arch` entry (timm), else `args.model`."""
    if not isinstance(obj, dict):
        return ""
    arch = obj.get("arch")
    if not isinstance(arch, str):
        arch = (
            getattr(obj.get("args"), "model", None)
            if isinstance(obj.get("args"), argparse.Namespace)
            else None
        )
    return arch if isinstance(arch, str) else ""


def _choose(obj, which: str, path: Path):
    """The raw or the EMA weights of a checkpoint that may hold both, chosen by `which`, in one line."""
    if which not in WHICH:
        raise UserError(f"model.init_weights must be one of {', '.join(WHICH)}, got {which!r}")
    if not isinstance(obj, dict):
        return obj
    ema = next((k for k in EMA_WRAPPERS if isinstance(obj.get(k), dict) and obj[k]), None)
    raw = next((k for k in WRAPPERS if isinstance(obj.get(k), dict) and obj[k]), None)
    if ema is None:
        if which == "ema":
            raise UserError(
                f"model.init_weights=ema: {path} holds no EMA weights ({', '.join(EMA_WRAPPERS)})"
            )
        return obj
    if which == "raw" and raw is None:
        raise UserError(f"model.init_weights=raw: {path} holds only EMA weights ({ema})")
    key = ema if which == "ema" or raw is None else raw
    other = (
        f"; model.init_weights={'raw' if key == ema else 'ema'} reads the {'raw' if key == ema else 'EMA'} "
        "ones"
        if raw is not None
        else " (it holds no others)"
    )
    log.warning(
        "model.init: %s: reading its %s weights (%s)%s",
        path,
        "EMA" if key == ema else "raw",
        key,
        other,
    )
    return obj[key]


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
            raise UserError(
                f"{source}: {what} ({first_keys(hits, 2)}) is not implemented by {target}"
            )
