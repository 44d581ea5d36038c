"""model.patch_dropout and model.patch_dropout_until for the tasks that train a ViT (classification,
CLIP's image tower): which epochs drop patch tokens, the model switched at each epoch's start
(Task.set_epoch), the run-start description and the FLOPs a training step computes."""

from __future__ import annotations

import math
import sys

import torch

from ..models import kept_patches, set_patch_dropout


def masked_epoch(epoch: int, epochs: float, until: float) -> bool:
    """Whether `epoch` trains with patch dropout: it ends (at min(epoch + 1, epochs)) no later than
    until x epochs; an epoch that would end past it is the unmasked tail."""
    return until >= 1 or min(epoch + 1, epochs) <= until * epochs + 1e-9


def first_unmasked_epoch(epochs: float, until: float) -> int | None:
    """The epoch where the unmasked tail starts, or None where every epoch is masked."""
    n = math.ceil(epochs)
    return next((e for e in range(n) if not masked_epoch(e, epochs, until)), None)


class PatchDropout:
    """One task's patch dropout: the rate, the tail, and the model it switches."""

    def __init__(self, model_cfg, epochs: float, announce: bool = True):
        self.p, self.until, self.epochs = (
            model_cfg.patch_dropout,
            model_cfg.patch_dropout_until,
            epochs,
        )
        self.announce = announce
        self.model = None
        self.on = False

    def build(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as built (epoch 0's setting; set_epoch switches it), kept to switch later."""
        self.model = model
        self.on = bool(self.p) and masked_epoch(0, self.epochs, self.until)
        return set_patch_dropout(model, self.p if self.on else 0.0)

    def set_epoch(self, epoch: int) -> None:
        if not self.p or self.model is None:
            return
        on = masked_epoch(epoch, self.epochs, self.until)
        if on != self.on:
            set_patch_dropout(self.model, self.p if on else 0.0)
            self.on = on
            if not on and self.announce and is_main():
                print(
                    f"patch dropout off from epoch {epoch} (model.patch_dropout_until="
                    f"{self.until:g}): the unmasked tail trains on every token",
                    file=sys.stderr,
                    flush=True,
                )

    def describe(self, num_patches: int, prefix: int) -> str:
        """A clause of the run's first line (empty where patch dropout is off)."""
        if not self.p:
            return ""
        kept = kept_patches(num_patches, self.p)
        tail = first_unmasked_epoch(self.epochs, self.until)
        until = "" if tail is None else f" until epoch {tail} (then every token)"
        cls = {0: "", 1: " + the class token"}.get(prefix, f" + {prefix} class and register tokens")
        return (
            f"; patch dropout {self.p:g} in training{until}: {kept} of {num_patches} patch "
            f"tokens kept{cls}, every token at evaluation"
        )

    def masked_fraction(self) -> float:
        """The fraction of the training steps (by epochs) that drop patches."""
        if not self.p:
            return 0.0
        n = math.ceil(self.epochs)
        masked = sum(
            min(e + 1, self.epochs) - e
            for e in range(n)
            if masked_epoch(e, self.epochs, self.until)
        )
        return masked / self.epochs if self.epochs else 1.0

    def flops(self, full: int, masked: int) -> int:
        """FLOPs per training sample for MFU: the masked and the full forward weighted by the
        epochs each trains (evaluation is not counted in MFU)."""
        f = self.masked_fraction()
        return round(f * masked + (1 - f) * full)


def is_main() -> bool:
    d = torch.distributed
    return not (d.is_available() and d.is_initialized()) or d.get_rank() == 0
