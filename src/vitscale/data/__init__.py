"""Datasets and loaders: `build_data(cfg.data, device=..., seed=...)` -> DataBundle.

    bundle.train.iterate(epoch, start_batch) -> (x float32 [B,C,H,W] on device, y)
    bundle.test.iterate()                    -> (x, y int64 [B]) over this rank's test shard

y is int64 [B], or float32 [B, num_classes] soft targets when mixup/cutmix is on.
"""
from __future__ import annotations

import torch

from ..config import micro_batch
from ..errors import DataError
from .fetch import data_home, default_root, download
from .image_text import ImageTextBundle, build_image_text
from .loaders import DataBundle, TensorEvalLoader, TensorTrainLoader

# (image size, channels, classes) of the built-in labelled sets; the image-text sets (CLIP)
NATIVE_GEOMETRY = {"fashion_mnist": (28, 1, 10), "cifar10": (32, 3, 10), "cifar100": (32, 3, 100)}
IMAGE_TEXT = ("openclipart", "csv", "webdataset")
PAIRS_ONLY = ("openclipart", "csv")   # webdataset shards hold pairs (.txt) or labels (.cls)

__all__ = ["NATIVE_GEOMETRY", "IMAGE_TEXT", "PAIRS_ONLY", "DataBundle", "build_data", "download", "default_root", "data_home",
           "TensorTrainLoader", "TensorEvalLoader", "ImageTextBundle", "build_image_text"]


def build_data(cfg, *, device, seed: int, rank: int = 0, world_size: int = 1) -> DataBundle:
    """Load `cfg.name` and build this rank's train/test loaders (see the module docstring)."""
    device = torch.device(device)
    micro_batch(cfg.batch_size, world_size, error=DataError)
    if cfg.name == "folder":
        from . import folder
        return folder.build(cfg, device=device, seed=seed, rank=rank, world_size=world_size)
    if cfg.name == "webdataset":                  # labelled shards (KEY.cls)
        from .stream import resolve_reader
        if resolve_reader(cfg) == "stream":
            from .stream_loader import classification_bundle
            return classification_bundle(cfg, device=device, seed=seed, rank=rank, world_size=world_size)
        from .pair_files import labelled_bundle
        return labelled_bundle(cfg, device=device, seed=seed, rank=rank, world_size=world_size)
    from .loaders import tensor_bundle
    if cfg.name == "fashion_mnist":
        from . import fashion_mnist
        splits = fashion_mnist.load(cfg.root)
    elif cfg.name in ("cifar10", "cifar100"):
        from . import cifar
        splits = cifar.load(cfg.name, cfg.root)
    elif cfg.name == "synthetic":
        from . import synthetic
        splits = synthetic.make(cfg, seed)
        return tensor_bundle(splits, cfg, device=device, seed=seed, rank=rank,
                             world_size=world_size, resize=False)
    else:
        raise DataError(f"data.name: unknown dataset '{cfg.name}'")
    return tensor_bundle(splits, cfg, device=device, seed=seed, rank=rank, world_size=world_size)
