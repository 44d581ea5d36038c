"""A labelled dataset as image-text pairs for CLIP (data.captions = true): caption =
data.caption_template.format(class name), tokens = the class's caption tokens.

In-memory sets become memory.py's pair loaders; folder data keeps its decoding workers and is
viewed as pairs through `FolderPairs`. The labelled test split is also the zero-shot set.
"""

from __future__ import annotations

from ...errors import DataError
from ..types import DataBundle, ZeroShotSet
from .memory import TensorEvalLoader, TensorTrainLoader, memory_bundle

DEFAULT_TEMPLATES = ("a photo of a {}.", "a drawing of {}.", "an image of {}.")


class FolderPairs:
    """A worker loader's labelled batches (loaders/workers.py) as pairs: tokens = class_tokens[label]."""

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

    def iterate(self, epoch: int = 0, start_batch: int = 0, ahead: int = 1):
        """`ahead` is for in-memory loaders; these batches come decoded from workers one at a time."""
        inner = self.inner
        if not self.train:
            for x, y, idx in inner.decoded():
                yield inner.norm(x), self.class_tokens[y], idx
            return
        for x, (y, idx), params in inner.decoded(epoch, start_batch):
            # idx: each sample's own index (a substitute's is its own)
            x, _ = inner.augment(x, y, params)
            yield x, self.class_tokens[y], idx


def as_pairs(
    cfg, data: DataBundle, *, device, seed, rank, world_size, context_length
) -> DataBundle:
    """The classification bundle `data` (built from cfg) as pairs (module docstring)."""
    from ..tokenizer import readable, tokenize

    names = [readable(str(c)) for c in data.class_names]
    try:
        captions = [cfg.caption_template.format(n) for n in names]
    except (IndexError, KeyError, ValueError) as e:
        raise DataError(
            f"data.caption_template '{cfg.caption_template}' must hold one '{{}}' "
            f"for the class name ({e})"
        ) from None
    class_tokens = tokenize(captions, context_length)  # [K,L]
    templates = [cfg.caption_template] + [t for t in DEFAULT_TEMPLATES if t != cfg.caption_template]
    if isinstance(data.train, TensorTrainLoader):
        tr, te = data.train, data.test
        assert isinstance(te, TensorEvalLoader)
        train_tokens = class_tokens.to(tr.y.device)[tr.y]
        test_tokens = class_tokens.to(te.y.device)[te.y]
        captions_test = [captions[int(y)] for y in te.y.tolist()]
        data.close()
        zs = {cfg.name: (names, templates, te.x.cpu(), te.y.cpu())}
        return memory_bundle(
            cfg,
            train_x=tr.x,
            train_tokens=train_tokens,
            test_x=te.x,
            test_tokens=test_tokens,
            captions_test=captions_test,
            mean=data.mean,
            std=data.std,
            zeroshot_sets=zs,
            device=device,
            seed=seed,
            rank=rank,
            world_size=world_size,
        )
    train, test = FolderPairs.wrap(data, class_tokens)  # folder data: decoded in workers
    labels = data.test.dataset.labels
    return DataBundle(
        train=train,
        test=test,
        zeroshot={cfg.name: ZeroShotSet(names, templates, data.test)},
        train_size=data.train_size,
        test_size=data.test_size,
        channels=data.channels,
        image_size=data.image_size,
        mean=data.mean,
        std=data.std,
        captions_test=[captions[int(y)] for y in labels],
    )
