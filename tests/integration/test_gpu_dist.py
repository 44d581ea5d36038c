"""NCCL under torchrun on a CUDA GPU. CI has no GPU: this skips there, with the reason
(scripts/gpu_session.sh runs it with unit/test_gpu.py on the GPU image)."""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"
)


def test_nccl_ddp_one_process_under_torchrun(tmp_path):
    out = tmp_path / "nccl"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "-m",
            "vitscale",
            "train",
            "configs/tests/tiny.toml",
            "--out",
            str(out),
            "--set",
            "run.device=cuda",
            "--set",
            "strategy.name=ddp",
            "--set",
            "train.precision=bf16",
            "--set",
            "train.epochs=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["device"] == "cuda:0"
