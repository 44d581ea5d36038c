"""Fine-tuning from vitscale's own weights against training from scratch, for the same time.

    python benchmarks/finetune_experiment.py prepare --out runs/ft/openclipart_folder
    python benchmarks/finetune_experiment.py run --folder runs/ft/openclipart_folder --out runs/ft --epochs 8
    python benchmarks/finetune_experiment.py report runs/ft

1. prepare: an ImageNet-style folder of OpenClipArt's PNGs (Debian's openclipart-png) by top-level
   category (20 classes; "special" and "unsorted" left out), 90/10 train/val by a hash of the
   file name, as symbolic links.
2. run: the default recipe trained on Fashion-MNIST (--pretrain-epochs), exported; then on the
   OpenClipArt folder at 56 px, for --epochs each (the same steps: the same time on a quiet machine;
   --seconds instead stops each at that much training time), (a) starting from those weights
   (`model.init`: the grey conv stem spread over RGB, 4x4 -> 7x7 position embeddings, a new 20-class
   head) and (b) from scratch with the same architecture. Every run evaluates each epoch.
3. report: test accuracy against training time for both, as a table (markdown).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zlib
from pathlib import Path

OPENCLIPART = Path("/usr/share/openclipart/png")
LEFT_OUT = {"special", "unsorted"}
# the default recipe's model (configs/fashion_mnist.toml) on 56 px colour images
FOLDER = [
    "data.name=folder",
    "data.image_size=56",
    "data.num_workers=2",
    "data.hflip=true",
    "run.eval_every=1",
    "run.log_every=20",
    "train.eval_hflip_tta=false",
]


def cmd_prepare(args) -> None:
    out = Path(args.out)
    n = 0
    for cat in sorted(
        p.name for p in OPENCLIPART.iterdir() if p.is_dir() and p.name not in LEFT_OUT
    ):
        for f in sorted((OPENCLIPART / cat).rglob("*.png")):
            rel = f.relative_to(OPENCLIPART / cat)
            split = "val" if zlib.crc32(str(rel).encode()) % 10 == 0 else "train"
            link = out / split / cat / str(rel).replace("/", "__")
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(f)
            n += 1
    print(f"{n} images in {out} (train/ and val/, {len(list((out / 'train').iterdir()))} classes)")


def vitscale(*args: str) -> None:
    cmd = [sys.executable, "-m", "vitscale", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def sets(items):
    return [x for s in items for x in ("--set", s)]


def cmd_run(args) -> None:
    out = Path(args.out)
    pre = out / "pretrain_fmnist"
    if not (pre / "summary.json").exists():
        vitscale(
            "train",
            "--out",
            str(pre),
            *sets([f"train.epochs={args.pretrain_epochs}", "run.threads=2"]),
        )
    weights = out / "fmnist.safetensors"
    vitscale("export", str(pre), "--out", str(weights))
    budget = (
        [f"train.time_limit_s={args.seconds}", "train.epochs=1000"]
        if args.seconds
        else [f"train.epochs={args.epochs}"]
    )
    common = FOLDER + [f"data.root={args.folder}", "run.threads=2"] + budget
    vitscale("train", "--out", str(out / "finetune"), *sets(common + [f"model.init={weights}"]))
    vitscale("train", "--out", str(out / "scratch"), *sets(common))


def curve(run: Path) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["train_time_s"], r["test_accuracy"]) for r in rows if r.get("kind") == "eval"]


def cmd_report(args) -> None:
    root = Path(args.root)
    runs = {name: curve(root / name) for name in ("finetune", "scratch")}
    print("| run | evaluations | test accuracy at each epoch end (training seconds) | final |")
    print("|---|---|---|---|")
    for name, c in runs.items():
        points = ", ".join(f"{100 * a:.2f}% ({t:.0f} s)" for t, a in c)
        print(f"| {name} | {len(c)} | {points} | {100 * c[-1][1]:.2f}% |")
    pre = json.loads((root / "pretrain_fmnist" / "summary.json").read_text())
    print(
        f"\npretraining: Fashion-MNIST {pre['epochs']:.0f} epochs, test accuracy {100 * pre['test_accuracy']:.2f}%, "
        f"{pre['train_time_s']:.0f} s"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--out", required=True)
    b = sub.add_parser("run")
    b.add_argument("--folder", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--epochs", type=float, default=8)
    b.add_argument(
        "--seconds", type=float, default=0, help="a training-time budget instead of --epochs"
    )
    b.add_argument("--pretrain-epochs", type=float, default=3)
    c = sub.add_parser("report")
    c.add_argument("root")
    args = p.parse_args()
    {"prepare": cmd_prepare, "run": cmd_run, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
