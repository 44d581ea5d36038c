"""The CLIP loss experiment of docs/clip.md: the same model, batch and steps with each loss.

    # 1. train one run per loss (sequentially; each is `vitscale train CONFIG --set clip.loss=L`)
    python benchmarks/clip_experiment.py train --out runs/clip_exp [--set key=value ...]
    # 2. tables (Markdown: each run, then mean +- std per loss over the folders given, e.g. one per
    #    seed) + curves (PNG: held-out R@1 per epoch, temperature per step)
    python benchmarks/clip_experiment.py report runs/clip_exp runs/clip_exp_seed1 --png docs/clip_curves.png \
        --tau-png docs/clip_tau.png
    # 3. per-step time of each loss, side by side in one process (interleaved rounds)
    python benchmarks/clip_experiment.py overhead [--steps 10 --rounds 5] [--set key=value ...]

The held-out metrics are those `vitscale train` writes: image->text / text->image recall@k on the
fixed held-out pairs and zero-shot top-1 on the held-out images' categories.

Patch dropout at equal training time (issue 43): the step-time ratio of each rate beside the
unmasked step, measured first with `vitscale bench CONFIG --beside model.patch_dropout=P`, gives
each masked run train.epochs = EPOCHS x ratio (the cosine schedule spans the run); one folder per
(loss, rate), `<loss>_pd<P>`:

    python benchmarks/clip_experiment.py train --out runs/pd/s0 --losses openclip fastclip_v3 \
        --epochs 3 --patch-dropout 0 0.5 0.75 --speedup 0.5=1.6 0.75=2.0 --set run.seed=0
    python benchmarks/clip_experiment.py report runs/pd/s0 runs/pd/s1 --losses openclip fastclip_v3 \
        --patch-dropout 0 0.5 0.75
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tomllib

LOSSES = ["openclip", "sogclr", "fastclip_v0", "fastclip_v1", "fastclip_v2", "fastclip_v3"]
CONFIG = "configs/clip_openclipart.toml"


def variant(loss: str, p: float, rates: list[float]) -> str:
    """The run folder of a loss at patch dropout p: the loss's name alone where the experiment has
    no patch dropout (the earlier experiments' layout), else `<loss>_pd<p>`."""
    return loss if rates == [0.0] else f"{loss}_pd{p:g}"


def speedups(pairs: list[str]) -> dict[float, float]:
    """--speedup P=RATIO ... -> {P: RATIO}."""
    out = {}
    for item in pairs:
        p, r = item.split("=")
        out[float(p)] = float(r)
    return out


def cmd_train(args) -> None:
    ratio = speedups(args.speedup)
    for loss in args.losses:
        for p in args.patch_dropout:
            train_one(args, loss, p, ratio)


def train_one(args, loss: str, p: float, ratio: dict[float, float]) -> None:
    name = variant(loss, p, args.patch_dropout)
    out = Path(args.out) / name
    if (out / "summary.json").exists():
        print(f"{name}: done already ({out})")
        return
    extra = []
    if p:
        extra += ["--set", f"model.patch_dropout={p:g}"]
    if args.epochs:  # equal training time: the masked runs take more steps, by the measured ratio
        if p and p not in ratio:
            sys.exit(f"--speedup has no ratio for patch dropout {p:g}")
        extra += ["--set", f"train.epochs={args.epochs * (ratio[p] if p else 1.0):.4g}"]
    cmd = [
        sys.executable,
        "-m",
        "vitscale",
        "train",
        args.config,
        "--out",
        str(out),
        "--set",
        f"clip.loss={loss}",
        "--set",
        "run.progress=plain",
        *extra,
    ]
    for s in args.set:
        cmd += ["--set", s]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def eval_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "eval"]


def train_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "train"]


def final(run: Path) -> dict | None:
    """The run's final held-out metrics and step count: summary.json, or, where the run trained to
    its last step and evaluated there but did not write its summary (a crash after the final
    evaluation), that final evaluation record of metrics.jsonl, which is what summary.json copies;
    None for an unfinished run."""
    if (run / "summary.json").exists():
        return json.loads((run / "summary.json").read_text())
    if not (run / "metrics.jsonl").exists() or not (run / "config.toml").exists():
        return None
    epochs = tomllib.loads((run / "config.toml").read_text())["train"]["epochs"]
    last = (eval_rows(run) or [None])[-1]
    if last is None or abs(last["epoch"] - epochs) > 1e-9:
        return None
    return {
        **last,
        "steps": last["step"],
        "from": "metrics.jsonl (final evaluation; no summary.json)",
    }


def finished(roots, losses) -> dict:
    """{loss: [run folder per root that has a finished run of it]}."""
    out = {}
    for loss in losses:
        runs = [Path(r) / loss for r in roots if final(Path(r) / loss) is not None]
        if runs:
            out[loss] = runs
    return out


def cmd_report(args) -> None:
    """One row per run, then per loss the mean +- std over the runs (seeds) of the held-out numbers;
    --png: mean R@1 per epoch, --tau-png: the temperature per step (every run)."""
    names = [
        variant(loss, p, args.patch_dropout) for loss in args.losses for p in args.patch_dropout
    ]
    groups = finished(args.roots, names)
    if not groups:
        sys.exit(f"no finished runs under {' '.join(args.roots)}")
    first = final(next(iter(groups.values()))[0])
    zs_key = next((k for k in first if k.startswith("zeroshot_") and k.endswith("_top1")), None)
    cols = [
        ("test_i2t_r1", "i2t R@1"),
        ("test_i2t_r5", "i2t R@5"),
        ("test_t2i_r1", "t2i R@1"),
        ("test_t2i_r5", "t2i R@5"),
        ("retrieval_r1", "mean R@1"),
    ] + ([(zs_key, "zero-shot top-1")] if zs_key else [])
    timed = args.patch_dropout != [0.0]  # equal-time runs: their training time beside the numbers
    head = "| loss | run | steps | train time (s) | " if timed else "| loss | run | steps | "
    lines = [
        head + " | ".join(c[1] for c in cols) + " | final tau |",
        "|---|---|---|" + "---|" * (len(cols) + timed) + "---|",
    ]
    stats = {}
    for loss, runs in groups.items():
        for run in runs:
            s = final(run)
            tau = next((r["tau"] for r in reversed(train_rows(run)) if "tau" in r), None)
            vals = [100 * s[k] if k in s else float("nan") for k, _ in cols]
            stats.setdefault(loss, []).append(vals + [tau if tau is not None else float("nan")])
            t = f" | {s['train_time_s']:.0f}" if timed and "train_time_s" in s else ""
            lines.append(
                f"| {loss} | {run.parent.name}{'*' if 'from' in s else ''} | {s['steps']}{t} | "
                + " | ".join(f"{v:.2f}" for v in vals)
                + f" | {'-' if tau is None else f'{tau:.4f}'} |"
            )
    lines += [
        "",
        "| loss | runs | " + " | ".join(c[1] for c in cols) + " | final tau |",
        "|---|---|" + "---|" * len(cols) + "---|",
    ]
    for loss, rows in stats.items():
        cells = []
        for j in range(len(cols) + 1):
            xs = [r[j] for r in rows]
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            cells.append(
                f"{statistics.mean(xs):.{4 if j == len(cols) else 2}f} ± {sd:.{4 if j == len(cols) else 2}f}"
            )
        lines.append(f"| {loss} | {len(rows)} | " + " | ".join(cells) + " |")
    if any("from" in final(run) for runs in groups.values() for run in runs):
        lines.append(
            "\n* no summary.json: the numbers are the run's final evaluation in metrics.jsonl"
        )
    print("\n".join(lines))
    if args.png:  # held-out mean R@1 per epoch, every run
        plot(
            args.png,
            args.title,
            groups,
            "epoch",
            "held-out mean R@1 (%)",
            lambda run: [
                (r["epoch"], 100 * r["retrieval_r1"]) for r in eval_rows(run) if "retrieval_r1" in r
            ],
            marker="o",
        )
    if args.tau_png:  # the temperature per logged step, every run
        plot(
            args.tau_png,
            args.title,
            groups,
            "step",
            "temperature (log scale)",
            lambda run: [(r["step"], r["tau"]) for r in train_rows(run) if "tau" in r],
            log=True,
        )


def plot(path, title, groups, xlabel, ylabel, points, log=False, marker=None) -> None:
    """One line per run, one colour per loss; points(run) -> [(x, y)]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    for c, (loss, runs) in enumerate(groups.items()):
        for i, run in enumerate(runs):
            xy = points(run)
            ax.plot(
                [p[0] for p in xy],
                [p[1] for p in xy],
                marker=marker,
                color=f"C{c}",
                alpha=0.85,
                label=loss if i == 0 else None,
            )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def cmd_overhead(args) -> None:
    """Build one trainer per loss (and patch dropout rate) on the same data and initial weights;
    time the same batch's training step for each, in interleaved rounds (so machine noise hits all
    alike; every other round in reverse order). With rates, each is also given as the median of its
    per-round ratios to the same loss's unmasked step (paired, as `vitscale bench --beside`)."""
    import tempfile

    import torch

    from vitscale.config import load_config
    from vitscale.loop import Trainer

    trainers, times, of = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for loss in args.losses:
            for p in args.patch_dropout:
                name = variant(loss, p, args.patch_dropout)
                cfg = load_config(
                    args.config,
                    [
                        f"clip.loss={loss}",
                        f"model.patch_dropout={p:g}",
                        "run.progress=off",
                        "run.tensorboard=false",
                        *args.set,
                    ],
                )
                trainers[name] = Trainer(cfg, run_dir=Path(tmp) / name)
                times[name], of[name] = [], (loss, p)
        first = next(iter(trainers.values()))
        batch = next(iter(first.data.train.iterate(1)))  # epoch 1: gamma < 1
        for t in trainers.values():
            t.task.set_epoch(1)
            for _ in range(args.warmup):
                t.train_step(batch)
        for r in range(args.rounds):
            for name, t in list(trainers.items())[:: -1 if r % 2 else 1]:
                start = time.perf_counter()
                for _ in range(args.steps):
                    t.train_step(batch)
                if torch.cuda.is_available():  # the step leaves its work queued on the GPU
                    torch.cuda.synchronize()
                times[name].append((time.perf_counter() - start) / args.steps)
        for t in trainers.values():
            t.data.close()
    names = list(times)
    base = statistics.median(times[names[0]])
    print(
        f"per-step time, median of {args.rounds} interleaved rounds x {args.steps} steps, batch "
        f"{batch[0].shape[0]}, {torch.get_num_threads()} threads:"
    )
    masked = args.patch_dropout != [0.0]
    print(
        "| run | step time (ms) | min-max (ms) | vs "
        + names[0]
        + " |"
        + (" unmasked / this, paired (min-max over rounds) |" if masked else "")
        + "\n|---|---|---|---|"
        + ("---|" if masked else "")
    )
    for name, ts in times.items():
        med = statistics.median(ts)
        cell = ""
        if masked:
            loss, _ = of[name]
            ref = times[variant(loss, 0.0, args.patch_dropout)] if 0.0 in args.patch_dropout else ts
            ratios = [a / b for a, b in zip(ref, ts)]
            cell = f" {statistics.median(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
        print(
            f"| {name} | {1e3 * med:.1f} | {1e3 * min(ts):.1f}-{1e3 * max(ts):.1f} | "
            f"{med / base:.3f}x |{cell}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("train", "overhead"):
        p = sub.add_parser(name)
        p.add_argument("--config", default=CONFIG)
        p.add_argument("--losses", nargs="+", default=LOSSES)
        p.add_argument("--set", action="append", default=[])
    t = sub.choices["train"]
    t.add_argument("--out", required=True)
    t.add_argument(
        "--epochs",
        type=float,
        default=0,
        help="equal training time: train.epochs of the unmasked run; a masked run gets this x its "
        "--speedup ratio (0: train.epochs as the config and --set say, for every run)",
    )
    t.add_argument(
        "--speedup",
        nargs="+",
        default=[],
        metavar="P=RATIO",
        help="the measured step-time ratio (unmasked / masked) of each patch dropout rate",
    )
    o = sub.choices["overhead"]
    o.add_argument("--steps", type=int, default=10)
    o.add_argument("--rounds", type=int, default=5)
    o.add_argument("--warmup", type=int, default=3)
    r = sub.add_parser("report")
    r.add_argument(
        "roots", nargs="+", help="run folders, one per seed (each with a folder per loss)"
    )
    r.add_argument("--losses", nargs="+", default=LOSSES)
    for q in (t, r, o):
        q.add_argument(
            "--patch-dropout",
            nargs="+",
            type=float,
            default=[0.0],
            help="model.patch_dropout rates, a run of each per loss (folders <loss>_pd<P>)",
        )
    r.add_argument("--png")
    r.add_argument("--tau-png")
    r.add_argument(
        "--title", default="CLIP on OpenClipArt, same model, batch and steps (2-core CPU)"
    )
    args = ap.parse_args()
    {"train": cmd_train, "report": cmd_report, "overhead": cmd_overhead}[args.cmd](args)


if __name__ == "__main__":
    main()
