"""Launched by tests/integration/test_siglip_dist.py: K gloo ranks (torch.multiprocessing.spawn,
FileStore) each hold their slice of a global batch of unit features and compute SigLIP's loss with
vitscale's SigLipLoss and OpenCLIP's (rank=, world_size=, its default bidir exchange) on identical
inputs; each rank's loss and gradients (its own image and text features: the text gradients come
back from the other ranks through the exchange's backward; logit_scale; logit_bias) are compared
with the float64 definition (tests/siglip_reference.py). Also: the comm count, and a process
group of ranks 1..K-1 (group ranks differ from global ones). Writes a JSON to argv[2]."""

import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: siglip_reference
from siglip_reference import features, rank_loss64  # noqa: E402

from vitscale.losses import SigLipLoss  # noqa: E402

B, D = 4, 16  # per-rank batch, feature width
# OpenCLIP's SigLIP init (the negatives weigh little) and two where they weigh, features aligned
CASES = [(math.log(10.0), -10.0, 0.0), (math.log(5.0), -1.0, 1.0), (math.log(30.0), -4.0, 2.0)]
NAMES = ("img", "txt", "logit_scale", "logit_bias")


def loss_and_grads(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    loss = fn(*leaves)
    return loss.detach().double(), [g.double() for g in torch.autograd.grad(loss, leaves)]


def exact(img_all, txt_all, ls, lb, k: int, rank: int):
    """float64: this rank's loss; its features' gradients of the SUM of all ranks' losses (what the
    exchange's backward brings back), logit_scale's and logit_bias's of its own loss."""
    img, txt, s, t = (x.double().requires_grad_() for x in (img_all, txt_all, ls, lb))
    losses = [rank_loss64(img, txt, s, t, k, q) for q in range(k)]
    g_s, g_t = torch.autograd.grad(losses[rank], [s, t], retain_graph=True)
    g_img, g_txt = torch.autograd.grad(sum(losses), [img, txt])
    own = slice(rank * B, (rank + 1) * B)
    local = rank_loss64(img[own], txt[own], s, t, 1, 0).detach()  # without the other ranks' texts
    g_own_txt = torch.autograd.grad(rank_loss64(img, txt, s, t, k, rank), txt)[0][own]
    return {
        "loss": losses[rank].detach(),
        "grads": [g_img[own], g_txt[own], g_s, g_t],
        "remote_loss": (losses[rank] - local).abs().item(),  # what the exchanged blocks add
        "remote_txt_grad": (g_txt[own] - g_own_txt).abs().max().item(),  # what comes back
    }


def errors(got, ref) -> dict:
    out = {"loss": (got[0] - ref["loss"]).abs().item()}
    out |= {n: (g - e).abs().max().item() for n, g, e in zip(NAMES, got[1], ref["grads"])}
    return out


def ours_fn(group=None):
    m = SigLipLoss(group=group)
    return lambda i, t, s, c: m.compute(i, t, torch.cat([s, c]))[0]


def case(i, k, rank, ref_loss):
    log_scale, bias, align = CASES[i]
    img_all, txt_all = features(k * B, D, seed=i, align=align)
    own = slice(rank * B, (rank + 1) * B)
    ls, lb = torch.tensor([log_scale]), torch.tensor([bias])
    ref = exact(img_all, txt_all, ls, lb, k, rank)
    ours = loss_and_grads(ours_fn(), img_all[own], txt_all[own], ls, lb)
    theirs = loss_and_grads(
        lambda a, b_, s, c: ref_loss(rank=rank, world_size=k)(a, b_, s.exp(), c),
        img_all[own],
        txt_all[own],
        ls,
        lb,
    )
    pair = errors(ours, {"loss": theirs[0], "grads": theirs[1]})
    return {
        "scale": math.exp(log_scale),
        "bias": bias,
        "loss64": ref["loss"].item(),
        "ours": errors(ours, ref),
        "open_clip": errors(theirs, ref),
        "ours_vs_open_clip": pair,
        "remote_loss": ref["remote_loss"],
        "remote_txt_grad": ref["remote_txt_grad"],
    }


def subgroup(k, rank):
    """Ranks 1..K-1 as their own process group (every rank creates it): their group ranks are the
    global ones minus 1; the loss exchanges inside it only."""
    g = dist.new_group(list(range(1, k)))
    if rank == 0:
        return None
    log_scale, bias, align = CASES[1]
    img_all, txt_all = features((k - 1) * B, D, seed=7, align=align)
    r = rank - 1
    own = slice(r * B, (r + 1) * B)
    ls, lb = torch.tensor([log_scale]), torch.tensor([bias])
    ref = exact(img_all, txt_all, ls, lb, k - 1, r)
    ours = loss_and_grads(ours_fn(g), img_all[own], txt_all[own], ls, lb)
    return {"scale": math.exp(log_scale), "bias": bias, "loss64": ref["loss"].item()} | {
        "ours": errors(ours, ref)
    }


def comm(k):
    """Elements sent: 2 (K-1) b d with the backward, (K-1) b d without (no_grad)."""
    img, txt = features(k * B, D, seed=0)
    m = SigLipLoss()
    p = torch.tensor([math.log(10.0), -10.0], requires_grad=True)
    loss, _ = m(img[:B].requires_grad_(), txt[:B].requires_grad_(), p)
    loss.backward()
    with torch.no_grad():
        m(img[:B], txt[:B], p)
    return dict(m.comm_elements)


def worker(rank, k, path, store):
    torch.set_num_threads(1)
    from open_clip.loss import SigLipLoss as OpenClipSigLipLoss

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=k)
    mine = {
        "cases": [case(i, k, rank, OpenClipSigLipLoss) for i in range(len(CASES))],
        "comm": comm(k),
        "subgroup": subgroup(k, rank) if k >= 3 else None,
    }
    every = [None] * k
    dist.all_gather_object(every, mine)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"k": k, "b": B, "d": D, "ranks": every}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    # leave without the interpreter's teardown, as clip_losses_dist_worker.py does (gloo's threads)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    k, path = int(sys.argv[1]), sys.argv[2]
    mp.spawn(worker, args=(k, path, path + ".store"), nprocs=k, join=True)
