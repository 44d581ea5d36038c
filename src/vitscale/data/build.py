"""The one place that dispatches on data.name, data.reader and data.captions: which source reads
the data (sources/), which loader serves it (loaders/), and the geometry a model gets from it.

    build_data(cfg.data, device=..., seed=...)       -> DataBundle of a labelled set
    build_image_text(cfg.data, device=..., seed=...) -> DataBundle of image-text pairs (CLIP)

Labelled sets: fashion_mnist, cifar10, cifar100, synthetic (held in memory: loaders/memory.py),
folder and webdataset (KEY.cls) shards read by seeking (decoded in workers: loaders/workers.py) or
streamed (loaders/stream.py). Pairs: openclipart (in memory), csv and webdataset (KEY.txt) shards,
or any labelled set with data.captions = true (loaders/captions.py).

Held-out pairs of csv / seek-read shards: data.test_root (another CSV / shard set), a prepared
folder's val split, else the samples whose crc32(key) falls below data.test_fraction
(sources/held_out.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ..errors import ConfigError, DataError, UserError
from .loaders.captions import as_pairs
from .loaders.memory import memory_bundle, tensor_bundle
from .loaders.stream import loaders as stream_loaders
from .loaders.worker_datasets import FolderDataset, PairDataset, ShardImages
from .loaders.workers import FolderEvalLoader, FolderTrainLoader, PairFileTrainLoader
from .sampler import EpochPlan
from .sources import held_out, shards
from .transforms import NORMALIZATIONS, BatchAugment, normalization
from .types import DataBundle

# (image size, channels, classes) of the built-in labelled sets
NATIVE_GEOMETRY = {"fashion_mnist": (28, 1, 10), "cifar10": (32, 3, 10), "cifar100": (32, 3, 100)}
IMAGE_TEXT = ("openclipart", "csv", "webdataset")
PAIRS_ONLY = ("openclipart", "csv")  # webdataset shards hold pairs (.txt) or labels (.cls)
MEAN, STD = NORMALIZATIONS["imagenet"]  # folder and shard data ("dataset" normalization)
CLIP_MEAN, CLIP_STD = NORMALIZATIONS["clip"]  # OpenAI CLIP's: image-text files and shards


# ---------------------------------------------------------------- geometry
def geometry(d, model_classes: int = 0) -> tuple[int, int, int]:
    """(image size, channels, classes) of a model for data config `d`; model.num_classes
    (`model_classes`) wins over the data's; folder and webdataset count their classes."""
    if d.name in NATIVE_GEOMETRY:
        size, ch, nc = NATIVE_GEOMETRY[d.name]
    elif d.name in PAIRS_ONLY:
        size, ch, nc = (64 if d.name == "openclipart" else 224), 3, 0
    elif d.name == "synthetic":
        size, ch, nc = 32, d.channels, d.num_classes
    else:  # folder, webdataset: classes come from the folders / labels unless the model fixes them
        size, ch, nc = 224, (d.channels if d.name == "folder" else 3), model_classes
        if not nc:  # count class folders
            nc = build_data(d, device=torch.device("cpu"), seed=0).num_classes
    return d.image_size or size, ch, model_classes or nc


def synthetic_stand_in(d, model_classes: int = 0) -> dict | None:
    """The data overrides of --synthetic: synthetic images of the geometry of `d` (None where
    there is no stand-in)."""
    if d.name not in (*NATIVE_GEOMETRY, "folder"):
        return None
    if d.name == "folder" and not model_classes:
        raise UserError(
            "--synthetic with a folder dataset needs model.num_classes (the folder's class "
            "count), e.g. --set model.num_classes=1000"
        )
    size, channels, classes = geometry(d, model_classes)
    return {
        "data.name": "synthetic",
        "data.root": "",
        "data.test_root": "",
        "data.image_size": size,
        "data.channels": channels,
        "data.num_classes": classes,
        "data.train_size": d.batch_size,
        "data.test_size": min(d.eval_batch_size, 256),
        # one global batch stands in for the data: the recipe's batch is what is timed, never one
        # that data.batch_rule would fit to a set of that size
        "data.batch_rule": "fixed",
    }


def synthetic_pairs_stand_in(d) -> dict | None:
    """The data overrides of --synthetic for image-text training: random images of the geometry of
    `d` captioned from their labels (tokens of the recipe's context length: the towers' work per
    pair is the recipe's), one global batch of them; None where `d` is synthetic already. Image-text
    shards are RGB at data.image_size (no labels to count)."""
    if d.name == "synthetic":
        return None
    size, channels = (d.image_size or 224, 3) if d.name == "webdataset" else geometry(d)[:2]
    return {
        "data.name": "synthetic",
        "data.captions": True,
        "data.root": "",
        "data.test_root": "",
        "data.image_size": size,
        "data.channels": channels,
        "data.num_classes": 10,
        "data.train_size": d.batch_size,
        "data.test_size": min(d.eval_batch_size, 256),
        "data.batch_rule": "fixed",  # as synthetic_stand_in's
    }


# ---------------------------------------------------------------- labelled sets
def check_data(cfg, pairs: bool) -> None:
    """What the data section cannot give the kind of model (`pairs`: image-text pairs for CLIP,
    else labelled images), in one line, before anything is read: every command that checks a
    config asks it (tasks.check_config), and the builders below ask it again."""
    if pairs:
        if cfg.name not in IMAGE_TEXT and not cfg.captions:
            raise DataError(
                f"data.name={cfg.name} holds no image-text pairs, which a CLIP model needs: use "
                f"data.name=openclipart|csv|webdataset, or data.captions=true to caption its labels"
            )
        if cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0:
            raise DataError(
                "data.mixup_alpha / data.cutmix_alpha: mixing images makes no sense for "
                "image-text pairs (CLIP); set them to 0"
            )
        return
    if cfg.name in PAIRS_ONLY:
        raise ConfigError(
            f"config: data.name={cfg.name} holds image-text pairs: train a CLIP model "
            f"(model.arch=clip_mini, clip_vit_b32, ...)"
        )
    if cfg.name == "folder" and cfg.channels not in (1, 3):
        raise DataError(f"data.channels={cfg.channels}: folder data is read as RGB (3) or grey (1)")
    if cfg.val_fraction and cfg.name not in (*NATIVE_GEOMETRY, "synthetic"):
        raise DataError(
            f"data.val_fraction: a validation split is carved from in-memory labelled sets "
            f"({', '.join(NATIVE_GEOMETRY)}, synthetic), not from data.name = '{cfg.name}'"
        )


def build_data(cfg, *, device, seed: int, rank: int = 0, world_size: int = 1) -> DataBundle:
    """Load `cfg.name` and build this rank's train/test loaders (see data/types.py)."""
    device = torch.device(device)
    check_data(cfg, pairs=False)
    kw = dict(device=device, seed=seed, rank=rank, world_size=world_size)
    if cfg.name == "folder":
        return _folder(cfg, **kw)
    if cfg.name == "webdataset":  # labelled shards (KEY.cls)
        return (
            _stream_labelled(cfg, **kw)
            if resolve_reader(cfg) == "stream"
            else _seek_labelled(cfg, **kw)
        )
    splits = _tensor_splits(cfg, seed)
    return tensor_bundle(*splits, resize=cfg.name != "synthetic", **kw)


def _tensor_splits(cfg, seed: int) -> tuple:
    """(splits, cfg) of the data held as tensors (Fashion-MNIST, CIFAR, synthetic), the validation
    split carved where data.val_fraction asks (tensor_bundle's arguments)."""
    if cfg.name == "fashion_mnist":
        from .sources import fashion_mnist

        splits = fashion_mnist.load(cfg.root, test=not cfg.val_fraction)
    elif cfg.name in ("cifar10", "cifar100"):
        from .sources import cifar

        splits = cifar.load(cfg.name, cfg.root, test=not cfg.val_fraction)
    elif cfg.name == "synthetic":
        from .sources import synthetic

        splits = synthetic.make(cfg, seed)
    else:
        raise DataError(f"data.name: unknown dataset '{cfg.name}'")
    return _held_out_validation(splits, cfg)


def reads_class_folder(name: str) -> bool:
    """Whether data.name `name` reads a class folder (ROOT/train/<class>/..., ROOT/val or test/):
    data.val_fraction does not split it (the search carves a view of links instead)."""
    return name == "folder"


def train_count(cfg, seed: int) -> int | None:
    """The training samples `build_data` gives for data config `cfg` (`seed`: run.seed), read
    before any loader is built (datafit: data.batch_rule asks it before the engine starts); None
    where only streaming the data would tell (webdataset with reader=stream, image-text data)."""
    if cfg.name == "folder":
        from .sources.folder import scan

        root = Path(cfg.root).expanduser()
        if not cfg.root or not root.is_dir():
            return None  # build_data refuses it in its own words
        return len(scan(root)[1][0])
    if cfg.name == "webdataset":
        if resolve_reader(cfg) == "stream":
            return None
        train, _ = _record_splits(
            cfg, lambda root, split="train": shards.read_shards(root, split, "cls")
        )
        return len(train)
    if cfg.name in ("fashion_mnist", "cifar10", "cifar100", "synthetic"):
        splits, _ = _tensor_splits(cfg, seed)
        return len(splits.train_y)
    return None


def _held_out_validation(splits, cfg) -> tuple:
    """(splits, cfg) for tensor_bundle: with data.val_fraction, the stratified validation split of
    the training set in the test split's place (data/val_split.py; the test split was not read)."""
    if not cfg.val_fraction:
        return splits, cfg
    from .val_split import carve_validation

    return carve_validation(splits, cfg.val_fraction, cfg.val_seed), cfg


def _folder(cfg, *, device, seed: int, rank: int, world_size: int) -> DataBundle:
    from .sources.folder import scan

    if not cfg.root:
        raise DataError("data.root must be set for data.name = 'folder' (ROOT/train/<class>/...)")
    root = Path(cfg.root).expanduser()
    if not root.is_dir():
        raise DataError(f"folder dataset: {root} is not a directory")
    classes, (train_p, train_y), (eval_p, eval_y) = scan(root)
    size, channels = cfg.image_size or 224, cfg.channels
    plan = EpochPlan(
        len(train_p),
        cfg.batch_size,
        seed=seed,
        drop_last=cfg.drop_last,
        rank=rank,
        world_size=world_size,
    )
    mean, std = _folder_normalization(cfg, size, train_p)
    augment = BatchAugment(cfg, mean=mean, std=std, num_classes=len(classes), crop_flip=False)
    train = FolderTrainLoader(
        FolderDataset(train_p, train_y, size, cfg.hflip, cfg.decoder, channels),
        plan,
        augment,
        cfg,
        seed=seed,
        device=device,
    )
    test = FolderEvalLoader(
        FolderDataset(eval_p, eval_y, size, False, cfg.decoder, channels),
        cfg,
        augment.norm,
        device=device,
        rank=rank,
        world_size=world_size,
    )
    return DataBundle(
        train=train,
        test=test,
        num_classes=len(classes),
        channels=channels,
        image_size=size,
        class_names=classes,
        train_size=len(train_p),
        test_size=len(eval_p),
        mean=mean,
        std=std,
    )


def _folder_normalization(cfg, size: int, train_paths=None) -> tuple:
    """RGB folders: "dataset" is ImageNet's mean/std, as before (the convention of weights made on
    photographs); grey folders (data.channels = 1): the training images' own (sources/folder.py
    grey_statistics; the folder is scanned when `train_paths` is None), unless data.normalize
    names other constants (ImageNet's or CLIP's, averaged over the channels: transforms.py)."""
    if cfg.channels != 1:
        return normalization(cfg.normalize, MEAN, STD)
    if cfg.normalize not in ("auto", "dataset"):
        return normalization(cfg.normalize, MEAN[:1], STD[:1])  # (their length says: grey)
    from .sources.folder import grey_statistics, scan

    if train_paths is None:
        _, (train_paths, _), _ = scan(Path(cfg.root).expanduser())
    return grey_statistics(train_paths, size)


def _seek_labelled(cfg, *, device, seed: int, rank: int, world_size: int) -> DataBundle:
    """Labelled local shards read by seeking (exact epochs): a DataBundle like folder data's."""
    train, test = _record_splits(
        cfg, lambda root, split="train": shards.read_shards(root, split, "cls")
    )
    size = cfg.image_size or 224
    train_ds, test_ds = (
        ShardImages(train, size, cfg.hflip, cfg.decoder),
        ShardImages(test, size, False, cfg.decoder),
    )
    m = shards.read_manifest(cfg.root)
    classes = list(m.get("classes", [])) if m else []
    num_classes = len(classes) or int(max(train_ds.labels.max(), test_ds.labels.max(initial=0))) + 1
    plan = EpochPlan(
        len(train),
        cfg.batch_size,
        seed=seed,
        drop_last=cfg.drop_last,
        rank=rank,
        world_size=world_size,
    )
    mean, std = normalization(cfg.normalize, MEAN, STD)
    augment = BatchAugment(cfg, mean=mean, std=std, num_classes=num_classes, crop_flip=False)
    return DataBundle(
        train=FolderTrainLoader(train_ds, plan, augment, cfg, seed=seed, device=device),
        test=FolderEvalLoader(
            test_ds, cfg, augment.norm, device=device, rank=rank, world_size=world_size
        ),
        num_classes=num_classes,
        channels=3,
        image_size=size,
        class_names=classes or [str(i) for i in range(num_classes)],
        train_size=len(train),
        test_size=len(test),
        mean=mean,
        std=std,
    )


def _stream_labelled(cfg, *, device, seed: int, rank: int = 0, world_size: int = 1) -> DataBundle:
    """Streamed labelled shards (KEY.jpg + KEY.cls): a DataBundle like folder data's."""
    from .sources.shard_sets import shard_sets

    train, test = shard_sets(cfg, "cls")
    num_classes = max(train.num_classes, test.num_classes)
    if num_classes < 2:
        raise DataError(
            f"webdataset {cfg.root}: labels (.cls) span {num_classes} class(es); need at least 2"
        )
    names = train.classes or [str(i) for i in range(num_classes)]
    mean, std = normalization(cfg.normalize, MEAN, STD)
    augment = BatchAugment(cfg, mean=mean, std=std, num_classes=num_classes, crop_flip=False)
    tr, te = stream_loaders(
        cfg, train, test, augment, device=device, seed=seed, rank=rank, world_size=world_size
    )
    return DataBundle(
        train=tr,
        test=te,
        num_classes=num_classes,
        channels=3,
        image_size=cfg.image_size or 224,
        class_names=names,
        train_size=len(train),
        test_size=len(test),
        mean=mean,
        std=std,
    )


# ---------------------------------------------------------------- image-text pairs
def build_image_text(
    cfg, *, device, seed: int, rank: int = 0, world_size: int = 1, context_length: int = 77
) -> DataBundle:
    """Load `cfg.name` as image-text pairs and build this rank's loaders (see data/types.py)."""
    check_data(cfg, pairs=True)
    kw = dict(
        device=torch.device(device),
        seed=seed,
        rank=rank,
        world_size=world_size,
        context_length=context_length,
    )
    if cfg.name == "openclipart":
        return openclipart_bundle(cfg, **kw)
    if cfg.name == "webdataset" and resolve_reader(cfg) == "stream":
        return _stream_pairs(cfg, **kw)
    if cfg.name in ("csv", "webdataset"):
        return _file_pairs(cfg, **kw)
    if cfg.captions:
        cfg = copy.copy(cfg)  # a copy: drop_last for lockstep steps (mixing is refused above)
        cfg.drop_last = True
        data = build_data(cfg, device=kw["device"], seed=seed, rank=rank, world_size=world_size)
        return as_pairs(cfg, data, **kw)
    raise DataError(
        f"data.name = '{cfg.name}' is a classification dataset: set data.captions = "
        f"true to train CLIP on it (captions from data.caption_template)"
    )


def openclipart_bundle(
    cfg, *, device, seed: int, rank: int, world_size: int, context_length: int, limit=None
) -> DataBundle:
    """OpenClipArt decoded once, held in memory (`limit`: an uncached subset, for tests)."""
    from .sources import openclipart

    return memory_bundle(
        cfg,
        **openclipart.pairs(cfg, context_length, limit=limit),
        device=device,
        seed=seed,
        rank=rank,
        world_size=world_size,
    )


def _file_pairs(
    cfg, *, device, seed: int, rank: int, world_size: int, context_length: int
) -> DataBundle:
    """A CSV's pairs or local shards read by seeking, decoded in workers."""
    if cfg.name == "csv":
        if not cfg.root:
            raise DataError("data.root must name the csv/tsv file for data.name = 'csv'")
        from .sources.csv import read_csv

        read = lambda p: read_csv(p, cfg.csv_image_key, cfg.csv_caption_key)  # noqa: E731
    else:
        read = shards.read_shards
    train, test = _record_splits(cfg, read)
    if not len(train):
        raise DataError(f"{cfg.name} dataset {cfg.root}: every sample fell in the held-out split")
    size = cfg.image_size or 224
    plan = EpochPlan(
        len(train), cfg.batch_size, seed=seed, drop_last=True, rank=rank, world_size=world_size
    )
    augment = BatchAugment(cfg, mean=CLIP_MEAN, std=CLIP_STD, num_classes=1, crop_flip=False)
    train_loader = PairFileTrainLoader(
        PairDataset(train, size, cfg.hflip, context_length, cfg.decoder),
        plan,
        augment,
        cfg,
        seed=seed,
        device=device,
    )
    test_loader = FolderEvalLoader(
        PairDataset(test, size, False, context_length, cfg.decoder),
        cfg,
        augment.norm,
        device=device,
        rank=rank,
        world_size=world_size,
    )
    return DataBundle(
        train=train_loader,
        test=test_loader,
        train_size=len(train),
        test_size=len(test),
        channels=3,
        image_size=size,
        mean=CLIP_MEAN,
        std=CLIP_STD,
        captions_test=test.captions.tolist(),
    )


def _stream_pairs(
    cfg, *, device, seed: int, rank: int, world_size: int, context_length: int
) -> DataBundle:
    """Streamed image-text shards (KEY.jpg + KEY.txt), no zero-shot sets."""
    from .sources.shard_sets import shard_sets

    train, test = shard_sets(cfg, "txt")
    augment = BatchAugment(cfg, mean=CLIP_MEAN, std=CLIP_STD, num_classes=1, crop_flip=False)
    tr, te = stream_loaders(
        cfg,
        train,
        test,
        augment,
        device=device,
        seed=seed,
        rank=rank,
        world_size=world_size,
        context_length=context_length,
    )
    return DataBundle(
        train=tr,
        test=te,
        train_size=len(train),
        test_size=len(test),
        channels=3,
        image_size=cfg.image_size or 224,
        mean=CLIP_MEAN,
        std=CLIP_STD,
        captions_test=[],
    )


# ---------------------------------------------------------------- which reader, which split
def resolve_reader(cfg) -> str:
    """data.reader: auto = seek for local uncompressed .tar files, else stream."""
    if cfg.reader != "auto":
        return cfg.reader
    urls = []
    for root in filter(None, (cfg.root, cfg.test_root)):
        if shards.is_remote(root):
            return "stream"
        m = shards.read_manifest(root)
        urls += [u for s in m["splits"].values() for u in s["shards"]] if m else shards.expand(root)
    return "seek" if all(u.endswith(".tar") for u in urls) else "stream"


def _record_splits(cfg, read):
    """(train, held-out) records: data.test_root, a prepared folder's val split, or by key."""
    rec = read(cfg.root)
    if cfg.test_root:
        return rec, read(cfg.test_root)
    if cfg.name == "webdataset" and shards.read_manifest(cfg.root):
        return rec, read(cfg.root, "val")
    return held_out.split(rec, cfg.test_fraction)


# ---------------------------------------------------------------- what evaluation fed a model
def eval_preprocess(cfg, mean, std, image_size: int) -> dict:
    """How the test images reached a model of data config `cfg` (normalized with `mean`, `std`, at
    `image_size`): OpenCLIP's preprocess_cfg keys, then timm's crop_pct. Checkpoints record it
    (tasks/base.py); exports write it (timm's pretrained cfg, OpenCLIP's preprocess_cfg).
    openclipart: the longer side fitted, white padding, bicubic (sources/openclipart.py); files,
    folders and shards: the shorter side, the central 87.5% (jpeg.py; OpenCLIP's "shortest" crops
    the central 100%), bilinear; tensor datasets: bilinear to the size."""
    mode, interp = ("longest", "bicubic") if cfg.name == "openclipart" else ("shortest", "bilinear")
    out = {
        "size": image_size,
        "mode": "RGB",
        "mean": list(mean),
        "std": list(std),
        "interpolation": interp,
        "resize_mode": mode,
    }
    if cfg.name == "openclipart":
        out["fill_color"] = 255
    out["crop_pct"] = 0.875 if cfg.name in ("folder", "webdataset", "csv") else 1.0
    return out


def dataset_normalization(cfg, seed: int, pairs: bool) -> tuple:
    """The (mean, std) build_data (`pairs` False) or build_image_text (True) normalize `cfg`'s images
    with, from the config alone (of synthetic data, its training split is made): for checkpoints
    that did not record them."""
    if pairs and cfg.name in IMAGE_TEXT:
        return CLIP_MEAN, CLIP_STD  # the image-text loaders'
    if cfg.name == "synthetic":
        from dataclasses import replace

        from .sources import synthetic

        s = synthetic.make(replace(cfg, test_size=1), seed)  # (the training split's statistics)
        return normalization(cfg.normalize, s.mean, s.std)
    if cfg.name == "fashion_mnist":
        from .sources import fashion_mnist

        return normalization(cfg.normalize, fashion_mnist.MEAN, fashion_mnist.STD)
    if cfg.name in ("cifar10", "cifar100"):
        from .sources.cifar import SPECS

        return normalization(cfg.normalize, *SPECS[cfg.name][-2:])
    if cfg.name == "folder":  # RGB: ImageNet's; grey: the training images' own
        return _folder_normalization(cfg, cfg.image_size or 224)
    return normalization(cfg.normalize, MEAN, STD)  # labelled shards: ImageNet's
