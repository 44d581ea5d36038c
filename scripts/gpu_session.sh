#!/usr/bin/env bash
# The GPU measurements docs/performance.md lists under "Not measured here", in one command for a
# lent or rented CUDA machine with no network: run from the repository root (vitscale itself is
# taken from src/). It checks first that what its parts import is there (torch, numpy, rich,
# safetensors; pytest for tests, matplotlib and tensorboard for the ladder) and names what is
# missing in one line; ftfy, deepspeed and open_clip are not needed (a bare GPU image lacks them).
#
#   bash scripts/gpu_session.sh OUT_DIR [all|tests|bench|ladder|tune]
#
# Writes into OUT_DIR (8 files, what the device tool brings back): log.txt (the machine and
# versions, then everything printed, the ladder's table too), tests.txt, bench_b16.json,
# bench_default.json, bench_default_graphs.json (CUDA graphs), ladder/ladder.{json,png} and
# tuned_b16.toml. Each step has its own time limit and the script goes on when one fails; each
# step's exit status is in log.txt. The limits add up to 24 minutes; docs/gpu.md estimates each
# part's time on one H100 (a device-tool call may run 10 minutes: run the parts in 3 calls,
# "tests" + "bench", then "ladder", then "tune"). Knobs (environment):
#   CFG=configs/vit_b16_imagenet.toml  BATCH=256  LAB_ARGS="--steps 10 --trials 3"  TUNE_BUDGET=240
#   ALLOW_CPU=1 (run without a GPU: for the smoke test)  PYTHON=python3
#   SKIP_STEPS="bench_default_graphs ..." (steps to leave out, by the names log.txt gives them)
set -uo pipefail
out=${1:?usage: bash scripts/gpu_session.sh OUT_DIR [all|tests|bench|ladder|tune]}
part=${2:-all}
case $part in all|tests|bench|ladder|tune) ;; *) echo "gpu_session.sh: unknown part '$part' (all, tests, bench, ladder or tune)" >&2; exit 2;; esac
py=${PYTHON:-python3}
cfg=${CFG:-configs/vit_b16_imagenet.toml}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${ALLOW_CPU:-}" ] && ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_session.sh: no CUDA GPU visible to $py (set ALLOW_CPU=1 to run anyway)" >&2; exit 2
fi
need="torch numpy rich safetensors"
case $part in all) need="$need pytest matplotlib tensorboard";; tests) need="$need pytest";; ladder) need="$need matplotlib tensorboard";; esac
missing=$("$py" -c "
import sys
missing = []
for name in sys.argv[1:]:
    try:
        __import__(name)
    except Exception:
        missing.append(name)
print(' '.join(missing))" $need 2>/dev/null) || missing="python ($py does not run)"
if [ -n "$missing" ]; then
  echo "gpu_session.sh: missing Python package(s) for part '$part': $missing (carry them as wheels: see /work/.library/device/README.md or pip install)" >&2; exit 2
fi
mkdir -p "$out"
read -r -a lab <<< "${LAB_ARGS:-}"
model=(--synthetic --set "data.batch_size=${BATCH:-256}" --set data.num_workers=0)

step() {  # step NAME SECONDS CMD...: run, log, keep going (not when NAME is in SKIP_STEPS)
  local name=$1 limit=$2; shift 2
  if [[ " ${SKIP_STEPS:-} " == *" $name "* ]]; then echo "== $name skipped (SKIP_STEPS)" | tee -a "$out/log.txt"; return; fi
  echo "== $name ($(date -u +%H:%M:%S) UTC): $*" | tee -a "$out/log.txt"
  timeout "$limit" "$@" >> "$out/log.txt" 2>&1
  local rc=$?
  echo "== $name exit $rc" | tee -a "$out/log.txt"
}
want() { [ "$part" = all ] || [ "$part" = "$1" ]; }

{ date -u; nvidia-smi 2>&1 | head -20
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
} > "$out/log.txt" 2>&1
if want tests; then
  step tests 240 bash -c "'$py' -m pytest -q -rs tests/test_gpu.py tests/test_attention_kernel.py > '$out/tests.txt' 2>&1"
fi
if want bench; then
  step bench_b16 180 "$py" -m vitscale bench "$cfg" "${model[@]}" "${lab[@]}" --json --out "$out/bench_b16.json"
  # the default recipe (a 2.3M-parameter ViT: launch-bound on a GPU) eager, then compiled with CUDA graphs
  step bench_default 75 "$py" -m vitscale bench --synthetic "${lab[@]}" --json --out "$out/bench_default.json"
  step bench_default_graphs 75 "$py" -m vitscale bench --synthetic "${lab[@]}" --set train.compile=true \
    --set train.compile_mode=reduce-overhead --json --out "$out/bench_default_graphs.json"
fi
if want ladder; then
  step ladder 540 "$py" -m vitscale ladder "$cfg" "${model[@]}" "${lab[@]}" --train-steps 0 --out "$out/ladder"
  [ -f "$out/ladder/ladder.md" ] && { cat "$out/ladder/ladder.md" >> "$out/log.txt"; rm "$out/ladder/ladder.md"; }
fi
if want tune; then
  step tune 330 "$py" -m vitscale tune "$cfg" "${model[@]}" "${lab[@]}" --allow-precision bf16 \
    --budget-s "${TUNE_BUDGET:-240}" --out "$out/tuned_b16.toml"
fi
grep "^== .* exit" "$out/log.txt"
