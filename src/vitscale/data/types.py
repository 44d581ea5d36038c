"""What the rest of vitscale gets from data/: the bundle, the loader protocols, and the records
the sources hand to the loaders. Imports no sibling module (everything else in data/ imports it).

    bundle.train.iterate(epoch, start_batch) -> (x float32 [B,C,H,W] on device, y)     classification
                                             -> (x, tokens int64 [B,L], index int64 [B]) pairs (CLIP)
    bundle.test.iterate()                    -> the same over this rank's held-out shard
    bundle.zeroshot[name].loader.iterate()   -> (x, labels int64 [B])                    pairs only

y is int64 [B], or float32 [B, num_classes] soft targets when mixup/cutmix is on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class TrainLoader(Protocol):
    """This rank's training batches: what loop.py and lab/timing.py call."""

    batch_size: int  # this rank's samples per batch
    skipped: int  # unreadable samples replaced so far

    def __len__(self) -> int:
        """Optimizer steps per epoch (the same on every rank)."""

    def iterate(self, epoch: int, start_batch: int = 0, ahead: int = 1) -> Iterator[tuple]:
        """The epoch's batches from `start_batch` on (exact resume); `ahead`: how many batches an
        in-memory loader prepares at once (the same batches; loaders fed by workers ignore it)."""

    def close(self) -> None:
        """Stop decoding worker processes (a no-op for in-memory data)."""


@runtime_checkable
class EvalLoader(Protocol):
    """This rank's held-out (or zero-shot) batches: what tasks/classification.py and tasks/clip.py call."""

    batch_size: int
    skipped: int

    def __len__(self) -> int:
        """Batches of this rank's shard."""

    def iterate(self) -> Iterator[tuple]: ...

    def close(self) -> None: ...


@dataclass
class ZeroShotSet:
    class_names: list
    templates: list
    loader: EvalLoader  # iterate() -> (images, labels int64)


@dataclass
class DataBundle:
    """One rank's loaders and what the model needs to know about the data. Classification sets
    give num_classes and class_names; image-text pairs give zero-shot sets and the held-out
    captions (num_classes 0)."""

    train: TrainLoader
    test: EvalLoader
    channels: int
    image_size: int  # the size the model sees
    train_size: int
    test_size: int
    mean: tuple
    std: tuple
    num_classes: int = 0
    class_names: list = field(default_factory=list)
    zeroshot: dict = field(default_factory=dict)  # name -> ZeroShotSet
    captions_test: list = field(default_factory=list)
    eval_split: str = (
        "test"  # "val": `test` holds a validation split of the training set (data.val_fraction)
    )

    def close(self):
        """Stop decoding worker processes (folder, shard data); a no-op for in-memory data."""
        seen = set()
        for loader in [self.train, self.test] + [z.loader for z in self.zeroshot.values()]:
            if id(loader) not in seen:
                seen.add(id(loader))
                loader.close()


@dataclass
class TensorSplits:
    """A labelled dataset held whole in memory (sources/fashion_mnist.py, cifar.py, synthetic.py)."""

    train_x: torch.Tensor  # [N,C,H,W] uint8
    train_y: torch.Tensor  # [N] int64
    test_x: torch.Tensor  # [M,C,H,W] uint8
    test_y: torch.Tensor  # [M] int64
    class_names: list
    mean: tuple
    std: tuple


@dataclass
class Records:
    """N samples: captions (or label text), keys, and where each image is (a file, or bytes inside
    a shard). Read from a CSV (sources/csv.py) or a shard index (sources/shards.py)."""

    captions: np.ndarray  # [N] str
    keys: np.ndarray  # [N] str (split key)
    paths: np.ndarray  # [N] str: image file, or the shard for tar records
    offset: np.ndarray | None = None  # [N] int64 byte offset inside the shard (tar only)
    size: np.ndarray | None = None  # [N] int64

    def __len__(self):
        return len(self.captions)

    def take(self, mask: np.ndarray) -> Records:
        pick = lambda a: None if a is None else a[mask]  # noqa: E731
        return Records(
            self.captions[mask],
            self.keys[mask],
            self.paths[mask],
            pick(self.offset),
            pick(self.size),
        )
