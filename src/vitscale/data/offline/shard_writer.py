"""The worker side of `vitscale data prepare`: image work (check, resize, encode) and shard writing
in a process pool, with a progress bar of images. prepare.py decides what goes where.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import warnings

from PIL import Image

from ...errors import DataError

TMP = ".tmp"  # a shard is written under NAME.tar.tmp and renamed when complete
TAR_MTIME = 0  # fixed tar metadata: shard bytes do not depend on when they were written


# ---------------------------------------------------------------- image work (in the workers)
def _open(path: str):
    """Image.open without PIL's multi-line DecompressionBombWarning: images between its limit and
    twice it (real ones: OpenClipArt has 13000 x 13000 drawings) are decoded; larger ones raise
    DecompressionBombError and are skipped and counted like any unreadable image."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(path)


def flatten(img: Image.Image) -> Image.Image:
    """-> RGB; transparent images (RGBA, LA, PA, P or L with a transparent colour) over white, as
    img2dataset does: a JPEG has no alpha, and dropping it leaves whatever colour the transparent
    pixels hold (black, for most of OpenClipArt's drawings)."""
    from ..jpeg import to_rgb

    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(
            Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba
        ).convert("RGB")
    return to_rgb(img)


def encode(path: str, size: int, quality: int) -> bytes:
    """An image file -> JPEG bytes: RGB (transparency over white), shorter side `size` when larger
    (never upscaled)."""
    with _open(path) as img:
        if img.format == "JPEG":  # decode at the smallest DCT scale still >= size
            img.draft("RGB", (size, size))
        img = flatten(img)
        img.load()
    w, h = img.size
    if min(w, h) > size:
        new = (size, max(1, round(h * size / w))) if w <= h else (max(1, round(w * size / h)), size)
        img = img.resize(new, Image.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def readable(path: str) -> str:
    """'' when the image decodes (JPEG at 1/8 scale, enough to read every coefficient), else why not."""
    from ..jpeg import to_rgb

    try:
        with _open(path) as img:
            if img.format == "JPEG":
                img.draft("RGB", (1, 1))
            to_rgb(img).load()
        return ""
    except Exception as e:  # noqa: BLE001 - unreadable, truncated, not an image, decompression bomb ...
        return f"{type(e).__name__}: {e}"


_report = None  # in a pool worker: the progress queue's put


def _tick(n: int = 1) -> None:
    if _report is not None:
        _report(n)


def _worker_init(queue) -> None:
    global _report
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent terminates the pool
    _report = queue.put


def check_chunk(paths: list[str]) -> list[tuple[int, str]]:
    """-> [(position in `paths`, error)] for the images that do not decode."""
    bad = []
    for j, p in enumerate(paths):
        err = readable(p)
        if err:
            bad.append((j, err))
        _tick()
    return bad


@dataclasses.dataclass
class ShardTask:
    out: str  # DIR
    name: str  # e.g. train-000003.tar
    start: int  # index of the first sample
    samples: list  # [(file, source as written, label int | caption str)]
    kind: str  # classification | pairs
    size: int
    quality: int


def write_shard(task: ShardTask) -> tuple[str, int, int]:
    """Write one shard via NAME.tmp + rename -> (name, samples, bytes)."""
    from webdataset import TarWriter

    final = os.path.join(task.out, task.name)
    tmp = final + TMP
    try:
        with open(tmp, "wb") as f:
            with TarWriter(f, encoder=False, mtime=TAR_MTIME) as sink:
                for k, (path, source, target) in enumerate(task.samples):
                    i = task.start + k
                    try:
                        jpg = encode(path, task.size, task.quality)
                    except Exception as e:  # noqa: BLE001
                        raise DataError(
                            f"prepare: {source} passed the check pass but cannot be read now "
                            f"({type(e).__name__}: {e}): the source changed while preparing; "
                            f"start again into a new --out"
                        ) from None
                    field, ext, payload = (
                        ("label", "cls", str(target).encode("ascii"))
                        if task.kind == "classification"
                        else ("caption", "txt", target.encode("utf-8"))
                    )
                    meta = {"index": i, "source": source, field: target}
                    sink.write(
                        {
                            "__key__": f"{i:09d}",
                            "jpg": jpg,
                            ext: payload,
                            "json": json.dumps(meta, ensure_ascii=False).encode("utf-8"),
                        }
                    )
                    _tick()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return task.name, len(task.samples), os.path.getsize(final)


# ---------------------------------------------------------------- running tasks
class Runner:
    """Tasks in a process pool (or in this process for workers=1) with a progress bar of images."""

    def __init__(self, workers: int, progress: bool):
        self.workers, self.progress, self.pool, self.queue = workers, progress, None, None
        if workers > 1:
            import multiprocessing as mp

            ctx = mp.get_context()
            self.queue = ctx.Queue()
            self.pool = ctx.Pool(workers, initializer=_worker_init, initargs=(self.queue,))

    def map(self, fn, tasks: list, sizes: list[int], label: str):
        """Yields fn(task) for each task, in completion order."""
        with _Bar(label, sum(sizes), self.progress) as advance:
            if self.pool is None:
                global _report
                _report = advance
                try:
                    for t in tasks:
                        yield fn(t)
                finally:
                    _report = None
                return
            import queue as queue_mod

            pending, seen = [self.pool.apply_async(fn, (t,)) for t in tasks], 0
            while pending:
                try:
                    n = self.queue.get(timeout=0.1)
                    while True:
                        advance(n)
                        seen += n
                        n = self.queue.get_nowait()
                except queue_mod.Empty:
                    pass
                still = []
                for r in pending:
                    if r.ready():
                        yield r.get()  # re-raises a worker's exception here
                    else:
                        still.append(r)
                pending = still
            try:  # ticks still in flight when the last task returned
                while seen < sum(sizes):  # (so that none is counted in the next pass)
                    n = self.queue.get(timeout=5)
                    advance(n)
                    seen += n
            except queue_mod.Empty:
                advance(sum(sizes) - seen)

    def close(self, abort: bool = False):
        if self.pool is not None:
            if abort:
                self.pool.terminate()
            else:
                self.pool.close()
            self.pool.join()
            self.pool = None


class _Bar:
    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled, self.bar = label, total, enabled, None

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("images"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self.bar.start()
        task = self.bar.add_task(self.label, total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def ordered(runner: Runner, fn, tasks, sizes, label):
    """runner.map's results in task order."""
    indexed = list(enumerate(tasks))
    results = {}
    for i, r in runner.map(_Indexed(fn), indexed, sizes, label):
        results[i] = r
    return [results[i] for i in range(len(tasks))]


class _Indexed:
    """(i, task) -> (i, fn(task)); a class so it pickles into the pool."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, item):
        i, task = item
        return i, self.fn(task)
