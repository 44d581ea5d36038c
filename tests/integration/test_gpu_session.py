"""scripts/gpu_session.sh, the one-command GPU measurement run, on a simulation of the GPU image
(tests/gpu_image/sitecustomize.py: the packages the image lacks made unimportable, torch.__version__
read as the image's 2.11.0+cu130): it records the versions, reaches its GPU check and stops there
in one line without a GPU; names missing packages in one line; installs carried wheels into a
target folder (never torch); and (ALLOW_CPU=1, tiny recipe) writes the files it promises. The GPU
numbers themselves come from running it on a GPU machine (docs/gpu.md)."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vitscale.config import load_config

SCRIPT = "scripts/gpu_session.sh"
GPU_IMAGE = str(Path(__file__).parents[1] / "gpu_image")  # its sitecustomize simulates the image
# what the GPU image lacks (scripts/gpu_wheels.sh carries them); open_clip: its vocabulary file
NOT_ON_THE_GPU_IMAGE = (
    "deepspeed webdataset braceexpand simplejpeg open_clip ftfy wcwidth hjson pydantic optuna"
)
# the image with open_clip (CLIP's vocabulary file) and ftfy carried as wheels, as gpu_wheels.sh does
CLIP_VOCABULARY_CARRIED = " ".join(
    n for n in NOT_ON_THE_GPU_IMAGE.split() if n not in ("open_clip", "ftfy", "wcwidth")
)
IMAGE_TORCH = "2.11.0+cu130"
NO_GPU = pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the stop on a machine without a GPU"
)


def run(out, *args, block=NOT_ON_THE_GPU_IMAGE, wheels=None, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("ALLOW_CPU", "SKIP_STEPS")}
    wheels = wheels or out.parent / "no_wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    e.update(
        {
            "PYTHON": sys.executable,
            "PYTHONPATH": GPU_IMAGE,
            "VITSCALE_BLOCK_IMPORTS": block,
            "VITSCALE_FAKE_TORCH_VERSION": IMAGE_TORCH,
            "WHEELS": str(wheels),
            "SITE": str(out.parent / "site"),
            **env,
        }
    )
    return subprocess.run(
        ["bash", SCRIPT, str(out), *args], capture_output=True, text=True, env=e, timeout=600
    )


def steps_exited_0(p, out, names) -> str:
    """The script exited 0 and each named step in its log.txt did; the log."""
    assert p.returncode == 0, p.stderr
    log = (out / "log.txt").read_text()
    for name in names:
        assert f"== {name} exit 0" in log, log[-3000:]
    return log


def one_line(p) -> str:
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


@NO_GPU
def test_dry_run_on_the_image_records_versions_and_stops_at_the_gpu_check(tmp_path):
    """The issue's done-when: the image's packages and torch, no GPU: the versions are in log.txt,
    then the GPU check stops the script in one line, before any part."""
    out = tmp_path / "o"
    p = run(out, "tests,bench")
    assert p.returncode == 2
    assert one_line(p).startswith(
        "gpu_session.sh: stopped at the GPU check: no CUDA GPU visible to"
    )
    log = (out / "log.txt").read_text()
    assert (
        f"torch {IMAGE_TORCH} " in log and f"this run uses torch {IMAGE_TORCH} as installed" in log
    )
    for name in NOT_ON_THE_GPU_IMAGE.split():
        if name != "open_clip":
            assert any(line.split()[:2] == [name, "missing"] for line in log.splitlines()), name
    assert any(line.split()[:3] == ["CLIP", "vocab", "missing"] for line in log.splitlines())
    assert "versions: PASS" in log and "== gpu_check exit 2" in log
    assert "== tests" not in log and "== bench" not in log
    assert sorted(f.name for f in out.iterdir()) == ["log.txt"]


def test_unknown_part_one_line(tmp_path):
    p = run(tmp_path / "o", "tests,ladders")
    assert p.returncode == 2 and "unknown part 'ladders'" in one_line(p)
    assert not (tmp_path / "o").exists()


def test_missing_package_named_in_one_line(tmp_path):
    out = tmp_path / "o"
    p = run(out, "ladder", ALLOW_CPU="1", block=f"{NOT_ON_THE_GPU_IMAGE} matplotlib")
    assert p.returncode == 2
    assert "missing Python package(s) for part(s) 'ladder': matplotlib" in one_line(p)
    log = (out / "log.txt").read_text()
    assert "versions: PASS" in log and "== gpu_check" not in log


def test_the_simulation_of_the_gpu_image():
    e = {
        **os.environ,
        "PYTHONPATH": GPU_IMAGE,
        "VITSCALE_BLOCK_IMPORTS": NOT_ON_THE_GPU_IMAGE,
        "VITSCALE_FAKE_TORCH_VERSION": IMAGE_TORCH,
    }
    code = (
        "import importlib, importlib.util, sys\n"
        "for n in ('ftfy', 'deepspeed', 'webdataset', 'simplejpeg'):\n"
        "    try:\n        importlib.import_module(n)\n        sys.exit(n + ' imported')\n"
        "    except ImportError:\n        pass\n"
        "try:\n    importlib.util.find_spec('open_clip')\n    sys.exit('open_clip found')\n"
        "except ImportError:\n    pass\n"
        "import torch\nassert torch.__version__ == '2.11.0+cu130' and torch.__version__ < (2, 12), torch.__version__\n"
        "import numpy, rich, safetensors, regex, yaml"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr


def wheel(folder: Path, name: str, version: str, files: dict) -> Path:
    """A minimal wheel: enough for pip install --no-deps --target."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


@NO_GPU
def test_carried_wheels_go_to_a_target_folder_on_the_path(tmp_path):
    """The wheels are installed with pip --no-index --no-deps into SITE, which the steps import
    from: here a stand-in ftfy, reported as carried."""
    out = tmp_path / "o"
    wheel(tmp_path / "whl", "ftfy", "0.0.1", {"ftfy/__init__.py": "__version__ = '0.0.1'\n"})
    p = run(out, "bench", wheels=tmp_path / "whl", block=NOT_ON_THE_GPU_IMAGE.replace("ftfy ", ""))
    assert p.returncode == 2 and "stopped at the GPU check" in one_line(p)
    log = (out / "log.txt").read_text()
    assert "== wheels exit 0" in log and "--no-index --no-deps" in log
    assert (tmp_path / "site" / "ftfy" / "__init__.py").is_file()
    assert any(line.split() == ["ftfy", "0.0.1", "(carried)"] for line in log.splitlines())


def test_a_torch_wheel_is_refused(tmp_path):
    (tmp_path / "whl").mkdir()
    (tmp_path / "whl" / "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    p = run(tmp_path / "o", "bench", wheels=tmp_path / "whl")
    assert p.returncode == 2 and "the GPU image's own torch is used as it is" in one_line(p)
    assert not (tmp_path / "site").exists()


def test_a_failing_tf32_check_stops_the_script(tmp_path):
    """The GPU check applies vitscale's TF32 flags and reads them both ways: with the flags set
    through the new API alone (vitscale before issue 25's fix), the legacy reader raises and the
    script stops there in one line with status 3."""
    real = sys.executable
    wrapper = tmp_path / "python"
    patch = (
        "import sys, torch; sys.path.insert(0, 'scripts'); import gpu_checks; from vitscale.strategy import devices\n"
        "def old(flags):\n"
        "    torch.backends.cuda.matmul.fp32_precision = 'tf32' if flags['matmul_tf32'] else 'ieee'\n"
        "    torch.backends.cudnn.conv.fp32_precision = 'tf32' if flags['conv_tf32'] else 'ieee'\n"
        "devices.apply_backend_flags = old\n"
        "sys.exit(gpu_checks.main(['gpu']))"
    )
    wrapper.write_text(
        f'#!/usr/bin/env bash\nif [ "$1 $2" = "scripts/gpu_checks.py gpu" ]; then exec {real} -c "{patch}"; fi\n'
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    out = tmp_path / "o"
    p = run(out, "bench", ALLOW_CPU="1", PYTHON=str(wrapper))
    assert p.returncode == 3
    assert one_line(p).startswith(
        "gpu_session.sh: stopped at the GPU check: TF32 flags: "
        "torch.get_float32_matmul_precision() raised RuntimeError"
    )
    log = (out / "log.txt").read_text()
    assert "== gpu_check exit 1" in log and "== bench" not in log


def test_bench_and_deepspeed_parts_on_the_image(tmp_path):
    """On the GPU image's packages and torch version: the GPU check passes its CPU part, DeepSpeed's
    steps are skipped with the reason, both benches of the default recipe and the b16 one write
    their files (the CUDA graphs bench is left out here: it compiles, ~1 min on 2 CPU cores)."""
    out = tmp_path / "o"
    p = run(
        out,
        "deepspeed,bench",
        ALLOW_CPU="1",
        CFG="configs/tests/tiny.toml",
        BATCH="16",
        LAB_ARGS="--steps 2 --trials 1 --warmup 1 --set run.threads=1",
        SKIP_STEPS="bench_default_graphs",
    )
    assert p.returncode == 0, p.stderr
    log = (out / "log.txt").read_text()
    assert f"torch {IMAGE_TORCH} " in log  # the versions that open the log
    assert "gpu_check: PASS (TF32 flags readable both ways; compiled matmul skipped: no GPU" in log
    assert (
        "cpu_adam: SKIP: DeepSpeed is not importable" in log
        and "== deepspeed_offload skipped: cpu_adam: SKIP" in log
    )
    assert "== bench_b16 exit 0" in log and "== bench_default exit 0" in log
    assert "== bench_default_graphs skipped" in log
    b16, default = (
        json.loads((out / f).read_text()) for f in ("bench_b16.json", "bench_default.json")
    )
    assert b16["synthetic"] and b16["batch_size"] == 16 and b16["images_per_s"] > 0
    recipe = (
        load_config()
    )  # the default recipe (configs/fashion_mnist.toml), benched on synthetic images
    assert default["config"]["data"]["name"] == "synthetic"
    assert (default["config"]["model"]["dim"], default["config"]["model"]["depth"]) == (
        recipe.model.dim,
        recipe.model.depth,
    )
    assert sorted(f.name for f in out.iterdir()) == [
        "bench_b16.json",
        "bench_default.json",
        "log.txt",
    ]


@NO_GPU
def test_the_peer_part_on_the_image(tmp_path):
    """The peer part (issue 32): vitscale's step beside timm's ViT (timm is on the GPU image), and a
    CLIP recipe on synthetic pairs with FastCLIP-v3 and with the OpenCLIP loss; open_clip (the
    vocabulary file) as a carried wheel would give it. Tiny recipes, eager, on the CPU here."""
    pytest.importorskip(
        "timm", reason="timm does not import here (see ../shared/tools/tv_cpu_stub)"
    )
    out = tmp_path / "o"
    p = run(
        out,
        "peer",
        block=CLIP_VOCABULARY_CARRIED,
        ALLOW_CPU="1",
        CFG="configs/tests/tiny.toml",
        BATCH="16",
        CLIP_CFG="configs/tests/clip_tiny.toml",
        CLIP_BATCH="16",
        PEER_ROUNDS="2",
        LAB_ARGS="--steps 2 --trials 1 --warmup 1 --set run.threads=1 --set train.compile=false "
        "--set train.precision=fp32",
    )
    steps_exited_0(p, out, ("bench_peer_b16", "bench_clip_v3", "bench_clip_openclip"))
    peer = json.loads((out / "bench_peer_b16.json").read_text())["peer"]
    assert peer["name"] == "timm" and len(peer["speedup_rounds"]) == 2
    losses = [
        json.loads((out / f"bench_clip_{x}.json").read_text())["config"]["clip"]["loss"]
        for x in ("v3", "openclip")
    ]
    assert losses == ["fastclip_v3", "openclip"]


@NO_GPU
def test_the_capture_part_on_the_image(tmp_path):
    """The capture part (issue 31) with tiny recipes on the CPU: the GPU tests of the captured step
    run (skipped here, with the reason), the bench of the recipe beside train.capture=step and the
    captured training run write their files."""
    out = tmp_path / "o"
    p = run(
        out,
        "capture",
        ALLOW_CPU="1",
        TRAIN_CFG="configs/tests/tiny.toml",
        PEER_ROUNDS="2",
        LAB_ARGS="configs/tests/tiny.toml --steps 2 --trials 1 --warmup 1 --set run.threads=1",
    )
    steps_exited_0(p, out, ("capture_tests", "bench_capture", "train_capture"))
    assert "needs a CUDA GPU" in (out / "capture_tests.txt").read_text()
    beside = json.loads((out / "bench_capture.json").read_text())["beside"]
    assert beside["overrides"] == {"train.capture": "step"} and len(beside["speedup_rounds"]) == 2
    summary = json.loads((out / "capture_summary.json").read_text())
    assert summary["steps"] > 0 and (out / "capture_metrics.jsonl").read_text().strip()
    assert sorted(f.name for f in out.iterdir()) == [
        "bench_capture.json",
        "capture_metrics.jsonl",
        "capture_summary.json",
        "capture_tests.txt",
        "log.txt",
    ]


@NO_GPU
def test_the_default_part_on_the_image(tmp_path):
    """The default part (issue 39): plain `vitscale train` with 3 seeds and the eager run beside,
    shortened here to a few steps of synthetic images (DEFAULT_SETS), in one tar with each run's
    summary, metrics and resolved config, and one line per run in log.txt."""
    import tarfile

    out = tmp_path / "o"
    p = run(
        out,
        "default",
        ALLOW_CPU="1",
        DEFAULT_SETS="--set data.name=synthetic --set data.channels=1 --set data.batch_size=64 "
        "--set data.train_size=256 --set data.test_size=64 --set run.max_steps=2 --set run.threads=1",
    )
    names = ["default_seed0", "default_seed1", "default_seed2", "default_eager"]
    log = steps_exited_0(p, out, names)
    assert sorted(f.name for f in out.iterdir()) == ["default_runs.tar", "log.txt"]
    with tarfile.open(out / "default_runs.tar") as tar:
        files = set(tar.getnames())
        summaries = {n: json.load(tar.extractfile(f"{n}/summary.json")) for n in names}
    assert files == {
        f"{n}/{f}" for n in names for f in ("summary.json", "metrics.jsonl", "config.toml")
    }
    assert summaries["default_eager"]["capture"] == "none"
    assert (
        "train.capture" in summaries["default_seed0"]["auto"]
    )  # the plain command: auto, answered
    assert [line for line in log.splitlines() if line.startswith("default_seed2: test accuracy")]


@NO_GPU
def test_the_knobs_part_on_the_image(tmp_path):
    """The knobs part (issue 51) with tiny recipes on the CPU, uncompiled (KNOBS_SETS): each SDPA
    kernel's gradient check in log.txt (the CPU's pass, the CUDA ones skipped and so not timed), one
    bench beside timm and beside each knob (the compile's knobs refused in one line each here, the
    precision modes and the passing kernel timed), the parity run, and the skip-mode bench within
    the part's budget; its three files and log.txt only. A budget too small for the skip bench says
    so with the command that runs it apart."""
    pytest.importorskip(
        "timm", reason="timm does not import here (see ../shared/tools/tv_cpu_stub)"
    )
    out = tmp_path / "o"
    env = dict(
        ALLOW_CPU="1",
        CFG="configs/tests/tiny.toml",
        BATCH="16",
        PEER_ROUNDS="2",
        LAB_ARGS="--steps 2 --trials 1 --warmup 1 --set run.threads=1",
        KNOBS_SETS="--set train.compile=false",
        PARITY_STEPS="4",
        KNOBS_SKIP="vit_pico_patch4:l16:0.4:16",
    )
    p = run(out, "knobs", **env)
    log = steps_exited_0(
        p,
        out,
        (
            "attention",
            "inductor_defaults",
            "bench_knobs_b16",
            "parity_b16",
            "bench_skip_l16",
        ),
    )
    assert "sdpa_flash: PASS" in log and "sdpa_cudnn: SKIP: a CUDA kernel" in log
    assert "== train.sdpa_backend=cudnn not timed: sdpa_cudnn: SKIP" in log
    assert "inductor defaults, torch" in log
    each = json.loads((out / "bench_knobs_b16.json").read_text())
    assert each["peer"]["name"] == "timm"
    cands = {next(iter(c["overrides"].items())): c for c in each["each"]["candidates"]}
    assert "needs train.compile=true" in cands[("train.inductor_combo_kernels", True)]["error"]
    for key in (("train.precision", "bf16_act"), ("train.sdpa_backend", "flash")):
        assert len(cands[key]["speedup_rounds"]) == 2
    assert ("train.sdpa_backend", "cudnn") not in cands
    parity = json.loads((out / "parity_b16.json").read_text())
    assert parity["candidate"] == {"train.precision": "bf16_act"} and parity["steps"] == 4
    assert sorted(f.name for f in out.iterdir()) == [
        "bench_knobs_b16.json",
        "bench_skip_l16.json",
        "log.txt",
        "parity_b16.json",
    ]
    # too little budget left for the skip bench: said, with the command, and not run
    small = tmp_path / "s"
    p = run(small, "knobs", **env, KNOBS_BUDGET="1", SKIP_STEPS="bench_knobs_b16 parity_b16")
    assert p.returncode == 0, p.stderr
    log = (small / "log.txt").read_text()
    assert "== bench_skip_l16 skipped: " in log
    assert 'run it apart: SKIP_ARCHS="vit_pico_patch4:l16:0.4:16" SKIP_LIMIT=420' in log
    assert not (small / "bench_skip_l16.json").exists()


@NO_GPU
def test_the_clip_part_on_the_image(tmp_path):
    """The clip part (issue 51 item 5) with the tiny CLIP on the CPU: the captured-beside-eager check
    passes (no graph on a CPU: the same numbers), and FastCLIP-v3's two benches (eager beside
    compiled, compiled beside compiled + captured) write their files; open_clip (the vocabulary
    file) as a carried wheel would give it."""
    out = tmp_path / "o"
    p = run(
        out,
        "clip",
        block=CLIP_VOCABULARY_CARRIED,
        ALLOW_CPU="1",
        CLIP_CFG="configs/tests/clip_tiny.toml",
        CLIP_BATCH="16",
        CLIP_LOSSES="fastclip_v3",
        PEER_ROUNDS="2",
        LAB_ARGS="--steps 2 --trials 1 --warmup 1 --set run.threads=1 --set train.precision=fp32",
    )
    log = steps_exited_0(
        p, out, ("clip_capture_check", "bench_clip_v3_compiled", "bench_clip_v3_captured")
    )
    assert "clip_capture_check: PASS" in log
    compiled = json.loads((out / "bench_clip_v3_compiled.json").read_text())
    captured = json.loads((out / "bench_clip_v3_captured.json").read_text())
    assert compiled["beside"]["overrides"] == {"train.compile": True}
    assert captured["beside"]["overrides"] == {"train.capture": "step"}
    assert (
        captured["config"]["train"]["compile"]
        and captured["config"]["clip"]["loss"] == "fastclip_v3"
    )
    assert sorted(f.name for f in out.iterdir()) == [
        "bench_clip_v3_captured.json",
        "bench_clip_v3_compiled.json",
        "log.txt",
    ]


@NO_GPU
def test_the_search_part_on_the_image(tmp_path):
    """The search part (issue 50, the recipe for one GPU): `vitscale search` over the
    time-to-accuracy space, then the pick trained with 3 seeds, in one tar with the report, the
    pick and each seed's summary, and one line per seed in log.txt; shortened here to 1-second
    trials of a tiny recipe on synthetic images, optuna carried (not blocked)."""
    import tarfile

    out = tmp_path / "o"
    space = tmp_path / "space.toml"  # the space's optimizer choice; the rest of it is GPU-sized
    space.write_text(
        '[optim]\nname = ["adamw", "muon"]\nlr = { low = 5e-4, high = 6e-3, log = true }\n'
    )
    tiny = (
        "--set data.name=synthetic --set data.channels=1 --set data.batch_size=32 "
        "--set data.train_size=192 --set data.test_size=64 --set run.threads=1 "
        "--set model.dim=32 --set model.depth=1 --set model.heads=2"
    )
    p = run(
        out,
        "search",
        block=NOT_ON_THE_GPU_IMAGE.replace(" optuna", ""),
        ALLOW_CPU="1",
        SEARCH_BUDGET="1",
        SEARCH_TRIALS="2",
        SEARCH_SETS=tiny,
        SEARCH_SPACE=str(space),
    )
    log = steps_exited_0(
        p, out, ("search", "search_pick_seed0", "search_pick_seed1", "search_pick_seed2")
    )
    assert sorted(f.name for f in out.iterdir()) == ["log.txt", "search_gpu.tar"]
    with tarfile.open(out / "search_gpu.tar") as tar:
        names = set(tar.getnames())
        picked = json.load(tar.extractfile("pick_seed2/summary.json"))
    assert {"search/search.md", "search/search.json", "search/best.toml"} <= names
    assert {f"pick_seed{s}/summary.json" for s in range(3)} <= names
    assert picked["world_size"] == 1 and "test_accuracy" in picked
    assert [
        line for line in log.splitlines() if line.startswith("search pick_seed2: test accuracy")
    ]


@NO_GPU
def test_the_search_part_without_optuna_stops_in_one_line(tmp_path):
    p = run(tmp_path / "o", "search", ALLOW_CPU="1")
    assert p.returncode == 2
    assert "missing Python package(s) for part(s) 'search': optuna" in one_line(p)
