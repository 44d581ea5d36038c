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
.venv/bin/pip install -q -c constraints.txt -e ".[dev]"
.venv/bin/python -c "import torch, vitscale; print('vitscale ready, torch', torch.__version__)"
