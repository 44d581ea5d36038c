"""Two recipes' training steps side by side in one process (interleaved rounds, real batches): the
images/s of each and the second's ratio to the first, round by round. Used for docs/search.md
(the recipe before issue 26 against the search's pick: 2.11x on 2026-11-26).

  git show b6062ad:src/vitscale/configs/fashion_mnist.toml > /tmp/old.toml
  python benchmarks/recipes_side_by_side.py /tmp/old.toml configs/fashion_mnist.toml --set run.threads=2
"""

import argparse

from vitscale.lab.recipes import lab_config
from vitscale.lab.rounds import measure_configs

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("first")
p.add_argument("second")
p.add_argument("--set", action="append", default=[], help="KEY=VALUE for both recipes")
p.add_argument("--steps", type=int, default=10)
p.add_argument("--rounds", type=int, default=6)
p.add_argument("--warmup", type=int, default=3)
a = p.parse_args()
cfgs = [lab_config(path, a.set) for path in (a.first, a.second)]
for name, r in zip(
    (a.first, a.second),
    measure_configs(cfgs, a.steps, a.rounds, a.warmup, names=[a.first, a.second]),
):
    if "error" in r:
        print(f"{name}: {r['error']}")
        continue
    rounds = ", ".join(f"{x:.2f}" for x in r["paired_rounds"])
    print(
        f"{name}: {r['images_per_s']:.0f} img/s, {r['paired_vs_first']:.2f}x the first (rounds: {rounds})"
    )
