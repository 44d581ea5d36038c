#!/usr/bin/env bash
# The default job's CPU step, this checkout against a worktree of an earlier commit (default: dd5435d,
# the commit before issue 49), alternating processes round by round (ROUNDS, default 9), on one thread
# each (another process on the 2 cores slows a 2-thread step by far more than any change: ENVIRONMENT.md),
# and its first 100 steps' records compared bit for bit. Usage: scripts/side_by_side_before.sh [REV]
set -euo pipefail
cd "$(dirname "$0")/.."
HERE=$(pwd -P)
REV=${1:-dd5435d}
OLD=$(mktemp -d)/before
git worktree add -q "$OLD" "$REV"
PY=$HERE/.venv/bin/python
out=$(mktemp -d)
ROUNDS=${ROUNDS:-9}
for i in $(seq 1 "$ROUNDS"); do
  for side in old new; do
    src=$([ $side = old ] && echo "$OLD/src" || echo "$HERE/src")
    (cd $([ $side = old ] && echo "$OLD" || echo "$HERE") && PYTHONPATH=$src $PY -m vitscale bench --synthetic --steps 20 --trials 3 --warmup 3 --set run.threads=1 --json > $out/$side.$i.json 2>/dev/null)
  done
done
OUT=$out ROUNDS=$ROUNDS $PY - <<'PY'
import json, os, statistics
out = os.environ["OUT"]
r = []
for i in range(1, int(os.environ["ROUNDS"]) + 1):
    o = json.load(open(f"{out}/old.{i}.json"))["images_per_s"]
    n = json.load(open(f"{out}/new.{i}.json"))["images_per_s"]
    r.append(n / o); print(f"round {i}: before {o:.1f} img/s, now {n:.1f} img/s, ratio {n / o:.4f}")
print(f"median ratio now/before: {statistics.median(r):.4f}")
PY
for side in old new; do
  src=$([ $side = old ] && echo "$OLD/src" || echo "$HERE/src")
  (cd $([ $side = old ] && echo "$OLD" || echo "$HERE") && PYTHONPATH=$src $PY -m vitscale train --out $out/run_$side --set run.max_steps=100 --set run.log_every=10 --set run.progress=off >/dev/null 2>&1)
done
OUT=$out $PY - <<'PY'
import json, os
def recs(side):
    keep = ("kind", "step", "loss", "lr", "grad_norm", "test_accuracy", "test_loss")
    path = f"{os.environ['OUT']}/run_{side}/metrics.jsonl"
    return [{k: r[k] for k in keep if k in r} for r in map(json.loads, open(path))]
a, b = recs("old"), recs("new")
print("first 100 steps' records (loss, lr, grad norm, evaluation) bit-identical:", a == b, len(a), "records")
PY
git worktree remove --force "$OLD"
