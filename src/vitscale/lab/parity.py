"""`vitscale parity`: does a candidate setting (a precision mode, an attention kernel, an inductor
knob) train like the recipe? The recipe with seed A, the recipe with seed B and the candidate with
seed A each train N steps on the same data stream (the seed decides the initial weights and the data
order); the losses are averaged over windows of steps, and the candidate passes where its largest
window difference from the recipe (same seed) is no larger than the recipe's own largest window
difference between the two seeds (the spread). What it reads and writes: commands.py."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from ..launch import is_main_process
from .recipes import check_counts, lab_config, log, synthetic_data, with_overrides


def losses(cfg, steps: int) -> list[float]:
    """The loss of each of `steps` training steps of `cfg` (its own trainer, data stream and seed)."""
    from .timing import Bench

    b = Bench(cfg)
    try:
        out = []
        for _ in range(steps):
            loss, _ = b.trainer.run_step(b.fetch())
            out.append(float(loss))
    finally:
        b.close()
    return out


def window_means(xs: list[float], window: int) -> list[float]:
    """Means of consecutive windows of `window` values (a last, shorter one included)."""
    return [sum(xs[i : i + window]) / len(xs[i : i + window]) for i in range(0, len(xs), window)]


def verdict(base: list[float], other_seed: list[float], cand: list[float], window: int) -> dict:
    """The candidate against the recipe (same seed), with the recipe's two-seed spread as the
    tolerance, both over window means; `passed` where the difference is within the spread."""
    b, o, c = (window_means(x, window) for x in (base, other_seed, cand))
    spread = max(abs(x - y) for x, y in zip(b, o))
    diff = max(abs(x - y) for x, y in zip(b, c))
    finite = all(v == v and abs(v) != float("inf") for v in cand)
    return {
        "window": window,
        "spread": spread,
        "difference": diff,
        "passed": bool(finite and diff <= spread),
        "windows": {"recipe": b, "recipe_other_seed": o, "candidate": c},
    }


MAX_BATCHES = 20


def parity_config(cfg, steps: int, synthetic: bool):
    """The recipe as parity trains it: with --synthetic, synthetic images of its shape, as many as
    `steps` global batches up to MAX_BATCHES (a stream of batches, not one reused; later epochs
    reshuffle them: ViT-B/16's 20 x 256 images are 0.8 GB in memory); no evaluation or checkpoint."""
    if synthetic:
        cfg = synthetic_data(cfg)
        n = cfg.data.batch_size * min(steps, MAX_BATCHES)
        cfg = with_overrides(cfg, {"data.train_size": n})
    return cfg


def run(args) -> int:
    check_counts(steps=(args.steps, 2), window=(args.window, 1))
    if not args.candidate:
        raise UserError("parity: name the candidate with --candidate KEY=VALUE (repeatable)")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if len(seeds) != 2 or seeds[0] == seeds[1]:
        raise UserError(f"--seeds: two different seeds, e.g. 0,1 (got {args.seeds!r})")
    cfg = parity_config(lab_config(args.config, args.overrides), args.steps, args.synthetic)
    cand = dict(kv.split("=", 1) for kv in args.candidate if "=" in kv)
    if len(cand) != len(args.candidate):
        raise UserError(f"--candidate takes KEY=VALUE, got {args.candidate}")
    runs = {
        "recipe": with_overrides(cfg, {"run.seed": seeds[0]}),
        "recipe_other_seed": with_overrides(cfg, {"run.seed": seeds[1]}),
        "candidate": with_overrides(cfg, {**cand, "run.seed": seeds[0]}),
    }
    curves = {}
    for name, c in runs.items():
        log(f"parity: {name} ({c.train.precision}, seed {c.run.seed}), {args.steps} steps")
        curves[name] = losses(c, args.steps)
    window = min(args.window, args.steps)
    v = verdict(curves["recipe"], curves["recipe_other_seed"], curves["candidate"], window)
    result = {"candidate": cand, "seeds": seeds, "steps": args.steps, **v, "losses": curves}
    result["config"] = cfg.to_dict()
    line = (
        f"parity: {'PASS' if v['passed'] else 'FAIL'} ({' '.join(args.candidate)}: largest "
        f"{window}-step window loss difference {v['difference']:.4f} from the recipe at seed "
        f"{seeds[0]}, the recipe's spread over seeds {seeds[0]},{seeds[1]} {v['spread']:.4f})"
    )
    if is_main_process():
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(line)
    return 0 if v["passed"] else 1
