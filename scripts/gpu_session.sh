#!/usr/bin/env bash
# The GPU measurements docs/performance.md lists under "Not measured here", for a lent or rented CUDA
# machine with no network, on the torch installed there (never reinstalled; the project's
# constraints pin another version): run from the repository root. vitscale itself is taken from src/
# (PYTHONPATH); the packages the image lacks come as wheels in .whl/ (scripts/gpu_wheels.sh fills it
# here), installed with pip --no-index --no-deps into /tmp/site and put on PYTHONPATH.
#
#   bash scripts/gpu_session.sh OUT_DIR [PARTS]   PARTS: all (default), or a comma list of
#                                                 tests, bench, ladder, tune, deepspeed, peer, capture, fp8, skip, default, clip, knobs, search
#                                                 in that order (peer, capture, fp8, default, clip, knobs and search are not in all: ask for them)
#
# First, every time: the carried wheels installed; the machine and every package's version ("missing"
# where absent) into log.txt; what the parts import checked (missing ones named in one line); then
# the GPU check (scripts/gpu_checks.py gpu): a CUDA GPU, vitscale's TF32 flags readable through both
# torch.get_float32_matmul_precision() and matmul.fp32_precision, and a torch.compile'd matmul on the
# GPU. If it fails the script stops there, with one line on stderr and a non-zero status (2: no GPU,
# 3: the check failed). Then the parts; each step has a time limit (timeout -k: killed, children
# too, KILL_AFTER seconds after the TERM), the script goes on when one fails, and each step's exit
# status is in log.txt.
#
# Writes into OUT_DIR (at most 8 files, what the device tool brings back): log.txt (the machine,
# versions and checks, then everything printed, the ladder's table too), tests.txt, bench_b16.json,
# bench_default.json, bench_default_graphs.json (CUDA graphs), ladder/ladder.{json,png},
# tuned_b16.toml; the peer part: bench_peer_b16.json (the recipe compiled beside timm's ViT compiled,
# issue 32), bench_clip_v3.json and bench_clip_openclip.json (CLIP ViT-B/16 on synthetic pairs, FastCLIP-v3
# and the OpenCLIP loss); the capture part (issue 31): capture_tests.txt (the captured step against the
# eager one on the GPU), bench_capture.json (the default recipe eager beside train.capture=step, kernel
# time per step), capture_summary.json and capture_metrics.jsonl (the default job captured, on
# Fashion-MNIST from FMNIST_ROOT); the fp8 part (issue 32): bench_fp8_{b16,l16,h14}.json (bf16 compiled beside
# train.fp8=rowwise, and beside tensorwise where it is not refused; torchao carried as a wheel); the default part
# (issue 39): default_runs.tar, the summary.json and metrics.jsonl of plain `vitscale train` (the user's
# command: only data.root set) with run.seed 0, 1 and 2, and of the same job with train.capture=none
# (seed 0, the eager step beside), under default_seed{0,1,2}/ and default_eager/ (one file: the device tool
# brings back 8), and their accuracy and training time in log.txt; the clip part (issue 51 item 5):
# bench_clip_{v3,openclip}_compiled.json (CLIP_CFG on synthetic pairs, one GPU, eager beside
# train.compile=true: towers + loss as one fullgraph graph) and bench_clip_{v3,openclip}_captured.json
# (compiled beside compiled + train.capture=step), and in log.txt "clip_capture_check: PASS|FAIL" (a
# tiny CLIP, FastCLIP-v3 and v0, 12 steps captured beside eager on the GPU: losses and u); the skip part (issue 41): bench_skip_{b16,l16}.json
# (ViT-B/16 at drop_path 0.1 and L/16 at 0.4, bf16 compiled: drop_path_mode=skip beside timm and beside the mask form);
# the knobs part (issue 51): in log.txt each SDPA kernel's gradient check ("sdpa_<kernel>: PASS|FAIL|SKIP") and
# inductor's defaults on this torch; bench_knobs_b16.json (ViT-B/16 bf16 batch 256 compiled, capture none: the
# recipe beside timm, and beside each knob, one candidate each: inductor's options, max-autotune-no-cudagraphs,
# bf16_act, pure_bf16, each SDPA kernel that passed), parity_b16.json (bf16_act beside autocast bf16, eager,
# 2 seeds' spread as the tolerance) and bench_skip_l16.json (issue 41's L/16 skip mode, in what is left of
# KNOBS_BUDGET seconds; said in one line, with its command, where too little is left).
# the search part (issue 50, the GPU's recipe): search_gpu.tar (search.md, search.json and best.toml of
# `vitscale search` over the time-to-accuracy space, SEARCH_TRIALS trials of SEARCH_BUDGET s of training each
# on the GPU; optuna carried: WITH_OPTUNA=1 scripts/gpu_wheels.sh), and the pick's test accuracy and time per
# seed in log.txt. Scratch runs
# go to a temporary folder. docs/gpu.md gives each part's time on one
# H100 and the device-tool calls for a 30-minute budget. Knobs (environment):
#   CFG=configs/vit_b16_imagenet.toml  BATCH=256  LAB_ARGS="--steps 10 --trials 3"  TUNE_BUDGET=240
#   CLIP_CFG=configs/clip_vit_b16.toml  CLIP_BATCH=256  PEER_ROUNDS=5  CLIP_LOSSES="fastclip_v3 openclip" (the clip part's)
#   FMNIST_ROOT=data/fashion-mnist (the four .gz files, carried)  CAPTURE_SETS="--set optim.name=adamw --set train.compile=true" (default: the first)
#   TRAIN_CFG=configs/fashion_mnist.toml (the job the capture part trains)
#   DEFAULT_SETS="--set run.max_steps=20" (the default part's runs shortened: smoke tests only)
#   SEARCH_BUDGET=8  SEARCH_TRIALS=30  SEARCH_SETS=""  SEARCH_SPACE=vit_time_to_accuracy  SEARCH_LIMIT=420
#   (the search part: training seconds per trial, trials, extra --set, the space, the step's time limit)
#   WHEELS=.whl  SITE=/tmp/site  PYTHON=python3  KILL_AFTER=15
#   ALLOW_CPU=1 (run without a GPU: for the smoke tests; the GPU check then checks the flags only)
#   KNOBS="train.inductor_combo_kernels=true ..." (the knobs part's candidates)  KNOBS_SDPA="flash cudnn efficient"
#   KNOBS_SETS="--set ..." (after the knobs part's own: smoke tests)  KNOBS_LIMIT=420  KNOBS_BUDGET=500  PARITY_STEPS=100
#   KNOBS_SKIP="vit_large_patch16:l16:0.4:128" (the knobs part's skip-mode bench)
#   SKIP_STEPS="bench_default_graphs ..." (steps to leave out, by the names log.txt gives them;
#   the wheels, versions and GPU check steps always run)
set -uo pipefail
usage="usage: bash scripts/gpu_session.sh OUT_DIR [all | comma list of tests,bench,ladder,tune,deepspeed,peer,capture,fp8,skip,default,clip,knobs,search]"
out=${1:?$usage}
parts=${2:-all}
[ "$parts" = all ] && parts=tests,deepspeed,bench,ladder,tune
for p in ${parts//,/ }; do
  case $p in tests|bench|ladder|tune|deepspeed|peer|capture|fp8|skip|default|clip|knobs|search) ;;
    *) echo "gpu_session.sh: unknown part '$p' (all, or a comma list of tests, bench, ladder, tune, deepspeed, peer, capture, fp8, skip, default, clip, knobs, search)" >&2; exit 2;;
  esac
done
py=${PYTHON:-python3}
cfg=${CFG:-configs/vit_b16_imagenet.toml}
wheels=${WHEELS:-.whl}
site=${SITE:-/tmp/site}
grace=${KILL_AFTER:-15}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
want() { [[ ",$parts," == *",$1,"* ]]; }
read -r -a lab <<< "${LAB_ARGS:-}"
model=(--synthetic --set "data.batch_size=${BATCH:-256}" --set data.num_workers=0)

mkdir -p "$out" || exit 2
log="$out/log.txt"
: > "$log"
stop() {  # stop CODE MESSAGE: one line on stderr (and in log.txt), then exit
  echo "== stopped: $2" >> "$log"
  echo "gpu_session.sh: $2" >&2
  exit "$1"
}
rc=0
run_step() {  # run_step NAME SECONDS CMD...: run under timeout -k, log, set rc
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date -u +%H:%M:%S) UTC, limit ${limit} s): $*" | tee -a "$log"
  timeout -k "$grace" "$limit" "$@" >> "$log" 2>&1
  rc=$?
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "== $name timed out after $limit s" | tee -a "$log"
  echo "== $name exit $rc" | tee -a "$log"
}
step() {  # step NAME SECONDS CMD...: as run_step, but not when NAME is in SKIP_STEPS
  if [[ " ${SKIP_STEPS:-} " == *" $1 "* ]]; then echo "== $1 skipped (SKIP_STEPS)" | tee -a "$log"; rc=0; return 1; fi
  run_step "$@"
}
verdict() {  # the last "NAME: PASS|FAIL|SKIP ..." line scripts/gpu_checks.py wrote for NAME
  local v
  v=$(grep -E "^$1: (PASS|FAIL|SKIP)" "$log" | tail -1)
  echo "${v:-$1: FAIL: no verdict (exit $rc)}"
}
reason() { local v; v=$(verdict "$1"); echo "${v#"$1: FAIL: "}"; }  # the verdict without "NAME: FAIL: "

# -- the wheels the image lacks (never torch: the image's own is used as it is) -----------------
shopt -s nullglob
carried=("$wheels"/*.whl)
shopt -u nullglob
if [ ${#carried[@]} -gt 0 ]; then
  for w in "${carried[@]}"; do
    case ${w##*/} in torch-*|torch_*|torchvision-*|torchaudio-*|triton-*|nvidia_*|nvidia-*)
      stop 2 "$w: a torch/CUDA wheel in $wheels; the GPU image's own torch is used as it is (remove it)";;
    esac
  done
  run_step wheels 120 "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$site" "${carried[@]}"
  [ $rc -eq 0 ] || stop 2 "the ${#carried[@]} wheels in $wheels did not install into $site (exit $rc; see $log)"
  export PYTHONPATH="$PWD/src:$site${PYTHONPATH#"$PWD/src"}" VITSCALE_SITE="$site"
else
  echo "== wheels: none in $wheels/ (bash scripts/gpu_wheels.sh fills it; the packages it holds are reported missing)" | tee -a "$log"
fi

# -- the machine and the versions ---------------------------------------------------------------
{ date -u; if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1 | head -20; else echo "nvidia-smi: not found"; fi; } >> "$log"
run_step versions 90 "$py" scripts/gpu_checks.py versions
[ $rc -eq 0 ] || stop 2 "stopped at the versions step: $(reason versions) [see $log]"

need="torch numpy rich safetensors"
want tests && need="$need pytest"
want ladder && need="$need matplotlib tensorboard"
want peer && need="$need timm open_clip"  # open_clip: CLIP's vocabulary file
want clip && need="$need open_clip"
want skip && need="$need timm"
want knobs && need="$need timm"
want fp8 && need="$need torchao"
want search && need="$need optuna"
missing=$("$py" -c "
import sys
missing = []
for name in sys.argv[1:]:
    try:
        __import__(name)
    except Exception:
        missing.append(name)
print(' '.join(missing))" $need 2>/dev/null) || missing="python ($py does not run)"
[ -z "$missing" ] || stop 2 "missing Python package(s) for part(s) '$parts': $missing (carry them as wheels: scripts/gpu_wheels.sh, docs/gpu.md)"

# -- the gate: a GPU, the TF32 flags both ways, a compiled matmul ---------------------------------
run_step gpu_check 150 "$py" scripts/gpu_checks.py gpu
case $rc in
  0) ;;
  2) stop 2 "stopped at the GPU check: $(reason gpu_check) [versions in $log]";;
  *) stop 3 "stopped at the GPU check: $(reason gpu_check) [details in $log]";;
esac

# -- the parts ----------------------------------------------------------------------------------
skip_bench() {  # skip_bench ARCH:TAG:DROP_PATH:BATCH SECONDS [SETS...]: issue 41's skip-mode bench
  local arch tag rate batch limit=$2
  IFS=: read -r arch tag rate batch <<< "$1"
  shift 2
  step "bench_skip_$tag" "$limit" "$py" -m vitscale bench "$cfg" --synthetic --set data.num_workers=0 \
    --set "data.batch_size=$batch" --set "model.arch=$arch" --set "model.drop_path=$rate" "${lab[@]}" \
    --set train.precision=bf16 --set train.compile=true --set train.capture=none --set model.drop_path_mode=skip "$@" --peer timm \
    --beside model.drop_path_mode=mask --rounds "${PEER_ROUNDS:-3}" --json --out "$out/bench_skip_$tag.json"
}
scratch=$(mktemp -d "${TMPDIR:-/tmp}/gpu_session.XXXXXX")
if want tests; then
  step tests 240 bash -c "'$py' -m pytest -q -rs -p no:cacheprovider tests/unit/test_gpu.py tests/unit/test_attention_kernel.py tests/integration/test_gpu_dist.py > '$out/tests.txt' 2>&1"
  step autotune 150 "$py" scripts/gpu_checks.py autotune
fi
if want deepspeed; then
  # DeepSpeedCPUAdam (strategy.offload_optimizer on CUDA) is compiled on first use: build it, then a
  # tiny ZeRO-2 run with the optimizer offloaded, which steps it
  if step cpu_adam 240 "$py" scripts/gpu_checks.py cpu_adam; then
    case $(verdict cpu_adam) in
      "cpu_adam: PASS"*)
        step deepspeed_offload 120 "$py" -m vitscale train configs/tests/tiny.toml --out "$scratch/ds_offload" \
          --set strategy.name=deepspeed --set strategy.zero_stage=2 --set strategy.offload_optimizer=true \
          --set train.precision=bf16 --set train.epochs=1;;
      *) echo "== deepspeed_offload skipped: $(verdict cpu_adam)" | tee -a "$log";;
    esac
  fi
fi
if want bench; then
  step bench_b16 180 "$py" -m vitscale bench "$cfg" "${model[@]}" "${lab[@]}" --json --out "$out/bench_b16.json"
  # the default recipe (a 2.3M-parameter ViT: launch-bound on a GPU) eager, then compiled with CUDA graphs
  step bench_default 75 "$py" -m vitscale bench --synthetic "${lab[@]}" --json --out "$out/bench_default.json"
  step bench_default_graphs 75 "$py" -m vitscale bench --synthetic "${lab[@]}" --set train.compile=true \
    --set train.compile_mode=reduce-overhead --json --out "$out/bench_default_graphs.json"
fi
if want ladder; then
  step ladder 480 "$py" -m vitscale ladder "$cfg" "${model[@]}" "${lab[@]}" --train-steps 0 --out "$out/ladder"
  [ -f "$out/ladder/ladder.md" ] && { cat "$out/ladder/ladder.md" >> "$log"; rm "$out/ladder/ladder.md"; }
fi
if want tune; then
  step tune 330 "$py" -m vitscale tune "$cfg" "${model[@]}" "${lab[@]}" --allow-precision bf16,bf16_act \
    --budget-s "${TUNE_BUDGET:-240}" --out "$out/tuned_b16.toml"
fi
if want peer; then
  # issue 32: ViT-B/16 bf16 compiled, vitscale's step beside timm's model in its plain loop, paired rounds
  step bench_peer_b16 420 "$py" -m vitscale bench "$cfg" "${model[@]}" "${lab[@]}" --set train.precision=bf16 \
    --set train.compile=true --peer timm --rounds "${PEER_ROUNDS:-5}" --json --out "$out/bench_peer_b16.json"
  clip=(--synthetic --set strategy.name=single --set "data.batch_size=${CLIP_BATCH:-256}" --set data.num_workers=0)
  for loss in fastclip_v3 openclip; do
    step "bench_clip_${loss#fastclip_}" 180 "$py" -m vitscale bench "${CLIP_CFG:-configs/clip_vit_b16.toml}" \
      "${clip[@]}" "${lab[@]}" --set clip.loss=$loss --json --out "$out/bench_clip_${loss#fastclip_}.json"
  done
fi
if want capture; then
  # issue 31: the whole step as one CUDA graph. The GPU tests of the captured step; the default recipe
  # eager beside captured (one process, paired rounds, kernel time per step); the default job captured
  # the default recipe's Muon keeps its lr on the host (refused by the capture): these runs take AdamW
  read -r -a capsets <<< "${CAPTURE_SETS:---set optim.name=adamw}"
  step capture_tests 180 bash -c "'$py' -m pytest -q -rs -p no:cacheprovider tests/unit/test_gpu.py -k captured > '$out/capture_tests.txt' 2>&1"
  step bench_capture 150 "$py" -m vitscale bench --synthetic "${lab[@]}" "${capsets[@]}" --set train.capture=none --beside train.capture=step \
    --rounds "${PEER_ROUNDS:-5}" --json --out "$out/bench_capture.json"
  step train_capture 240 "$py" -m vitscale train "${TRAIN_CFG:-configs/fashion_mnist.toml}" --out "$scratch/capture" \
    --set "data.root=${FMNIST_ROOT:-data/fashion-mnist}" --set train.capture=step \
    --set run.progress=off "${capsets[@]}"
  for f in summary.json metrics.jsonl; do
    [ -f "$scratch/capture/$f" ] && cp "$scratch/capture/$f" "$out/capture_$f"
  done
fi
if want fp8; then
  # issue 32 item 3: float8 (torchao) beside bf16, both compiled, at the widths of ViT-B/16, L/16 and H/14;
  # FP8_ARCHS="vit_base_patch16:b16 ..." picks them (the tensorwise candidate at a refused width is one line)
  for pair in ${FP8_ARCHS:-vit_base_patch16:b16 vit_large_patch16:l16 vit_huge_patch14:h14}; do
    arch=${pair%%:*} tag=${pair##*:}
    step "bench_fp8_$tag" 300 "$py" -m vitscale bench "$cfg" "${model[@]}" "${lab[@]}" --set "model.arch=$arch" \
      --set train.precision=bf16 --set train.compile=true --beside train.fp8=rowwise --rounds "${PEER_ROUNDS:-5}" \
      --json --out "$out/bench_fp8_$tag.json"
  done
fi
if want skip; then
  # issue 41: stochastic depth that skips the dropped rows' work, bf16 compiled: the recipe with
  # model.drop_path_mode=skip beside timm's ViT at the same drop-path rate (--peer), and beside the
  # mask form (--beside: its speedup is mask over skip). SKIP_ARCHS="arch:tag:drop_path:batch ..."
  for quad in ${SKIP_ARCHS:-vit_base_patch16:b16:0.1:256 vit_large_patch16:l16:0.4:128}; do
    skip_bench "$quad" "${SKIP_LIMIT:-270}"
  done
fi
if want default; then
  # issue 39: the default job as a user runs it (plain `vitscale train`: precision and capture auto),
  # 3 seeds, and seed 0 with the capture off (the eager step) for the accuracy beside
  read -r -a defsets <<< "${DEFAULT_SETS:-}"  # a smoke run's shortening (e.g. --set run.max_steps=20); none on a GPU
  runs=()
  for seed in 0 1 2 eager; do
    name=default_seed$seed sets=(--set "run.seed=$seed")
    [ "$seed" = eager ] && name=default_eager sets=(--set run.seed=0 --set train.capture=none)
    step "$name" 240 "$py" -m vitscale train --out "$scratch/$name" \
      --set "data.root=${FMNIST_ROOT:-data/fashion-mnist}" "${sets[@]}" "${defsets[@]}"
    [ -f "$scratch/$name/summary.json" ] && runs+=("$name/summary.json" "$name/metrics.jsonl" "$name/config.toml")
  done
  [ ${#runs[@]} -gt 0 ] && tar -C "$scratch" -cf "$out/default_runs.tar" "${runs[@]}"
  "$py" - "$scratch" >> "$log" 2>&1 <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("default_*/summary.json")):
    s = json.loads(p.read_text())
    print(f"{p.parent.name}: test accuracy {100 * s['test_accuracy']:.2f}%, training {s['train_time_s']:.1f} s, "
          f"{s['images_per_s']:.0f} img/s, precision {s['precision']}, capture {s.get('capture')}, {s['device']}")
PY
fi
if want clip; then
  # issue 51 item 5: CLIP's step compiled whole (fullgraph) and captured, one GPU, synthetic pairs.
  # First the captured step against the eager one on the GPU (a tiny CLIP, fp32), then per loss the
  # recipe eager beside compiled, and compiled beside compiled + captured (paired rounds)
  step clip_capture_check 240 "$py" - <<'PY'
import json, sys, tempfile, torch
from vitscale.config import load_config
from vitscale.loop import Trainer
dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: ALLOW_CPU's smoke test, no graph
sets = [f"run.device={dev}", "train.epochs=3", "clip.gamma_decay_epochs=2", "optim.impl=fused",
        "clip.tau_lr=0.05", "run.eval_every=0", "run.progress=off", "run.log_every=1"]
ok = True
for loss in ("fastclip_v3", "fastclip_v0"):
    out = {}
    for cap in ("none", "step"):
        cfg = load_config("configs/tests/clip_tiny.toml", [*sets, f"clip.loss={loss}", f"train.capture={cap}"])
        tr = Trainer(cfg, tempfile.mkdtemp() + "/run")
        try:
            tr.fit()
        finally:
            tr.close()
        recs = [json.loads(x) for x in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in recs if r.get("kind") == "train"]
        graph = tr.whole is not None and tr.whole.graph is not None
        out[cap] = (losses, tr.task.state_dict()["lu1"].double(), graph)
    (le, ue, _), (lc, uc, graph) = out["none"], out["step"]
    fin = torch.isfinite(ue)
    du = float((ue[fin] - uc[fin]).abs().max()) if fin.any() else 0.0
    dl = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(le, lc))
    good = (graph or dev == "cpu") and len(le) == len(lc) == 12 and torch.equal(fin, torch.isfinite(uc))
    good = good and du <= 1e-4 and dl <= 1e-4
    ok &= good
    print(f"{loss} on {dev}: CUDA graph {graph}, {len(lc)} steps, losses max rel diff {dl:.3g}, max |d log u| {du:.3g}")
print(f"clip_capture_check: {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
  clipset=(--synthetic --set strategy.name=single --set "data.batch_size=${CLIP_BATCH:-256}" --set data.num_workers=0)
  for loss in ${CLIP_LOSSES:-fastclip_v3 openclip}; do
    step "bench_clip_${loss#fastclip_}_compiled" 300 "$py" -m vitscale bench "${CLIP_CFG:-configs/clip_vit_b16.toml}" \
      "${clipset[@]}" "${lab[@]}" --set clip.loss=$loss --set train.capture=none --beside train.compile=true \
      --rounds "${PEER_ROUNDS:-5}" --json --out "$out/bench_clip_${loss#fastclip_}_compiled.json"
    step "bench_clip_${loss#fastclip_}_captured" 300 "$py" -m vitscale bench "${CLIP_CFG:-configs/clip_vit_b16.toml}" \
      "${clipset[@]}" "${lab[@]}" --set clip.loss=$loss --set train.compile=true --set train.capture=none \
      --beside train.capture=step --rounds "${PEER_ROUNDS:-5}" --json --out "$out/bench_clip_${loss#fastclip_}_captured.json"
  done
fi
if want knobs; then
  # issue 51: ViT-B/16 bf16 batch 256 compiled (capture none: the compile alone). Each SDPA kernel's
  # gradient check against float64 math first (only the passing ones are timed) and inductor's
  # defaults on this torch; then one bench process, the recipe beside timm (--peer) and beside each
  # knob (--each: one compile per knob, 20-40 s each); the loss parity of bf16_act beside autocast
  # (eager); then ViT-L/16 in skip mode (issue 41) within what is left of KNOBS_BUDGET seconds
  kstart=$SECONDS
  read -r -a knobsets <<< "${KNOBS_SETS:-}"
  step attention 120 "$py" scripts/gpu_checks.py attention
  step inductor_defaults 60 "$py" -c "import torch, torch._inductor.config as c; d = c.get_config_copy(); print('inductor defaults, torch', torch.__version__, {k: d.get(k, 'absent') for k in ('coordinate_descent_tuning', 'combo_kernels', 'triton.mix_order_reduction', 'max_autotune_gemm_backends')})"
  each=()
  for kv in ${KNOBS:-train.inductor_coordinate_descent=true train.inductor_combo_kernels=true train.inductor_mix_order=on train.compile_mode=max-autotune-no-cudagraphs train.precision=bf16_act train.precision=pure_bf16}; do
    each+=(--each "$kv")
  done
  for k in ${KNOBS_SDPA:-flash cudnn efficient}; do
    case $(verdict "sdpa_$k") in
      "sdpa_$k: PASS"*) each+=(--each "train.sdpa_backend=$k");;
      *) echo "== train.sdpa_backend=$k not timed: $(verdict "sdpa_$k")" | tee -a "$log";;
    esac
  done
  step bench_knobs_b16 "${KNOBS_LIMIT:-420}" "$py" -m vitscale bench "$cfg" "${model[@]}" "${lab[@]}" --set train.precision=bf16 \
    --set train.compile=true --set train.capture=none "${knobsets[@]}" --peer timm "${each[@]}" --rounds "${PEER_ROUNDS:-3}" \
    --json --out "$out/bench_knobs_b16.json"
  step parity_b16 150 "$py" -m vitscale parity "$cfg" "${model[@]}" --set train.precision=bf16 --set train.capture=none \
    "${knobsets[@]}" --candidate train.precision=bf16_act --steps "${PARITY_STEPS:-100}" --window 10 --out "$out/parity_b16.json"
  left=$(( ${KNOBS_BUDGET:-500} - (SECONDS - kstart) ))
  quad=${KNOBS_SKIP:-vit_large_patch16:l16:0.4:128}
  if [ "$left" -ge 120 ]; then
    limit=$(( left < ${SKIP_LIMIT:-420} ? left : ${SKIP_LIMIT:-420} ))
    skip_bench "$quad" "$limit" "${knobsets[@]}"
  else
    IFS=: read -r _ ktag _ _ <<< "$quad"
    echo "== bench_skip_$ktag skipped: ${left} s left of KNOBS_BUDGET; run it apart: SKIP_ARCHS=\"$quad\" SKIP_LIMIT=420 bash scripts/gpu_session.sh OUT skip" | tee -a "$log"
  fi
fi
if want search; then
  # issue 50: the default job's recipe for one GPU (the machine class a recipe's [per_device.cuda] table
  # names): trials of a few seconds, scored on a validation split of the training set, the best two
  # repeated with 2 more seeds; then the pick (best.toml) and the recipe as written trained on the full
  # training set with seeds 0-2, test accuracy and training time of each in log.txt
  read -r -a searchsets <<< "${SEARCH_SETS:-}"
  fm=(--set "data.root=${FMNIST_ROOT:-data/fashion-mnist}")
  step search "${SEARCH_LIMIT:-420}" "$py" -m vitscale search --space "${SEARCH_SPACE:-vit_time_to_accuracy}" \
    --budget-s "${SEARCH_BUDGET:-8}" --trials "${SEARCH_TRIALS:-30}" --repeat-top 2 --seeds 2 \
    --sampler-seed 50 --out "$scratch/search" "${fm[@]}" --set optim.lr_scaling=sqrt \
    --set optim.lr_ref_batch=128 "${searchsets[@]}"
  if [ -f "$scratch/search/best.toml" ]; then
    for seed in 0 1 2; do
      step "search_pick_seed$seed" 120 "$py" -m vitscale train "$scratch/search/best.toml" \
        --out "$scratch/pick_seed$seed" "${fm[@]}" --set "run.seed=$seed" "${searchsets[@]}"
    done
  fi
  files=()
  for f in search/search.md search/search.json search/best.toml; do [ -f "$scratch/$f" ] && files+=("$f"); done
  for f in "$scratch"/pick_seed*/summary.json; do [ -f "$f" ] && files+=("${f#"$scratch"/}"); done
  [ ${#files[@]} -gt 0 ] && tar -C "$scratch" -cf "$out/search_gpu.tar" "${files[@]}"
  "$py" - "$scratch" >> "$log" 2>&1 <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("pick_seed*/summary.json")):
    s = json.loads(p.read_text())
    reach = {k: (v or {}).get("train_time_s") for k, v in (s.get("time_to_target") or {}).items()}
    print(f"search {p.parent.name}: test accuracy {100 * s['test_accuracy']:.2f}%, "
          f"training {s['train_time_s']:.1f} s, targets reached at {reach}, {s['device']}")
PY
fi
rm -rf "$scratch"
grep -E "^== .* (exit|skipped)|^[a-z_]+: (PASS|FAIL|SKIP)" "$log"
