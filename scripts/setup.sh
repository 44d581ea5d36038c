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
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# DeepSpeed (strategy.name=deepspeed) as pure Python: DS_BUILD_OPS=0 skips its C++/CUDA ops at install;
# vitscale needs none of them on CPU (it hands DeepSpeed a torch optimizer)
DS_BUILD_OPS=0 .venv/bin/pip install -q -c constraints.txt -e ".[dev,deepspeed]"
.venv/bin/python -c "import torch, vitscale, deepspeed; print('vitscale ready, torch', torch.__version__, '| deepspeed', deepspeed.__version__)"
