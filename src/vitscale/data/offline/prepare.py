"""`vitscale data prepare`: an image folder or a CSV of (image, caption) -> webdataset shards of
pre-resized JPEGs, so training decodes small images (what FFCV and img2dataset do).

Output (DIR = --out; read by the streaming loader, the format is fixed):

    DIR/manifest.json        written last, atomically, once every shard is complete
    DIR/prepare.json         the arguments, a fingerprint of the source list and the check results
    DIR/{train,val}-NNNNNN.tar
        KEY.jpg   RGB JPEG at `quality`, shorter side resized to `size` (LANCZOS) when larger,
                  never upscaled, aspect kept; transparent images composited over white
        KEY.cls   the label as decimal ASCII (classification) | KEY.txt  the caption, UTF-8 (pairs)
        KEY.json  {"index": i, "source": path as in the folder (relative to SRC) / the CSV,
                   "label": int | "caption": str}

KEY = f"{i:09d}", i = the sample's index within its split. Indices are contiguous 0..N-1: every
sample is in shard i // shard_size, in index order. The train split is shuffled with `seed`
before indices are assigned; val keeps the source order.

Skipped samples: rows with an empty caption are dropped when the source is listed; unreadable
images are found by a first, parallel check pass (each image decoded at reduced scale: JPEGs at
1/8 via PIL's draft mode, so truncated files are caught, which `Image.verify()` misses). Indices
are assigned to the samples that remain, then the shard pass decodes each image once more at full
scale. The check's result is stored in prepare.json, so a resumed run neither repeats it nor
shifts an index. An image that passed the check but fails in the shard pass means the source
changed under us: that is an error (start again into a new DIR), never a silent gap.

Parallel (shard_writer.py): one task per shard (and per chunk of the check pass) in a process
pool; a shard's bytes depend only on its samples (fixed tar metadata), so any number of workers
gives the same files.
Resumable: a shard is written to NAME.tar.tmp and renamed when complete, so a final name always
holds a whole shard; a rerun with the same arguments keeps the finished shards, a rerun with other
arguments (or a changed source list) into the same DIR is refused.

Needs no torch (PIL, numpy, webdataset's TarWriter, rich for the progress bar).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from ...errors import DataError
from .shard_writer import TMP, Runner, ShardTask, check_chunk, ordered, write_shard

log = logging.getLogger("vitscale.data")
FORMAT, VERSION = "vitscale-shards", 1
STATE, MANIFEST = "prepare.json", "manifest.json"
CSV_SUFFIXES = (".csv", ".tsv")
CHECK_CHUNK = 256  # images per task of the check pass


# ---------------------------------------------------------------- listing the source
@dataclasses.dataclass
class Source:
    kind: str
    classes: list | None
    splits: dict  # split -> [(file, source as written, label | caption)] in source order
    no_caption: int
    arguments: dict  # what the output depends on (refusal of a different rerun)


def list_source(
    src: str, *, size, quality, shard_size, seed, image_key, caption_key, val_fraction
) -> Source:
    p = Path(src).expanduser()
    if not p.exists():
        raise DataError(
            f"prepare: {src} not found (expected an image folder ROOT/train/<class>/*.jpg "
            f"or a .csv/.tsv file)"
        )
    args = {
        "source": str(p.resolve()),
        "size": size,
        "quality": quality,
        "shard_size": shard_size,
        "seed": seed,
    }
    if p.is_dir():
        return _list_folder(p, args)
    if p.suffix.lower() not in CSV_SUFFIXES:
        raise DataError(
            f"prepare: {src} is neither a folder (ROOT/train/<class>/...) nor a .csv/.tsv file"
        )
    return _list_csv(p, args, image_key, caption_key, val_fraction)


def _list_folder(p: Path, args: dict) -> Source:
    """An image folder ROOT/{train,val}/<class>/*: labelled rows, sources relative to ROOT."""
    from ..sources.folder import scan

    classes, (tr_p, tr_y), (ev_p, ev_y) = scan(p)
    root = str(p)

    def rows(paths, labels):
        return [
            (f, Path(os.path.relpath(f, root)).as_posix(), int(y))
            for f, y in zip(paths.tolist(), labels.tolist())
        ]

    return Source(
        "classification",
        classes,
        {"train": rows(tr_p, tr_y), "val": rows(ev_p, ev_y)},
        0,
        {"kind": "classification", **args},
    )


def _list_csv(p: Path, args: dict, image_key, caption_key, val_fraction) -> Source:
    """A CSV/TSV of (image, caption): captioned rows split by key into train and val; rows with
    an empty caption dropped (and counted)."""
    from ..sources.csv import read_csv
    from ..sources.held_out import held_out

    rec = read_csv(str(p), image_key, caption_key)
    splits, no_caption = {"train": [], "val": []}, 0
    for path, key, caption in zip(rec.paths.tolist(), rec.keys.tolist(), rec.captions.tolist()):
        if not caption.strip():
            no_caption += 1
            continue
        splits["val" if held_out(key, val_fraction) else "train"].append((path, key, caption))
    if no_caption:
        log.warning("prepare: skipped %d CSV row(s) with an empty caption", no_caption)
    return Source(
        "pairs",
        None,
        splits,
        no_caption,
        {
            "kind": "pairs",
            **args,
            "image_key": image_key,
            "caption_key": caption_key,
            "val_fraction": val_fraction,
        },
    )


def fingerprint(splits: dict) -> str:
    h = hashlib.sha256()
    for split in sorted(splits):
        for _, source, target in splits[split]:
            h.update(json.dumps([split, source, target], ensure_ascii=False).encode("utf-8"))
    return h.hexdigest()


# ---------------------------------------------------------------- the output folder
def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + TMP)
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _remove_temporaries(out: Path) -> None:
    for t in out.glob(f"*{TMP}"):
        try:
            t.unlink()
        except OSError:
            pass


def open_out(out: Path, arguments: dict, sources: str, count: int) -> dict:
    """Create DIR with prepare.json, or check that DIR was started with the same arguments."""
    state_path = out / STATE
    if state_path.is_file():
        try:
            state = json.loads(state_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise DataError(
                f"prepare: {state_path} is unreadable ({e}); use another --out or delete it"
            ) from None
        old = state.get("arguments", {})
        if old != arguments:
            diff = ", ".join(
                f"{k} {old.get(k)!r} then, {arguments.get(k)!r} now"
                for k in sorted(set(old) | set(arguments))
                if old.get(k) != arguments.get(k)
            )
            raise DataError(
                f"prepare: {out} was started with other arguments ({diff}); rerun with the "
                f"same ones to resume, or use another --out"
            )
        if state.get("sources") != sources:
            raise DataError(
                f"prepare: the source changed since {out} was started ({state.get('count')} "
                f"samples listed then, {count} now); use another --out"
            )
        return state
    if out.exists() and not out.is_dir():
        raise DataError(f"prepare: --out {out} exists and is not a folder")
    if out.is_dir() and ((out / MANIFEST).exists() or any(out.glob("*.tar"))):
        raise DataError(f"prepare: {out} already holds shards without {STATE}; use another --out")
    out.mkdir(parents=True, exist_ok=True)
    state = {
        "format": f"{FORMAT}-prepare",
        "version": VERSION,
        "arguments": arguments,
        "sources": sources,
        "count": count,
    }
    _write_json(state_path, state)
    return state


# ---------------------------------------------------------------- the command
@dataclasses.dataclass
class Prepared:
    manifest: dict
    out: Path
    written: list  # shard names written by this run
    reused: int  # shards already complete from an earlier run
    images: int  # images decoded by this run (check pass not counted)
    bytes: int  # all shards
    seconds: float

    def summary(self) -> str:
        splits = self.manifest["splits"]
        n = sum(s["samples"] for s in splits.values())
        shards = sum(len(s["shards"]) for s in splits.values())
        parts = ", ".join(f"{k} {v['samples']}" for k, v in splits.items())
        sk = self.manifest["skipped"]
        rate = self.images / self.seconds if self.seconds > 0 else 0.0
        return (
            f"{n} samples ({parts}) in {shards} shards in {self.out}; skipped {sk['unreadable']} "
            f"unreadable, {sk['no_caption']} without caption; {self.bytes / 1e6:.1f} MB; "
            f"{len(self.written)} shards written, {self.reused} kept; {self.seconds:.1f} s, {rate:.0f} images/s"
        )


def _validate(size, quality, shard_size, workers, val_fraction):
    if not isinstance(size, int) or size < 1:
        raise DataError(f"prepare: --size must be a positive integer, got {size!r}")
    if not isinstance(quality, int) or not 1 <= quality <= 100:
        raise DataError(f"prepare: --quality must be in 1..100, got {quality!r}")
    if not isinstance(shard_size, int) or shard_size < 1:
        raise DataError(f"prepare: --shard-size must be a positive integer, got {shard_size!r}")
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise DataError(f"prepare: --workers must be a positive integer, got {workers!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"prepare: --val-fraction must be in [0, 1), got {val_fraction!r}")


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"vitscale: {msg}", file=sys.stderr)


def _check_pass(
    source: Source,
    state: dict,
    out: Path,
    workers: int,
    count: int,
    shard_size: int,
    progress: bool,
    held: list,
) -> None:
    """The check pass, once per DIR: finds the unreadable images (kept in prepare.json). The pool
    it starts goes into `held` (prepare_shards closes it, also on an error)."""
    if "unreadable" in state:
        return
    flat = [
        (split, j, row[0])
        for split in ("train", "val")
        for j, row in enumerate(source.splits[split])
    ]
    chunks = [flat[k : k + CHECK_CHUNK] for k in range(0, len(flat), CHECK_CHUNK)]
    runner = Runner(min(workers, max(len(chunks), -(-count // shard_size))), progress)
    held.append(runner)
    found = ordered(
        runner,
        check_chunk,
        [[f for _, _, f in c] for c in chunks],
        [len(c) for c in chunks],
        "checking",
    )
    bad = [(chunk[j][0], chunk[j][1], err) for chunk, errs in zip(chunks, found) for j, err in errs]
    state["unreadable"] = [[split, source.splits[split][j][1], err] for split, j, err in bad]
    _write_json(out / STATE, state)
    for _, name, err in state["unreadable"][:10]:
        log.warning("prepare: skipped unreadable image %s (%s)", name, err)
    if len(bad) > 10:
        log.warning("prepare: %d unreadable images in all (listed in %s)", len(bad), out / STATE)


def _shard_tasks(
    src,
    source: Source,
    state: dict,
    out: Path,
    *,
    size: int,
    quality: int,
    shard_size: int,
    seed: int,
):
    """-> (one ShardTask per shard, the manifest's splits, unreadable samples left out)."""
    skip = {(split, name) for split, name, _ in state["unreadable"]}
    tasks, splits, unreadable = [], {}, 0
    for split in ("train", "val"):
        rows = source.splits[split]
        if split == "train":  # shuffle first: a folder is sorted by class
            rows = [rows[j] for j in np.random.default_rng(seed).permutation(len(rows)).tolist()]
        kept = [r for r in rows if (split, r[1]) not in skip]
        unreadable += len(rows) - len(kept)
        if not kept:
            if split == "train":
                raise DataError(f"prepare: no readable training samples in {src}")
            continue  # no val samples: "val" is absent from the manifest
        names, counts = [], []
        for j, start in enumerate(range(0, len(kept), shard_size)):
            names.append(f"{split}-{j:06d}.tar")
            counts.append(len(kept[start : start + shard_size]))
            tasks.append(
                ShardTask(
                    str(out),
                    names[-1],
                    start,
                    kept[start : start + shard_size],
                    source.kind,
                    size,
                    quality,
                )
            )
        splits[split] = {"shards": names, "counts": counts, "samples": len(kept)}
    return tasks, splits, unreadable


def _write_shards(tasks: list, out: Path, workers: int, progress: bool, held: list):
    """Write the shards not yet complete in OUT (with the pool in `held`, else one started and put
    there) -> (names written, images decoded, shards reused)."""
    todo = [t for t in tasks if not (out / t.name).is_file()]
    reused = len(tasks) - len(todo)
    if reused:
        _say(
            progress,
            f"prepare: {reused} of {len(tasks)} shards already done in {out}, "
            f"{f'writing the other {len(todo)}' if todo else 'nothing to write'}",
        )
    written, images = [], 0
    if todo:
        if not held:
            held.append(Runner(min(workers, len(todo)), progress))
        for name, n, _ in held[0].map(
            write_shard, todo, [len(t.samples) for t in todo], "writing shards"
        ):
            written.append(name)
            images += n
    return written, images, reused


def _manifest(
    src,
    source: Source,
    splits: dict,
    unreadable: int,
    *,
    size: int,
    quality: int,
    seed: int,
    shard_size: int,
) -> dict:
    manifest = {"format": FORMAT, "version": VERSION, "kind": source.kind}
    if source.classes is not None:
        manifest["classes"] = list(source.classes)
    manifest.update(
        {
            "image": {"short_side": size, "quality": quality},
            "source": str(src),
            "seed": seed,
            "shard_size": shard_size,
            "skipped": {"unreadable": unreadable, "no_caption": source.no_caption},
            "splits": splits,
        }
    )
    return manifest


def prepare_shards(
    src,
    out,
    *,
    size: int = 256,
    quality: int = 90,
    shard_size: int = 1000,
    workers: int | None = None,
    seed: int = 0,
    image_key: str = "filepath",
    caption_key: str = "title",
    val_fraction: float = 0.1,
    progress: bool = True,
) -> Prepared:
    """`prepare` with the run's statistics (the CLI prints `.summary()`)."""
    t0 = time.perf_counter()
    _validate(size, quality, shard_size, workers, val_fraction)
    source = list_source(
        str(src),
        size=size,
        quality=quality,
        shard_size=shard_size,
        seed=seed,
        image_key=image_key,
        caption_key=caption_key,
        val_fraction=val_fraction,
    )
    count = sum(len(v) for v in source.splits.values())
    out = Path(out).expanduser()
    state = open_out(out, source.arguments, fingerprint(source.splits), count)
    _remove_temporaries(out)
    workers = workers or os.cpu_count() or 1
    held: list = []  # the process pool, once started
    try:
        _check_pass(source, state, out, workers, count, shard_size, progress, held)
        tasks, splits, unreadable = _shard_tasks(
            src, source, state, out, size=size, quality=quality, shard_size=shard_size, seed=seed
        )
        written, images, reused = _write_shards(tasks, out, workers, progress, held)
        if held:
            held[0].close()
    except BaseException:
        if held:
            held[0].close(abort=True)
        _remove_temporaries(out)
        raise
    manifest = _manifest(
        src,
        source,
        splits,
        unreadable,
        size=size,
        quality=quality,
        seed=seed,
        shard_size=shard_size,
    )
    _write_json(out / MANIFEST, manifest)
    total = sum((out / n).stat().st_size for s in splits.values() for n in s["shards"])
    return Prepared(manifest, out, sorted(written), reused, images, total, time.perf_counter() - t0)


def prepare(
    src,
    out,
    *,
    size: int = 256,
    quality: int = 90,
    shard_size: int = 1000,
    workers: int | None = None,
    seed: int = 0,
    image_key: str = "filepath",
    caption_key: str = "title",
    val_fraction: float = 0.1,
    progress: bool = True,
) -> dict:
    """SRC (ImageNet-style folder, or .csv/.tsv of image paths and captions) -> shards in OUT.
    Returns the manifest (also written to OUT/manifest.json). See the module docstring."""
    return prepare_shards(
        src,
        out,
        size=size,
        quality=quality,
        shard_size=shard_size,
        workers=workers,
        seed=seed,
        image_key=image_key,
        caption_key=caption_key,
        val_fraction=val_fraction,
        progress=progress,
    ).manifest
