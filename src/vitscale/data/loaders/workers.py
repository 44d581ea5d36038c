"""Loaders whose images are decoded in DataLoader worker processes (loaders/worker_datasets.py):
ImageNet-style folders, CSV pairs and seek-read webdataset shards.

    FolderTrainLoader.iterate(epoch, start_batch) -> (x float32 [B,C,S,S], labels [B])   classification
    PairFileTrainLoader.iterate(...)              -> (x, tokens [B,L], index [B])         pairs (CLIP)
    FolderEvalLoader.iterate()                    -> (x, labels) or (x, tokens, index)

Batches follow `EpochPlan` (sampler.py); each image's random crop comes from a seed derived from
(seed, epoch, position in the epoch), so batches do not depend on the number of workers. Replaced
unreadable training images are counted in `loader.skipped`; normalization and mixing happen on
the device.
"""

from __future__ import annotations

import functools
import logging
import signal

import torch

from ...errors import DataError
from ..sampler import EpochPlan, derive_seed, generator, shard_range
from ..transforms import BatchAugment
from .device import pin_batches
from .worker_datasets import collate

log = logging.getLogger("vitscale.data")


class _Batches:
    """Batch sampler of keys; (epoch, start) are set before each pass, so one DataLoader with
    persistent workers serves every epoch. Holds no reference to its loader (no ref cycle: a
    DataLoader freed by the garbage collector instead of refcounting stalls 5 s per worker)."""

    def __init__(self, num_batches: int, keys_for):
        self.num_batches, self.keys_for, self.epoch, self.start = num_batches, keys_for, 0, 0

    def __len__(self):
        return max(self.num_batches - self.start, 0)

    def __iter__(self):
        return iter(self.keys_for(self.epoch, self.start))


def train_keys(plan: EpochPlan, seed: int):
    """keys_for(epoch, start) -> this rank's batches of (file index, per-image seed)."""

    def keys_for(epoch: int, start: int):
        for b in range(start, len(plan)):
            g_idx = plan.global_batch(epoch, b).tolist()
            lo, hi = plan.local_range(len(g_idx))
            pos = b * plan.batch_size  # position in the epoch
            yield [(g_idx[j], derive_seed("img", seed, epoch, pos + j)) for j in range(lo, hi)]

    return keys_for


def eval_keys(lo: int, hi: int, batch_size: int):
    def keys_for(epoch: int, start: int):
        for s in range(lo + start * batch_size, hi, batch_size):
            yield [(i, -1) for i in range(s, min(s + batch_size, hi))]

    return keys_for


def leave_stop_signals_to_the_trainer(_worker_id: int = 0) -> None:
    """A loader worker ignores SIGTERM, SIGUSR1 and SIGINT: the training process handles them at a
    step boundary (stop.py) and then ends its workers. A scheduler that signals every process of the
    job, or a Ctrl-C to the terminal's process group, would otherwise end the workers under a step."""
    for name in ("SIGTERM", "SIGUSR1", "SIGINT"):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)


def _dataloader(dataset, batches, cfg, device):
    workers = cfg.num_workers
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batches,
        num_workers=workers,
        worker_init_fn=leave_stop_signals_to_the_trainer if workers else None,
        collate_fn=functools.partial(
            collate,
            size=dataset.size,
            pairs=dataset.pairs,
            channels=getattr(dataset, "channels", 3),
        ),
        pin_memory=pin_batches(device.type, cfg.pin_memory, on_device=False),
        persistent_workers=workers > 0,
    )


class _FolderLoader:
    """Decoding workers over a dataset whose collate gives (x, second, index, kept positions,
    failures): second = labels, or tokens for pairs (worker_datasets.collate)."""

    def _start(self, dataset, keys_for, num_batches, cfg, device):
        self.dataset, self.device, self.skipped = dataset, torch.device(device), 0
        self._sampler = _Batches(num_batches, keys_for)
        self._loader = _dataloader(dataset, self._sampler, cfg, self.device)

    def _batches(self, epoch: int, start: int):
        """Yields (b, x uint8 [b,3,S,S] on device, second, index [b] on device, kept positions
        [b]), logging skips."""
        self._sampler.epoch, self._sampler.start = epoch, start
        for b, (*tensors, keep, failures) in enumerate(self._loader, start):
            for path, err in failures:
                if path is None:  # no substitute (FillsBatches)
                    raise DataError(err)
                self.skipped += 1
                log.warning(
                    "skipped unreadable image %s (%s); %d skipped so far", path, err, self.skipped
                )
            yield (b, *(t.to(self.device, non_blocking=True) for t in tensors), keep)

    def worker_processes(self) -> list:
        """The decoding worker processes alive for this loader now (persistent across epochs)."""
        it = getattr(self._loader, "_iterator", None)
        return list(getattr(it, "_workers", []) or [])

    def close(self):
        """Stop the decoding workers now (they also stop when the loader is freed)."""
        it = getattr(self._loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self._loader._iterator = None


class FolderTrainLoader(_FolderLoader):
    def __init__(self, dataset, plan: EpochPlan, augment: BatchAugment, cfg, *, seed, device):
        self.plan, self.augment, self.seed = plan, augment, seed
        self.batch_size = plan.batch_size // plan.world_size
        self._start(dataset, train_keys(plan, seed), len(plan), cfg, device)

    def __len__(self):
        return len(self.plan)

    def indices(self, epoch: int) -> torch.Tensor:
        return self.plan.indices(epoch)

    def iterate(self, epoch: int, start_batch: int = 0, ahead: int = 1):
        """`ahead` is for in-memory loaders; these batches come decoded from workers one at a time."""
        for x, rest, params in self.decoded(epoch, start_batch):
            yield self.emit(x, rest, params)

    def decoded(self, epoch: int, start_batch: int = 0):
        """(x uint8 [b,3,S,S] on the device, the collate's other tensors, the augmentation of the
        batch's kept samples) for each batch from `start_batch` on."""
        if start_batch < 0:
            raise DataError(f"data: start_batch must be >= 0, got {start_batch}")
        for b, x, *rest, keep in self._batches(epoch, start_batch):
            n_global = len(self.plan.global_batch(epoch, b))
            lo, hi = self.plan.local_range(n_global)
            params = self.augment.draw(generator("aug", self.seed, epoch, b), n_global)
            yield x, rest, params.take(slice(lo, hi)).take(keep)

    def emit(self, x, rest, params):
        """The training batch from the decoded images and the collate's other tensors."""
        y, _ = rest
        return self.augment(x, y, params)


class FolderEvalLoader(_FolderLoader):
    def __init__(self, dataset, cfg, norm, *, device, rank=0, world_size=1):
        self.norm = norm
        self.batch_size = cfg.eval_batch_size
        self.lo, self.hi = shard_range(len(dataset), rank, world_size)
        self.num_samples = self.hi - self.lo
        self._start(dataset, eval_keys(self.lo, self.hi, self.batch_size), len(self), cfg, device)

    def __len__(self):
        return -(-self.num_samples // self.batch_size)

    def indices(self) -> torch.Tensor:
        return torch.arange(self.lo, self.hi)

    def iterate(self):
        """(x, labels) or, for pairs, (x, tokens, index)."""
        for x, second, index in self.decoded():
            yield (self.norm(x), second, index) if self.dataset.pairs else (self.norm(x), second)

    def decoded(self):
        """(x uint8 [b,3,S,S] on the device, labels or tokens, index) for each batch of this rank's shard."""
        for _, x, second, index, _ in self._batches(0, 0):
            yield x, second, index


class PairFileTrainLoader(FolderTrainLoader):
    """The training loader over pairs (a PairDataset): the collate gives (x, tokens, index)."""

    def emit(self, x, rest, params):
        tok, idx = rest
        x, idx = self.augment(x, idx, params)  # num_classes=1: no label mixing, idx passes through
        return x, tok, idx
