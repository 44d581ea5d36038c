"""Can the folder-data loader feed the training step? images/s per decoding worker vs images/s consumed.

1. Writes a generated ImageFolder (default 2,000 JPEGs of 256x256, 10 classes; smooth colour
   fields + noise, ~20-30 kB each like photos) into a temp dir.
2. Runs vitscale's folder loader (src/vitscale/data/folder.py: decode, random-resized crop to
   224 px, flip, in DataLoader workers) for one pass with 0, 1, 2 workers: images/s.
3. Benchmarks the training step of a recipe on synthetic 224 px data (vitscale.lab.bench.measure) and,
   for scale, estimates a GPU's consumption (train FLOPs per image / (peak x MFU)).
4. Reports loader/step ratios and the workers needed = ceil(step img/s / (img/s of one worker)).

  python benchmarks/loader_throughput.py --images 2000 --arch vit_tiny_patch16
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
# load_config(None) is the default recipe: reset its model dimensions so that the arch's own apply
PLAIN_VIT = ["model.dim=0", "model.depth=0", "model.heads=0", "model.mlp_ratio=0", "model.patch_size=0",
             "model.stem=patch", "model.head=token", "model.attention=sdpa"]


def write_folder(root: Path, n: int, size: int = 256, classes: int = 10, seed: int = 0) -> None:
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    for split, count in (("train", n), ("val", max(classes, n // 20))):
        for i in range(count):
            c = i % classes
            d = root / split / f"class{c:02d}"
            d.mkdir(parents=True, exist_ok=True)
            a, b, ph = rng.uniform(1, 6, 3)
            img = np.stack([np.sin(a * xx * 6 + ph), np.cos(b * yy * 6 - ph), np.sin((xx + yy) * (a + b))], -1)
            img = (127 + 90 * img + rng.normal(0, 12, img.shape)).clip(0, 255).astype(np.uint8)
            Image.fromarray(img).save(d / f"{i:06d}.jpg", quality=90)


def loader_rate(root: Path, workers: int, batch: int, size: int, max_batches: int) -> float:
    import torch

    from vitscale.config import load_config
    from vitscale.data.folder import build
    cfg = load_config(None, [f"data.root={root}", "data.name=folder", f"data.image_size={size}",
                             f"data.batch_size={batch}", f"data.num_workers={workers}", "data.hflip=true"])
    data = build(cfg.data, device=torch.device("cpu"), seed=0)
    it = data.train.iterate(0)
    next(it)                                   # workers started, first batch done
    t0, n = time.perf_counter(), 0
    for i, (x, y) in enumerate(it):
        n += x.shape[0]
        if i + 1 >= max_batches:
            break
    dt = time.perf_counter() - t0
    data.train.close()
    return n / dt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", default="0,1,2")
    p.add_argument("--arch", default="vit_tiny_patch16", help="model of the training step (224 px)")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--step-batch", type=int, default=32, help="batch of the benchmarked training step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--gpu", default="H100", help="GPU for the consumption estimate")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--gpu-archs", default="vit_tiny_patch16,vit_base_patch16", help="models for the GPU estimate")
    p.add_argument("--dir", help="reuse / keep the generated folder here (default: a temp dir)")
    args = p.parse_args()
    import torch

    from vitscale.lab.bench import measure
    from vitscale.config import load_config
    from vitscale.tasks import model_info
    from vitscale.metrics import gpu_peak
    from vitscale.lab.harness import machine_line
    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="vitscale-loader-")
    root = Path(args.dir or tmp.name)
    t0 = time.perf_counter()
    if not (root / "train").is_dir():
        write_folder(root, args.images)
    kb = sum(f.stat().st_size for f in (root / "train").rglob("*.jpg")) / args.images / 1e3
    print(f"# folder loader vs training step; {machine_line(torch.device('cpu'))}; {os.cpu_count()} CPUs\n\n"
          f"command: python {' '.join(sys.argv)}\n\n{args.images} JPEGs 256x256 (mean {kb:.1f} kB) in "
          f"{time.perf_counter() - t0:.1f}s; loader: decode + random-resized crop to {args.size} px + flip, "
          f"batch {args.batch}, one pass\n")
    batches = args.images // args.batch - 1
    rates = {}
    print("| decoding workers | loader img/s | per worker |\n|---:|---:|---:|")
    for w in (int(x) for x in args.workers.split(",")):
        rates[w] = loader_rate(root, w, args.batch, args.size, batches)
        print(f"| {w} | {rates[w]:.0f} | {rates[w] / max(1, w):.0f} |", flush=True)
    one = rates.get(1) or rates[max(rates)]
    cfg = load_config(None, [*PLAIN_VIT, f"model.arch={args.arch}", "data.name=synthetic", "data.channels=3",
                             f"data.image_size={args.size}", "data.num_classes=1000", f"data.batch_size={args.step_batch}",
                             f"data.train_size={2 * args.step_batch}", f"train.precision={args.precision}",
                             "run.progress=off", "run.tensorboard=false"])
    r = measure(cfg, args.steps, 1, 1, True)
    peak = gpu_peak(args.gpu, "bf16" if "bf16" in args.precision else "fp32")
    print(f"\n| consumer | step img/s | loader(1 worker)/step | workers needed |\n|---|---:|---:|---:|")
    print(f"| {args.arch} {args.precision} train step here (batch {args.step_batch}, measured) | "
          f"{r['images_per_s']:.1f} | {one / r['images_per_s']:.1f} | {math.ceil(r['images_per_s'] / one)} |")
    for arch in args.gpu_archs.split(","):   # a fresh config: the Trainer resolved the benchmarked one
        info = model_info(load_config(None, [*PLAIN_VIT, f"model.arch={arch}", "data.name=synthetic", "data.channels=3",
                                             f"data.image_size={args.size}", "data.num_classes=1000"]))
        gpu_ips = peak * args.mfu / info["train_flops_per_image"]
        print(f"| {arch} on one {args.gpu} (estimated: {info['train_flops_per_image'] / 1e9:.2f} GFLOP/img, "
              f"MFU {args.mfu:g}) | {gpu_ips:.0f} | {one / gpu_ips:.3f} | {math.ceil(gpu_ips / one)} |")
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
