"""The held-out split by key, the same on every machine: a sample is held out when crc32(key)
falls below the fraction (CSV rows and seek-read shards: sources/csv.py, sources/shards.py; streamed
shards: sources/shard_sets.py; OpenClipArt; `vitscale data prepare`'s val split)."""

from __future__ import annotations

import zlib

import numpy as np

from ..types import Records


def held_out(key: str, fraction: float) -> bool:
    """Stable across runs and machines (not Python's salted hash()); never with fraction 0."""
    return zlib.crc32(key.encode("utf-8")) < fraction * 2**32


def split(rec: Records, fraction: float) -> tuple[Records, Records]:
    """(training records, held-out records) of one record list."""
    test = np.array([held_out(k, fraction) for k in rec.keys.tolist()], dtype=bool)
    return rec.take(~test), rec.take(test)
