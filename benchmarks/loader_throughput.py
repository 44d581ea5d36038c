"""Images/s per CPU core: Pillow (as before), the simplejpeg path and pre-resized shards, and the cores
one H100 needs to feed ViT-S/16 and ViT-B/16 (issue 17).

1. Writes an ImageNet-like folder (default 2,000 train + 100 val JPEGs, 10 classes): sizes drawn
   around ImageNet's (45% 500x375, 15% 375x500, 10% 500x333, 10% 500x500, 20% 200-500 x 150-500
   at random), photo-like content (smooth colour fields + gratings + blocky and fine noise),
   quality 90/93/95: ~110 kB per file, like ImageNet's train set.
2. Writes pre-resized shards of it: `vitscale data prepare SRC --out DIR --size 256 --quality 90`.
3. Measures one decoding process ("per core"): data.num_workers=0 (the loader's own process decodes)
   and torch.set_num_threads(1); one pass over the train split through vitscale's loaders
   (decode + random-resized crop to 224 + flip + collate), timing the uint8 -> float normalization
   separately and leaving it out (a GPU run does it on the device). The configurations take turns
   for --rounds rounds; the median is reported (a shared machine's noise hits all of them alike):
     (a) data.name=folder data.decoder=pil          today's path
     (b) data.name=folder data.decoder=simplejpeg   the crop box first, DCT-scaled decode
     (c) data.name=webdataset on the prepared shards, read by seeking (reader=auto for local .tar)
     (d) the same shards streamed through the webdataset library (reader=stream)
4. Cores per H100 = GPU images/s at --mfu of the bf16 peak (train FLOPs per image / (peak x MFU))
   / images/s per core.
5. With --step: the old table too, loader workers 0/1/2 vs a training step measured here.

  python benchmarks/loader_throughput.py --images 2000
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
# load_config(None) is the default recipe: reset its model dimensions so that the arch's own apply
PLAIN_VIT = [
    "model.dim=0",
    "model.depth=0",
    "model.heads=0",
    "model.mlp_ratio=0",
    "model.patch_size=0",
    "model.stem=patch",
    "model.head=token",
    "model.attention=sdpa",
]
DIMS = ((500, 375, 0.45), (375, 500, 0.15), (500, 333, 0.10), (500, 500, 0.10))  # the rest: random


def image_dims(rng) -> tuple[int, int]:
    u = rng.uniform()
    for w, h, p in DIMS:
        if u < p:
            return w, h
        u -= p
    return int(rng.integers(200, 501)), int(rng.integers(150, 501))


def photo(w: int, h: int, rng):
    """Photo-like uint8 [h,w,3]: smooth colour fields + gratings + blocky and fine noise (JPEGs of
    ~110 kB at quality 90-95 for ImageNet's sizes)."""
    import numpy as np

    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) / max(w, h)
    a, b, ph = rng.uniform(1, 6, 3)
    img = 70 * np.stack(
        [np.sin(a * xx * 6 + ph), np.cos(b * yy * 6 - ph), np.sin((xx + yy) * (a + b))], -1
    )
    tex = np.zeros((h, w), np.float32)
    for _ in range(4):
        f, t = rng.uniform(10, 150), rng.uniform(0, np.pi)
        tex += np.sin(f * (xx * np.cos(t) + yy * np.sin(t)) + rng.uniform(0, 6))
    k = int(rng.integers(2, 6))
    blocks = (
        rng.normal(0, 1, (h // k + 1, w // k + 1, 3))
        .astype(np.float32)
        .repeat(k, 0)
        .repeat(k, 1)[:h, :w]
    )
    detail = rng.uniform(1.0, 2.4)
    img += 127 + detail * (
        8 * tex[..., None] + 12 * blocks + rng.normal(0, 5, (h, w, 3)).astype(np.float32)
    )
    return img.clip(0, 255).astype(np.uint8)


def write_folder(root: Path, n: int, classes: int = 10, seed: int = 0) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, count in (("train", n), ("val", max(classes, n // 20))):
        for i in range(count):
            d = root / split / f"class{i % classes:02d}"
            d.mkdir(parents=True, exist_ok=True)
            w, h = image_dims(rng)
            Image.fromarray(photo(w, h, rng)).save(
                d / f"{i:06d}.jpg", quality=int(rng.choice([90, 93, 95]))
            )


def folder_stats(root: Path) -> tuple[int, float, float, float]:
    """-> files, mean kB, mean width, mean height (from the JPEG headers)."""
    import simplejpeg

    files = sorted((root / "train").rglob("*.jpg"))
    kb, ws, hs = 0.0, 0.0, 0.0
    for f in files:
        data = f.read_bytes()
        h, w = simplejpeg.decode_jpeg_header(data)[:2]
        kb, ws, hs = kb + len(data) / 1e3, ws + w, hs + h
    return len(files), kb / len(files), ws / len(files), hs / len(files)


def shard_stats(out: Path) -> tuple[int, float, float, float]:
    """-> train samples, mean kB, mean width, mean height of the JPEGs in the train shards."""
    import tarfile

    import simplejpeg

    n, kb, ws, hs = 0, 0.0, 0.0, 0.0
    for shard in sorted(out.glob("train-*.tar")):
        with tarfile.open(shard) as tf:
            for m in tf:
                if m.name.endswith(".jpg"):
                    data = tf.extractfile(m).read()
                    h, w = simplejpeg.decode_jpeg_header(data)[:2]
                    n, kb, ws, hs = n + 1, kb + len(data) / 1e3, ws + w, hs + h
    return n, kb / max(n, 1), ws / max(n, 1), hs / max(n, 1)


def dct_scales(root: Path, size: int) -> str:
    """How often the simplejpeg path decodes a training crop at each DCT scale (seeds 0..N-1)."""
    import random

    import simplejpeg

    from vitscale.data import jpeg

    count = {}
    files = sorted((root / "train").rglob("*.jpg"))
    for i, f in enumerate(files):
        h, w = simplejpeg.decode_jpeg_header(f.read_bytes())[:2]
        m = jpeg.dct_eighths(jpeg.train_box(w, h, size, random.Random(i)), size)
        count[m] = count.get(m, 0) + 1
    return ", ".join(
        f"{'1' if m == 8 else f'{m}/8'}: {100 * c / len(files):.1f}%"
        for m, c in sorted(count.items())
    )


def prepare(src: Path, out: Path, size: int, quality: int, shard_size: int) -> str:
    """`vitscale data prepare` (one worker: the machine is shared); '' when done, else why not."""
    if (out / "manifest.json").is_file():
        return ""
    cmd = [
        sys.executable,
        "-m",
        "vitscale",
        "data",
        "prepare",
        str(src),
        "--out",
        str(out),
        "--size",
        str(size),
        "--quality",
        str(quality),
        "--shard-size",
        str(shard_size),
        "--workers",
        "1",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not (out / "manifest.json").is_file():
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return f"`{' '.join(cmd[1:])}` failed (exit {r.returncode}): {' | '.join(tail)}"
    return ""


class _Timed:
    """Wraps a loader's BatchAugment: times its calls (the normalization a GPU run does on the device)."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        out = self.inner(*a, **kw)
        self.seconds += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def build(overrides: list[str], size: int, batch: int):
    import torch

    from vitscale.config import load_config
    from vitscale.data import build_data

    cfg = load_config(
        None,
        [
            *overrides,
            f"data.image_size={size}",
            f"data.batch_size={batch}",
            "data.num_workers=0",
            "data.hflip=true",
        ],
    )
    data = build_data(cfg.data, device=torch.device("cpu"), seed=0)
    data.train.augment = _Timed(data.train.augment)
    return data


def one_pass(data, epoch: int) -> tuple[float, float]:
    """-> (images/s of the decoding process, images/s with the CPU normalization) over one pass."""
    aug = data.train.augment
    aug.seconds, n = 0.0, 0
    t0 = time.perf_counter()
    for x, _ in data.train.iterate(epoch):
        n += x.shape[0]
    dt = time.perf_counter() - t0
    return n / (dt - aug.seconds), n / dt


def gpu_rates(archs: list[str], size: int, gpu: str, mfu: float) -> dict:
    from vitscale.config import load_config
    from vitscale.metrics import gpu_peak
    from vitscale.tasks import model_info

    peak = gpu_peak(gpu, "bf16")
    out = {}
    for arch in archs:
        info = model_info(
            load_config(
                None,
                [
                    *PLAIN_VIT,
                    f"model.arch={arch}",
                    "data.name=synthetic",
                    "data.channels=3",
                    f"data.image_size={size}",
                    "data.num_classes=1000",
                ],
            )
        )
        out[arch] = (peak * mfu / info["train_flops_per_image"], info["train_flops_per_image"])
    return out


def others() -> str:
    """Whether PyTurboJPEG / pillow-simd are here to compare."""
    import importlib.util

    import PIL

    notes = []
    if importlib.util.find_spec("turbojpeg") is None:
        notes.append(
            "PyTurboJPEG: not installed (it needs the system library libturbojpeg, which this "
            "machine lacks; no system packages installed for a benchmark)"
        )
    else:
        try:
            from turbojpeg import TurboJPEG

            TurboJPEG()
            notes.append("PyTurboJPEG: importable, not wired into the loader; not compared")
        except Exception as e:  # noqa: BLE001 - no libturbojpeg
            notes.append(f"PyTurboJPEG: installed but unusable ({type(e).__name__}: {e})")
    notes.append(
        "pillow-simd: "
        + (
            "installed"
            if ".post" in PIL.__version__
            else f"not installed (Pillow {PIL.__version__}; pillow-simd replaces Pillow "
            "and builds from source: not compared)"
        )
    )
    return "; ".join(notes)


def step_table(root: Path, args) -> None:
    """The old table: folder-loader workers 0/1/2 vs a training step measured here (and GPU estimates)."""
    import torch

    from vitscale.config import load_config
    from vitscale.data import build_data as build_folder
    from vitscale.lab.bench import measure

    rates = {}
    print(
        "\n## --step: the folder loader (decoder=auto, CPU normalization included) vs a training step here\n"
    )
    print("| decoding workers | loader img/s | per worker |\n|---:|---:|---:|")
    for w in (int(x) for x in args.workers.split(",")):
        cfg = load_config(
            None,
            [
                f"data.root={root}",
                "data.name=folder",
                f"data.image_size={args.size}",
                f"data.batch_size={args.batch}",
                f"data.num_workers={w}",
                "data.hflip=true",
            ],
        )
        data = build_folder(cfg.data, device=torch.device("cpu"), seed=0)
        it = data.train.iterate(0)
        next(it)
        t0, n = time.perf_counter(), 0
        for x, _ in it:
            n += x.shape[0]
        rates[w] = n / (time.perf_counter() - t0)
        data.train.close()
        print(f"| {w} | {rates[w]:.0f} | {rates[w] / max(1, w):.0f} |", flush=True)
    one = rates.get(1) or rates[max(rates)]
    cfg = load_config(
        None,
        [
            *PLAIN_VIT,
            f"model.arch={args.arch}",
            "data.name=synthetic",
            "data.channels=3",
            f"data.image_size={args.size}",
            "data.num_classes=1000",
            f"data.batch_size={args.step_batch}",
            f"data.train_size={2 * args.step_batch}",
            f"train.precision={args.precision}",
            "run.progress=off",
            "run.tensorboard=false",
        ],
    )
    r = measure(cfg, args.steps, 1, 1, True)
    print(
        "\n| consumer | step img/s | loader(1 worker)/step | workers needed |\n|---|---:|---:|---:|"
    )
    print(
        f"| {args.arch} {args.precision} train step here (batch {args.step_batch}, measured) | "
        f"{r['images_per_s']:.1f} | {one / r['images_per_s']:.1f} | {math.ceil(r['images_per_s'] / one)} |"
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--images", type=int, default=2000, help="training JPEGs to write (val: 1/20 of it)"
    )
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument(
        "--rounds", type=int, default=3, help="passes per configuration, taking turns; the median"
    )
    p.add_argument("--shard-size", type=int, default=500)
    p.add_argument("--prepared-size", type=int, default=256, help="vitscale data prepare --size")
    p.add_argument(
        "--prepared-quality", type=int, default=90, help="vitscale data prepare --quality"
    )
    p.add_argument("--gpu", default="H100", help="GPU for the consumption estimate")
    p.add_argument("--mfu", type=float, default=0.5)
    p.add_argument(
        "--gpu-archs",
        default="vit_small_patch16,vit_base_patch16",
        help="models for the GPU estimate",
    )
    p.add_argument(
        "--dir", help="reuse / keep the generated folder and shards here (default: a temp dir)"
    )
    p.add_argument(
        "--step",
        action="store_true",
        help="also the old table: workers 0/1/2 vs a training step here",
    )
    p.add_argument("--workers", default="0,1,2", help="--step: decoding workers to try")
    p.add_argument("--arch", default="vit_tiny_patch16", help="--step: model of the training step")
    p.add_argument("--precision", default="bf16", help="--step")
    p.add_argument(
        "--step-batch", type=int, default=32, help="--step: batch of the benchmarked training step"
    )
    p.add_argument("--steps", type=int, default=3, help="--step")
    args = p.parse_args()
    import torch

    from vitscale.lab.machine import machine_line

    torch.set_num_threads(1)
    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="vitscale-loader-")
    base = Path(args.dir or tmp.name)
    src, shards = base / "folder", base / f"shards-{args.prepared_size}-q{args.prepared_quality}"
    t0, made = time.perf_counter(), not (src / "train").is_dir()
    if made:
        write_folder(src, args.images)
    t_gen = f"written in {time.perf_counter() - t0:.0f}s" if made else f"reused from {src}"
    n, kb, mw, mh = folder_stats(src)
    t0, made = time.perf_counter(), not (shards / "manifest.json").is_file()
    why_not = prepare(src, shards, args.prepared_size, args.prepared_quality, args.shard_size)
    t_prep = f"{time.perf_counter() - t0:.0f}s" if made else f"reused from {shards}"
    load = os.getloadavg()
    print(
        f"# Decoding images/s per core; cores per {args.gpu}\n\n"
        f"command: `python {' '.join(sys.argv)}`  \n"
        f"machine: {machine_line(torch.device('cpu'))}; {os.cpu_count()} CPUs; load average "
        f"{load[0]:.1f} at the start (a shared machine)  \n"
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='minutes')}\n\n"
        f"Files: {n} train JPEGs, mean {mw:.0f}x{mh:.0f} px, mean {kb:.1f} kB ({t_gen}); "
        f"simplejpeg decodes the crops at DCT scale {dct_scales(src, args.size)}."
    )
    if why_not:
        print(f"Pre-resized shards: NOT MEASURED: {why_not}")
    else:
        sn, skb, sw, sh = shard_stats(shards)
        print(
            f"Pre-resized shards: `vitscale data prepare --size {args.prepared_size} --quality "
            f"{args.prepared_quality} --shard-size {args.shard_size} --workers 1` ({t_prep}): {sn} train "
            f"JPEGs, mean {sw:.0f}x{sh:.0f} px, mean {skb:.1f} kB."
        )
    print(
        f"\nPer core: one decoding process (data.num_workers=0, torch.set_num_threads(1)); one pass over the "
        f"train split per round (decode + random-resized crop to {args.size} + flip + collate, batch {args.batch}); "
        f'the CPU uint8->float normalization is timed and left out (on the GPU in a GPU run; "with norm." '
        f"keeps it). After a warm-up of 3 batches each, median of {args.rounds} rounds, configurations taking turns.\n"
    )
    configs = {
        "(a) folder, decoder=pil (today)": [
            "data.name=folder",
            f"data.root={src}",
            "data.decoder=pil",
        ],
        "(b) folder, decoder=simplejpeg": [
            "data.name=folder",
            f"data.root={src}",
            "data.decoder=simplejpeg",
        ],
    }
    if not why_not:
        wds = ["data.name=webdataset", f"data.root={shards}", "data.decoder=simplejpeg"]
        configs[
            f"(c) pre-resized shards ({args.prepared_size} px), read by seeking (reader=auto)"
        ] = [*wds, "data.reader=seek"]
        configs[f"(d) pre-resized shards ({args.prepared_size} px), streamed (reader=stream)"] = [
            *wds,
            "data.reader=stream",
        ]
    bundles, rates = {}, {k: [] for k in configs}
    for name, ov in list(configs.items()):
        try:
            bundles[name] = build(ov, args.size, args.batch)
        except Exception as e:  # noqa: BLE001 - a loader not there yet: say so, measure the rest
            print(
                f"{name}: NOT MEASURED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n"
            )
            rates.pop(name)
    for data in bundles.values():  # warm-up: imports, shard streams, page cache
        for _, _ in zip(range(3), data.train.iterate(args.rounds)):
            pass
    for r in range(args.rounds):
        for name, data in bundles.items():
            rates[name].append(one_pass(data, r))
    gpu = gpu_rates(args.gpu_archs.split(","), args.size, args.gpu, args.mfu)
    base_rate = statistics.median(x for x, _ in rates["(a) folder, decoder=pil (today)"])
    head = " | ".join(f"cores per {args.gpu}: {a}" for a in gpu)
    print(
        f"| path | img/s per core | with norm. | rounds | vs (a) | {head} |\n|---|---:|---:|---|---:|"
        + "---:|" * len(gpu)
    )
    for name, rs in rates.items():
        dec = statistics.median(x for x, _ in rs)
        cores = " | ".join(f"{g / dec:.1f}" for g, _ in gpu.values())
        print(
            f"| {name} | {dec:.0f} | {statistics.median(y for _, y in rs):.0f} | "
            f"{', '.join(f'{x:.0f}' for x, _ in rs)} | {dec / base_rate:.2f}x | {cores} |"
        )
    print(
        "\n| model (224 px) | train GFLOP/img | GPU img/s at MFU "
        + f"{args.mfu:g} |\n|---|---:|---:|"
    )
    for arch, (g, flops) in gpu.items():
        print(f"| {arch} on one {args.gpu} (bf16 dense peak) | {flops / 1e9:.1f} | {g:.0f} |")
    print(f"\nOther decoders: {others()}.  \nLoad average at the end: {os.getloadavg()[0]:.1f}.")
    for data in bundles.values():
        if hasattr(data.train, "close"):
            data.train.close()
    if args.step:
        step_table(src, args)
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
