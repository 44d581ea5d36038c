"""The CLIP loss experiment of docs/clip.md: the same model, batch and steps with each loss.

    # 1. train one run per loss (sequentially; each is `vitscale train CONFIG --set clip.loss=L`)
    python benchmarks/clip_experiment.py train --out runs/clip_exp [--set key=value ...]
    # 2. table (Markdown) + curves (PNG) from those runs
    python benchmarks/clip_experiment.py report runs/clip_exp --png docs/clip_curves.png
    # 3. per-step time of each loss, side by side in one process (interleaved rounds)
    python benchmarks/clip_experiment.py overhead [--steps 10 --rounds 5] [--set key=value ...]

The held-out metrics are those `vitscale train` writes: image->text / text->image recall@k on the
fixed held-out pairs and zero-shot top-1 on the held-out images' categories.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

LOSSES = ["openclip", "sogclr", "fastclip_v1", "fastclip_v2", "fastclip_v3"]
CONFIG = "configs/clip_openclipart.toml"


def cmd_train(args) -> None:
    for loss in args.losses:
        out = Path(args.out) / loss
        if (out / "summary.json").exists():
            print(f"{loss}: done already ({out})")
            continue
        cmd = [sys.executable, "-m", "vitscale", "train", args.config, "--out", str(out),
               "--set", f"clip.loss={loss}", "--set", "run.progress=plain"]
        for s in args.set:
            cmd += ["--set", s]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)


def eval_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "eval"]


def cmd_report(args) -> None:
    runs = [Path(args.root) / loss for loss in args.losses if (Path(args.root) / loss / "summary.json").exists()]
    if not runs:
        sys.exit(f"no finished runs under {args.root}")
    zs_key = None
    lines = ["| loss | steps | i2t R@1 | i2t R@5 | t2i R@1 | t2i R@5 | zero-shot top-1 | final tau |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s = json.loads((run / "summary.json").read_text())
        zs_key = zs_key or next((k for k in s if k.startswith("zeroshot_") and k.endswith("_top1")), None)
        train = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        tau = next((r.get("tau") for r in reversed(train) if r.get("kind") == "train" and "tau" in r), None)
        pct = lambda k: f"{100 * s[k]:.2f}" if k in s else "-"  # noqa: E731
        lines.append(f"| {run.name} | {s['steps']} | {pct('test_i2t_r1')} | {pct('test_i2t_r5')} | "
                     f"{pct('test_t2i_r1')} | {pct('test_t2i_r5')} | {pct(zs_key) if zs_key else '-'} | "
                     f"{'-' if tau is None else f'{tau:.4f}'} |")
    print("\n".join(lines))
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        keys = [("retrieval_r1", "held-out retrieval R@1 (mean of both directions, %)")]
        if zs_key:
            keys.append((zs_key, "zero-shot top-1 on held-out categories (%)"))
        fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.2))
        axes = axes if len(keys) > 1 else [axes]
        for ax, (key, label) in zip(axes, keys):
            for run in runs:
                rows = [r for r in eval_rows(run) if key in r]
                ax.plot([r["epoch"] for r in rows], [100 * r[key] for r in rows], marker="o", label=run.name)
            ax.set_xlabel("epoch")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(args.title)
        fig.tight_layout()
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")


def cmd_overhead(args) -> None:
    """Build one trainer per loss on the same data and initial weights; time the same batch's
    training step for each, in interleaved rounds (so machine noise hits all alike)."""
    import tempfile

    import torch

    from vitscale.config import load_config
    from vitscale.loop import Trainer
    trainers, times = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for loss in args.losses:
            cfg = load_config(args.config, [f"clip.loss={loss}", "run.progress=off", "run.tensorboard=false",
                                            *args.set])
            trainers[loss] = Trainer(cfg, run_dir=Path(tmp) / loss)
            times[loss] = []
        batch = next(iter(trainers[args.losses[0]].data.train.iterate(1)))  # epoch 1: gamma < 1
        for t in trainers.values():
            t.task.set_epoch(1)
            for _ in range(args.warmup):
                t.train_step(batch)
        for _ in range(args.rounds):
            for loss, t in trainers.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    t.train_step(batch)
                times[loss].append((time.perf_counter() - start) / args.steps)
        for t in trainers.values():
            t.data.close()
    base = statistics.median(times[args.losses[0]])
    print(f"per-step time, median of {args.rounds} interleaved rounds x {args.steps} steps, batch "
          f"{batch[0].shape[0]}, {torch.get_num_threads()} threads:")
    print("| loss | step time (ms) | min-max (ms) | vs " + args.losses[0] + " |\n|---|---|---|---|")
    for loss, ts in times.items():
        med = statistics.median(ts)
        print(f"| {loss} | {1e3 * med:.1f} | {1e3 * min(ts):.1f}-{1e3 * max(ts):.1f} | {med / base:.3f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("train", "overhead"):
        p = sub.add_parser(name)
        p.add_argument("--config", default=CONFIG)
        p.add_argument("--losses", nargs="+", default=LOSSES)
        p.add_argument("--set", action="append", default=[])
    sub.choices["train"].add_argument("--out", required=True)
    o = sub.choices["overhead"]
    o.add_argument("--steps", type=int, default=10)
    o.add_argument("--rounds", type=int, default=5)
    o.add_argument("--warmup", type=int, default=3)
    r = sub.add_parser("report")
    r.add_argument("root")
    r.add_argument("--losses", nargs="+", default=LOSSES)
    r.add_argument("--png")
    r.add_argument("--title", default="CLIP on OpenClipArt, same model, batch and steps (2-core CPU)")
    args = ap.parse_args()
    {"train": cmd_train, "report": cmd_report, "overhead": cmd_overhead}[args.cmd](args)


if __name__ == "__main__":
    main()
