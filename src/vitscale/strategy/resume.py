"""What each engine can resume from: which engines resume which checkpoints, the engine folder of
a checkpoint written before checkpoints named theirs, and reading a sharded DCP folder (FSDP2's
step_N.dcp) in one process. The engine rules live here, inside strategy/, so that the trainer, the
CLI and `vitscale eval` ask without naming an engine; what a checkpoint holds, and its engine folder
next to it, is read through state.SavedRun."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError


def unnamed_engine_suffix(strategy: str) -> str | None:
    """The engine folder's suffix of a checkpoint that `strategy` wrote before checkpoints named
    their engine folder: DeepSpeed's step_N.ds; None where the .pt held it all."""
    return ".ds" if strategy == "deepspeed" else None


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


def check_resume(saved: str, path: Path, strategy: str) -> None:
    """One-line UserError when the checkpoint `path` that engine `saved` wrote (its strategy.name)
    cannot be resumed by `strategy`: DeepSpeed's engine checkpoint resumes only under DeepSpeed, and
    DeepSpeed resumes only from it."""
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
