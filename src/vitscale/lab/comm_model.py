"""Analytic data-parallel scaling model: collective times on a two-level (node) network, step times.

Notation: K GPUs, G = GPUs per node, N = ceil(K / G) nodes, B = bytes of the tensor being
reduced (gradients: params x bytes of the reduce dtype), bw = bandwidth per GPU in bytes/s
(one direction), a = latency per ring step in seconds, n = ceil(B / bucket) buckets.

A collective with ring factor c (c = 2 for all-reduce = reduce-scatter + all-gather, c = 1 for a
reduce-scatter or an all-gather alone) costs, on one level of K GPUs (the textbook ring):

    t = c (K-1)/K x B / bw  +  n x c (K-1) x a

Beyond one node the model is hierarchical (what NCCL's multi-channel rings and Horovod/torch
hierarchical all-reduce achieve with one NIC per GPU): a reduce-scatter inside the node over the
intra-node link, the inter-node collective on each GPU's 1/G shard over the inter-node link (all G
NICs of a node in parallel), then an all-gather inside the node:

    t = c (G-1)/G x B / bw_intra  +  c (N-1)/N x (B/G) / bw_inter
        + n x c x ((G-1) a_intra + (N-1) a_inter)

With G = 1 (one GPU per node) it is the flat ring over the inter-node link. If a node has fewer
NICs than GPUs, give the inter-node link's bandwidth per GPU (NIC bandwidth x NICs / G).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Link:
    name: str
    bw: float  # bytes/s per GPU, one direction
    latency: float  # seconds per ring step


# bandwidth per GPU and per-step latency (nominal figures; measured NCCL bus bandwidth is lower)
LINKS = {
    "nvlink": Link("NVLink 4 (H100 SXM)", 450e9, 3e-6),
    "pcie": Link("PCIe 4.0 x16", 25e9, 5e-6),
    "pcie3": Link("PCIe 3.0 x16 (T4 nodes)", 12e9, 8e-6),
    "infiniband": Link("InfiniBand HDR 200 Gb/s", 25e9, 5e-6),
    "infiniband_ndr": Link("InfiniBand NDR 400 Gb/s", 50e9, 5e-6),
    "ethernet": Link("Ethernet 100 Gb/s", 12.5e9, 20e-6),
    "ethernet10": Link("Ethernet 10 Gb/s", 1.25e9, 50e-6),
}
DEFAULT_LINKS = "nvlink+infiniband,pcie+infiniband,pcie+ethernet,ethernet10"


def parse_link(text: str) -> Link:
    """A preset name, or 'GBPS[:LATENCY_US]' (e.g. '3.1:40' = 3.1 GB/s, 40 us per step)."""
    text = text.strip()
    if text in LINKS:
        return LINKS[text]
    try:
        bw, _, lat = text.partition(":")
        return Link(f"{float(bw):g} GB/s", float(bw) * 1e9, float(lat or 10) * 1e-6)
    except ValueError:
        raise ValueError(
            f"unknown link {text!r}: one of {', '.join(LINKS)} or GBPS[:LATENCY_US]"
        ) from None


def parse_links(text: str) -> list[tuple[str, Link, Link]]:
    """'nvlink+infiniband,pcie' -> [(label, intra, inter)]: 'A+B' = A inside a node, B between nodes;
    a single name is used at both levels."""
    out = []
    for spec in filter(None, (s.strip() for s in text.split(","))):
        intra, _, inter = spec.partition("+")
        out.append((spec, parse_link(intra), parse_link(inter or intra)))
    return out


def collective_time(
    c: float, nbytes: float, k: int, intra: Link, inter: Link, per_node: int, bucket_bytes: float
) -> float:
    """Seconds for a ring collective with factor c (2 all-reduce, 1 reduce-scatter / all-gather)
    of `nbytes` over k GPUs; the module docstring has the formula."""
    if k <= 1 or nbytes <= 0:
        return 0.0
    buckets = max(1, math.ceil(nbytes / bucket_bytes)) if bucket_bytes > 0 else 1
    g = min(k, max(1, per_node))
    nodes = math.ceil(k / g)
    t = c * (g - 1) / g * nbytes / intra.bw + buckets * c * (g - 1) * intra.latency
    if nodes > 1:
        t += (
            c * (nodes - 1) / nodes * (nbytes / g) / inter.bw
            + buckets * c * (nodes - 1) * inter.latency
        )
    return t


@dataclass(frozen=True)
class StepCost:
    """Measured (or estimated) costs of one optimizer step on ONE device at `batch` images."""

    batch: float  # images per optimizer step on the device
    forward: float  # seconds, all micro-batches of the step
    backward: float
    optimizer: float = 0.0  # seconds, the full (unsharded) optimizer step
    data: float = 0.0  # seconds of exposed data loading per step
    accum: int = 1  # micro-batches per optimizer step


def scaled(cost: StepCost, batch: float) -> StepCost:
    """The same device at another per-device batch: forward/backward/data linear in images
    (no small-batch inefficiency is modelled), optimizer unchanged."""
    f = batch / cost.batch
    return replace(
        cost, batch=batch, forward=cost.forward * f, backward=cost.backward * f, data=cost.data * f
    )


STRATEGIES = ("ddp", "zero12", "zero3", "hsdp")


def comm_times(
    strategy: str,
    grad_bytes: float,
    k: int,
    intra: Link,
    inter: Link,
    per_node: int,
    bucket_bytes: float,
) -> dict:
    """Collective seconds per optimizer step, by phase.

    ddp:    one all-reduce of the gradients (c = 2) during the last backward.
    zero12: reduce-scatter of gradients (c = 1, during backward) + all-gather of the updated
            parameter shards after the step (c = 1): the all-reduce's volume, 2 (K-1)/K x B.
    zero3:  (FSDP2) all-gather of parameters in forward and again in backward + reduce-scatter of
            gradients: 3 (K-1)/K x B per micro-batch's gathers and the step's reduce-scatter.
    hsdp:   FSDP2 over the G GPUs of a node (zero3's gathers and reduce-scatter, intra-node only),
            then an all-reduce of each GPU's 1/G gradient shard across the N nodes (c = 2 over the
            inter-node link, in backward): the two levels.
    """
    if strategy == "hsdp":
        g = min(k, max(1, per_node))
        node = collective_time(1, grad_bytes, g, intra, intra, g, bucket_bytes)
        nodes = math.ceil(k / g)
        across = collective_time(2, grad_bytes / g, nodes, inter, inter, 1, bucket_bytes)
        return {"forward": node, "backward": 2 * node + across, "after": 0.0}
    t1 = collective_time(1, grad_bytes, k, intra, inter, per_node, bucket_bytes)
    if strategy == "ddp":
        return {
            "backward": collective_time(2, grad_bytes, k, intra, inter, per_node, bucket_bytes),
            "forward": 0.0,
            "after": 0.0,
        }
    if strategy == "zero12":
        return {"backward": t1, "forward": 0.0, "after": t1}
    if strategy == "zero3":
        return {"forward": t1, "backward": 2 * t1, "after": 0.0}
    raise ValueError(f"unknown strategy {strategy!r}: one of {STRATEGIES}")


def step_time(
    cost: StepCost,
    strategy: str,
    grad_bytes: float,
    k: int,
    intra: Link,
    inter: Link,
    per_node: int = 8,
    bucket_bytes: float = 25e6,
    overlap: float = 0.7,
) -> dict:
    """Predicted seconds of one optimizer step on each of k GPUs running `cost` (per-device work).

    Only the last micro-batch's backward hides communication (earlier ones run under no_sync),
    except ZeRO-3 whose gathers happen every micro-batch:
        exposed = max(0, comm_bwd - overlap x backward_of_one_micro_batch)
                + max(0, comm_fwd - overlap x forward_of_one_micro_batch)   (zero3, x accum)
                + comm_after                                                  (zero12 all-gather)
        optimizer = full step (ddp) or step / k (sharded: ZeRO-1/2/3 update only their shard)
        step = data + forward + backward + optimizer + exposed
    """
    comm = comm_times(strategy, grad_bytes, k, intra, inter, per_node, bucket_bytes)
    a = max(1, cost.accum)
    fwd1, bwd1 = cost.forward / a, cost.backward / a
    if strategy in ("zero3", "hsdp"):
        exposed = a * (
            max(0.0, comm["forward"] - overlap * fwd1) + max(0.0, comm["backward"] - overlap * bwd1)
        )
        total_comm = a * (comm["forward"] + comm["backward"])
    else:
        exposed = max(0.0, comm["backward"] - overlap * bwd1) + comm["after"]
        total_comm = comm["backward"] + comm["after"]
    shards = min(k, max(1, per_node)) if strategy == "hsdp" else k
    opt = cost.optimizer if strategy == "ddp" or k <= 1 else cost.optimizer / shards
    if k <= 1:
        exposed = total_comm = 0.0
    total = cost.data + cost.forward + cost.backward + opt + exposed
    return {
        "step_s": total,
        "comm_s": total_comm,
        "exposed_s": exposed,
        "optimizer_s": opt,
        "compute_s": cost.forward + cost.backward,
    }


def scaling_table(
    cost: StepCost,
    strategy: str,
    grad_bytes: float,
    gpus: list[int],
    intra: Link,
    inter: Link,
    per_node: int = 8,
    bucket_bytes: float = 25e6,
    overlap: float = 0.7,
    tp: TensorParallel | None = None,
) -> list[dict]:
    """Rows for strong and weak scaling at each K in `gpus`, relative to K = 1 at cost.batch; with
    tensor parallelism (`tp`), K GPUs are K / tp data-parallel groups (K not a multiple of tp is
    left out).

    strong: global batch fixed at cost.batch, per-group batch cost.batch / (K / tp);
            speedup = T(1) / T(K), efficiency = speedup / K.
    weak:   per-group batch fixed at cost.batch, global batch cost.batch x K / tp;
            efficiency = T(1) / T(K) x (K / tp) / K ... = throughput per GPU relative to one GPU,
            speedup (throughput) = K x efficiency.
    images/s = global batch / T(K).
    """
    t = tp.tp if tp is not None else 1
    t1 = step_time(cost, strategy, grad_bytes, 1, intra, inter, per_node, bucket_bytes, overlap)[
        "step_s"
    ]
    rows = []
    for k in gpus:
        if k > 1 and k % t:
            continue
        groups = max(1, k // t)  # K = 1: one GPU, no split (the baseline)
        args = (strategy, grad_bytes, k, intra, inter, tp, per_node, bucket_bytes, overlap)
        if k == 1:
            s = w = step_time(cost, *args[:5], per_node, bucket_bytes, overlap)
        else:  # fractional below 1 image
            s = mesh_step_time(scaled(cost, cost.batch / groups), *args)
            w = mesh_step_time(cost, *args)
        weak_speedup = groups * t1 / w["step_s"]
        rows.append(
            {
                "gpus": k,
                "tp": t,
                "strong_step_s": s["step_s"],
                "strong_images_per_s": cost.batch / s["step_s"],
                "strong_speedup": t1 / s["step_s"],
                "strong_efficiency": t1 / s["step_s"] / k,
                "strong_comm_share": s["exposed_s"] / s["step_s"],
                "weak_step_s": w["step_s"],
                "weak_images_per_s": cost.batch * groups / w["step_s"],
                "weak_speedup": weak_speedup,
                "weak_efficiency": weak_speedup / k,
                "weak_comm_share": w["exposed_s"] / w["step_s"],
                "comm_s": w["comm_s"],
                "tp_comm_s": w.get("tp_comm_s", 0.0),
            }
        )
    return rows


@dataclass(frozen=True)
class TensorParallel:
    """Tensor parallelism of size `tp` inside a node (strategy.tp): each block's attention and MLP
    split Megatron's way. Per micro-batch and block, one all-reduce of the branch output in forward
    for each of the two branches and one of each branch's input gradient in backward: 4 all-reduces
    (c = 2) of the micro-batch's activations [b, tokens, width] over the tp GPUs on the intra-node
    link. Sequence parallelism replaces each by a reduce-scatter and an all-gather (c = 1 + 1): the
    same volume, the norms on 1/tp of the tokens. They are on the critical path: not overlapped.
    The per-GPU compute, optimizer step and gradients are 1/tp of the unsplit ones (the blocks'
    weights dominate), and the data-parallel size is K / tp."""

    tp: int
    depth: int
    act_bytes: float  # one sample's activations between blocks: tokens x width x bytes

    def comm_s(self, micro_batch: float, accum: int, intra: Link) -> float:
        payload = micro_batch * self.act_bytes
        per = collective_time(2, payload, self.tp, intra, intra, self.tp, float("inf"))
        return 4 * self.depth * per * max(1, accum)


def mesh_step_time(
    cost: StepCost,
    strategy: str,
    grad_bytes: float,
    k: int,
    intra: Link,
    inter: Link,
    tp: TensorParallel | None = None,
    per_node: int = 8,
    bucket_bytes: float = 25e6,
    overlap: float = 0.7,
) -> dict:
    """step_time on K GPUs as K / tp data-parallel groups of tp tensor-parallel GPUs (`tp` None or
    of size 1: step_time itself); `cost` is one GPU's work for the group's batch."""
    if tp is None or tp.tp <= 1:
        return step_time(
            cost, strategy, grad_bytes, k, intra, inter, per_node, bucket_bytes, overlap
        )
    t = tp.tp
    split = replace(
        cost, forward=cost.forward / t, backward=cost.backward / t, optimizer=cost.optimizer / t
    )
    dp_nodes_per = max(1, per_node // t)  # data-parallel groups per node
    s = step_time(
        split, strategy, grad_bytes / t, k // t, intra, inter, dp_nodes_per, bucket_bytes, overlap
    )
    tp_s = tp.comm_s(cost.batch / max(1, cost.accum), cost.accum, intra)
    return {
        **s,
        "step_s": s["step_s"] + tp_s,
        "comm_s": s["comm_s"] + tp_s,
        "exposed_s": s["exposed_s"] + tp_s,
        "tp_comm_s": tp_s,
    }
