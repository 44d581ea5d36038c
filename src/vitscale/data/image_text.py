"""Image-text pairs for CLIP: `build_image_text(cfg.data, ...)` -> ImageTextBundle.

    bundle.train.iterate(epoch, start_batch) -> (images float32 [b,C,H,W] on device,
                                                 tokens int64 [b,L], index int64 [b])
    bundle.test.iterate()                    -> the same over this rank's held-out shard
    bundle.zeroshot[name].loader.iterate()   -> (images, labels int64 [b])

`index` is the sample's stable position in the train set (FastCLIP keeps per-sample state by
it). Batches follow `EpochPlan`: global batch b of epoch e is a function of (seed, e, b), rank r
takes its contiguous slice, every rank has the same number of batches, resume is exact.

Sources: data.name = openclipart (decoded once, cached, held in memory), csv / webdataset
(decoded per batch in DataLoader workers, see pair_files.py), or any classification dataset with
data.captions = true (captions from data.caption_template, held in memory or folder-decoded).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from ..config import micro_batch
from ..errors import DataError
from ..strategy.devices import to_device
from .sampler import EpochPlan, generator
from .loaders import TensorEvalLoader, TensorTrainLoader
from .transforms import BatchAugment

DEFAULT_TEMPLATES = ("a photo of a {}.", "a drawing of {}.", "an image of {}.")


@dataclass
class ZeroShotSet:
    class_names: list
    templates: list
    loader: object          # iterate() -> (images, labels int64); __len__; close()


@dataclass
class ImageTextBundle:
    train: object
    test: object
    zeroshot: dict
    train_size: int
    test_size: int
    channels: int
    image_size: int
    mean: tuple
    std: tuple
    captions_test: list = field(default_factory=list)

    def close(self):
        """Stop decoding workers (a no-op for in-memory data)."""
        seen = set()
        for loader in [self.train, self.test] + [z.loader for z in self.zeroshot.values()]:
            if id(loader) not in seen:
                seen.add(id(loader))
                loader.close()


def readable(name: str) -> str:
    return name.replace("_", " ").strip()


class PairTrainLoader(TensorTrainLoader):
    """In-memory pairs: x uint8 [N,C,H,W], y = tokens int64 [N,L] (same home), batches by
    EpochPlan; a batch is (images, tokens, dataset index)."""

    def batch(self, epoch: int, b: int):
        g_idx = self.plan.global_batch(epoch, b)
        lo, hi = self.plan.local_range(len(g_idx))
        params = self.augment.draw(generator("aug", self.seed, epoch, b), len(g_idx))
        idx = g_idx[lo:hi]
        home = idx.to(self.x.device)
        x, tokens = to_device(self.x[home], self.device, self.pin), to_device(self.y[home], self.device, self.pin)
        index = idx.to(self.device, non_blocking=True)
        x, index = self.augment(x, index, params.take(slice(lo, hi)))
        return x, tokens, index


class PairEvalLoader(TensorEvalLoader):
    """In-memory held-out pairs (y = tokens), no augmentation; rank r gets a contiguous shard;
    a batch is (images, tokens, index)."""

    def iterate(self):
        for (x, tokens), s in zip(super().iterate(), range(self.lo, self.hi, self.batch_size)):
            yield x, tokens, torch.arange(s, s + len(x), device=self.device)


def check_augment(cfg):
    if cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0:
        raise DataError("data.mixup_alpha / data.cutmix_alpha: mixing images makes no sense for "
                        "image-text pairs (CLIP); set them to 0")


def memory_bundle(cfg, *, train_x, train_tokens, test_x, test_tokens, captions_test, mean, std,
                  zeroshot_sets, device, seed, rank, world_size) -> ImageTextBundle:
    """Pairs held whole in memory (on the device when data.on_device).

    zeroshot_sets: name -> (class_names, templates, x uint8, labels int64) on CPU.
    """
    from .loaders import TensorEvalLoader
    device = torch.device(device)
    home = device if cfg.on_device else torch.device("cpu")
    train_x, train_tokens = train_x.to(home), train_tokens.to(home)
    test_x, test_tokens = test_x.to(home), test_tokens.to(home)
    plan = EpochPlan(len(train_x), cfg.batch_size, seed=seed, drop_last=True, rank=rank,
                     world_size=world_size)
    augment = BatchAugment(cfg, mean=mean, std=std, num_classes=1)
    zs = {}
    for name, (classes, templates, x, y) in zeroshot_sets.items():
        loader = TensorEvalLoader(x.to(home), y.to(home), cfg.eval_batch_size, augment.norm,
                                  device=device, rank=rank, world_size=world_size, pin_memory=cfg.pin_memory)
        zs[name] = ZeroShotSet(list(classes), list(templates), loader)
    return ImageTextBundle(
        train=PairTrainLoader(train_x, train_tokens, plan, augment, seed=seed, device=device,
                              pin_memory=cfg.pin_memory),
        test=PairEvalLoader(test_x, test_tokens, cfg.eval_batch_size, augment.norm, device=device,
                            rank=rank, world_size=world_size, pin_memory=cfg.pin_memory),
        zeroshot=zs, train_size=len(train_x), test_size=len(test_x), channels=train_x.shape[1],
        image_size=train_x.shape[-1], mean=tuple(mean), std=tuple(std),
        captions_test=list(captions_test))


def _classification(cfg, *, device, seed, rank, world_size, context_length) -> ImageTextBundle:
    """A classification dataset as pairs: caption = data.caption_template.format(class name)."""
    from . import build_data
    from .loaders import TensorEvalLoader, TensorTrainLoader
    from .tokenizer import tokenize
    data = build_data(cfg, device=device, seed=seed, rank=rank, world_size=world_size)
    names = [readable(str(c)) for c in data.class_names]
    try:
        captions = [cfg.caption_template.format(n) for n in names]
    except (IndexError, KeyError, ValueError) as e:
        raise DataError(f"data.caption_template '{cfg.caption_template}' must hold one '{{}}' "
                        f"for the class name ({e})") from None
    class_tokens = tokenize(captions, context_length)                          # [K,L]
    templates = [cfg.caption_template] + [t for t in DEFAULT_TEMPLATES if t != cfg.caption_template]
    if isinstance(data.train, TensorTrainLoader):
        tr, te = data.train, data.test
        assert isinstance(te, TensorEvalLoader)
        train_tokens = class_tokens.to(tr.y.device)[tr.y]
        test_tokens = class_tokens.to(te.y.device)[te.y]
        captions_test = [captions[int(y)] for y in te.y.tolist()]
        data.close()
        zs = {cfg.name: (names, templates, te.x.cpu(), te.y.cpu())}
        return memory_bundle(cfg, train_x=tr.x, train_tokens=train_tokens, test_x=te.x,
                             test_tokens=test_tokens, captions_test=captions_test, mean=data.mean,
                             std=data.std, zeroshot_sets=zs, device=device, seed=seed, rank=rank,
                             world_size=world_size)
    from .pair_files import FolderPairs                       # folder data: decoded in workers
    train, test = FolderPairs.wrap(data, class_tokens)
    labels = test.inner.dataset.labels
    return ImageTextBundle(
        train=train, test=test, zeroshot={cfg.name: ZeroShotSet(names, templates, data.test)},
        train_size=data.train_size, test_size=data.test_size, channels=data.channels,
        image_size=data.image_size, mean=data.mean, std=data.std,
        captions_test=[captions[int(y)] for y in labels])


def build_image_text(cfg, *, device, seed: int, rank: int = 0, world_size: int = 1,
                     context_length: int = 77) -> ImageTextBundle:
    """Load `cfg.name` as image-text pairs and build this rank's loaders (module docstring)."""
    check_augment(cfg)
    micro_batch(cfg.batch_size, world_size, error=DataError)
    kw = dict(device=torch.device(device), seed=seed, rank=rank, world_size=world_size,
              context_length=context_length)
    if cfg.name == "openclipart":
        from . import openclipart
        return openclipart.build(cfg, **kw)
    if cfg.name in ("csv", "webdataset"):
        from . import pair_files
        return pair_files.build(cfg, **kw)
    if cfg.captions:
        cfg = copy.copy(cfg)            # a copy: drop_last for lockstep steps (mixing is refused above)
        cfg.drop_last = True
        return _classification(cfg, **kw)
    raise DataError(f"data.name = '{cfg.name}' is a classification dataset: set data.captions = "
                    f"true to train CLIP on it (captions from data.caption_template)")
