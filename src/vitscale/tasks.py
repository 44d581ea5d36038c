"""Tasks turn a batch into a loss and evaluate a model; they know nothing about engines."""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn


class ClassificationTask:
    metric = "test_accuracy"  # the metric whose best value a run keeps

    def __init__(self, num_classes: int, label_smoothing: float = 0.0, hflip_tta: bool = False):
        self.num_classes = num_classes
        self.label_smoothing = label_smoothing
        self.hflip_tta = hflip_tta

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross entropy in fp32; y = class indices [B] or soft targets [B, K] (mixup/cutmix)."""
        logits = logits.float()
        if y.ndim == 2 and self.label_smoothing:
            y = y * (1 - self.label_smoothing) + self.label_smoothing / self.num_classes
            return F.cross_entropy(logits, y)
        return F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)

    # the verbs the loop uses (the CLIP task has the same set)
    def forward_loss(self, model, batch, prepare) -> torch.Tensor:
        x, y = batch
        return self.loss(model(prepare(x)), y)

    def set_epoch(self, epoch: int) -> None:
        pass

    def after_step(self, step: int | None = None) -> None:
        pass

    def logs(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def state_bytes(self) -> int:
        return 0

    def evaluate_all(self, s, data) -> dict:
        """Accuracy and loss over the whole test set: each rank evaluates its disjoint shard with
        the same number of forwards; the counts are summed exactly."""
        batches = max(s.gather_objects(len(data.test)))
        r = self.evaluate(s.eval_module(), data.test, s.autocast, s.prepare, batches)
        correct, count, loss_sum = s.all_reduce_sum(torch.tensor(
            [r["correct"], r["count"], r["loss_sum"]], dtype=torch.float64, device=s.device)).tolist()
        return {"test_accuracy": correct / max(1, count), "test_loss": loss_sum / max(1, count),
                "test_count": int(count)}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, autocast, prepare=lambda x: x, batches: int = 0) -> dict:
        """Sums over this process's shard: {'correct', 'count', 'loss_sum'} (exact, no averaging).
        `batches`: run at least this many forward passes, padding with empty batches (sharded
        models need every rank in every forward)."""
        was_training = model.training
        model.eval()
        correct = count = 0
        loss_sum = 0.0
        seen = 0
        for x, y in itertools.chain(loader.iterate(), _empty_batches(loader, batches)):
            seen += 1
            if seen > max(batches, len(loader)):
                break
            x = prepare(x)
            with autocast():
                logits = model(x).float()
                if self.hflip_tta:
                    logits = logits + model(x.flip(-1)).float()
            loss_sum += F.cross_entropy(logits if not self.hflip_tta else logits / 2, y, reduction="sum").item()
            correct += (logits.argmax(-1) == y).sum().item()
            count += y.numel()
        model.train(was_training)
        return {"correct": correct, "count": count, "loss_sum": loss_sum}


def _empty_batches(loader, batches: int):
    """Zero-size batches shaped like the loader's, for ranks whose shard has fewer batches."""
    if batches <= len(loader):
        return
    x, y = next(iter(loader.iterate()))
    while True:
        yield x[:0], y[:0]
