"""Image-text pairs on disk: a CSV/TSV of (image path, caption), or webdataset tar shards.

Both are random-access record lists decoded per batch in DataLoader worker processes with PIL,
exactly like folder.py (random-resized crop + flip for training, central crop for evaluation,
seeded per image, so batches do not depend on the number of workers), which gives every
image-text source the same batching: `EpochPlan` global batches, rank slices, exact resume,
lockstep steps on every rank.

webdataset (img2dataset / OpenCLIP layout: KEY.jpg|jpeg|png|webp + KEY.txt [+ KEY.json] in
uncompressed .tar files): each shard is scanned once (member offsets and captions, cached under
data_home()/webdataset-index keyed by path, size and mtime); samples are then read by seeking to
their offset, so every rank and worker reads exactly the samples of its batches. The stable index
is the position in the sorted shard list (shard offset + position in the shard). This wants
shards on a local or network file system, not streamed from object storage.

Held-out pairs: data.test_root (another CSV / shard set), else the samples whose crc32(key)
falls below data.test_fraction (key = the image path as written in the CSV, or the sample KEY),
the same split on every machine. An unreadable training image is replaced by a substitute before
batching (folder.FillsBatches: every rank's batch stays full) and counted; an unreadable held-out
image is dropped from its batch and counted.
"""
from __future__ import annotations

import csv
import logging
import os
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from .fetch import cached_json, file_tag
from .folder import (FillsBatches, FolderDataset, FolderEvalLoader, FolderTrainLoader, decode, failures_of,
                     resolve_decoder)
from .sampler import EpochPlan, generator
from .transforms import NORMALIZATIONS, BatchAugment

log = logging.getLogger("vitscale.data")
CLIP_MEAN, CLIP_STD = NORMALIZATIONS["clip"]  # OpenAI CLIP's
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


def held_out(key: str, fraction: float) -> bool:
    """Stable across runs and machines (not Python's salted hash())."""
    return zlib.crc32(key.encode("utf-8")) < fraction * 2**32


@dataclass
class Records:
    """N samples: captions, keys, and where each image is (a file, or bytes inside a shard)."""
    captions: np.ndarray            # [N] str
    keys: np.ndarray                # [N] str (split key)
    paths: np.ndarray               # [N] str: image file, or the shard for tar records
    offset: np.ndarray | None = None   # [N] int64 byte offset inside the shard (tar only)
    size: np.ndarray | None = None     # [N] int64

    def __len__(self):
        return len(self.captions)

    def take(self, mask: np.ndarray) -> "Records":
        pick = lambda a: None if a is None else a[mask]  # noqa: E731
        return Records(self.captions[mask], self.keys[mask], self.paths[mask], pick(self.offset),
                       pick(self.size))

    def split(self, fraction: float):
        test = np.array([held_out(k, fraction) for k in self.keys.tolist()], dtype=bool)
        return self.take(~test), self.take(test)


# ---------------------------------------------------------------- CSV / TSV
def read_csv(path: str, image_key: str, caption_key: str) -> Records:
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"csv dataset: {p} not found")
    sep = "\t" if p.suffix.lower() == ".tsv" else ","
    with open(p, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=sep)
        cols = reader.fieldnames or []
        for key, what in ((image_key, "data.csv_image_key"), (caption_key, "data.csv_caption_key")):
            if key not in cols:
                raise DataError(f"csv dataset {p}: no column '{key}' ({what}); columns: "
                                f"{', '.join(cols) or 'none (empty file)'}")
        rows = [(r[image_key] or "", r[caption_key] or "") for r in reader]
    if not rows:
        raise DataError(f"csv dataset {p}: no rows")
    base = p.parent
    paths = [str(Path(i) if os.path.isabs(i) else base / i) for i, _ in rows]
    return Records(np.array([c for _, c in rows]), np.array([i for i, _ in rows]), np.array(paths))


# ---------------------------------------------------------------- webdataset shards
def shard_list(root: str, split: str = "train") -> list[str]:
    """The split's shards: a `vitscale data prepare` folder's, else stream.expand(root); the seek
    reader needs them uncompressed."""
    from .stream import expand, is_remote, read_manifest
    if not root:
        raise DataError("data.root must name the webdataset shards (a folder of .tar files or a "
                        "pattern like /data/{00000..00009}.tar)")
    m = read_manifest(root)
    if m is not None:
        if split not in m["splits"]:
            raise DataError(f"webdataset: {root} has no {split} split: set data.test_root")
        return m["splits"][split]["shards"]
    shards = expand(root)
    other = [s for s in shards if is_remote(s) or not s.endswith(".tar")]
    if other:
        raise DataError(f"webdataset: data.reader=seek reads local uncompressed .tar shards, not {other[0]}: "
                        f"set data.reader=stream (or auto)")
    return shards


def scan_shard(path: str, want: str = "txt") -> dict:
    """{keys, offsets, sizes, captions, incomplete}: one pass over the tar's headers; captions = the
    text of each sample's KEY.<want> member (txt: the caption, cls: the label)."""
    samples: dict = {}
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                d, base = os.path.split(m.name)
                if "." not in base:
                    continue
                stem, ext = base.split(".", 1)
                s = samples.setdefault(os.path.join(d, stem), {})
                ext = ext.lower()
                if ext in IMAGE_EXTS and "img" not in s:
                    s["img"] = (m.offset_data, m.size)
                elif ext == want:
                    s[want] = tf.extractfile(m).read().decode("utf-8", "replace").strip()
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"webdataset: cannot read shard {path} ({type(e).__name__}: {e}); shards "
                        f"must be uncompressed .tar") from None
    out = {"keys": [], "offsets": [], "sizes": [], "captions": [], "incomplete": 0}
    for key, s in samples.items():
        if "img" not in s or not s.get(want):
            out["incomplete"] += 1
            continue
        out["keys"].append(key)
        out["offsets"].append(s["img"][0])
        out["sizes"].append(s["img"][1])
        out["captions"].append(s[want])
    return out


def shard_index(path: str, want: str = "txt") -> dict:
    """scan_shard, cached on disk (keyed by absolute path, size, mtime and the member read)."""
    suffix = "" if want == "txt" else f"|{want}"
    return cached_json("webdataset-index", file_tag(path) + suffix, lambda: scan_shard(path, want))


def read_shards(root: str, split: str = "train", want: str = "txt") -> Records:
    caps, keys, paths, offs, sizes, incomplete = [], [], [], [], [], 0
    for shard in shard_list(root, split):
        idx = shard_index(shard, want)
        n = len(idx["keys"])
        caps += idx["captions"]
        keys += idx["keys"]
        paths += [shard] * n
        offs += idx["offsets"]
        sizes += idx["sizes"]
        incomplete += idx["incomplete"]
    if incomplete:
        log.warning("webdataset %s: skipped %d sample(s) without an image or a .%s %s",
                    root, incomplete, want, "caption" if want == "txt" else "label")
    if not keys:
        raise DataError(f"webdataset: no samples (KEY.jpg + KEY.{want}) in {root}")
    return Records(np.array(caps), np.array(keys), np.array(paths),
                   np.array(offs, dtype=np.int64), np.array(sizes, dtype=np.int64))


# ---------------------------------------------------------------- decoding in workers
def read_member(rec: Records, i: int):
    """(what decode reads, the sample's name): the file, or the image's bytes inside its shard."""
    path = str(rec.paths[i])
    if rec.offset is None:
        return path, path
    with open(path, "rb") as f:
        f.seek(int(rec.offset[i]))
        data = f.read(int(rec.size[i]))
    return data, f"{path}:{rec.keys[i]}"


class ShardImages(FolderDataset):
    """Labelled samples (KEY.jpg + KEY.cls) in local tar shards, read by seeking; items as
    FolderDataset's (image, label, index, name, error)."""

    def __init__(self, rec: Records, size: int, hflip: bool, decoder: str):
        from .stream import label_of
        labels = [label_of(t, str(p), str(k)) for t, p, k in zip(rec.captions.tolist(), rec.paths, rec.keys)]
        super().__init__(rec.paths, np.array(labels, dtype=np.int64), size, hflip, decoder)
        self.rec = rec

    def source(self, i: int):
        return read_member(self.rec, i)


def splits(cfg, read):
    """(train, held-out) records: data.test_root, a prepared folder's val split, or by key."""
    from .stream import read_manifest
    rec = read(cfg.root)
    if cfg.test_root:
        return rec, read(cfg.test_root)
    if cfg.name == "webdataset" and read_manifest(cfg.root):
        return rec, read(cfg.root, "val")
    return rec.split(cfg.test_fraction)


def labelled_bundle(cfg, *, device, seed: int, rank: int, world_size: int):
    """Labelled local shards read by seeking (exact epochs): a DataBundle like folder data's."""
    from .folder import MEAN, STD
    from .loaders import DataBundle
    from .stream import read_manifest
    from .transforms import normalization
    train, test = splits(cfg, lambda root, split="train": read_shards(root, split, "cls"))
    size = cfg.image_size or 224
    train_ds, test_ds = ShardImages(train, size, cfg.hflip, cfg.decoder), ShardImages(test, size, False, cfg.decoder)
    m = read_manifest(cfg.root)
    classes = list(m.get("classes", [])) if m else []
    num_classes = len(classes) or int(max(train_ds.labels.max(), test_ds.labels.max(initial=0))) + 1
    plan = EpochPlan(len(train), cfg.batch_size, seed=seed, drop_last=cfg.drop_last, rank=rank,
                     world_size=world_size)
    mean, std = normalization(cfg.normalize, MEAN, STD)
    augment = BatchAugment(cfg, mean=mean, std=std, num_classes=num_classes, crop_flip=False)
    return DataBundle(
        train=FolderTrainLoader(train_ds, plan, augment, cfg, seed=seed, device=device),
        test=FolderEvalLoader(test_ds, cfg, augment.norm, device=device, rank=rank, world_size=world_size),
        num_classes=num_classes, channels=3, image_size=size, class_names=classes or [str(i) for i in range(num_classes)],
        train_size=len(train), test_size=len(test), mean=mean, std=std)


class PairDataset(FillsBatches, torch.utils.data.Dataset):
    """Keys (index, sample seed) -> (image uint8 [3,S,S] or None, tokens [L], index, source, error);
    a local batch of training keys comes back full (FillsBatches)."""
    pairs = True

    def __init__(self, rec: Records, size: int, hflip: bool, context_length: int, decoder: str = "auto"):
        self.rec, self.size, self.hflip, self.context_length = rec, size, hflip, context_length
        self.decoder = resolve_decoder(decoder)

    def __len__(self):
        return len(self.rec)

    def _source(self, i: int):
        return read_member(self.rec, i)

    def __getitem__(self, key):
        from .tokenizer import get_tokenizer
        i, sample_seed = key
        tokens = get_tokenizer()(str(self.rec.captions[i]), self.context_length)[0]
        try:
            src, name = self._source(i)
        except OSError as e:
            return None, tokens, i, str(self.rec.paths[i]), f"{type(e).__name__}: {e}"
        try:
            return decode(src, self.size, sample_seed, self.hflip, decoder=self.decoder), tokens, i, name, ""
        except Exception as e:  # noqa: BLE001 - unreadable, truncated, not an image ...
            return None, tokens, i, name, f"{type(e).__name__}: {e}"


def collate(items, size: int):
    """-> x uint8 [b,3,S,S], tokens [b,L], index [b], kept positions [b], failures."""
    keep = [j for j, it in enumerate(items) if it[0] is not None]
    L = items[0][1].shape[0] if items else 1
    x = torch.stack([items[j][0] for j in keep]) if keep else torch.empty(0, 3, size, size, dtype=torch.uint8)
    tok = torch.stack([items[j][1] for j in keep]) if keep else torch.empty(0, L, dtype=torch.long)
    idx = torch.tensor([items[j][2] for j in keep], dtype=torch.long)
    return x, tok, idx, torch.tensor(keep, dtype=torch.long), failures_of(items)


class PairFileTrainLoader(FolderTrainLoader):
    """folder.py's training loader over pairs: the collate gives (x, tokens, index)."""

    def __init__(self, dataset, plan: EpochPlan, augment: BatchAugment, cfg, *, seed, device):
        super().__init__(dataset, plan, augment, cfg, seed=seed, device=device, collate_fn=collate)

    def emit(self, x, rest, params):
        tok, idx = rest
        x, idx = self.augment(x, idx, params)  # num_classes=1: no label mixing, idx passes through
        return x, tok, idx


class FolderPairs:
    """A folder classification bundle's loaders as pairs: tokens = class_tokens[label]."""

    def __init__(self, inner, class_tokens, train: bool):
        self.inner, self.train = inner, train
        self.class_tokens = class_tokens.to(inner.device)
        self.batch_size = inner.batch_size
        self.num_samples = getattr(inner, "num_samples", None)

    @classmethod
    def wrap(cls, data, class_tokens):
        return cls(data.train, class_tokens, True), cls(data.test, class_tokens, False)

    @property
    def skipped(self):
        return self.inner.skipped

    def __len__(self):
        return len(self.inner)

    def indices(self, *epoch):
        return self.inner.indices(*epoch)

    def close(self):
        self.inner.close()

    def iterate(self, epoch: int = 0, start_batch: int = 0):
        inner = self.inner
        if start_batch < 0:
            raise DataError(f"data: start_batch must be >= 0, got {start_batch}")
        for b, x, y, idx, keep in inner._batches(epoch if self.train else 0, start_batch if self.train else 0):
            if self.train:      # idx: each sample's own index (a substitute's is its own)
                g = inner.plan.global_batch(epoch, b)
                lo, hi = inner.plan.local_range(len(g))
                params = inner.augment.draw(generator("aug", inner.seed, epoch, b), len(g))
                x, _ = inner.augment(x, y, params.take(slice(lo, hi)).take(keep))
            else:
                x = inner.norm(x)
            yield x, self.class_tokens[y], idx


def build(cfg, *, device, seed: int, rank: int, world_size: int, context_length: int):
    from .image_text import ImageTextBundle
    from .stream import resolve_reader
    if cfg.name == "csv":
        if not cfg.root:
            raise DataError("data.root must name the csv/tsv file for data.name = 'csv'")
        read = lambda p: read_csv(p, cfg.csv_image_key, cfg.csv_caption_key)  # noqa: E731
    elif resolve_reader(cfg) == "stream":
        from .stream_loader import pairs_bundle
        return pairs_bundle(cfg, device=device, seed=seed, rank=rank, world_size=world_size,
                            context_length=context_length)
    else:
        read = read_shards
    train, test = splits(cfg, read)
    if not len(train):
        raise DataError(f"{cfg.name} dataset {cfg.root}: every sample fell in the held-out split")
    size = cfg.image_size or 224
    plan = EpochPlan(len(train), cfg.batch_size, seed=seed, drop_last=True, rank=rank,
                     world_size=world_size)
    augment = BatchAugment(cfg, mean=CLIP_MEAN, std=CLIP_STD, num_classes=1, crop_flip=False)
    train_loader = PairFileTrainLoader(PairDataset(train, size, cfg.hflip, context_length, cfg.decoder), plan,
                                       augment, cfg, seed=seed, device=device)
    test_loader = FolderEvalLoader(PairDataset(test, size, False, context_length, cfg.decoder), cfg, augment.norm,
                                   device=device, rank=rank, world_size=world_size, collate_fn=collate)
    return ImageTextBundle(train=train_loader, test=test_loader, zeroshot={}, train_size=len(train),
                           test_size=len(test), channels=3, image_size=size, mean=CLIP_MEAN,
                           std=CLIP_STD, captions_test=test.captions.tolist())
