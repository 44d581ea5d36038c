"""Launched by tests/integration/test_clip_losses_dist.py: K gloo ranks (torch.multiprocessing.spawn, FileStore)
train a tiny two-tower linear "model" wrapped in DDP, each rank with its slice of a global batch, and
compare with the single-process full-batch loss on the whole batch (computed by rank 0 before the
process group exists).  Writes {variant: {"max_rel": ..., "comm": ..., ...}} to the JSON at argv[2]."""

import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from vitscale.losses import ClipLoss, FastClipLoss

B, D, P, NDATA, STEPS = 3, 4, 6, 40, 2  # per-rank batch, feature dim, input dim, dataset size
VARIANTS = ("openclip", "fastclip_v0", "fastclip_v1", "fastclip_v3", "fastclip_v2")
T0_LOW, T0_SPAN = 0.03, 0.05  # per-sample taus (v2) drawn in [T0_LOW, T0_LOW + T0_SPAN)
TAU_INIT, TAU_LR, OPENCLIP_TAU = 0.05, 1e-3, 0.07
# the smallest temperature any logit is divided by: Adam moves a tau by about TAU_LR per step at most
TAU_MIN = min(T0_LOW, TAU_INIT, OPENCLIP_TAU) - STEPS * TAU_LR


class Towers(nn.Module):
    def __init__(self, with_scale):
        super().__init__()
        torch.manual_seed(0)
        self.img, self.txt = nn.Linear(P, D), nn.Linear(P, D)
        self.logit_scale = (
            nn.Parameter(torch.tensor(math.log(1 / OPENCLIP_TAU))) if with_scale else None
        )

    def forward(self, xi, xt):
        return F.normalize(self.img(xi), dim=1), F.normalize(self.txt(xt), dim=1)


def data(k):
    g = torch.Generator().manual_seed(1)
    xs = [
        (
            torch.randn(k * B, P, generator=g),
            torch.randn(k * B, P, generator=g),
            torch.randperm(NDATA, generator=g)[: k * B],
        )
        for _ in range(STEPS)
    ]
    u0 = torch.rand(2, NDATA, generator=g, dtype=torch.float64) + 0.5
    t0 = torch.rand(2, NDATA, generator=g) * T0_SPAN + T0_LOW
    return xs, u0, t0


def make_loss(variant, u0, t0, shard=False):
    if variant == "openclip":
        return ClipLoss()
    m = FastClipLoss(
        variant,
        dataset_size=NDATA,
        gamma_schedule="cosine",
        gamma_min=0.2,
        gamma_decay_epochs=4,
        tau_init=TAU_INIT,
        tau_lr=TAU_LR,
        rho=6.5,
        eps=1e-14,
        shard_state=shard,
    )
    m.set_epoch(1)  # gamma < 1: the old u matters
    sd = FastClipLoss(variant, dataset_size=NDATA, tau_init=TAU_INIT).state_dict()  # whole tables
    sd["lu1"], sd["lu2"] = u0[0].log().float(), u0[1].log().float()
    sd["lu1"][::7] = -math.inf  # some samples never seen: u reset to g
    if m.individual:
        sd["tau1"], sd["tau2"] = t0[0], t0[1]
    sd.update(epoch=1, gamma=m.gamma)
    m.load_state_dict(sd)
    return m


def run(variant, k, rank, model, loss_mod, xs):
    """STEPS forward/backward/after_step; returns per-step grads, losses, temperature grads, state."""
    out = {"grads": [], "loss": [], "tau_grad": []}
    sl = slice(rank * B, (rank + 1) * B) if k > 1 else slice(None)
    for xi, xt, idx in xs:
        model.zero_grad()
        e1, e2 = model(xi[sl], xt[sl])
        scale = (model.module if k > 1 else model).logit_scale
        loss, _ = loss_mod(e1, e2, scale if scale is not None else torch.zeros(()), idx[sl])
        loss.backward()
        out["grads"].append([p.grad.clone() for p in model.parameters()])
        out["loss"].append(loss.item())
        grad = loss_mod.temperature_grad() if hasattr(loss_mod, "temperature_grad") else None
        if torch.is_tensor(grad):  # d(loss)/d(theta) of the global temperature
            out["tau_grad"].append(grad.clone())
        loss_mod.after_step()
    out["state"] = {k_: v for k_, v in loss_mod.state_dict().items() if torch.is_tensor(v)}
    return out


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def worker(rank, k, path, store):
    xs, u0, t0 = data(k)
    refs = {}
    if rank == 0:  # single process, whole global batch
        for v in VARIANTS:
            refs[v] = run(v, 1, 0, Towers(v == "openclip"), make_loss(v, u0, t0), xs)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=k)
    results = {}
    for v in VARIANTS:
        model = nn.parallel.DistributedDataParallel(Towers(v == "openclip"))
        loss_mod = make_loss(v, u0, t0)
        got = run(v, k, rank, model, loss_mod, xs)
        allgot = [None] * k
        dist.all_gather_object(allgot, {"loss": got["loss"], "state": got["state"]})
        if rank == 0:
            ref = refs[v]
            r = {
                "grad": max(
                    rel(a, b) for ga, gb in zip(got["grads"], ref["grads"]) for a, b in zip(ga, gb)
                )
            }
            if v != "openclip":  # every rank holds the whole (replicated) per-sample state
                r["state"] = max(
                    rel(
                        o["state"][n].masked_fill(o["state"][n] == -math.inf, 0),
                        ref["state"][n].masked_fill(ref["state"][n] == -math.inf, 0),
                    )
                    for o in allgot
                    for n in ref["state"]
                )
            # mean over ranks of the local losses = the full-batch value (InfoNCE; FastCLIP's V)
            r["loss"] = max(
                abs(sum(o["loss"][s] for o in allgot) / k - ref["loss"][s]) / ref["loss"][s]
                for s in range(STEPS)
            )
            if got["tau_grad"]:
                r["tau_grad"] = max(
                    abs(a.item() - b.item()) / abs(b.item())
                    for a, b in zip(got["tau_grad"], ref["tau_grad"])
                )
            results[v] = {"max_rel": r, "comm": loss_mod.comm_elements}
    for v in VARIANTS[1:]:  # sharded per-sample state vs replicated, same ranks
        runs = {}
        for shard in (False, True):
            model = nn.parallel.DistributedDataParallel(Towers(False))
            loss_mod = make_loss(v, u0, t0, shard)
            runs[shard] = run(v, k, rank, model, loss_mod, xs)
            runs[shard]["rows"] = loss_mod.lu1.numel()
            runs[shard]["bytes"] = loss_mod.state_bytes()
            runs[shard]["comm"] = dict(loss_mod.comm_elements)
        a, b = runs[False], runs[True]
        same = all(
            torch.equal(x, y) for ga, gb in zip(a["grads"], b["grads"]) for x, y in zip(ga, gb)
        )
        same &= a["loss"] == b["loss"] and all(
            torch.equal(x, y) for x, y in zip(a["tau_grad"], b["tau_grad"])
        )
        if rank == 0:  # rank 0's state_dict gathers the whole table
            same &= a["state"].keys() == b["state"].keys() and all(
                torch.equal(a["state"][n], b["state"][n]) for n in a["state"]
            )
        flags = [None] * k
        dist.all_gather_object(flags, (same, b["rows"], b["bytes"], a["bytes"], b["comm"]))
        if rank == 0:
            results[v]["sharded"] = {
                "identical": [f[0] for f in flags],
                "rows": [f[1] for f in flags],
                "bytes": [f[2] for f in flags],
                "replicated_bytes": flags[0][3],
                "comm": flags[0][4],
            }
    if rank == 0:
        with open(path, "w") as f:
            json.dump(
                {"k": k, "b": B, "d": D, "steps": STEPS, "tau_min": TAU_MIN, "results": results},
                f,
                indent=1,
            )
    dist.barrier()
    dist.destroy_process_group()
    # leave without the interpreter's teardown, as the CLI does after a multi-process run: gloo's
    # threads can abort it ("terminate called without an active exception", SIGABRT) after all
    # results are written (seen once under a loaded 2-core machine, 2026-11-28)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    k, path = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    mp.spawn(worker, args=(k, path, path + ".store"), nprocs=k, join=True)
