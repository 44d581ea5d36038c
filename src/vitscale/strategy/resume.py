"""What each engine can resume from: the engine folder next to a checkpoint (DeepSpeed's
step_N.ds, FSDP2's sharded step_N.dcp), which engines resume which checkpoints, and reading a
sharded DCP folder in one process. The engine rules live here, inside strategy/, so that the
trainer, the CLI and `vitscale eval` ask without naming an engine."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError


def engine_folder(path: Path, state: dict) -> Path | None:
    """The engine folder written next to the checkpoint `path`, or None when the .pt holds it all."""
    suffix = state.get("engine")
    if suffix is None and saved_strategy(state) == "deepspeed":
        suffix = ".ds"  # written before checkpoints named their engine folder
    return Path(path).with_suffix(suffix) if suffix else None


def saved_strategy(state: dict) -> str:
    return state.get("config", {}).get("strategy", {}).get("name", "single")


def read_dcp(path: Path, keys: set[str] | None = None) -> dict:
    """A torch.distributed.checkpoint folder consolidated in this process (no process group used):
    full tensors on the CPU; `keys` limits it to those top-level entries (e.g. {"model"})."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise UserError(
            f"sharded checkpoint folder not found or incomplete: {path} (expected the "
            "step_N.dcp folder written next to the .pt checkpoint)"
        )
    sd: dict = {}
    # what torch.distributed.checkpoint.format_utils.dcp_to_torch_save does (dcp.load itself
    # cannot fill an empty dict): every rank that calls it reads the whole checkpoint
    _load_state_dict(
        sd,
        storage_reader=FileSystemReader(str(path)),
        planner=_EmptyStateDictLoadPlanner(keys=keys),
        no_dist=True,
    )
    return sd


def check_resume(state: dict, path: Path, strategy: str) -> None:
    """One-line UserError when the engine that wrote `state` cannot be resumed by `strategy`:
    DeepSpeed's engine checkpoint resumes only under DeepSpeed, and DeepSpeed resumes only from it."""
    saved = saved_strategy(state)
    if (saved == "deepspeed") == (strategy == "deepspeed"):
        return
    if saved == "deepspeed":
        raise UserError(
            f"cannot resume {path} under strategy.name={strategy}: it was written by "
            "strategy.name=deepspeed, whose optimizer state is in DeepSpeed's own engine "
            "checkpoint; resume it with strategy.name=deepspeed (same processes; other "
            "counts after DeepSpeed's ds_to_universal), or take its weights with "
            f"`vitscale export {path}`"
        )
    raise UserError(
        f"cannot resume {path} under strategy.name=deepspeed: it was written by "
        f"strategy.name={saved} and DeepSpeed resumes only from its own engine checkpoint; "
        f"resume it with strategy.name={saved} (single, ddp and fsdp resume each other's "
        f"checkpoints), or take its weights with `vitscale export {path}`"
    )
