"""Does the default recipe travel (issue 59)? It trains the default job's recipe, the recipe as it
was before its data rule (batch 1024 whatever the data, EMA without warm-up) and the AdamW recipe
of 2026-11-26 (docs/search/avx2_200s/recipe.toml) at the default recipe's training time and at its
own length, on small grey class folders nobody tuned on (benchmarks/heldout_sets.py,
benchmarks/openclipart_grey.py), one `vitscale train` process at a time, and prints one table
(markdown) with the test accuracy, training time, steps and batch of each run; --json writes them.

  python benchmarks/recipe_travels.py /work/data/heldout/digits /work/data/heldout/glyphs \\
      /work/data/openclipart_grey10 --seeds 0 1 --out /work/runs/travels --json travels.json
  (ROOT:noflip: every arm without horizontal flips, for digits and letters)

Time the runs on an otherwise idle machine (the AdamW arm's equal time is the recipe's run's own
training time, read from its summary.json)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
ADAMW = HERE / "docs/search/avx2_200s/recipe.toml"
ARMS = {
    "recipe": ("", []),  # the default job's recipe as it stands
    "before": ("", ["data.batch_size=1024", "train.ema_warmup=false"]),  # before the data rule
    "adamw_own": (str(ADAMW), []),  # the AdamW recipe of 2026-11-26 at its own 12 epochs
    "adamw_equal": (str(ADAMW), ["optim.schedule_clock=time", "train.epochs=100000"]),
}


def folder_sets(root: str) -> list[str]:
    """ROOT, or ROOT:noflip for data whose mirror image is another class (digits, letters): every
    arm then trains and evaluates without horizontal flips, as a user would set for such data."""
    root, _, flag = root.partition(":")
    flips = ["data.hflip=false", "train.eval_hflip_tta=false"] if flag == "noflip" else []
    return ["data.name=folder", f"data.root={root}", "data.channels=1", *flips]


def train(config: str, sets: list[str], out: Path) -> dict:
    """One `vitscale train` (its summary.json; a one-line reason where it failed)."""
    summary = out / "summary.json"
    if summary.is_file():  # done in an earlier sitting: resumable
        return json.loads(summary.read_text())
    cmd = [sys.executable, "-m", "vitscale", "train", *([config] if config else [])]
    cmd += ["--out", str(out), "--set", "run.progress=off", "--set", "run.tensorboard=false"]
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {r.returncode}: {last}"}
    return json.loads(summary.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("roots", nargs="+", help="grey class folders (ROOT/train, ROOT/test)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--out", default="runs/travels")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    rows = []
    for root in a.roots:
        name = Path(root.partition(":")[0]).name + ("-noflip" if root.endswith(":noflip") else "")
        for seed in a.seeds:
            recipe_time = None
            for arm in a.arms:
                config, sets = ARMS[arm]
                sets = [*folder_sets(root), f"run.seed={seed}", *sets]
                if arm == "adamw_equal":
                    if recipe_time is None:
                        continue
                    sets.append(f"train.time_limit_s={recipe_time:.1f}")
                s = train(config, sets, Path(a.out) / f"{name}-{arm}-s{seed}")
                if arm == "recipe" and "train_time_s" in s:
                    recipe_time = s["train_time_s"]
                auto = s.get("auto", {})
                row = {
                    "set": name,
                    "arm": arm,
                    "seed": seed,
                    "test_accuracy": s.get("test_accuracy"),
                    "train_time_s": s.get("train_time_s"),
                    "steps": s.get("steps"),
                    "epochs": s.get("epochs"),
                    "batch": auto.get("data.batch_size", {}).get("value"),
                    "error": s.get("error"),
                }
                rows.append(row)
                acc = row["test_accuracy"]
                said = row["error"] or (
                    f"{100 * acc:.2f}% in {row['train_time_s']:.1f}s, {row['steps']} steps"
                    if acc is not None
                    else "no accuracy"
                )
                print(f"{name} {arm} seed {seed}: {said}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    print("\n| set | arm | seed | test accuracy | training s | steps | epochs | batch (rule) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "fail" if r["test_accuracy"] is None else f"{100 * r['test_accuracy']:.2f}%"
        t = "" if r["train_time_s"] is None else f"{r['train_time_s']:.1f}"
        ep = "" if r["epochs"] is None else f"{r['epochs']:.3g}"
        print(
            f"| {r['set']} | {r['arm']} | {r['seed']} | {acc} | {t} | {r['steps']} | {ep} | "
            f"{r['batch'] or ''} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
