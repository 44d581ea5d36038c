#!/usr/bin/env bash
# Sets up vitscale on a fresh Debian/Ubuntu machine: the Fashion-MNIST package, a virtualenv in
# .venv, and the package with its dev extras. torch is pinned through constraints.txt (a CPU
# build here; bring your own CUDA torch elsewhere and drop the constraint).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi
# OpenClipArt (data.name=openclipart): ~8k PNG clip art with SVG metadata for the captions
if [ ! -d /usr/share/openclipart/png ] || [ ! -d /usr/share/openclipart/svg ]; then
  if command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq openclipart-png openclipart-svg >/dev/null
  fi
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# DeepSpeed (strategy.name=deepspeed) as pure Python: DS_BUILD_OPS=0 skips its C++/CUDA ops at install;
# vitscale needs none of them on CPU (it hands DeepSpeed a torch optimizer)
DS_BUILD_OPS=0 .venv/bin/pip install -q -c constraints.txt -e ".[dev,deepspeed]"
# CLIP's BPE vocabulary file (bpe_simple_vocab_16e6.txt.gz) ships in open-clip-torch; vitscale only
# reads that file, so no deps (they would pull torchvision)
.venv/bin/pip install -q --no-deps -c constraints.txt open-clip-torch
# --with-peers (CI): timm and OpenCLIP for the parity tests and the zoo sweeps, which compare vitscale
# against them (vitscale itself never imports them). PyPI's torchvision is CUDA-only; the stub in
# ../shared/tools/tv_cpu_stub makes it (and so timm and open_clip) import on this CPU torch.
if [ "${1:-}" = "--with-peers" ]; then
  .venv/bin/pip install -q -c constraints.txt torchvision==0.28.0 timm==1.0.31 open-clip-torch==3.3.0
  # torchao: train.fp8's float8 conversion, tested on the CPU (its compiled kernels are for GPUs and
  # other torch versions: they do not load here, and the float8 training path does not need them)
  .venv/bin/pip install -q -c constraints.txt torchao==0.18.0
  stub=../shared/tools/tv_cpu_stub/install_tv_cpu_stub.sh
  if [ -f "$stub" ]; then
    bash "$stub" .venv
  else
    echo "setup.sh: $stub not found: torchvision, timm and open_clip will not import; their tests skip" >&2
  fi
fi
.venv/bin/python -c "import torch, vitscale, deepspeed; print('vitscale ready, torch', torch.__version__, '| deepspeed', deepspeed.__version__)"
