"""scripts/gpu_session.sh, the one-command GPU measurement run: refuses without a GPU in one line,
names missing packages in one line, and (ALLOW_CPU=1, tiny recipe) writes the files it promises
with only the GPU image's packages (ftfy, deepspeed and open_clip made unimportable by
tests/gpu_image/sitecustomize.py). The GPU numbers themselves come from running it on a GPU
machine (docs/performance.md)."""
import json
import os
import subprocess
import sys

from pathlib import Path

import pytest

SCRIPT = "scripts/gpu_session.sh"
GPU_IMAGE = str(Path(__file__).parent / "gpu_image")  # its sitecustomize blocks VITSCALE_BLOCK_IMPORTS
NOT_ON_THE_GPU_IMAGE = "ftfy deepspeed open_clip"


def run(out, *args, block=NOT_ON_THE_GPU_IMAGE, **env):
    e = {k: v for k, v in os.environ.items() if k != "ALLOW_CPU"}
    e.update(PYTHON=sys.executable, PYTHONPATH=GPU_IMAGE, VITSCALE_BLOCK_IMPORTS=block, **env)
    return subprocess.run(["bash", SCRIPT, str(out), *args], capture_output=True, text=True, env=e, timeout=600)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu_in_one_line(tmp_path):
    p = run(tmp_path / "o")
    assert p.returncode == 2 and "no CUDA GPU" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_unknown_part_one_line(tmp_path):
    p = run(tmp_path / "o", "ladders")
    assert p.returncode == 2 and "unknown part 'ladders'" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_missing_package_named_in_one_line(tmp_path):
    p = run(tmp_path / "o", "ladder", ALLOW_CPU="1", block=f"{NOT_ON_THE_GPU_IMAGE} matplotlib")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "missing Python package(s) for part 'ladder': matplotlib" in p.stderr
    assert not (tmp_path / "o").exists()


def test_the_blocker_simulates_the_gpu_image():
    e = {**os.environ, "PYTHONPATH": GPU_IMAGE, "VITSCALE_BLOCK_IMPORTS": NOT_ON_THE_GPU_IMAGE}
    code = "import importlib, sys\nfor n in ('ftfy', 'deepspeed'):\n    try:\n        importlib.import_module(n)\n" \
           "        sys.exit(n + ' imported')\n    except ImportError:\n        pass\nimport torch"
    p = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_bench_part_writes_its_files(tmp_path):
    """On the GPU image's packages: both benches of the default recipe and the b16 one (the CUDA
    graphs bench is left out here: it compiles, ~1 min on 2 CPU cores)."""
    out = tmp_path / "o"
    p = run(out, "bench", ALLOW_CPU="1", CFG="configs/tests/tiny.toml", BATCH="16",
            LAB_ARGS="--steps 2 --trials 1 --warmup 1 --set run.threads=1", SKIP_STEPS="bench_default_graphs")
    assert p.returncode == 0, p.stderr
    log = (out / "log.txt").read_text()
    assert "torch 2." in log  # the versions line that opens the log
    assert "== bench_b16 exit 0" in log and "== bench_default exit 0" in log
    assert "== bench_default_graphs skipped" in log
    b16, default = (json.loads((out / f).read_text()) for f in ("bench_b16.json", "bench_default.json"))
    assert b16["synthetic"] and b16["batch_size"] == 16 and b16["images_per_s"] > 0
    assert default["config"]["data"]["name"] == "synthetic" and default["config"]["model"]["dim"] == 192
