"""The device mesh (issue 49): every process is one point of a (dp_replicate, dp_shard, tp) grid, tp
innermost (the ranks of one tensor-parallel group are neighbours: one node's GPUs), as torchtitan
lays it out. `strategy.name` is the short form of a shape:

- single: one process (1, 1, 1);
- ddp: replicas, (-1, 1, tp): DistributedDataParallel where tp = 1;
- fsdp: shards, (1, -1, tp): FSDP2 over the shard dimension;
- hsdp: replicas of shards, (-1, local processes, tp): FSDP2 over both dimensions, each node one
  shard group by default (strategy.dp_shard sets it);
- deepspeed: its own engine, (-1, 1, 1) as far as the data goes.

`strategy.dp_replicate`, `strategy.dp_shard` and `strategy.tp` set a dimension (0: the name's
default, -1: fill the processes left). The product is the world size; the data-parallel ranks are
the (replicate, shard) points, and the ranks of one tensor-parallel group see the same batches.
Every refusal here is asked at config time (`check_engine`), before a process group exists."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..errors import ConfigError

DIMS = ("dp_replicate", "dp_shard", "tp")
# which dimensions each short form lets grow past 1 (tp for every engine built on the mesh)
FREE = {
    "single": (),
    "ddp": ("dp_replicate", "tp"),
    "fsdp": ("dp_shard", "tp"),
    "hsdp": ("dp_replicate", "dp_shard", "tp"),
    "deepspeed": ("dp_replicate",),
}
# the short forms that let each dimension grow past 1 (FREE's other side), as a refusal names them
GROWS = {"dp_shard": "fsdp or hsdp", "dp_replicate": "ddp or hsdp", "tp": "fsdp, hsdp or ddp"}
DEFAULTS = {  # the dimensions a short form fills (-1) or fixes, before the keys
    "single": (1, 1, 1),
    "ddp": (-1, 1, 1),
    "fsdp": (1, -1, 1),
    "hsdp": (-1, 0, 1),  # 0: the processes of one node (LOCAL_WORLD_SIZE)
    "deepspeed": (-1, 1, 1),
}


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the mesh's three dimensions."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel processes: replicas x shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def sizes(self) -> tuple[int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.tp)

    def describe(self) -> str:
        parts = [f"{n} {v}" for n, v in zip(DIMS, self.sizes) if v > 1]
        return " x ".join(parts) if parts else "one process"

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index of global `rank` (tp innermost)."""
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp


def local_processes(world: int) -> int:
    """Processes on this node as the launcher says (LOCAL_WORLD_SIZE), else the world."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else world


def mesh_shape(
    scfg, world: int, local: int | None = None, origin: dict[str, str] | None = None
) -> MeshShape:
    """The mesh of `world` processes that strategy.name and strategy.dp_replicate / dp_shard / tp
    describe; a one-line ConfigError where they cannot make one. `origin`: where a key's value
    came from, by key (" (from the saved run)", " (from the command line)": a resume's), said
    after the value in a refusal."""
    name, said = scfg.name, origin or {}
    asked = {d: getattr(scfg, d) for d in DIMS}
    for d, v in asked.items():
        if v < -1:
            raise ConfigError(
                f"config: strategy.{d}={v}{said.get(d, '')}: give a size >= 1, -1 (fill) or 0 "
                "(default)"
            )
        if v not in (0, 1, -1) and d not in FREE[name]:
            raise ConfigError(
                f"config: strategy.{d}={v}{said.get(d, '')} with strategy.name={name}"
                f"{said.get('name', '')}: that dimension is {name}'s to leave at 1; use "
                f"strategy.name={GROWS[d]}"
            )
    sizes = [asked[d] or DEFAULTS[name][i] for i, d in enumerate(DIMS)]
    if sizes[1] == 0:  # hsdp's default shard group: one node
        node = local or local_processes(world)
        sizes[1] = node if asked["dp_replicate"] in (0, -1) else -1
    fill = [i for i, v in enumerate(sizes) if v == -1]
    if len(fill) > 1:  # the name's own fill gives way to the one asked
        keep = [i for i in fill if asked[DIMS[i]] == -1] or fill[:1]
        for i in fill:
            if i not in keep[:1]:
                sizes[i] = 1
        fill = keep[:1]
    known = math.prod(v for v in sizes if v != -1)
    if fill:
        if world % known:
            raise ConfigError(
                f"config: the mesh {mesh_text(sizes, said)} does not divide {world} processes "
                f"({known} does not divide {world})"
            )
        sizes[fill[0]] = world // known
    shape = MeshShape(*sizes)
    if shape.world != world:
        raise ConfigError(
            f"config: the mesh {mesh_text(sizes, said)} has {shape.world} processes, the launch "
            f"{world}: strategy.dp_replicate x dp_shard x tp must be the world size (one may be -1)"
        )
    if scfg.sequence_parallel and shape.tp == 1:
        raise ConfigError(
            f"config: strategy.sequence_parallel{said.get('sequence_parallel', '')} splits the "
            "tokens over the tensor-parallel ranks: it needs strategy.tp > 1"
        )
    if name == "hsdp" and world == 1:
        raise ConfigError(
            "config: strategy.name=hsdp on one process: HSDP replicates shard groups over "
            "several processes (launch with torchrun --nproc-per-node N)"
        )
    return shape


def mesh_text(sizes, origin: dict[str, str] | None = None) -> str:
    """The sizes in words, each dimension's origin after it where `origin` names one."""
    said = origin or {}
    return " x ".join(f"{d}={v}{said.get(d, '')}" for d, v in zip(DIMS, sizes))


def tp_refusal(shape: MeshShape, widths: dict[str, int | None]) -> str | None:
    """Where strategy.tp does not divide what tensor parallelism splits (`widths`: the model's
    head counts and hidden widths by name; None: a part it cannot split), one line; else None."""
    if shape.tp == 1:
        return None
    for what, n in widths.items():
        if n is None:
            return (
                f"config: strategy.tp={shape.tp}: the model has a {what}, which tensor "
                "parallelism cannot split (it needs every head or hidden unit on one rank); "
                "use strategy.tp=1"
            )
        if n % shape.tp:
            return (
                f"config: strategy.tp={shape.tp} does not divide the model's {what} ({n}): "
                "tensor parallelism splits heads and hidden widths evenly"
            )
    return None


def build_mesh(shape: MeshShape, device_type: str):
    """The DeviceMesh over every process, dimensions named DIMS (tp innermost)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shape.sizes, mesh_dim_names=DIMS)


def dp_group(shape: MeshShape):
    """The process group of this rank's data-parallel peers (same tp index): None where that is
    the world (tp = 1). Collective: every rank creates every group."""
    if shape.tp == 1:
        return None
    import torch.distributed as dist

    groups = [[j + i * shape.tp for i in range(shape.dp)] for j in range(shape.tp)]
    group, _ = dist.new_subgroups_by_enumeration(groups)
    return group
