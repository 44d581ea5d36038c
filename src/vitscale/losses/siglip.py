"""SigLIP's sigmoid loss (Zhai et al. 2023) with OpenCLIP's `SigLipLoss` semantics.

Each (image, text) pair is its own binary problem: z_ij = exp(logit_scale) <img_i, txt_j> + logit_bias,
label +1 on the diagonal (the pair) and -1 elsewhere, loss = -sum_ij logsigmoid(label_ij z_ij) / b.
Across K data-parallel ranks a rank scores its b images against its own texts (labels 2 eye - 1)
and then against every other rank's texts (labels -1), which travel round the ring by OpenCLIP's
bidirectional neighbour exchange (`dist_impl="bidir"`): floor((K-1)/2) rounds that pass text blocks
both ways, plus one one-way round when K-1 is odd. Logits are made one [b, b] block at a time, never
the world batch's [N, N] (N = K b) nor a gathered [N, d] (autograd keeps the K blocks' [b, b] for the
backward, b N in all, as OpenCLIP's does). The exchanges are autograd functions: a received block's
gradient goes back along the same path to the rank that owns the features.

The mean over ranks of the rank losses is the full-batch loss over N images and N texts (1/N times
the sum of all N^2 terms); the engines' averaging of parameter gradients over ranks then gives its
gradient, as for ClipLoss. Communication (elements sent per worker): (K-1) b d text features forward
and as many gradients backward, 2 (K-1) b d per step (ClipLoss: 4 (K-1) b d).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .clip import ClipLoss, no_autocast, world

SIGLIP_TAU_INIT = 0.1  # logit_scale = log(10): OpenCLIP's init_logit_scale for SigLIP
SIGLIP_BIAS_INIT = -10.0  # OpenCLIP's init_logit_bias for SigLIP


def _p2p(group, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[int, torch.Tensor]]):
    """Point-to-point in one batch: each (tensor, group rank) of `sends` is sent; one tensor shaped
    like `like` is received from each (group rank, like) of `recvs`, returned in that order."""
    g = dist.get_global_rank  # P2POp takes global ranks (group_peer= is torch >= 2.6's)
    out = [torch.empty_like(like) for _, like in recvs]
    ops = [dist.P2POp(dist.isend, t.contiguous(), g(group, r), group=group) for t, r in sends]
    ops += [dist.P2POp(dist.irecv, o, g(group, r), group=group) for o, (r, _) in zip(out, recvs)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


class _ExchangeBidir(torch.autograd.Function):
    """Sends `to_left` to the left rank and `to_right` to the right one; returns (from the right,
    from the left). Backward: each received block's gradient goes back to its sender (OpenCLIP's
    NeighbourExchangeBidir)."""

    @staticmethod
    def forward(ctx, group, left: int, right: int, to_left, to_right):
        ctx.group, ctx.left, ctx.right = group, left, right
        from_right, from_left = _p2p(
            group, [(to_right, right), (to_left, left)], [(right, to_left), (left, to_right)]
        )
        return from_right, from_left

    @staticmethod
    def backward(ctx, g_from_right, g_from_left):
        # g_from_right goes back right, g_from_left back left; what comes back is to_left's and
        # to_right's gradient (their receivers sent it)
        g_to_left, g_to_right = _p2p(
            ctx.group,
            [(g_from_right, ctx.right), (g_from_left, ctx.left)],
            [(ctx.left, g_from_left), (ctx.right, g_from_right)],
        )
        return None, None, None, g_to_left, g_to_right


class _ExchangeRight(torch.autograd.Function):
    """Sends `x` to the right rank, returns what the left rank sent (OpenCLIP's NeighbourExchange
    from left to right); backward: the gradient goes back left, the right rank's comes in."""

    @staticmethod
    def forward(ctx, group, left: int, right: int, x):
        ctx.group, ctx.left, ctx.right = group, left, right
        return _p2p(group, [(x, right)], [(left, x)])[0]

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, _p2p(ctx.group, [(grad, ctx.left)], [(ctx.right, grad)])[0]


class SigLipLoss(ClipLoss):
    """SigLIP's pairwise sigmoid loss (module docstring). `compute(img, txt, logit_params, index)`
    takes the CLIP model's third output: [logit_scale, logit_bias] (shape [2], ClipSpec.logit_bias
    set) or logit_scale with `logit_bias=` given apart. logit_scale is the log of the scale, clamped
    at 100 after exp as ClipLoss does (OpenCLIP clamps the parameter to [0, ln 100] after each step).
    No per-sample state; set_epoch, after_step and the state dict are ClipLoss's (empty)."""

    def __init__(self, *, device=None, group=None):
        super().__init__(device=device, group=group)
        self._blocks: dict = {}

    def signs(self, device, b: int) -> torch.Tensor:
        """[b, b] labels of the local block: 2 eye - 1 (OpenCLIP's get_ground_truth)."""
        if torch.compiler.is_compiling():  # made in the graph: no cache the trace would guard on
            return 2 * torch.eye(b, device=device) - torch.ones(b, b, device=device)
        key = (str(device), b)
        if key not in self._blocks:
            self._blocks[key] = 2 * torch.eye(b, device=device) - torch.ones(b, b, device=device)
        return self._blocks[key]

    @staticmethod
    def block(img, txt, scale, bias, signs=None) -> torch.Tensor:
        """-sum logsigmoid(label z) over one [b, b] block, z = scale img @ txt.T + bias; signs None:
        every label -1 (another rank's texts)."""
        logits = scale * img @ txt.T + bias
        return -F.logsigmoid(-logits if signs is None else signs * logits).sum()

    def compute(self, img_f, txt_f, logit_scale, index=None, logit_bias=None):
        """(loss, {name: 0-d device tensor}): static shapes, no host read; in one process, no
        collective (torch.compile's fullgraph, a CUDA graph's replay)."""
        k, rank, group = world(self.group)
        with no_autocast(img_f.device.type):
            e1, e2 = img_f.float(), txt_f.float()
            b, d = e1.shape
            scale, bias = split_logit_params(logit_scale, logit_bias)
            # each block / b, added in OpenCLIP's order (its rounding): local, right, left, ...
            loss = self.block(e1, e2, scale, bias, self.signs(e1.device, b)) / b
            if k > 1:
                for total in self.remote_blocks(e1, e2, scale, bias, k, rank, group):
                    loss = loss + total / b
                sent = (k - 1) * b * d * (2 if torch.is_grad_enabled() else 1)
                self.comm_elements["features"] += sent
        logs = {
            "loss": loss.detach(),
            "tau": 1.0 / scale.detach(),
            "logit_scale": scale.detach(),
            "logit_bias": bias.detach(),
        }
        return loss, logs

    def remote_blocks(self, e1, e2, scale, bias, k: int, rank: int, group) -> list[torch.Tensor]:
        """The negative-only block sums of the other K-1 ranks' texts, in the order OpenCLIP's
        bidir exchange passes them round the ring (from the right, from the left, ...)."""
        left, right = (rank - 1) % k, (rank + 1) % k
        out = []
        to_left = to_right = e2
        rounds, odd = divmod(k - 1, 2)
        for _ in range(rounds):
            from_right, from_left = _ExchangeBidir.apply(group, left, right, to_left, to_right)
            out += [self.block(e1, from_right, scale, bias), self.block(e1, from_left, scale, bias)]
            to_left, to_right = from_right, from_left
        if odd:
            from_left = _ExchangeRight.apply(group, left, right, to_right)
            out.append(self.block(e1, from_left, scale, bias))
        return out


def split_logit_params(logit_scale: torch.Tensor, logit_bias: torch.Tensor | None = None):
    """(exp(logit_scale) clamped at 100, logit_bias), 0-d fp32, from the model's [2] output or from
    logit_scale and logit_bias apart."""
    p = logit_scale.float().reshape(-1)
    if logit_bias is None:
        if p.numel() != 2:
            raise ValueError(
                "siglip: the model has no logit_bias (ClipSpec.logit_bias; clip.loss=siglip sets it)"
            )
        log_scale, bias = p[0], p[1]
    else:
        log_scale, bias = p.reshape(()), logit_bias.float().reshape(())
    return log_scale.exp().clamp(max=100.0), bias
