"""Streamed webdataset shards (data.reader = stream): the samples of a tar stream, their counts,
and the two splits as ShardSets (which shards, how many samples each, where indices start).
loaders/stream_plan.py decides which rank and worker reads which shard; loaders/stream.py decodes.

Sample index (FastCLIP's per-sample state): shards from `vitscale data prepare` name each sample
by its index (KEY = 000000123); for other shard sets one counting pass over the shards
(cached under data_home()/webdataset-counts, keyed by path, size and mtime) gives each shard's sample
count, and index = the samples of the earlier shards (sorted list) + the position in its shard:
the index the seek reader gives (sources/shards.py). A map of keys would cost memory per sample;
counts cost one number per shard.
"""

from __future__ import annotations

import gzip
import logging
import zlib
from dataclasses import dataclass, field

import numpy as np

from ...errors import DataError
from ..home import cached_json, file_tag
from .held_out import held_out
from .shards import IMAGE_EXTS, expand, is_remote, label_of, open_url, read_manifest

log = logging.getLogger("vitscale.data")


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
        n[held_out(s["__key__"], fraction)] += 1
        if want == "cls":
            top = max(top, label_of(got[1], url, s["__key__"]))
    error = errors.events[0][2] if errors.events else ""
    return {"count": n, "incomplete": incomplete, "max_label": top, "error": error}


def count_samples(urls: list[str], want: str, fraction: float) -> list[dict]:
    """Per shard: {count: [training, held-out], incomplete, max_label, error}; one pass for both
    parts, cached (local files by path, size, mtime)."""
    return [
        cached_json(
            "webdataset-counts",
            f"{url}|{want}|{fraction}|v2" + ("" if is_remote(url) else "|" + file_tag(url)),
            lambda url=url: _count_one(url, want, fraction),
        )
        for url in urls
    ]


@dataclass
class ShardSet:
    """One split as shards: URLs, samples per shard, and where each shard's indices start."""

    urls: list
    counts: list
    want: str  # "txt" (captions) or "cls" (labels)
    fraction: float = 0.0  # held-out share, split by key (raw shard sets without test_root)
    test: bool = False  # the held-out part (True) or the training part of the shards
    index_from_key: bool = False  # prepared shards: index = int(KEY)
    num_classes: int = 0
    classes: list = field(default_factory=list)

    def __post_init__(self):
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def keep(self, key: str) -> bool:
        return held_out(key, self.fraction) == self.test

    def index(self, shard: int, position: int, key: str) -> int:
        return (
            int(key.rsplit("/", 1)[-1])
            if self.index_from_key
            else int(self.offsets[shard]) + position
        )


def shard_sets(cfg, want: str) -> tuple[ShardSet, ShardSet]:
    """(train, test) shard sets of data.root / data.test_root (module docstring)."""
    if not cfg.root:
        raise DataError(
            "data.root must name the webdataset shards (a folder, a pattern like "
            "/data/{00000..00009}.tar, a pipe: command or a URL)"
        )
    m = read_manifest(cfg.root)
    if m is not None:
        kind = "pairs" if want == "txt" else "classification"
        if m.get("kind") != kind:
            raise DataError(f"webdataset: {cfg.root} was prepared for {m.get('kind')}, not {kind}")
        splits = m["splits"]
        classes = list(m.get("classes", []))
        made = lambda s: ShardSet(  # noqa: E731
            s["shards"],
            s["counts"],
            want,
            index_from_key=True,
            num_classes=len(classes),
            classes=classes,
        )
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
    return raw_set(cfg.root, want, cfg.test_fraction, False), raw_set(
        cfg.root, want, cfg.test_fraction, True
    )


def raw_set(root: str, want: str, fraction: float, test: bool) -> ShardSet:
    urls = expand(root)
    counts = count_samples(urls, want, fraction)
    for url, c in zip(urls, counts):
        if c["error"]:  # truncated, unreadable: its readable samples are used
            log.warning(
                "webdataset: shard %s is damaged (%s): using the %d sample(s) before the damage",
                url,
                c["error"],
                c["count"][test],
            )
    incomplete = sum(c["incomplete"] for c in counts)
    if incomplete:
        log.warning(
            "webdataset %s: %d sample(s) without an image or a %s are skipped",
            root,
            incomplete,
            "caption (.txt)" if want == "txt" else "label (.cls)",
        )
    top = max(c["max_label"] for c in counts)
    return ShardSet(
        urls, [c["count"][test] for c in counts], want, fraction, test, num_classes=top + 1
    )


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
