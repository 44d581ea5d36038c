"""webdataset shards: where they are (a folder, brace pattern, pipe: command or URL), a
`vitscale data prepare` folder's manifest, and the seek reader's index of local .tar shards.

Layout (img2dataset / OpenCLIP): KEY.jpg|jpeg|png|webp + KEY.txt (caption) or KEY.cls (label)
[+ KEY.json]. The seek reader (data.reader = seek) scans each uncompressed shard once (member
offsets and captions, cached under data_home()/webdataset-index keyed by path, size and mtime)
and then reads every sample by seeking to its offset; its stable index is the position in the
sorted shard list (shard offset + position in the shard), the index the streaming reader gives
too (sources/shard_sets.py). The seek reader wants shards on a local or network file system.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import tarfile
from pathlib import Path

import numpy as np

from ...errors import DataError
from ..home import cached_json, file_tag
from ..types import Records

log = logging.getLogger("vitscale.data")
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
SHARD_EXTS = (".tar", ".tar.gz", ".tgz")
MANIFEST = "manifest.json"


# ---------------------------------------------------------------- where the shards are
def is_remote(url: str) -> bool:
    """pipe: commands and scheme:// URLs (http, s3, gs, ...), as opposed to local paths."""
    return url.startswith("pipe:") or re.match(r"[a-z][a-z0-9+.-]*://", url) is not None


def open_url(url: str) -> str:
    """What webdataset's gopen opens: s3:// through the AWS CLI, everything else as given."""
    if url.startswith("s3://"):
        return f"pipe:aws s3 cp {url} -"
    return url


def expand(root: str) -> list[str]:
    """A folder, a brace pattern (local ones may also hold * ? [ globs), a pipe: command or URL
    (several with '::') -> the shard URLs, sorted: both readers number samples in this order."""
    import braceexpand

    out, missing = set(), []
    for part in root.split("::"):
        p = Path(part).expanduser()
        if is_remote(part):
            out.update(braceexpand.braceexpand(part))
        elif p.is_dir():
            out.update(str(s) for s in p.iterdir() if s.name.endswith(SHARD_EXTS))
        else:
            for name in braceexpand.braceexpand(str(p)):
                if any(ch in name for ch in "*?["):
                    out.update(glob.glob(name))
                elif os.path.exists(name):
                    out.add(name)
                else:
                    missing.append(name)
    if missing:
        raise DataError(
            f"webdataset: {len(missing)} shard(s) of {root} not found, e.g. {missing[0]}"
        )
    if not out:
        raise DataError(f"webdataset: no shards (.tar, .tar.gz, .tgz) at {root}")
    return sorted(out)


def read_manifest(root: str) -> dict | None:
    """A `vitscale data prepare` folder's manifest (shard names made full paths), else None."""
    p = Path(root).expanduser()
    path = p / MANIFEST if p.is_dir() else p if p.name == MANIFEST else None
    if path is None or not path.is_file():
        return None
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"webdataset: cannot read {path} ({e})") from None
    if m.get("format") != "vitscale-shards":
        raise DataError(f"webdataset: {path} is not a `vitscale data prepare` manifest")
    for split in m["splits"].values():
        split["shards"] = [str(path.parent / s) for s in split["shards"]]
    return m


def label_of(text: str, url: str, key: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataError(
            f"webdataset: {url}: sample {key} has label '{text[:40]}', not an integer"
        ) from None


# ---------------------------------------------------------------- the seek reader's index
def shard_list(root: str, split: str = "train") -> list[str]:
    """The split's shards: a `vitscale data prepare` folder's, else expand(root); the seek
    reader needs them uncompressed."""
    if not root:
        raise DataError(
            "data.root must name the webdataset shards (a folder of .tar files or a "
            "pattern like /data/{00000..00009}.tar)"
        )
    m = read_manifest(root)
    if m is not None:
        if split not in m["splits"]:
            raise DataError(f"webdataset: {root} has no {split} split: set data.test_root")
        return m["splits"][split]["shards"]
    shards = expand(root)
    other = [s for s in shards if is_remote(s) or not s.endswith(".tar")]
    if other:
        raise DataError(
            f"webdataset: data.reader=seek reads local uncompressed .tar shards, not {other[0]}: "
            f"set data.reader=stream (or auto)"
        )
    return shards


def scan_shard(path: str, want: str = "txt") -> dict:
    """{keys, offsets, sizes, captions, incomplete}: one pass over the tar's headers; captions = the
    text of each sample's KEY.<want> member (txt: the caption, cls: the label)."""
    samples: dict = {}
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                d, base = os.path.split(m.name)
                if "." not in base:
                    continue
                stem, ext = base.split(".", 1)
                s = samples.setdefault(os.path.join(d, stem), {})
                ext = ext.lower()
                if ext in IMAGE_EXTS and "img" not in s:
                    s["img"] = (m.offset_data, m.size)
                elif ext == want:
                    s[want] = tf.extractfile(m).read().decode("utf-8", "replace").strip()
    except (tarfile.TarError, OSError) as e:
        raise DataError(
            f"webdataset: cannot read shard {path} ({type(e).__name__}: {e}); shards "
            f"must be uncompressed .tar"
        ) from None
    out = {"keys": [], "offsets": [], "sizes": [], "captions": [], "incomplete": 0}
    for key, s in samples.items():
        if "img" not in s or not s.get(want):
            out["incomplete"] += 1
            continue
        out["keys"].append(key)
        out["offsets"].append(s["img"][0])
        out["sizes"].append(s["img"][1])
        out["captions"].append(s[want])
    return out


def shard_index(path: str, want: str = "txt") -> dict:
    """scan_shard, cached on disk (keyed by absolute path, size, mtime and the member read)."""
    suffix = "" if want == "txt" else f"|{want}"
    return cached_json("webdataset-index", file_tag(path) + suffix, lambda: scan_shard(path, want))


def read_shards(root: str, split: str = "train", want: str = "txt") -> Records:
    caps, keys, paths, offs, sizes, incomplete = [], [], [], [], [], 0
    for shard in shard_list(root, split):
        idx = shard_index(shard, want)
        n = len(idx["keys"])
        caps += idx["captions"]
        keys += idx["keys"]
        paths += [shard] * n
        offs += idx["offsets"]
        sizes += idx["sizes"]
        incomplete += idx["incomplete"]
    if incomplete:
        log.warning(
            "webdataset %s: skipped %d sample(s) without an image or a .%s %s",
            root,
            incomplete,
            want,
            "caption" if want == "txt" else "label",
        )
    if not keys:
        raise DataError(f"webdataset: no samples (KEY.jpg + KEY.{want}) in {root}")
    return Records(
        np.array(caps),
        np.array(keys),
        np.array(paths),
        np.array(offs, dtype=np.int64),
        np.array(sizes, dtype=np.int64),
    )
