"""What the two-arm benchmark scripts share (token_layout.py, stem_memory_format.py): their
command-line arguments, and two arms of the whole training step timed side by side (paired
rounds, lab/rounds.py) with their img/s and ratio printed."""

from __future__ import annotations

import argparse
import statistics

from vitscale.lab.rounds import paired_rounds, rate, rounds_won, side_by_side


def arguments(doc: str | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    return p.parse_args()


def time_and_report(benches: list, names: list[str], args: argparse.Namespace) -> None:
    """Time the two Benches side by side, print each one's img/s and arm 0's speed-up over arm 1
    (the ratio of the median rounds, and round by round), then close them."""
    times = side_by_side(benches, args.steps, args.rounds, args.warmup, label=lambda i: names[i])
    ips = [rate(t, args.steps, b.global_batch)["images_per_s"] for t, b in zip(times, benches)]
    print(
        f"overrides: {' '.join(args.overrides) or '(the default recipe)'}; synthetic batch "
        f"{benches[0].global_batch}, {args.rounds} rounds x {args.steps} steps"
    )
    for n, v in zip(names, ips):
        print(f"  {n}: {v:.1f} img/s")
    rounds = paired_rounds(times, [b.global_batch for b in benches])[1]  # arm 1 / arm 0, per round
    print(
        f"  {names[0]} / {names[1]}: {ips[0] / ips[1]:.3f}x (median rounds), "
        f"{statistics.median(1 / r for r in rounds):.3f}x round by round "
        f"(faster in {rounds_won([1 / r for r in rounds])} of {len(rounds)} rounds)"
    )
    for b in benches:
        b.close()
