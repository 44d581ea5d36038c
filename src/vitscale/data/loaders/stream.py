"""Loaders over streamed webdataset shards (stream_plan.py says which samples make which batch).

    StreamTrainLoader.iterate(epoch, start_batch) -> (x float32 [B,3,S,S], labels [B])      classification
                                                  -> (x, tokens [B,L], index [B])           pairs (CLIP)
    StreamEvalLoader.iterate()                    -> the same over this rank's held-out shards

Decoding runs in DataLoader worker processes (one per stream); each worker yields whole
collated batches with what went wrong on the way, logged and counted here. A training batch is
always full: an undecodable image is replaced before collation by a sample of the stream's
previous batch (`StreamTrainDataset`), so every rank gives the CLIP losses' gathers equal sizes.
"""

from __future__ import annotations

import logging

import torch

from ...errors import DataError
from ..jpeg import decode, resolve_decoder
from ..sampler import derive_seed, generator
from ..sources.shard_sets import ShardErrors, ShardSet, set_samples
from ..sources.shards import label_of
from ..tokenizer import get_tokenizer
from .device import pin_batches
from .stream_plan import StreamPlan, stream_samples
from .worker_datasets import Batch, collate
from .workers import leave_stop_signals_to_the_trainer

log = logging.getLogger("vitscale.data")


class _Decode:
    """(url, key, index, image bytes, text) -> (image uint8 [3,S,S] or None, tokens [L] or label, index,
    name, error)."""

    def __init__(self, size: int, hflip: bool, decoder: str, context_length: int, pairs: bool):
        self.size, self.hflip, self.decoder = size, hflip, resolve_decoder(decoder)
        self.context_length, self.pairs = context_length, pairs

    def __call__(self, sample, sample_seed: int):
        url, key, index, img, text = sample
        second = (
            get_tokenizer()(text, self.context_length)[0]
            if self.pairs
            else label_of(text, url, key)
        )
        try:
            return (
                decode(img, self.size, sample_seed, self.hflip, decoder=self.decoder),
                second,
                index,
                key,
                "",
            )
        except Exception as e:  # noqa: BLE001 - corrupt, truncated, not an image ...
            return None, second, index, f"{url}:{key}", f"{type(e).__name__}: {e}"


class StreamTrainDataset(torch.utils.data.IterableDataset):
    """This rank's training batches; DataLoader worker w serves stream (start + w) % V, so the
    round-robin order of the workers is the batch order b = start, start + 1, ...

    Every batch takes exactly its `bl` samples from the stream, and an undecodable one is replaced
    in its slot (the slot's crop seed; the substitute's own caption/label and index) by the first
    decodable sample of: the stream's previous batch from the same slot on, then the other good
    samples of this batch (only a stream's first batch of an epoch has no previous batch). Refilling
    from the next samples instead would make the samples consumed before batch b depend on which
    images decode, so a resume could not skip them without decoding; the previous batch's samples
    are read by the replay anyway."""

    def __init__(self, plan: StreamPlan, decode: _Decode, buffer: int):
        self.plan, self.decode, self.buffer = plan, decode, buffer
        self.epoch, self.start = 0, 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()  # the loader starts one worker per stream
        V = self.plan.streams
        yield from self._stream(
            (self.start + (info.id if info else 0)) % V, self.plan.hi - self.plan.lo, V
        )

    def _stream(self, v: int, bl: int, V: int):
        plan, epoch = self.plan, self.epoch
        k0 = max(0, -(-(self.start - v) // V))  # first batch of stream v at or after start
        errors, bad = ShardErrors(), []
        samples = stream_samples(plan, epoch, v, self.buffer, errors, bad)
        prev: list = []  # the previous batch's raw samples
        try:
            for _ in range(k0):  # replay without decoding (exact resume)
                prev = [next(samples) for _ in range(bl)]
            for k in range(k0, plan.batches_of(v)):
                b = k * V + v
                first = b * plan.batch_size + plan.lo  # position in the epoch
                raw = [next(samples) for _ in range(bl)]
                seeds = [derive_seed("img", plan.seed, epoch, first + j) for j in range(bl)]
                items = Batch(self.decode(s, seed) for s, seed in zip(raw, seeds))
                ok = [it[0] is not None for it in items]
                for j in [j for j in range(bl) if not ok[j]]:
                    items.failures.append((items[j][3], items[j][4]))
                    items[j] = self._substitute(j, seeds[j], prev, raw, ok)
                prev = raw
                events = errors.events + bad
                errors.events, bad[:] = [], []
                yield (*collate(items, self.decode.size, self.decode.pairs), events)
        except DataError as e:
            yield ("error", str(e))

    def _substitute(self, j: int, seed: int, prev: list, raw: list, ok: list):
        """Slot j's replacement (class docstring), decoded with the slot's seed."""
        n = len(raw)
        candidates = [prev[(j + a) % len(prev)] for a in range(len(prev))] + [
            raw[(j + a) % n] for a in range(1, n) if ok[(j + a) % n]
        ]
        for sample in candidates:
            item = self.decode(sample, seed)
            if item[0] is not None:
                return item
            log.debug("substitute candidate %s is unreadable too (%s)", item[3], item[4])
        raise DataError(
            f"webdataset: no readable image in a batch of {n} sample(s) or the one before it to "
            f"replace an undecodable one: is most of the data unreadable?"
        )


class StreamEvalDataset(torch.utils.data.IterableDataset):
    """This rank's held-out shards in order (worker w reads every V-th), eval transform."""

    def __init__(
        self,
        shards: ShardSet,
        rank: int,
        world_size: int,
        workers: int,
        batch_size: int,
        decode: _Decode,
    ):
        self.shards, self.workers, self.batch_size, self.decode = (
            shards,
            max(1, workers),
            batch_size,
            decode,
        )
        self.mine = list(range(len(shards.urls)))[rank::world_size]

    def worker_shards(self, w: int) -> list[int]:
        return self.mine[w :: self.workers]

    def __len__(self) -> int:
        return sum(
            -(-sum(self.shards.counts[s] for s in self.worker_shards(w)) // self.batch_size)
            for w in range(self.workers)
        )

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        ws = [info.id] if info else range(self.workers)
        for w in ws:
            errors, bad, items = ShardErrors(), [], []
            for s in self.worker_shards(w):
                for sample in set_samples(self.shards, s, errors, bad):
                    items.append(self.decode(sample, -1))
                    if len(items) == self.batch_size:
                        yield (
                            *collate(items, self.decode.size, self.decode.pairs),
                            errors.events + bad,
                        )
                        items, errors.events = [], []
                        bad.clear()  # in place: set_samples appends to this list
            if items or errors.events or bad:
                yield (*collate(items, self.decode.size, self.decode.pairs), errors.events + bad)


class _StreamLoader:
    """DataLoader over a stream dataset (workers started per pass: each pass carries its epoch)."""

    def _start(self, dataset, cfg, device, workers: int):
        self.dataset, self.device, self.workers = dataset, torch.device(device), workers
        self.pin = pin_batches(self.device.type, cfg.pin_memory, on_device=False)
        self.skipped, self.shard_errors, self._it = 0, 0, None

    def _batches(self, start: int = 0):
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_size=None,
            num_workers=self.workers,
            pin_memory=self.pin,
            worker_init_fn=leave_stop_signals_to_the_trainer if self.workers else None,
        )
        self._it = iter(loader)
        for b, item in enumerate(self._it, start):
            if isinstance(item[0], str):  # ("error", message) from a worker
                raise DataError(item[1])
            *tensors, keep, failures, events = item
            for what, name, err in [("sample", *f) for f in failures] + events:
                if what == "shard":
                    self.shard_errors += 1
                    log.warning(
                        "webdataset: shard %s stopped (%s): its other samples are skipped in this "
                        "pass; %d shard error(s) so far",
                        name,
                        err,
                        self.shard_errors,
                    )
                else:
                    self.skipped += 1
                    log.warning(
                        "skipped sample %s (%s); %d skipped so far", name, err, self.skipped
                    )
            yield (b, *(t.to(self.device, non_blocking=True) for t in tensors), keep)
        self._it = None

    def close(self):
        it, self._it = self._it, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


class StreamTrainLoader(_StreamLoader):
    def __init__(self, dataset: StreamTrainDataset, augment, cfg, *, device):
        self.plan, self.augment = dataset.plan, augment
        self.batch_size = self.plan.hi - self.plan.lo
        self.seed, self.pairs = self.plan.seed, dataset.decode.pairs
        self._start(dataset, cfg, device, dataset.plan.streams if cfg.num_workers else 0)

    def __len__(self) -> int:
        return len(self.plan)

    def iterate(self, epoch: int, start_batch: int = 0, ahead: int = 1):
        """`ahead` is for in-memory loaders; these batches come decoded from workers one at a time."""
        if start_batch < 0:
            raise DataError(f"data: start_batch must be >= 0, got {start_batch}")
        self.close()
        self.dataset.epoch, self.dataset.start = epoch, start_batch
        plan = self.plan
        for b, x, second, index, keep in self._batches(start_batch):
            params = self.augment.draw(generator("aug", self.seed, epoch, b), plan.batch_size)
            params = params.take(slice(plan.lo, plan.hi)).take(keep)
            if self.pairs:
                x, index = self.augment(x, index, params)  # num_classes=1: index passes through
                yield x, second, index
            else:
                yield self.augment(x, second, params)


class StreamEvalLoader(_StreamLoader):
    def __init__(self, dataset: StreamEvalDataset, cfg, norm, *, device):
        self.norm, self.batch_size, self.pairs = norm, dataset.batch_size, dataset.decode.pairs
        self.num_samples = sum(dataset.shards.counts[s] for s in dataset.mine)
        self._start(dataset, cfg, device, dataset.workers if cfg.num_workers else 0)

    def __len__(self) -> int:
        return len(self.dataset)

    def iterate(self):
        self.close()
        for _, x, second, index, _ in self._batches():
            yield (self.norm(x), second, index) if self.pairs else (self.norm(x), second)


def loaders(
    cfg,
    train: ShardSet,
    test: ShardSet,
    augment,
    *,
    device,
    seed: int,
    rank: int,
    world_size: int,
    context_length: int = 77,
):
    """-> (train loader, test loader) over the streamed shard sets."""
    size, pairs, decoder = cfg.image_size or 224, train.want == "txt", cfg.decoder
    plan = StreamPlan(
        train, cfg.batch_size, seed=seed, rank=rank, world_size=world_size, streams=cfg.num_workers
    )
    train_ds = StreamTrainDataset(
        plan, _Decode(size, cfg.hflip, decoder, context_length, pairs), cfg.shuffle_buffer
    )
    test_ds = StreamEvalDataset(
        test,
        rank,
        world_size,
        cfg.num_workers,
        cfg.eval_batch_size,
        _Decode(size, False, decoder, context_length, pairs),
    )
    return (
        StreamTrainLoader(train_ds, augment, cfg, device=device),
        StreamEvalLoader(test_ds, cfg, augment.norm, device=device),
    )
