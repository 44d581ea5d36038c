"""Fashion-MNIST from the standard idx files (gzip or raw), parsed with numpy."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np
import torch

from ...errors import DataError
from ..home import default_root
from ..types import TensorSplits

CLASS_NAMES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
MEAN, STD = (0.2860,), (0.3530,)
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """An idx file (magic 0x0800|ndim, big-endian uint32 dims, uint8 data) -> uint8 array."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: truncated or corrupt file ({e})") from None
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: too short for an idx header ({len(raw)} bytes)")
    magic = int.from_bytes(raw[:4], "big")
    if magic != 0x0800 | ndim:
        raise DataError(
            f"{path}: bad magic number 0x{magic:08x} (expected 0x{0x800 | ndim:08x}: "
            f"uint8 data with {ndim} dimension(s))"
        )
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if len(raw) != header + int(np.prod(dims)):
        raise DataError(
            f"{path}: {len(raw) - header} data bytes, expected {int(np.prod(dims))} "
            f"for dims {dims} (truncated or corrupt)"
        )
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def _find(root: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    return None


def load_split(root: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """-> images [N,1,28,28] uint8, labels [N] int64."""
    paths = [_find(root, stem) for stem in FILES[split]]
    if None in paths:
        missing = FILES[split][paths.index(None)] + ".gz"
        raise DataError(
            f"Fashion-MNIST not found in {root} (no {missing}): run `vitscale data "
            "download fashion-mnist` (or `apt-get install dataset-fashion-mnist`)"
        )
    images, labels = read_idx(paths[0], 3), read_idx(paths[1], 1)
    if images.shape[1:] != (28, 28):
        raise DataError(f"{paths[0]}: images are {images.shape[1:]}, expected 28x28")
    if len(images) != len(labels):
        raise DataError(
            f"{paths[1]}: {len(labels)} labels for {len(images)} images in {paths[0].name}"
        )
    if len(labels) and labels.max() >= len(CLASS_NAMES):
        raise DataError(f"{paths[1]}: label {labels.max()} out of range 0..9")
    x = torch.from_numpy(images.copy()).unsqueeze(1)
    return x, torch.from_numpy(labels.astype(np.int64))


def load(root: str | Path = "", test: bool = True) -> TensorSplits:
    """`test` False: the test split is not read (empty tensors in its place)."""
    root = Path(root).expanduser() if root else default_root("fashion_mnist")
    train_x, train_y = load_split(root, "train")
    test_x, test_y = load_split(root, "test") if test else (train_x[:0], train_y[:0])
    return TensorSplits(train_x, train_y, test_x, test_y, list(CLASS_NAMES), MEAN, STD)
