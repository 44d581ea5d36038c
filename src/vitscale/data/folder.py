"""ImageNet-style folders: root/train/<class>/*.jpg and root/{val,validation,test}/<class>/...

Decoding and the per-image crop run in DataLoader worker processes (jpeg.py, data.decoder: Pillow,
or simplejpeg, which decodes a JPEG at the DCT scale its crop needs); each image's random crop comes
from a seed derived from (seed, epoch, position in the epoch), so batches do not depend on the
number of workers. An unreadable training image is replaced before batching by a substitute
drawn from (its position's seed, attempt), so every rank's batch stays full (the CLIP losses gather
equal-sized batches across ranks); it is counted in `loader.skipped`. An unreadable evaluation image
is dropped from its batch. Normalization and mixing happen on the device.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from ..strategy.devices import pin_batches
from .jpeg import CROP_FRACTION, RATIO, SCALE, decode, eval_box, resolve_decoder, rrc_box, to_rgb  # noqa: F401
from .loaders import DataBundle
from .sampler import EpochPlan, derive_seed, generator, shard_range
from .transforms import NORMALIZATIONS, BatchAugment, normalization

log = logging.getLogger("vitscale.data")
EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
EVAL_SPLITS = ("val", "validation", "test")
MEAN, STD = NORMALIZATIONS["imagenet"]
MAX_DRAWS = 64      # substitute candidates drawn for one unreadable training sample (per pass)


def _images_in(folder: Path) -> list[str]:
    out = []
    for dirpath, dirnames, files in os.walk(folder, followlinks=True):
        dirnames.sort()
        out += [os.path.join(dirpath, f) for f in sorted(files) if f.lower().endswith(EXTENSIONS)]
    return out


def scan(root: Path):
    """-> classes, (train paths, labels), (eval paths, labels). Empty class folders are skipped."""
    train_dir = root / "train"
    if not train_dir.is_dir():
        raise DataError(f"folder dataset: {train_dir} not found (expected {root}/train/<class>/*.jpg "
                        f"and {root}/val/<class>/*.jpg)")
    eval_dir = next((root / s for s in EVAL_SPLITS if (root / s).is_dir()), None)
    if eval_dir is None:
        raise DataError(f"folder dataset: no evaluation split in {root} (expected one of "
                        f"{', '.join(EVAL_SPLITS)})")
    splits = []
    for split_dir in (train_dir, eval_dir):
        found, empty = {}, []
        for d in sorted(p for p in split_dir.iterdir() if p.is_dir()):
            files = _images_in(d)
            if files:
                found[d.name] = files
            else:
                empty.append(d.name)
        if empty:
            log.warning("skipped %d empty class folder(s) in %s: %s", len(empty), split_dir,
                        ", ".join(empty))
        if not found:
            raise DataError(f"folder dataset: no images ({'/'.join(EXTENSIONS)}) in {split_dir}/<class>/")
        splits.append(found)
    classes = list(splits[0])
    index = {c: i for i, c in enumerate(classes)}
    for name in splits[1]:
        if name not in index:
            raise DataError(f"folder dataset: class '{name}' in {eval_dir} has no training images "
                            f"in {train_dir}")
    out = []
    for found in splits:
        paths = [p for c in found for p in found[c]]
        labels = [index[c] for c in found for _ in found[c]]
        out.append((np.array(paths), np.array(labels, dtype=np.int64)))  # numpy: no refcount COW
    return classes, out[0], out[1]


class Batch(list):
    """A local batch's items, and the (name, error) of the unreadable samples that substitutes
    replaced in it (`failures`, in slot order)."""

    def __init__(self, items=()):
        super().__init__(items)
        self.failures: list = []


def failures_of(items) -> list:
    """(name, error) of every unreadable sample of a batch: dropped ones and replaced ones."""
    return [(it[3], it[4]) for it in items if it[0] is None] + list(getattr(items, "failures", ()))


class FillsBatches:
    """Full training batches from a map-style dataset whose keys are (index, sample seed) and whose
    items are (image or None, second, index, name, error).

    `__getitems__` (what the DataLoader calls with a local batch's keys, in whichever worker)
    replaces each unreadable training sample (sample seed >= 0; evaluation keys carry -1 and are
    never replaced) by a readable substitute before collation: candidate a is
    derive_seed("substitute", sample seed, a) mod N, first skipping the indices already in the
    local batch, then allowing them. The substitute is decoded with the slot's seed (its crop and
    flip), and carries its own label/caption and index (FastCLIP's per-sample state is the
    substitute's). Batches stay a function of the keys, so of (seed, epoch, b, world size) for any
    number of workers; the failure is counted once, at the bad sample's own slot (a failing
    candidate is logged at debug level only: it is counted at its own slot)."""

    def __getitems__(self, keys):
        items = Batch(self[k] for k in keys)
        avoid = {int(k[0]) for k in keys}
        for j, (i, sample_seed) in enumerate(keys):
            if items[j][0] is None and sample_seed >= 0:
                bad = items[j]
                try:
                    items[j] = self.substitute(int(i), sample_seed, avoid)
                except DataError as e:      # raised by the loader in the main process: one line,
                    items.failures.append((None, str(e)))   # not a worker's traceback
                    continue
                items.failures.append((bad[3], bad[4]))
                avoid.add(int(items[j][2]))
        return items

    def substitute(self, i: int, sample_seed: int, avoid: set):
        n, tried = len(self), {i}
        for outside in (True, False):          # outside the local batch first
            for a in range(MAX_DRAWS):
                c = derive_seed("substitute", sample_seed, a) % n
                if c in tried or (outside and c in avoid):
                    continue
                tried.add(c)
                item = self[(c, sample_seed)]
                if item[0] is not None:
                    return item
                log.debug("substitute candidate %s is unreadable too (%s)", item[3], item[4])
        raise DataError(f"data: no readable substitute for unreadable sample {i} among {len(tried) - 1} "
                        f"candidate(s): is most of the training data unreadable?")


class FolderDataset(FillsBatches, torch.utils.data.Dataset):
    """Keys are (file index, sample seed); items are (image or None, label, index, path, error)."""
    pairs = False

    def __init__(self, paths: np.ndarray, labels: np.ndarray, size: int, hflip: bool, decoder: str = "auto"):
        self.paths, self.labels, self.size, self.hflip = paths, labels, size, hflip
        self.decoder = resolve_decoder(decoder)

    def __len__(self):
        return len(self.paths)

    def source(self, i: int):
        """(what decode reads: a path or bytes, the name that warnings give)"""
        path = str(self.paths[i])
        return path, path

    def __getitem__(self, key):
        i, sample_seed = key
        name = str(self.paths[i])
        try:
            src, name = self.source(i)
            return (decode(src, self.size, sample_seed, self.hflip, self.decoder), int(self.labels[i]),
                    int(i), name, "")
        except Exception as e:  # unreadable, truncated, not an image, decompression bomb ...
            return None, int(self.labels[i]), int(i), name, f"{type(e).__name__}: {e}"


def collate(items, size: int):
    """Drop failed samples -> x uint8 [b,3,S,S], y int64 [b], index [b], kept positions [b], failures."""
    keep = [j for j, it in enumerate(items) if it[0] is not None]
    x = torch.stack([items[j][0] for j in keep]) if keep else torch.empty(0, 3, size, size, dtype=torch.uint8)
    y = torch.tensor([items[j][1] for j in keep], dtype=torch.long)
    index = torch.tensor([items[j][2] for j in keep], dtype=torch.long)
    return x, y, index, torch.tensor(keep, dtype=torch.long), failures_of(items)


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
            pos = b * plan.batch_size                                       # position in the epoch
            yield [(g_idx[j], derive_seed("img", seed, epoch, pos + j)) for j in range(lo, hi)]
    return keys_for


def eval_keys(lo: int, hi: int, batch_size: int):
    def keys_for(epoch: int, start: int):
        for s in range(lo + start * batch_size, hi, batch_size):
            yield [(i, -1) for i in range(s, min(s + batch_size, hi))]
    return keys_for


def _dataloader(dataset, batches, cfg, device, collate_fn):
    workers = cfg.num_workers
    return torch.utils.data.DataLoader(dataset, batch_sampler=batches, num_workers=workers,
                                       collate_fn=functools.partial(collate_fn, size=dataset.size),
                                       pin_memory=pin_batches(device.type, cfg.pin_memory, on_device=False),
                                       persistent_workers=workers > 0)


class _FolderLoader:
    """Decoding workers over a dataset whose collate gives (x, second, index, kept positions,
    failures): folder.py's second = labels, pair_files.py's = tokens."""

    def _start(self, dataset, keys_for, num_batches, cfg, device, collate_fn):
        self.dataset, self.device, self.skipped = dataset, torch.device(device), 0
        self._sampler = _Batches(num_batches, keys_for)
        self._loader = _dataloader(dataset, self._sampler, cfg, self.device, collate_fn)

    def _batches(self, epoch: int, start: int):
        """Yields (b, x uint8 [b,3,S,S] on device, second, index [b] on device, kept positions
        [b]), logging skips."""
        self._sampler.epoch, self._sampler.start = epoch, start
        for b, (*tensors, keep, failures) in enumerate(self._loader, start):
            for path, err in failures:
                if path is None:                     # no substitute (FillsBatches)
                    raise DataError(err)
                self.skipped += 1
                log.warning("skipped unreadable image %s (%s); %d skipped so far", path, err, self.skipped)
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
    def __init__(self, dataset, plan: EpochPlan, augment: BatchAugment, cfg, *, seed, device, collate_fn=collate):
        self.plan, self.augment, self.seed = plan, augment, seed
        self.batch_size = plan.batch_size // plan.world_size
        self._start(dataset, train_keys(plan, seed), len(plan), cfg, device, collate_fn)

    def __len__(self):
        return len(self.plan)

    def indices(self, epoch: int) -> torch.Tensor:
        return self.plan.indices(epoch)

    def iterate(self, epoch: int, start_batch: int = 0):
        if start_batch < 0:
            raise DataError(f"data: start_batch must be >= 0, got {start_batch}")
        for b, x, *rest, keep in self._batches(epoch, start_batch):
            n_global = len(self.plan.global_batch(epoch, b))
            lo, hi = self.plan.local_range(n_global)
            params = self.augment.draw(generator("aug", self.seed, epoch, b), n_global)
            yield self.emit(x, rest, params.take(slice(lo, hi)).take(keep))

    def emit(self, x, rest, params):
        """The training batch from the decoded images and the collate's other tensors."""
        y, _ = rest
        return self.augment(x, y, params)


class FolderEvalLoader(_FolderLoader):
    def __init__(self, dataset, cfg, norm, *, device, rank=0, world_size=1, collate_fn=collate):
        self.norm = norm
        self.batch_size = cfg.eval_batch_size
        self.lo, self.hi = shard_range(len(dataset), rank, world_size)
        self.num_samples = self.hi - self.lo
        self._start(dataset, eval_keys(self.lo, self.hi, self.batch_size), len(self), cfg, device, collate_fn)

    def __len__(self):
        return -(-self.num_samples // self.batch_size)

    def indices(self) -> torch.Tensor:
        return torch.arange(self.lo, self.hi)

    def iterate(self):
        """(x, labels) or, for pairs, (x, tokens, index)."""
        for _, x, second, index, _ in self._batches(0, 0):
            yield (self.norm(x), second, index) if self.dataset.pairs else (self.norm(x), second)


def build(cfg, *, device, seed: int, rank: int = 0, world_size: int = 1) -> DataBundle:
    if not cfg.root:
        raise DataError("data.root must be set for data.name = 'folder' (ROOT/train/<class>/...)")
    root = Path(cfg.root).expanduser()
    if not root.is_dir():
        raise DataError(f"folder dataset: {root} is not a directory")
    classes, (train_p, train_y), (eval_p, eval_y) = scan(root)
    size, device = cfg.image_size or 224, torch.device(device)
    plan = EpochPlan(len(train_p), cfg.batch_size, seed=seed, drop_last=cfg.drop_last,
                     rank=rank, world_size=world_size)
    mean, std = normalization(cfg.normalize, MEAN, STD)  # "dataset": ImageNet's, as before
    augment = BatchAugment(cfg, mean=mean, std=std, num_classes=len(classes), crop_flip=False)
    train = FolderTrainLoader(FolderDataset(train_p, train_y, size, cfg.hflip, cfg.decoder), plan, augment, cfg,
                              seed=seed, device=device)
    test = FolderEvalLoader(FolderDataset(eval_p, eval_y, size, False, cfg.decoder), cfg, augment.norm,
                            device=device, rank=rank, world_size=world_size)
    return DataBundle(train=train, test=test, num_classes=len(classes), channels=3, image_size=size,
                      class_names=classes, train_size=len(train_p), test_size=len(eval_p),
                      mean=mean, std=std)
