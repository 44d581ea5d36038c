"""Where datasets and data caches live at run time: data_home(), each built-in set's default
folder, and cached_json (the shard indexes and counts of sources/shards.py and
sources/shard_sets.py). Downloading them is offline/fetch.py's job."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from ..errors import DataError

SYSTEM_FMNIST = Path("/usr/share/datasets/fashion-mnist")  # Debian's dataset-fashion-mnist
FMNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
# the folder each built-in set is kept in under data_home()
FOLDERS = {
    "cifar10": "cifar-10-batches-py",
    "cifar100": "cifar-100-python",
    "fashion_mnist": "fashion-mnist",
}


def canonical(name: str) -> str:
    key = name.lower().replace("-", "_")
    key = {"cifar_10": "cifar10", "cifar_100": "cifar100", "fmnist": "fashion_mnist"}.get(key, key)
    if key not in FOLDERS:
        raise DataError(f"unknown dataset '{name}': choose one of cifar10, cifar100, fashion-mnist")
    return key


def data_home() -> Path:
    """$VITSCALE_DATA, else ~/.cache/vitscale/data."""
    return Path(os.environ.get("VITSCALE_DATA") or "~/.cache/vitscale/data").expanduser()


def default_root(name: str) -> Path:
    """Where a dataset is looked for when `data.root` is empty."""
    key = canonical(name)
    home = data_home() / FOLDERS[key]
    if key == "fashion_mnist" and not (home / FMNIST_FILES[0]).exists() and SYSTEM_FMNIST.is_dir():
        return SYSTEM_FMNIST
    return home


def file_tag(path: str) -> str:
    """What identifies a local file's content for a cache: absolute path, size, modification time."""
    st = os.stat(path)
    return f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"


def cached_json(kind: str, tag: str, compute):
    """compute(), kept as JSON under data_home()/kind/, keyed by a hash of `tag` (written atomically;
    a cache that cannot be written costs a warning, not the run)."""
    cache = data_home() / kind / f"{hashlib.blake2b(tag.encode(), digest_size=12).hexdigest()}.json"
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    value = compute()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, cache)
    except OSError as e:
        logging.getLogger("vitscale.data").warning("could not cache %s in %s (%s)", kind, cache, e)
    return value
