"""Fetching the official archives of the built-in sets (md5-checked, atomic, safe extract) into
the folders home.py names."""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from ...errors import DataError
from ..home import FOLDERS, canonical, data_home

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/"
FMNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"

# name -> (dataset folder, [(url, md5)], extract?). The Fashion-MNIST md5s are the official ones
# (as in torchvision); Debian's copies hold the same deflate streams with the gzip header's file
# name and mtime stripped (checked byte for byte), so their md5s are accepted as present too.
SOURCES = {
    "cifar10": (
        FOLDERS["cifar10"],
        [(CIFAR_URL + "cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a")],
        True,
    ),
    "cifar100": (
        FOLDERS["cifar100"],
        [(CIFAR_URL + "cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85")],
        True,
    ),
    "fashion_mnist": (
        FOLDERS["fashion_mnist"],
        [
            (FMNIST_URL + "train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
            (FMNIST_URL + "train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe"),
            (FMNIST_URL + "t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79"),
            (FMNIST_URL + "t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310"),
        ],
        False,
    ),
}
DEBIAN_MD5 = {
    "train-images-idx3-ubyte.gz": "cf8536b0aa1a6ac5fa3f23001093305c",
    "train-labels-idx1-ubyte.gz": "10bea18fdb374794d4bb42e356e600c9",
    "t10k-images-idx3-ubyte.gz": "f78720b4224f21cce2f2ccf2d7a94c9a",
    "t10k-labels-idx1-ubyte.gz": "0d30e22e447f3c33dab9ed536400ac01",
}
# the file whose presence marks an extracted archive as complete
MARKER = {"cifar10": "batches.meta", "cifar100": "meta"}


def md5sum(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def _progress(label: str, total: int, enabled: bool):
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    ) as bar:
        task = bar.add_task(label, total=total or None)
        yield lambda n: bar.advance(task, n)


def fetch_url(
    url: str, dest: Path, md5: str, *, progress: bool = True, timeout: float = 60
) -> Path:
    """Download `url` to `dest` via a temp file; check md5; rename into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    h = hashlib.md5()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r, open(tmp, "wb") as f:
            with _progress(
                dest.name, int(r.headers.get("Content-Length") or 0), progress
            ) as advance:
                while chunk := r.read(1 << 20):
                    f.write(chunk)
                    h.update(chunk)
                    advance(len(chunk))
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        tmp.unlink(missing_ok=True)
        reason = getattr(e, "reason", None) or e
        raise DataError(f"download of {url} failed: {reason}") from None
    except BaseException:  # Ctrl-C: leave no partial file behind
        tmp.unlink(missing_ok=True)
        raise
    if h.hexdigest() != md5:
        tmp.unlink(missing_ok=True)
        raise DataError(
            f"download of {url}: md5 {h.hexdigest()} != expected {md5} "
            "(the file was removed; try again)"
        )
    os.replace(tmp, dest)
    return dest


def extract(archive: Path, parent: Path, folder: str) -> Path:
    """Extract `archive` (tar.gz) and move its top-level `folder` to parent/folder."""
    tmpdir = Path(tempfile.mkdtemp(prefix=".extract-", dir=parent))
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()
            for m in members:
                parts = PurePosixPath(m.name).parts
                if m.name.startswith(("/", "\\")) or ".." in parts or not (m.isfile() or m.isdir()):
                    raise DataError(f"{archive}: refusing unsafe archive member {m.name!r}")
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmpdir, members=members, **kw)
        if not (tmpdir / folder).is_dir():
            raise DataError(f"{archive}: the archive has no {folder}/ folder")
        dest = parent / folder
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmpdir / folder, dest)
        return dest
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"{archive}: corrupt archive ({e})") from None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def download(name: str, root: str | Path | None = None, *, progress: bool = True) -> Path:
    """Fetch a dataset; returns the folder the loader reads (for CIFAR: root/<extracted folder>).

    `root`: for CIFAR the folder to extract into (default `data_home()`); for Fashion-MNIST the
    folder that receives the four .gz files (default `data_home()/fashion-mnist`).
    """
    key = canonical(name)
    folder, files, is_archive = SOURCES[key]
    if is_archive:
        parent = Path(root).expanduser() if root else data_home()
        dest = parent / folder
        if (dest / MARKER[key]).exists():
            return dest
        url, md5 = files[0]
        archive = parent / url.rsplit("/", 1)[1]
        if not (archive.exists() and md5sum(archive) == md5):
            fetch_url(url, archive, md5, progress=progress)
        dest = extract(archive, parent, folder)
        archive.unlink()
        return dest
    dest = Path(root).expanduser() if root else data_home() / folder
    for url, md5 in files:
        path = dest / url.rsplit("/", 1)[1]
        if path.exists() and md5sum(path) in (md5, DEBIAN_MD5.get(path.name)):
            continue
        fetch_url(url, path, md5, progress=progress)
    return dest
