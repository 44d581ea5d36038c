"""A validation split carved from a labelled TRAINING set (data.val_fraction): seeded (data.val_seed,
not run.seed, so every trial and every repeat of a search sees the same split) and stratified (each
class gives round(fraction x its count) samples). The held-out samples replace the test split, which
is then never read: model selection (`vitscale search`) scores on them, never on the test set."""

from __future__ import annotations

import torch

from .sampler import generator
from .types import TensorSplits


def stratified_split(
    labels: torch.Tensor, fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, validation indices), each ascending, disjoint, together all of range(N):
    class c holds out round(fraction x count_c) of its samples, chosen by a generator seeded from
    (`seed`, c) alone."""
    held = []
    for c in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == c).flatten()
        n = int(round(fraction * len(idx)))
        perm = torch.randperm(len(idx), generator=generator("val-split", seed, c))
        held.append(idx[perm[:n]])
    val = torch.sort(torch.cat(held)).values if held else torch.zeros(0, dtype=torch.int64)
    keep = torch.ones(len(labels), dtype=torch.bool)
    keep[val] = False
    return torch.nonzero(keep).flatten(), val


def carve_validation(splits: TensorSplits, fraction: float, seed: int) -> TensorSplits:
    """The training split minus the held-out samples; the held-out samples in place of the test split."""
    train, val = stratified_split(splits.train_y, fraction, seed)
    return TensorSplits(
        splits.train_x[train],
        splits.train_y[train],
        splits.train_x[val],
        splits.train_y[val],
        list(splits.class_names),
        splits.mean,
        splits.std,
    )
