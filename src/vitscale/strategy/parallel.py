"""The parallelize pipeline (issue 49), applied from outside to a plain model placed on its device,
in one fixed order, as torchtitan's parallelize_* functions: activation checkpointing, the tensor-
parallel plan, compile, then FSDP2 over the data-parallel mesh (the shard dimension, or replicate x
shard for HSDP). Each step is a function of the model and the mesh; the engine (fsdp.py) calls them.

Tensor parallelism follows the model's plan (models/layers.tp_plan): q, k and v column-wise by heads
(one fused weight, each rank's rows [q_r; k_r; v_r]: a strided shard), the attention projection
row-wise, the MLP's first layer column-wise and its second row-wise (Megatron's split: one
all-reduce per branch in forward, one in backward). Every other parameter (embeddings, norms, the
head) is replicated over the tp dimension as a DTensor, so that FSDP2, the gradient norm and the
optimizer see one kind of parameter; the replicated activations between the split layers are plain
tensors, mixed with those parameters under DTensor's implicit replication (`tp_context`)."""

from __future__ import annotations

import contextlib
import logging
import types
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .base import GradCheckpointing


def apply_ac(model: nn.Module, on: bool) -> None:
    """1. Activation checkpointing: the model recomputes its blocks in backward."""
    if on:
        cast(GradCheckpointing, model).set_grad_checkpointing(True)


def styles(sequence_parallel: bool = False) -> dict[str, Any]:
    """The plan's style names -> torch.distributed.tensor.parallel styles. Column-wise outputs stay
    local shards (heads, hidden units: plain tensors for the attention and the activation);
    row-wise outputs stay DTensors, as the residual stream is: replicated, or with
    `sequence_parallel` split by tokens (Shard(1)): the row-wise all-reduce becomes a
    reduce-scatter, the column-wise input an all-gather, the norms run on their tokens."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    stream = Shard(1) if sequence_parallel else Replicate()

    whole = dict(output_layouts=Shard(1), desired_output_layouts=Replicate())
    split = dict(input_layouts=Replicate(), desired_input_layouts=Shard(1))
    return {
        "colwise": lambda: ColwiseParallel(input_layouts=stream),
        "rowwise": lambda: RowwiseParallel(output_layouts=stream, use_local_output=False),
        "colwise_qkv": lambda: fused_colwise(3, stream),
        "colwise_glu": lambda: fused_colwise(2, stream),
        "local_norm": local_norm,
        "sequence": lambda: SequenceParallel(use_local_output=False),
        "sequence_in": lambda: PrepareModuleInput(**split, use_local_output=False),
        "sequence_out": lambda: PrepareModuleOutput(**whole, use_local_output=False),
        "sequence_in_out": lambda: PrepareModuleInputOutput(
            **split, use_local_input=False, **whole, use_local_output=False
        ),
    }


def fused_colwise(parts: int, stream):
    """The style of a column-wise weight of `parts` stacked blocks (Fused)."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    class Fused(ColwiseParallel):
        """Column-wise over a weight of `parts` stacked blocks ([q; k; v], or a packed SwiGLU's
        [gate; value]): rank r holds its rows of each block ([q_r; k_r; v_r]), a strided shard of
        the whole (split_factor = parts), and its output stays that shard (not redistributed to a
        contiguous one)."""

        def __init__(self, parts: int):
            super().__init__(
                input_layouts=stream, output_layouts=_StridedShard(-1, split_factor=parts)
            )
            self.parts = parts

        def _partition_linear_fn(self, name, module, device_mesh):
            for pname, param in module.named_parameters():
                # the bias replicated: the linear slices it to the output's shard, and FSDP2 then
                # shards it plainly over the data-parallel ranks
                placement = (
                    _StridedShard(0, split_factor=self.parts) if pname == "weight" else Replicate()
                )
                dist_param = nn.Parameter(
                    distribute_tensor(param, device_mesh, [placement]),
                    requires_grad=param.requires_grad,
                )
                module.register_parameter(pname, dist_param)

    return Fused(parts)


def local_norm():
    """The style of a norm over each head's features (LocalNorm)."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class LocalNorm(ParallelStyle):
        """A norm over each head's features (q/k norm) under tensor parallelism: its input is the
        rank's heads as a plain tensor, so its weights, replicated DTensors, are applied as their
        local copies, whose gradients are partial sums (each rank's heads), summed across the
        ranks as DTensor reduces a Partial placement."""

        def _apply(self, module, device_mesh):
            for pname, param in list(module.named_parameters(recurse=False)):
                d = distribute_tensor(param.data, device_mesh, [Replicate()])
                module.register_parameter(pname, nn.Parameter(d, requires_grad=param.requires_grad))
            module.forward = types.MethodType(local_norm_forward, module)
            return module

    return LocalNorm()


def local_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A LayerNorm's or RMSNorm's forward with its DTensor weights' local copies (LocalNorm)."""
    from torch.distributed.tensor import Partial

    def local(p):
        return None if p is None else p.to_local(grad_placements=[Partial()] * p.device_mesh.ndim)

    if isinstance(self, nn.LayerNorm):
        return F.layer_norm(
            x, self.normalized_shape, local(self.weight), local(self.bias), self.eps
        )
    return F.rms_norm(x, self.normalized_shape, local(self.weight), self.eps)


def replicate_rest(model: nn.Module, tp_mesh) -> None:
    """Every parameter the plan left whole becomes a DTensor replicated over the tp dimension."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                d = distribute_tensor(p.data, tp_mesh, [Replicate()])
                module.register_parameter(name, nn.Parameter(d, requires_grad=p.requires_grad))


def apply_tp(model: nn.Module, tp_mesh, plan: dict[str, str], sequence_parallel: bool) -> None:
    """2. The tensor-parallel plan over the tp dimension of the mesh."""
    from torch.distributed.tensor.parallel import parallelize_module

    kinds = styles(sequence_parallel)
    # gathering a tp x dp parameter for a full checkpoint takes two all-gathers, which DTensor
    # warns about on every rank at every checkpoint: a cost of the checkpoint, not of the step
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    parallelize_module(model, tp_mesh, {name: kinds[kind]() for name, kind in plan.items()})
    replicate_rest(model, tp_mesh)
    # the model's inputs as replicated DTensors (the patch embedding's convolution takes no plain
    # tensor in backward); its output (logits, features) as plain tensors for the loss
    model.register_forward_pre_hook(lambda m, args: replicated(args, tp_mesh))
    model.register_forward_hook(lambda m, args, out: to_local(out))


def replicated(args: tuple, mesh) -> tuple:
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(
        DTensor.from_local(a, mesh, [Replicate()], run_check=False)
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
        else a
        for a in args
    )


def to_local(out):
    from torch.distributed.tensor import DTensor

    if isinstance(out, DTensor):  # replicated: this rank's copy (a new tensor, not a view of
        return out.full_tensor().clone()  # it, which FSDP2's backward hook warns about)
    if isinstance(out, tuple):
        return tuple(to_local(o) for o in out)
    if isinstance(out, dict):
        return {k: to_local(v) for k, v in out.items()}
    return out


def tp_context(on: bool):
    """Forward and backward of a tensor-parallel model: plain tensors (the activations between the
    split layers, the inputs) mix with the replicated DTensor parameters as replicated."""
    if not on:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


def apply_compile(units: list[nn.Module], on: bool, kwargs: dict) -> None:
    """3. Each block's forward compiled in place (parameter names unchanged), with torch.compile's
    `kwargs` (compiling.compile_args: the mode, or its options with the train.inductor_* knobs)."""
    if on:
        for block in units:
            block.compile(**kwargs)


def apply_fsdp(model: nn.Module, units: list[nn.Module], dp_mesh, **kw) -> None:
    """4. FSDP2: each block, then the root, over `dp_mesh` (1-D: shard; 2-D: HSDP, replicate x
    shard)."""
    from torch.distributed.fsdp import fully_shard

    kw["shard_placement_fn"] = shard_placement
    for block in units:
        fully_shard(block, mesh=dp_mesh, **kw)
    fully_shard(model, mesh=dp_mesh, **kw)


def shard_placement(p: nn.Parameter):
    """FSDP2's split of a parameter over the data-parallel ranks: dim 0 (its default), but dim 1
    for the fused q, k, v weight, whose dim 0 tensor parallelism splits by a stride (FSDP2 would
    nest a second strided split in the first, which its gather and DCP do not undo)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = isinstance(p, DTensor) and any(isinstance(x, _StridedShard) for x in p.placements)
    return Shard(1) if strided else None


def on_whole_matrix(update: torch.Tensor, fn):
    """Muon's `whole` (muon.MuonAdamW): `fn` of the whole matrix, this rank's part of its result
    back. A sharded DTensor (FSDP2, HSDP, tensor parallel) is gathered whole (`full_tensor`), `fn`
    runs alike on every rank, and each keeps its shard (`distribute_tensor` with src_data_rank=None:
    a local slice, no second collective)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(update, DTensor):
        return fn(update)
    whole = fn(update.full_tensor())
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
