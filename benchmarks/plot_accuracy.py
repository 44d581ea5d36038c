"""Plot test accuracy against training time for one or more vitscale runs.

    python benchmarks/plot_accuracy.py RUN [RUN ...] --out docs/fashion_mnist_accuracy.png

Reads each RUN/metrics.jsonl (its `kind = eval` lines) and labels curves with the run folder name.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def eval_points(run: Path) -> tuple[list[float], list[float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind") == "eval" and "train_time_s" in r]
    return [r["train_time_s"] / 60 for r in rows], [100 * r["test_accuracy"] for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="Fashion-MNIST test accuracy vs training time (2-core CPU)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in args.runs:
        t, acc = eval_points(run)
        ax.plot(t, acc, marker="o", label=run.name)
    for y, style in ((91, "--"), (93, ":")):
        ax.axhline(y, color="grey", linestyle=style, linewidth=1)
    for x in (5, 10):
        ax.axvline(x, color="grey", linestyle="-", linewidth=0.5)
    ax.set_xlabel("training time (minutes, evaluation excluded)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
