"""scripts/gpu_session.sh, the one-command GPU measurement run: refuses without a GPU in one line,
and (ALLOW_CPU=1, tiny recipe) writes the files it promises. The GPU numbers themselves come from
running it on a GPU machine (docs/performance.md)."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = "scripts/gpu_session.sh"


def run(out, *args, **env):
    e = {k: v for k, v in os.environ.items() if k != "ALLOW_CPU"}
    e.update(PYTHON=sys.executable, **env)
    return subprocess.run(["bash", SCRIPT, str(out), *args], capture_output=True, text=True, env=e, timeout=600)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu_in_one_line(tmp_path):
    p = run(tmp_path / "o")
    assert p.returncode == 2 and "no CUDA GPU" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_unknown_part_one_line(tmp_path):
    p = run(tmp_path / "o", "ladders")
    assert p.returncode == 2 and "unknown part 'ladders'" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_bench_part_writes_its_files(tmp_path):
    out = tmp_path / "o"
    p = run(out, "bench", ALLOW_CPU="1", CFG="configs/tests/tiny.toml", BATCH="16",
            LAB_ARGS="--steps 2 --trials 1 --warmup 1 --set run.threads=1")
    assert p.returncode == 0, p.stderr
    log = (out / "log.txt").read_text()
    assert "torch 2." in log  # the versions line that opens the log
    assert "== bench_b16 exit 0" in log and "== bench_default exit 0" in log
    b16, default = (json.loads((out / f).read_text()) for f in ("bench_b16.json", "bench_default.json"))
    assert b16["synthetic"] and b16["batch_size"] == 16 and b16["images_per_s"] > 0
    assert default["config"]["data"]["name"] == "synthetic" and default["config"]["model"]["dim"] == 192
