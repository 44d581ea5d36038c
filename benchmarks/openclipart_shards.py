"""Real data through the shard path: OpenClipArt (Debian's openclipart-png/-svg, ~8k PNGs with
their titles and keywords) -> a CSV -> `vitscale data prepare` -> CLIP training from the prepared
shards, read by seeking and streamed, side by side.

  python benchmarks/openclipart_shards.py --out runs/oca_shards --epochs 2

Writes OUT/openclipart.csv (filepath = the PNG, title = the caption vitscale's OpenClipArt loader
gives it), OUT/shards (prepared at --size, 10% held out by crc32 of the path), then trains
configs/clip_openclipart.toml on them with data.reader=seek and =stream and prints each run's
held-out retrieval R@1 and training images/s.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def write_csv(out: Path) -> int:
    from vitscale.data.sources.openclipart import ROOT as OCA
    from vitscale.data.sources.openclipart import caption_for, scan

    rels = scan(OCA)
    with open(out, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["filepath", "title"])
        for rel in rels:
            try:
                svg = (OCA / "svg" / (rel[:-4] + ".svg")).read_text(
                    encoding="utf-8", errors="replace"
                )
            except OSError:
                svg = ""
            w.writerow([str(OCA / "png" / rel), caption_for(svg, Path(rel).stem)[0]])
    return len(rels)


def vitscale(*args: str) -> float:
    cmd = [sys.executable, "-m", "vitscale", *args]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="runs/oca_shards")
    p.add_argument(
        "--size", type=int, default=72, help="data prepare --size (training crops are 64 px)"
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = write_csv(out / "openclipart.csv")
    print(f"{n} OpenClipArt images listed in {out / 'openclipart.csv'}")
    t = vitscale(
        "data",
        "prepare",
        str(out / "openclipart.csv"),
        "--out",
        str(out / "shards"),
        "--size",
        str(args.size),
        "--quality",
        "90",
        "--shard-size",
        "256",
        "--workers",
        str(args.workers),
        "--val-fraction",
        "0.1",
    )
    print(f"prepare: {t:.0f} s (wall, {args.workers} workers)")
    rows = []
    for reader in ("seek", "stream"):
        run = out / f"run_{reader}"
        if not (run / "summary.json").exists():
            vitscale(
                "train",
                "clip_openclipart",
                "--out",
                str(run),
                "--set",
                "data.name=webdataset",
                "--set",
                f"data.root={out / 'shards'}",
                "--set",
                f"data.reader={reader}",
                "--set",
                f"train.epochs={args.epochs}",
                "--set",
                "data.num_workers=1",
                "--set",
                "run.progress=off",
            )
        s = json.loads((run / "summary.json").read_text())
        rows.append((reader, s))
    print(
        "\n| reader | steps | held-out pairs | retrieval R@1 (mean of i2t, t2i) | train img/s |\n|---|---:|---:|---:|---:|"
    )
    for reader, s in rows:
        print(
            f"| {reader} | {s['steps']} | {s['test_pairs']} | {100 * s['retrieval_r1']:.2f}% | "
            f"{s['images_per_s']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
