"""What runs in the DataLoader worker processes of loaders/workers.py: map-style datasets whose
keys are (index, sample seed) and whose items are (image uint8 [C,S,S] or None, label or tokens,
index, name, error), and the one collate of their batches.

Decoding and the per-image crop (jpeg.py, data.decoder: Pillow, or simplejpeg, which decodes a
JPEG at the DCT scale its crop needs) are seeded per image, so batches do not depend on the number
of workers. An unreadable training image is replaced before batching by a substitute drawn from
(its position's seed, attempt), so every rank's batch stays full (the CLIP losses gather
equal-sized batches across ranks); an unreadable evaluation image is dropped from its batch.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ...errors import DataError
from ..jpeg import decode, grey, resolve_decoder
from ..sampler import derive_seed
from ..sources.shards import label_of
from ..types import Records

log = logging.getLogger("vitscale.data")
MAX_DRAWS = 64  # substitute candidates drawn for one unreadable training sample (per pass)


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
                except DataError as e:  # raised by the loader in the main process: one line,
                    items.failures.append((None, str(e)))  # not a worker's traceback
                    continue
                items.failures.append((bad[3], bad[4]))
                avoid.add(int(items[j][2]))
        return items

    def substitute(self, i: int, sample_seed: int, avoid: set):
        n, tried = len(self), {i}
        for outside in (True, False):  # outside the local batch first
            for a in range(MAX_DRAWS):
                c = derive_seed("substitute", sample_seed, a) % n
                if c in tried or (outside and c in avoid):
                    continue
                tried.add(c)
                item = self[(c, sample_seed)]
                if item[0] is not None:
                    return item
                log.debug("substitute candidate %s is unreadable too (%s)", item[3], item[4])
        raise DataError(
            f"data: no readable substitute for unreadable sample {i} among {len(tried) - 1} "
            f"candidate(s): is most of the training data unreadable?"
        )


class FolderDataset(FillsBatches, torch.utils.data.Dataset):
    """Keys are (file index, sample seed); items are (image or None, label, index, path, error)."""

    pairs = False

    def __init__(
        self,
        paths: np.ndarray,
        labels: np.ndarray,
        size: int,
        hflip: bool,
        decoder: str = "auto",
        channels: int = 3,
    ):
        self.paths, self.labels, self.size, self.hflip = paths, labels, size, hflip
        self.decoder = resolve_decoder(decoder)
        self.channels = channels  # 3: RGB; 1: grey (jpeg.grey of the decoded RGB image)

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
            x = decode(src, self.size, sample_seed, self.hflip, self.decoder)
            return (
                grey(x) if self.channels == 1 else x,
                int(self.labels[i]),
                int(i),
                name,
                "",
            )
        except Exception as e:  # unreadable, truncated, not an image, decompression bomb ...
            return None, int(self.labels[i]), int(i), name, f"{type(e).__name__}: {e}"


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
        labels = [
            label_of(t, str(p), str(k))
            for t, p, k in zip(rec.captions.tolist(), rec.paths, rec.keys)
        ]
        super().__init__(rec.paths, np.array(labels, dtype=np.int64), size, hflip, decoder)
        self.rec = rec

    def source(self, i: int):
        return read_member(self.rec, i)


class PairDataset(FillsBatches, torch.utils.data.Dataset):
    """Keys (index, sample seed) -> (image uint8 [3,S,S] or None, tokens [L], index, source, error);
    a local batch of training keys comes back full (FillsBatches)."""

    pairs = True

    def __init__(
        self, rec: Records, size: int, hflip: bool, context_length: int, decoder: str = "auto"
    ):
        self.rec, self.size, self.hflip, self.context_length = rec, size, hflip, context_length
        self.decoder = resolve_decoder(decoder)

    def __len__(self):
        return len(self.rec)

    def _source(self, i: int):
        return read_member(self.rec, i)

    def __getitem__(self, key):
        from ..tokenizer import get_tokenizer

        i, sample_seed = key
        tokens = get_tokenizer()(str(self.rec.captions[i]), self.context_length)[0]
        try:
            src, name = self._source(i)
        except OSError as e:
            return None, tokens, i, str(self.rec.paths[i]), f"{type(e).__name__}: {e}"
        try:
            return (
                decode(src, self.size, sample_seed, self.hflip, decoder=self.decoder),
                tokens,
                i,
                name,
                "",
            )
        except Exception as e:  # noqa: BLE001 - unreadable, truncated, not an image ...
            return None, tokens, i, name, f"{type(e).__name__}: {e}"


def collate(items, size: int, pairs: bool, channels: int = 3):
    """-> x uint8 [b,C,S,S], tokens [b,L] (pairs) or labels [b], index [b], kept positions [b],
    failures: unreadable samples (image None) are dropped, a whole batch of them included."""
    keep = [j for j, it in enumerate(items) if it[0] is not None]
    x = (
        torch.stack([items[j][0] for j in keep])
        if keep
        else torch.empty(0, channels, size, size, dtype=torch.uint8)
    )
    if pairs:
        L = items[0][1].shape[0] if items else 1
        second = (
            torch.stack([items[j][1] for j in keep])
            if keep
            else torch.empty(0, L, dtype=torch.long)
        )
    else:
        second = torch.tensor([items[j][1] for j in keep], dtype=torch.long)
    index = torch.tensor([items[j][2] for j in keep], dtype=torch.long)
    return x, second, index, torch.tensor(keep, dtype=torch.long), failures_of(items)
