"""ImageNet-style folders: root/train/<class>/*.jpg and root/{val,validation,test}/<class>/...
scan() lists them (paths and labels, sorted); loaders/workers.py decodes them. grey_statistics()
gives a grey (data.channels = 1) folder its own mean and std."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ...errors import DataError

log = logging.getLogger("vitscale.data")
EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
EVAL_SPLITS = ("val", "validation", "test")
STATS_IMAGES = 2048  # a grey folder's mean/std: of at most this many training images


def _images_in(folder: Path) -> list[str]:
    out = []
    for dirpath, dirnames, files in os.walk(folder, followlinks=True):
        dirnames.sort()
        out += [os.path.join(dirpath, f) for f in sorted(files) if f.lower().endswith(EXTENSIONS)]
    return out


def _split_dirs(root: Path) -> tuple[Path, Path]:
    train_dir = root / "train"
    if not train_dir.is_dir():
        raise DataError(
            f"folder dataset: {train_dir} not found (expected {root}/train/<class>/*.jpg "
            f"and {root}/val/<class>/*.jpg)"
        )
    eval_dir = next((root / s for s in EVAL_SPLITS if (root / s).is_dir()), None)
    if eval_dir is None:
        raise DataError(
            f"folder dataset: no evaluation split in {root} (expected one of "
            f"{', '.join(EVAL_SPLITS)})"
        )
    return train_dir, eval_dir


def _classes_in(split_dir: Path) -> dict:
    """class name -> its image paths; empty class folders are skipped with a warning."""
    found, empty = {}, []
    for d in sorted(p for p in split_dir.iterdir() if p.is_dir()):
        files = _images_in(d)
        if files:
            found[d.name] = files
        else:
            empty.append(d.name)
    if empty:
        log.warning(
            "skipped %d empty class folder(s) in %s: %s", len(empty), split_dir, ", ".join(empty)
        )
    if not found:
        raise DataError(
            f"folder dataset: no images ({'/'.join(EXTENSIONS)}) in {split_dir}/<class>/"
        )
    return found


def scan(root: Path):
    """-> classes, (train paths, labels), (eval paths, labels). Empty class folders are skipped."""
    train_dir, eval_dir = _split_dirs(root)
    splits = [_classes_in(train_dir), _classes_in(eval_dir)]
    classes = list(splits[0])
    index = {c: i for i, c in enumerate(classes)}
    for name in splits[1]:
        if name not in index:
            raise DataError(
                f"folder dataset: class '{name}' in {eval_dir} has no training images "
                f"in {train_dir}"
            )
    out = []
    for found in splits:
        paths = [p for c in found for p in found[c]]
        labels = [index[c] for c in found for _ in found[c]]
        out.append((np.array(paths), np.array(labels, dtype=np.int64)))  # numpy: no refcount COW
    return classes, out[0], out[1]


def grey_statistics(paths, size: int) -> tuple[tuple, tuple]:
    """((mean,), (std,)) of the pixels (0-1) of grey training images `paths` as evaluation gives
    them to the model (jpeg.py's eval transform at `size`, jpeg.grey; Pillow's decoder: the same
    numbers where simplejpeg is installed and where not): of every image, or of STATS_IMAGES evenly
    spaced ones (the paths are sorted by class) when there are more. Unreadable images are left
    out. A grey folder has no conventional statistics as RGB folders have ImageNet's, so
    data.normalize = dataset / auto takes these (computed by every process alike: deterministic)."""
    from ..jpeg import decode, grey

    n = len(paths)
    picked = (
        np.linspace(0, n - 1, STATS_IMAGES).round().astype(int) if n > STATS_IMAGES else range(n)
    )
    total = total_sq = count = 0.0
    for i in picked:
        try:
            x = grey(decode(str(paths[i]), size, -1, False, "pil")).double().div_(255.0)
        except Exception:  # noqa: BLE001 - unreadable: the loaders skip and count it
            continue
        total += x.sum().item()
        total_sq += x.square().sum().item()
        count += x.numel()
    if not count:
        raise DataError(f"folder dataset: none of {len(picked)} training images is readable")
    mean = total / count
    std = max(total_sq / count - mean * mean, 0.0) ** 0.5
    if std < 1e-3:
        raise DataError(
            f"folder dataset: the training images are one flat grey ({mean:.3f}): nothing to learn"
        )
    log.info(
        "grey folder: pixel mean %.4f, std %.4f (of %d training images)", mean, std, len(picked)
    )
    return (round(mean, 4),), (round(std, 4),)
