"""Which streamed shards each rank and worker reads (data.reader = stream), in which order, and
how many batches each yields; the webdataset library opens and expands the tar streams
(sources/shard_sets.py), loaders/stream.py decodes them.

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

Bad input never stops a run: an undecodable training image is replaced in its batch by a sample of
the stream's previous batch (loaders/stream.py; batches stay full on every rank) and counted, an
undecodable held-out image is dropped and counted, a sample without its caption/label is skipped
before batching and counted, a truncated or vanished shard ends that shard for this pass (one
warning, counted); a stream none of whose shards can be read is a one-line error.
"""

from __future__ import annotations

import random

import torch

from ...errors import DataError
from ..sampler import derive_seed, generator, shard_range
from ..sources.shard_sets import ShardErrors, ShardSet, set_samples


class StreamPlan:
    """Shards -> ranks -> streams (one per decoding worker) for each epoch."""

    def __init__(
        self,
        shards: ShardSet,
        batch_size: int,
        *,
        seed: int,
        rank: int,
        world_size: int,
        streams: int,
    ):
        self.shards, self.batch_size, self.seed = shards, batch_size, seed
        self.rank, self.world_size, self.streams = rank, world_size, max(1, streams)
        if batch_size > len(shards):
            raise DataError(
                f"data.batch_size ({batch_size}) is larger than the training set "
                f"({len(shards)} samples): lower data.batch_size"
            )
        self.num_batches = len(shards) // batch_size
        self.lo, self.hi = shard_range(batch_size, rank, world_size)  # this rank's part of a batch
        used = [i for i, c in enumerate(shards.counts) if c > 0]
        need = world_size * self.streams
        if len(used) < need:
            raise DataError(
                f"webdataset: {len(used)} non-empty shard(s) cannot feed {world_size} process(es) "
                f"x {self.streams} stream(s) (data.num_workers): write more, smaller shards "
                f"(vitscale data prepare --shard-size) or lower data.num_workers"
            )
        self.used = used

    def __len__(self) -> int:
        return self.num_batches

    def stream_shards(self, epoch: int, v: int) -> list[int]:
        order = torch.randperm(
            len(self.used), generator=generator("shards", self.seed, epoch)
        ).tolist()
        mine = [self.used[i] for i in order][self.rank :: self.world_size]
        return mine[v :: self.streams]

    def batches_of(self, v: int) -> int:
        """How many of the epoch's batches stream v yields."""
        return len(range(v, self.num_batches, self.streams))


def stream_samples(
    plan: StreamPlan, epoch: int, v: int, buffer: int, errors: ShardErrors, bad: list
):
    """Stream v's endless sample sequence (set_samples' tuples). Each pass over its shards goes
    through its own shuffle buffer, so the first pass holds every sample once."""
    from webdataset import shuffle

    shards, set_ = plan.stream_shards(epoch, v), plan.shards

    def one_pass(order):
        for s in order:
            yield from set_samples(set_, s, errors, bad)

    for cycle in range(10**9):
        order = (
            shards
            if cycle == 0
            else [
                shards[i]
                for i in torch.randperm(
                    len(shards), generator=generator("cycle", plan.seed, epoch, plan.rank, v, cycle)
                ).tolist()
            ]
        )
        samples = one_pass(order)
        if buffer > 0:
            rng = random.Random(derive_seed("buffer", plan.seed, epoch, plan.rank, v, cycle))
            samples = shuffle(buffer, buffer, rng=rng)(samples)
        got = 0
        for sample in samples:
            got += 1
            yield sample
        if not got:
            raise DataError(
                f"webdataset: none of the {len(shards)} shard(s) of a stream could be read "
                f"(e.g. {set_.urls[shards[0]]}: {errors.events[-1][2] if errors.events else 'empty'})"
            )
