"""CIFAR-10 / CIFAR-100 from the official python pickles (protocol 2, bytes keys)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from ...errors import DataError
from ..home import default_root
from ..types import TensorSplits

# name -> folder, train files, test files, meta file, label key, label-names key, mean, std
SPECS = {
    "cifar10": (
        "cifar-10-batches-py",
        [f"data_batch_{i}" for i in range(1, 6)],
        ["test_batch"],
        "batches.meta",
        b"labels",
        b"label_names",
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
    ),
    "cifar100": (
        "cifar-100-python",
        ["train"],
        ["test"],
        "meta",
        b"fine_labels",
        b"fine_label_names",
        (0.5071, 0.4865, 0.4409),
        (0.2673, 0.2564, 0.2762),
    ),
}
# what a CIFAR pickle may reference: numpy arrays (numpy 1 and 2 paths) and protocol-2 bytes
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _SafeUnpickler(pickle.Unpickler):
    """Refuses anything but arrays, lists, dicts and strings (a pickle can run code)."""

    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name}")
        return super().find_class(module, name)


def read_pickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            d = _SafeUnpickler(f, encoding="bytes").load()
    except FileNotFoundError:
        raise DataError(f"{path}: missing file (incomplete CIFAR folder?)") from None
    except Exception as e:  # any unpickling failure means a corrupt file
        raise DataError(f"{path}: not a valid CIFAR pickle ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise DataError(f"{path}: not a valid CIFAR pickle (top level is {type(d).__name__})")
    return d


def find_dir(root: Path, folder: str, marker: str) -> Path | None:
    """`root` may be the extracted folder itself or its parent."""
    for cand in (root, root / folder):
        if (cand / marker).is_file():
            return cand
    return None


def _read_batch(path: Path, label_key: bytes, num_classes: int):
    d = read_pickle(path)
    if b"data" not in d or label_key not in d:
        raise DataError(f"{path}: missing key {b'data' if b'data' not in d else label_key!r}")
    data, labels = np.asarray(d[b"data"]), np.asarray(d[label_key])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(f"{path}: data is {data.dtype} {data.shape}, expected uint8 [N, 3072]")
    if labels.shape != (len(data),):
        raise DataError(f"{path}: {labels.size} labels for {len(data)} images")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f"{path}: labels outside 0..{num_classes - 1}")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)  # rows are R, G, B planes


def _read_split(base: Path, files, label_key, num_classes):
    parts = [_read_batch(base / f, label_key, num_classes) for f in files]
    x = torch.from_numpy(np.concatenate([p[0] for p in parts]))  # [N,3,32,32] uint8
    return x, torch.from_numpy(np.concatenate([p[1] for p in parts]))


def load(name: str, root: str | Path = "", test: bool = True) -> TensorSplits:
    """`test` False: the test split is not read (empty tensors in its place)."""
    folder, train_files, test_files, meta, label_key, names_key, mean, std = SPECS[name]
    root = Path(root).expanduser() if root else default_root(name)
    base = find_dir(root, folder, meta)
    if base is None:
        raise DataError(
            f"{name.upper()} not found in {root} (no {folder}/{meta}): run "
            f"`vitscale data download {name}`"
        )
    meta_d = read_pickle(base / meta)
    if names_key not in meta_d:
        raise DataError(f"{base / meta}: missing key {names_key!r}")
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in meta_d[names_key]]
    train_x, train_y = _read_split(base, train_files, label_key, len(names))
    test_x, test_y = (
        _read_split(base, test_files, label_key, len(names)) if test else (train_x[:0], train_y[:0])
    )
    return TensorSplits(train_x, train_y, test_x, test_y, names, mean, std)
