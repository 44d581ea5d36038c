"""Loaders for datasets held whole in memory (Fashion-MNIST, CIFAR, synthetic; OpenClipArt and
captioned in-memory sets as image-text pairs).

The split is one uint8 tensor [N,C,H,W], on the training device when `data.on_device`
(airbench style), else in host memory and moved per batch. Batches are gathered by index and
augmented with `BatchAugment` on the device. Pairs hold tokens int64 [N,L] where labels would be;
a pair batch is (images, tokens, dataset index).
"""

from __future__ import annotations

import torch

from ...errors import DataError
from ..sampler import EpochPlan, generator, shard_range
from ..transforms import BatchAugment, Normalizer, normalization, resize_u8
from ..types import DataBundle, TensorSplits, ZeroShotSet
from .device import pin_batches, to_device


class TensorTrainLoader:
    """`len()` optimizer steps per epoch; `iterate(epoch, start_batch)` yields this rank's share."""

    def __init__(
        self, x, y, plan: EpochPlan, augment: BatchAugment, *, seed: int, device, pin_memory=True
    ):
        self.x, self.y = x, y  # [N,C,H,W] uint8, [N] int64
        self.plan, self.augment = plan, augment
        self.seed, self.device = seed, torch.device(device)
        # host-held data bound for a GPU: each batch through pinned memory (data.pin_memory)
        self.pin = pin_batches(self.device.type, pin_memory, on_device=x.device == self.device)
        self.batch_size = plan.batch_size // plan.world_size
        self.skipped = 0  # nothing can be unreadable here

    def __len__(self) -> int:
        return len(self.plan)

    def indices(self, epoch: int) -> torch.Tensor:
        """[n_local] sample indices this rank sees in `epoch`, in order."""
        return self.plan.indices(epoch)

    def batch(self, epoch: int, b: int):
        """(x [B,C,H,W] float32, y [B] int64 or [B,K] float32) for batch b of `epoch`."""
        return next(self.batches(epoch, range(b, b + 1)))

    def draws(self, epoch: int, b: int):
        """This rank's sample indices of batch b and their augmentation draws (drawn for the
        global batch, so that they do not depend on the number of processes)."""
        g_idx = self.plan.global_batch(epoch, b)  # [Bg]
        lo, hi = self.plan.local_range(len(g_idx))
        params = self.augment.draw(generator("aug", self.seed, epoch, b), len(g_idx))
        return g_idx[lo:hi], params.take(slice(lo, hi))

    def batches(self, epoch: int, bs: range):
        """Batches `bs` of `epoch`, prepared together: one gather from the split, one copy to the
        device and one crop/flip for all of them (the per-batch draws are those of one batch at a
        time: the same numbers), then each batch's view."""
        idx, params = zip(*(self.draws(epoch, b) for b in bs))
        home = torch.cat(idx).to(self.x.device)
        x, y = (
            to_device(self.x[home], self.device, self.pin),
            to_device(self.y[home], self.device, self.pin),
        )
        yield from self.augment.block(x, y, list(params), [len(i) for i in idx])  # on the device

    def close(self):
        pass

    def iterate(self, epoch: int, start_batch: int = 0, ahead: int = 1):
        """`ahead`: batches prepared at once (train.capture=step: a step is then a copy and a
        replay; the numbers do not depend on it)."""
        if start_batch < 0:
            raise DataError(f"data: start_batch must be >= 0, got {start_batch}")
        for b in range(start_batch, len(self.plan), ahead):
            yield from self.batches(epoch, range(b, min(b + ahead, len(self.plan))))


class TensorEvalLoader:
    """The whole test split, no augmentation; rank r gets a contiguous shard (no padding)."""

    def __init__(
        self,
        x,
        y,
        batch_size: int,
        norm: Normalizer,
        *,
        device,
        rank=0,
        world_size=1,
        pin_memory=True,
    ):
        self.x, self.y, self.batch_size, self.norm = x, y, batch_size, norm
        self.device = torch.device(device)
        self.pin = pin_batches(self.device.type, pin_memory, on_device=x.device == self.device)
        self.lo, self.hi = shard_range(len(x), rank, world_size)
        self.num_samples = self.hi - self.lo
        self.skipped = 0

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def indices(self) -> torch.Tensor:
        return torch.arange(self.lo, self.hi)

    def close(self):
        pass

    def iterate(self):
        for s in range(self.lo, self.hi, self.batch_size):
            e = min(s + self.batch_size, self.hi)
            x = to_device(self.x[s:e], self.device, self.pin)
            yield self.norm(x), to_device(self.y[s:e], self.device, self.pin)


def tensor_bundle(
    splits: TensorSplits,
    cfg,
    *,
    device,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    resize: bool = True,
) -> DataBundle:
    """Place (and resize once, if `cfg.image_size` differs) the splits; build both loaders."""
    device = torch.device(device)
    home = device if cfg.on_device else torch.device("cpu")
    xs = []
    for x in (splits.train_x, splits.test_x):
        x = x.to(home)
        if resize and cfg.image_size and cfg.image_size != x.shape[-1]:
            x = resize_u8(x, cfg.image_size)
        xs.append(x)
    train_x, test_x = xs
    train_y, test_y = splits.train_y.to(home), splits.test_y.to(home)
    num_classes = len(splits.class_names)
    plan = EpochPlan(
        len(train_x),
        cfg.batch_size,
        seed=seed,
        drop_last=cfg.drop_last,
        rank=rank,
        world_size=world_size,
    )
    mean, std = normalization(cfg.normalize, splits.mean, splits.std)
    augment = BatchAugment(cfg, mean=mean, std=std, num_classes=num_classes)
    return DataBundle(
        train=TensorTrainLoader(
            train_x, train_y, plan, augment, seed=seed, device=device, pin_memory=cfg.pin_memory
        ),
        test=TensorEvalLoader(
            test_x,
            test_y,
            cfg.eval_batch_size,
            augment.norm,
            device=device,
            rank=rank,
            world_size=world_size,
            pin_memory=cfg.pin_memory,
        ),
        num_classes=num_classes,
        channels=train_x.shape[1],
        image_size=train_x.shape[-1],
        class_names=list(splits.class_names),
        train_size=len(train_x),
        test_size=len(test_x),
        mean=mean,
        std=std,
        eval_split="val" if getattr(cfg, "val_fraction", 0) else "test",
    )


class PairTrainLoader(TensorTrainLoader):
    """In-memory pairs: x uint8 [N,C,H,W], y = tokens int64 [N,L] (same home), batches by
    EpochPlan; a batch is (images, tokens, dataset index)."""

    def batches(self, epoch: int, bs: range):
        for b in bs:
            idx, params = self.draws(epoch, b)
            home = idx.to(self.x.device)
            x, tokens = (
                to_device(self.x[home], self.device, self.pin),
                to_device(self.y[home], self.device, self.pin),
            )
            index = idx.to(self.device, non_blocking=True)
            x, index = self.augment(x, index, params)
            yield x, tokens, index


class PairEvalLoader(TensorEvalLoader):
    """In-memory held-out pairs (y = tokens), no augmentation; rank r gets a contiguous shard;
    a batch is (images, tokens, index)."""

    def iterate(self):
        for (x, tokens), s in zip(super().iterate(), range(self.lo, self.hi, self.batch_size)):
            yield x, tokens, torch.arange(s, s + len(x), device=self.device)


def _zeroshot_loaders(
    cfg, zeroshot_sets, norm: Normalizer, *, home, device, rank, world_size
) -> dict:
    """name -> ZeroShotSet: each set's images and labels moved to `home`, behind an eval loader."""
    zs = {}
    for name, (classes, templates, x, y) in zeroshot_sets.items():
        loader = TensorEvalLoader(
            x.to(home),
            y.to(home),
            cfg.eval_batch_size,
            norm,
            device=device,
            rank=rank,
            world_size=world_size,
            pin_memory=cfg.pin_memory,
        )
        zs[name] = ZeroShotSet(list(classes), list(templates), loader)
    return zs


def memory_bundle(
    cfg,
    *,
    train_x,
    train_tokens,
    test_x,
    test_tokens,
    captions_test,
    mean,
    std,
    zeroshot_sets,
    device,
    seed,
    rank,
    world_size,
) -> DataBundle:
    """Pairs held whole in memory (on the device when data.on_device).

    zeroshot_sets: name -> (class_names, templates, x uint8, labels int64) on CPU.
    """
    device = torch.device(device)
    home = device if cfg.on_device else torch.device("cpu")
    train_x, train_tokens = train_x.to(home), train_tokens.to(home)
    test_x, test_tokens = test_x.to(home), test_tokens.to(home)
    plan = EpochPlan(
        len(train_x), cfg.batch_size, seed=seed, drop_last=True, rank=rank, world_size=world_size
    )
    augment = BatchAugment(cfg, mean=mean, std=std, num_classes=1)
    zs = _zeroshot_loaders(
        cfg, zeroshot_sets, augment.norm, home=home, device=device, rank=rank, world_size=world_size
    )
    return DataBundle(
        train=PairTrainLoader(
            train_x,
            train_tokens,
            plan,
            augment,
            seed=seed,
            device=device,
            pin_memory=cfg.pin_memory,
        ),
        test=PairEvalLoader(
            test_x,
            test_tokens,
            cfg.eval_batch_size,
            augment.norm,
            device=device,
            rank=rank,
            world_size=world_size,
            pin_memory=cfg.pin_memory,
        ),
        zeroshot=zs,
        train_size=len(train_x),
        test_size=len(test_x),
        channels=train_x.shape[1],
        image_size=train_x.shape[-1],
        mean=tuple(mean),
        std=tuple(std),
        captions_test=list(captions_test),
    )
