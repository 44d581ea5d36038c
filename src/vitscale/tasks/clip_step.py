"""CLIP's training forward as one function of tensors: both towers, the contrastive loss and, for
the global losses, their per-sample state updates (FastCLIP's u and temperatures, written in place
by index with static shapes), with no host read and nothing taken from the host per step.

- train.compile=true in one process: torch.compile(fullgraph=True) traces that function whole
  (towers + loss + state writes: no graph break), its backward by AOTAutograd; several processes
  keep the model compiled alone and the loss eager (the loss's collectives run there).
- train.capture=step: capture.WholeStep replays it (with backward, the optimizers and the
  temperatures' step) as one CUDA graph; the gamma schedule and the epoch's Adam coefficients are
  device tensors written when an epoch starts, v0's temperature lr a device table indexed by the
  step counter on the device (losses/fastclip*.py).
"""

from __future__ import annotations

import torch

from ..compiling import compile_args
from ..losses import ClipLoss, FastClipLoss, StepLogs, one_process


def clip_forward(model, loss: ClipLoss | FastClipLoss, images, tokens, index):
    """(loss, {name: 0-d tensor}) of one batch. A global loss keeps its own temperature and leaves
    logit_scale unused; a zero gradient keeps that parameter in the graph (DDP and ZeRO expect one
    for each)."""
    img, txt, logit_scale = model(images, tokens)
    value, logs = loss.compute(img, txt, logit_scale, index)
    return value + 0.0 * logit_scale.sum(), logs


class ClipStep:
    """The forward a CLIP run trains with: `clip_forward`, compiled whole (fullgraph) where
    `compile` and the loss runs in one process. `compiled` says which."""

    def __init__(self, loss: ClipLoss | FastClipLoss, train_cfg, group=None):
        self.loss = loss
        self.compiled = bool(train_cfg.compile) and one_process(group)
        kw = compile_args(train_cfg)
        self.fn = (
            torch.compile(clip_forward, fullgraph=True, **kw) if self.compiled else clip_forward
        )

    def __call__(self, model, images, tokens, index) -> tuple[torch.Tensor, StepLogs]:
        """The loss and its logs (one device tensor, read at log steps). Compiled, the plain module
        under the strategy's compiled wrapper is traced (one compile of the whole forward)."""
        if self.compiled:
            model = getattr(model, "_orig_mod", model)
        value, logs = self.fn(model, self.loss, images, tokens, index)
        self.loss.note_step()
        return value, StepLogs(logs)
