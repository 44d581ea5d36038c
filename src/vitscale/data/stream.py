"""Streamed webdataset shards (data.reader = stream): the webdataset library opens and expands
the tar streams; vitscale decides which shards each rank and worker reads, in which order, and
how many batches each yields.

Sources (data.root, data.test_root): a folder of .tar / .tar.gz / .tgz shards, a brace pattern
(/data/{00000..00331}.tar), a `pipe:` command (`pipe:aws s3 cp s3://b/0.tar -`), http(s)://,
s3:// (read through `aws s3 cp URL -`) or gs:// URLs, or a folder written by
`vitscale data prepare` (its manifest.json names the splits and their sample counts).

Per epoch e (`StreamPlan` below):
- the training shards are permuted by (seed, e); rank r takes every world_size-th of them and
  its streams (one per decoding worker, V = max(1, data.num_workers)) every V-th of those;
- each stream reads its shards in order through webdataset's shuffle buffer (data.shuffle_buffer
  samples, seeded by (seed, e, r, v)) and starts over on its shards (re-permuted) when it runs
  short, so every rank yields exactly floor(N / batch) steps: a stream whose shards hold fewer
  samples than its share sees some twice that epoch, one with more leaves the rest unseen that
  epoch (OpenCLIP's resampled shards do the same);
- global batch b is batch b // V of stream b % V; its images get the per-image seed of
  (seed, e, position in the epoch), then the batch augmentation of (seed, e, b), like folder data.

Resume: batch b of epoch e is a function of (seed, e, b, world size, data.num_workers, shard
set), so a resumed run replays its streams up to its first batch reading but not decoding the
samples before it: the batches after a resume are exactly those of an uninterrupted run, at the
cost of re-reading the bytes of the epoch done so far.

Sample index (FastCLIP's per-sample state): shards from `vitscale data prepare` name each sample
by its index (KEY = 000000123); for other shard sets one counting pass over the shards
(cached under data_home()/webdataset-counts, keyed by path, size and mtime) gives each shard's sample
count, and index = the samples of the earlier shards (sorted list) + the position in its shard:
the index the seek reader gives. A map of keys would cost memory per sample; counts cost one
number per shard.

Bad input never stops a run: an undecodable training image is replaced in its batch by a sample of
the stream's previous batch (stream_loader.py; batches stay full on every rank) and counted, an
undecodable held-out image is dropped and counted, a sample without its caption/label is skipped
before batching and counted, a truncated or vanished shard ends that
shard for this pass (one warning, counted); a stream none of whose shards can be read is a
one-line error.
"""
from __future__ import annotations

import glob
import gzip
import json
import logging
import os
import random
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from .fetch import cached_json, file_tag
from .sampler import derive_seed, generator, shard_range

log = logging.getLogger("vitscale.data")
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
SHARD_EXTS = (".tar", ".tar.gz", ".tgz")
MANIFEST = "manifest.json"


# ---------------------------------------------------------------- where the shards are
def is_remote(url: str) -> bool:
    """pipe: commands and scheme:// URLs (http, s3, gs, ...), as opposed to local paths."""
    return url.startswith("pipe:") or re.match(r"[a-z][a-z0-9+.-]*://", url) is not None


def open_url(url: str) -> str:
    """What webdataset's gopen opens: s3:// through the AWS CLI, everything else as given."""
    if url.startswith("s3://"):
        return f"pipe:aws s3 cp {url} -"
    return url


def expand(root: str) -> list[str]:
    """A folder, a brace pattern (local ones may also hold * ? [ globs), a pipe: command or URL
    (several with '::') -> the shard URLs, sorted: both readers number samples in this order."""
    import braceexpand
    out, missing = set(), []
    for part in root.split("::"):
        p = Path(part).expanduser()
        if is_remote(part):
            out.update(braceexpand.braceexpand(part))
        elif p.is_dir():
            out.update(str(s) for s in p.iterdir() if s.name.endswith(SHARD_EXTS))
        else:
            for name in braceexpand.braceexpand(str(p)):
                if any(ch in name for ch in "*?["):
                    out.update(glob.glob(name))
                elif os.path.exists(name):
                    out.add(name)
                else:
                    missing.append(name)
    if missing:
        raise DataError(f"webdataset: {len(missing)} shard(s) of {root} not found, e.g. {missing[0]}")
    if not out:
        raise DataError(f"webdataset: no shards (.tar, .tar.gz, .tgz) at {root}")
    return sorted(out)


def read_manifest(root: str) -> dict | None:
    """A `vitscale data prepare` folder's manifest (shard names made full paths), else None."""
    p = Path(root).expanduser()
    path = p / MANIFEST if p.is_dir() else p if p.name == MANIFEST else None
    if path is None or not path.is_file():
        return None
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"webdataset: cannot read {path} ({e})") from None
    if m.get("format") != "vitscale-shards":
        raise DataError(f"webdataset: {path} is not a `vitscale data prepare` manifest")
    for split in m["splits"].values():
        split["shards"] = [str(path.parent / s) for s in split["shards"]]
    return m


# ---------------------------------------------------------------- samples out of tar streams
def complete(sample: dict, want: str):
    """-> (image bytes, the wanted field's text) or the name of what is missing.
    Members KEY.ext.gz are gunzipped (compressed members)."""
    for k in [k for k in sample if isinstance(k, str) and k.endswith(".gz")]:
        try:
            sample[k[:-3]] = gzip.decompress(sample.pop(k))
        except (OSError, EOFError, zlib.error) as e:
            return f"unreadable member .{k} ({type(e).__name__}: {e})"
    img = next((sample[e] for e in IMAGE_EXTS if e in sample), None)
    if img is None:
        return "no image (.jpg/.jpeg/.png/.webp)"
    text = sample.get(want)
    text = text.decode("utf-8", "replace").strip() if text is not None else ""
    if not text:
        return f"no {'caption' if want == 'txt' else 'label'} (.{want})"
    return img, text


class ShardErrors:
    """webdataset's exception handler: note the error, go on with the next shard."""

    def __init__(self):
        self.events: list = []

    def __call__(self, exn) -> bool:
        url = next((a for a in reversed(exn.args) if isinstance(a, str) and a), "?")
        first = str(exn.args[0]).split(" @ ")[0] if exn.args else ""
        self.events.append(("shard", url, f"{type(exn).__name__}: {first}"))
        return True


def shard_samples(url: str, errors: ShardErrors):
    """Raw samples of one shard ({__key__, ext: bytes}), in tar order."""
    from webdataset.tariterators import tarfile_samples
    yield from tarfile_samples([{"url": open_url(url)}], handler=errors)


def in_test(key: str, fraction: float) -> bool:
    """Does the sample fall in the held-out part? (never with fraction 0: a separate test_root)"""
    from .pair_files import held_out
    return fraction > 0 and held_out(key, fraction)


# ---------------------------------------------------------------- counting
def _count_one(url: str, want: str, fraction: float) -> dict:
    """One pass over a shard: complete samples of the training and the held-out part."""
    errors = ShardErrors()
    n, incomplete, top = [0, 0], 0, -1
    for s in shard_samples(url, errors):
        got = complete(s, want)
        if isinstance(got, str):
            incomplete += 1
            continue
        n[in_test(s["__key__"], fraction)] += 1
        if want == "cls":
            top = max(top, label_of(got[1], url, s["__key__"]))
    error = errors.events[0][2] if errors.events else ""
    return {"count": n, "incomplete": incomplete, "max_label": top, "error": error}


def label_of(text: str, url: str, key: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataError(f"webdataset: {url}: sample {key} has label '{text[:40]}', not an integer") from None


def count_samples(urls: list[str], want: str, fraction: float) -> list[dict]:
    """Per shard: {count: [training, held-out], incomplete, max_label, error}; one pass for both
    parts, cached (local files by path, size, mtime)."""
    return [cached_json("webdataset-counts", f"{url}|{want}|{fraction}|v2" + ("" if is_remote(url) else
                        "|" + file_tag(url)), lambda url=url: _count_one(url, want, fraction))
            for url in urls]


@dataclass
class ShardSet:
    """One split as shards: URLs, samples per shard, and where each shard's indices start."""
    urls: list
    counts: list
    want: str                      # "txt" (captions) or "cls" (labels)
    fraction: float = 0.0          # held-out share, split by key (raw shard sets without test_root)
    test: bool = False             # the held-out part (True) or the training part of the shards
    index_from_key: bool = False   # prepared shards: index = int(KEY)
    num_classes: int = 0
    classes: list = field(default_factory=list)

    def __post_init__(self):
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def keep(self, key: str) -> bool:
        return in_test(key, self.fraction) == self.test

    def index(self, shard: int, position: int, key: str) -> int:
        return int(key.rsplit("/", 1)[-1]) if self.index_from_key else int(self.offsets[shard]) + position


def shard_sets(cfg, want: str) -> tuple[ShardSet, ShardSet]:
    """(train, test) shard sets of data.root / data.test_root (module docstring)."""
    if not cfg.root:
        raise DataError("data.root must name the webdataset shards (a folder, a pattern like "
                        "/data/{00000..00009}.tar, a pipe: command or a URL)")
    m = read_manifest(cfg.root)
    if m is not None:
        kind = "pairs" if want == "txt" else "classification"
        if m.get("kind") != kind:
            raise DataError(f"webdataset: {cfg.root} was prepared for {m.get('kind')}, not {kind}")
        splits = m["splits"]
        classes = list(m.get("classes", []))
        made = lambda s: ShardSet(s["shards"], s["counts"], want, index_from_key=True,  # noqa: E731
                                  num_classes=len(classes), classes=classes)
        train = made(splits["train"])
        if cfg.test_root:
            test = raw_set(cfg.test_root, want, 0.0, False)
        elif "val" in splits:
            test = made(splits["val"])
        else:
            raise DataError(f"webdataset: {cfg.root} has no val split: set data.test_root")
        return train, test
    if cfg.test_root:
        return raw_set(cfg.root, want, 0.0, False), raw_set(cfg.test_root, want, 0.0, False)
    return raw_set(cfg.root, want, cfg.test_fraction, False), raw_set(cfg.root, want, cfg.test_fraction, True)


def raw_set(root: str, want: str, fraction: float, test: bool) -> ShardSet:
    urls = expand(root)
    counts = count_samples(urls, want, fraction)
    for url, c in zip(urls, counts):
        if c["error"]:     # truncated, unreadable: its readable samples are used
            log.warning("webdataset: shard %s is damaged (%s): using the %d sample(s) before the damage",
                        url, c["error"], c["count"][test])
    incomplete = sum(c["incomplete"] for c in counts)
    if incomplete:
        log.warning("webdataset %s: %d sample(s) without an image or a %s are skipped", root, incomplete,
                    "caption (.txt)" if want == "txt" else "label (.cls)")
    top = max(c["max_label"] for c in counts)
    return ShardSet(urls, [c["count"][test] for c in counts], want, fraction, test, num_classes=top + 1)


# ---------------------------------------------------------------- which shards, which batches
class StreamPlan:
    """Shards -> ranks -> streams (one per decoding worker) for each epoch."""

    def __init__(self, shards: ShardSet, batch_size: int, *, seed: int, rank: int, world_size: int,
                 streams: int):
        self.shards, self.batch_size, self.seed = shards, batch_size, seed
        self.rank, self.world_size, self.streams = rank, world_size, max(1, streams)
        if batch_size > len(shards):
            raise DataError(f"data.batch_size ({batch_size}) is larger than the training set "
                            f"({len(shards)} samples): lower data.batch_size")
        self.num_batches = len(shards) // batch_size
        self.lo, self.hi = shard_range(batch_size, rank, world_size)   # this rank's part of a batch
        used = [i for i, c in enumerate(shards.counts) if c > 0]
        need = world_size * self.streams
        if len(used) < need:
            raise DataError(f"webdataset: {len(used)} non-empty shard(s) cannot feed {world_size} process(es) "
                            f"x {self.streams} stream(s) (data.num_workers): write more, smaller shards "
                            f"(vitscale data prepare --shard-size) or lower data.num_workers")
        self.used = used

    def __len__(self) -> int:
        return self.num_batches

    def stream_shards(self, epoch: int, v: int) -> list[int]:
        order = torch.randperm(len(self.used), generator=generator("shards", self.seed, epoch)).tolist()
        mine = [self.used[i] for i in order][self.rank::self.world_size]
        return mine[v::self.streams]

    def batches_of(self, v: int) -> int:
        """How many of the epoch's batches stream v yields."""
        return len(range(v, self.num_batches, self.streams))


def set_samples(set_: ShardSet, s: int, errors: ShardErrors, bad: list):
    """Shard s of the set: its samples of the set's part as (url, key, index, image bytes, text);
    samples without their image or text are noted in `bad` and skipped."""
    url, pos = set_.urls[s], 0
    for sample in shard_samples(url, errors):
        key = sample["__key__"]
        if not set_.keep(key):
            continue
        c = complete(sample, set_.want)
        if isinstance(c, str):
            bad.append(("sample", f"{url}:{key}", c))
            continue
        yield url, key, set_.index(s, pos, key), c[0], c[1]
        pos += 1


def stream_samples(plan: StreamPlan, epoch: int, v: int, buffer: int, errors: ShardErrors, bad: list):
    """Stream v's endless sample sequence (set_samples' tuples). Each pass over its shards goes
    through its own shuffle buffer, so the first pass holds every sample once."""
    from webdataset import shuffle
    shards, set_ = plan.stream_shards(epoch, v), plan.shards

    def one_pass(order):
        for s in order:
            yield from set_samples(set_, s, errors, bad)

    for cycle in range(10**9):
        order = shards if cycle == 0 else [shards[i] for i in torch.randperm(
            len(shards), generator=generator("cycle", plan.seed, epoch, plan.rank, v, cycle)).tolist()]
        samples = one_pass(order)
        if buffer > 0:
            rng = random.Random(derive_seed("buffer", plan.seed, epoch, plan.rank, v, cycle))
            samples = shuffle(buffer, buffer, rng=rng)(samples)
        got = 0
        for sample in samples:
            got += 1
            yield sample
        if not got:
            raise DataError(f"webdataset: none of the {len(shards)} shard(s) of a stream could be read "
                            f"(e.g. {set_.urls[shards[0]]}: {errors.events[-1][2] if errors.events else 'empty'})")


def resolve_reader(cfg) -> str:
    """data.reader: auto = seek for local uncompressed .tar files, else stream."""
    if cfg.reader != "auto":
        return cfg.reader
    urls = []
    for root in filter(None, (cfg.root, cfg.test_root)):
        if is_remote(root):
            return "stream"
        m = read_manifest(root)
        urls += [u for s in m["splits"].values() for u in s["shards"]] if m else expand(root)
    return "seek" if all(u.endswith(".tar") for u in urls) else "stream"
