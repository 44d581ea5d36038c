#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with the wheels that scripts/gpu_session.sh carries to the GPU image:
# exactly the Python packages vitscale's GPU session imports that the image lacks (the image has
# torch 2.11+cu130, numpy, rich, safetensors, pillow, regex, pyyaml, pytest, matplotlib,
# tensorboard, timm, torchvision, ninja, psutil, py-cpuinfo, msgpack, einops, tqdm, packaging;
# /work/.library/device/KINDS.md). Never torch, nor anything that pulls it in: the image's torch is
# used as it is. Run here (needs PyPI), from any folder:
#
#   bash scripts/gpu_wheels.sh [DEST=.whl]        WITH_TORCHAO=1 adds torchao (the fp8 part)
#
# The image runs Python 3.12 on x86-64, so binary wheels are fetched for cp312 manylinux; DeepSpeed
# publishes no wheel, so its sdist is built into a pure-Python one here with DS_BUILD_OPS=0 (its
# ops, DeepSpeedCPUAdam's included, are compiled there on first use: gpu_session.sh's cpu_adam step).
# The versions are the dev environment's (tested with vitscale here). About 8 MiB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
py=${PYTHON:-}
[ -n "$py" ] || { [ -x .venv/bin/python ] && py=.venv/bin/python || py=python3; }
WHEELS=(
  webdataset==1.0.2 braceexpand==0.1.7    # data.name=webdataset / prepared shards (webdataset needs pyyaml, numpy: on the image)
  simplejpeg==1.9.0                       # the JPEG decoder of the data pipeline
  ftfy==6.3.1 wcwidth==0.9.4              # CLIP's caption cleaning (optional: without it fix_text is skipped)
  open-clip-torch==3.3.0                  # only for CLIP's BPE vocabulary file (found without importing open_clip)
  hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0               # pydantic 2.14 needs >= 4.16 (the image's may be older; it only adds)
)
# WITH_TORCHAO=1: torchao for train.fp8 (gpu_session.sh's fp8 part); 0.17.0 is the release built for the
# image's torch 2.11; about 19 MiB, so carry it only for that part (Fashion-MNIST for the capture part is 30 MB)
[ "${WITH_TORCHAO:-0}" = 1 ] && WHEELS+=(torchao==0.17.0)
# WITH_OPTUNA=1: Optuna and what it needs beyond the image, for `vitscale search` (gpu_session.sh's search part)
# (the dev environment's versions; the image has MarkupSafe, and SQLAlchemy needs no greenlet for SQLite)
[ "${WITH_OPTUNA:-0}" = 1 ] && WHEELS+=(optuna==5.0.0 sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3
                                         colorlog==6.12.0)
DEEPSPEED=deepspeed==0.19.8               # its other needs (ninja, msgpack, psutil, py-cpuinfo, einops, tqdm) are on the image
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p "$dest"
rm -f "$dest"/*.whl
"$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$dest" "${WHEELS[@]}"
DS_BUILD_OPS=0 "$py" -m pip wheel -q --disable-pip-version-check --no-deps --no-binary=deepspeed -w "$dest" "$DEEPSPEED"
if ls "$dest" | grep -Eiq '^(torch|torchvision|torchaudio|triton|nvidia)[-_]'; then
  echo "gpu_wheels.sh: $dest holds a torch/CUDA wheel: the GPU image's own must be used" >&2; exit 1
fi
ls -l "$dest"/*.whl | awk '{ printf "%9d  %s\n", $5, $NF; s += $5 } END { printf "%9d  total (%.1f MiB) in %d wheels\n", s, s / 1048576, NR }'
total=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
[ "$total" -le $((30 * 1024 * 1024)) ] || { echo "gpu_wheels.sh: $dest is over 30 MiB (the device tool carries 64 MiB with the tree)" >&2; exit 1; }
