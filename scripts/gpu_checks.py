"""The checks scripts/gpu_session.sh runs before (and beside) its measurements, each in a process of
its own, with vitscale taken from src/ (PYTHONPATH) and the image's torch as it is:

    python scripts/gpu_checks.py versions   # the machine: python, torch, CUDA, GPU, each package or "missing"
    python scripts/gpu_checks.py gpu        # the gate: a GPU, TF32 flags readable both ways, a compiled matmul
    python scripts/gpu_checks.py autotune   # a matmul compiled with max-autotune (autotuning reads the flags)
    python scripts/gpu_checks.py cpu_adam   # DeepSpeedCPUAdam: its JIT build, then one step against AdamW
    python scripts/gpu_checks.py attention  # each SDPA backend's gradients against float64 math at ViT-B/16's shape

Each prints what it finds and ends with one line "NAME: PASS ...", "NAME: FAIL ..." or "NAME: SKIP
..." (the line gpu_session.sh repeats). Exit status: 0 pass or skip, 1 fail, 2 no CUDA GPU (gpu;
ALLOW_CPU=1 runs the CPU part of the checks instead)."""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (import name, distribution name): what vitscale or its GPU session imports; the image lacks some
PACKAGES = [
    ("numpy", "numpy"),
    ("rich", "rich"),
    ("safetensors", "safetensors"),
    ("PIL", "pillow"),
    ("regex", "regex"),
    ("yaml", "pyyaml"),
    ("pytest", "pytest"),
    ("matplotlib", "matplotlib"),
    ("tensorboard", "tensorboard"),
    ("torchvision", "torchvision"),
    ("timm", "timm"),
    ("triton", "triton"),
    ("ninja", "ninja"),
    ("typing_extensions", "typing-extensions"),
    # not on the GPU image: carried as wheels (scripts/gpu_wheels.sh)
    ("ftfy", "ftfy"),
    ("wcwidth", "wcwidth"),
    ("webdataset", "webdataset"),
    ("braceexpand", "braceexpand"),
    ("simplejpeg", "simplejpeg"),
    ("hjson", "hjson"),
    ("pydantic", "pydantic"),
    ("deepspeed", "deepspeed"),
    ("optuna", "optuna"),  # the search part (WITH_OPTUNA=1 scripts/gpu_wheels.sh)
]


def out(line: str = "") -> None:
    print(line, flush=True)


def first_line(cmd: list[str], containing: str = "") -> str:
    """The first line of a command's output (that contains `containing`)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"failed ({type(e).__name__})"
    lines = [ln for ln in (p.stdout or p.stderr).strip().splitlines() if containing in ln]
    return lines[0].strip() if lines else f"exit {p.returncode}"


def where(module) -> str:
    site = os.environ.get("VITSCALE_SITE")
    f = getattr(module, "__file__", None) or ""
    return " (carried)" if site and f.startswith(str(Path(site).resolve())) else ""


def package(name: str, dist: str) -> str:
    try:
        m = importlib.import_module(name)
    except ImportError as e:
        return f"missing ({type(e).__name__}: {e})"
    except Exception as e:  # noqa: BLE001 (installed but broken: say how)
        return f"broken ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    v = getattr(m, "__version__", None)
    if not isinstance(v, str):
        try:
            v = metadata.version(dist)
        except metadata.PackageNotFoundError:
            v = "?"
    return f"{v}{where(m)}"


def tools() -> dict[str, str]:
    """What a JIT build (torch.utils.cpp_extension, DeepSpeed's ops) needs."""
    inc = Path(sysconfig.get_paths()["include"]) / "Python.h"
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    nvcc = shutil.which("nvcc") or str(
        Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    )
    nvcc = nvcc if Path(nvcc).is_file() else None
    return {
        "ninja": f"{shutil.which('ninja')} {first_line(['ninja', '--version'])}"
        if shutil.which("ninja")
        else "missing",
        "c++": f"{cxx} | {first_line([cxx, '--version'])}" if cxx else "missing",
        "nvcc": f"{nvcc} | {first_line([nvcc, '--version'], 'release')}" if nvcc else "missing",
        "Python.h": str(inc) if inc.is_file() else f"missing ({inc})",
    }


def versions() -> int:
    out(f"python {platform.python_version()} ({sys.executable})")
    try:
        import torch
    except Exception as e:  # noqa: BLE001 (the packages are still listed, then FAIL)
        torch, no_torch = None, f"{sys.executable} cannot import torch ({type(e).__name__}: {e})"
        out(f"torch: {no_torch}")
    if torch is not None:
        cuda = torch.cuda.is_available()
        gpu = (
            f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}, "
            f"{torch.cuda.device_count()} visible)"
            if cuda
            else "no GPU visible"
        )
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        out(
            f"torch {torch.__version__} cuda {torch.version.cuda} cudnn {cudnn} | {gpu} | at {Path(torch.__file__).parent}"
        )
        pins = ROOT / "constraints.txt"
        pin = (
            next(
                (ln.strip() for ln in pins.read_text().splitlines() if ln.startswith("torch")), None
            )
            if pins.is_file()
            else None
        )
        if pin:
            out(
                f"constraints.txt pins {pin}; this run uses torch {torch.__version__} as installed (never reinstalled here)"
            )
    width = max(len(n) for n, _ in PACKAGES)
    for name, dist in PACKAGES:
        out(f"  {name:<{width}} {package(name, dist)}")
    try:
        from vitscale.data.tokenizer import vocab_path

        vocab = str(vocab_path())
    except Exception as e:  # noqa: BLE001
        vocab = f"missing ({str(e).splitlines()[0]})"
    out(f"  {'CLIP vocab':<{width}} {vocab}")
    for k, v in tools().items():
        out(f"  {k:<{width}} {v}")
    if torch is None:
        out(f"versions: FAIL: {no_torch}")
        return 1
    out(f"versions: PASS (torch {torch.__version__}, {gpu})")
    return 0


def gpu(allow_cpu: bool) -> int:
    """The gate: vitscale's TF32 flags, then both kinds of reader, then a compiled matmul on the GPU."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not allow_cpu:
        out(
            f"gpu_check: FAIL: no CUDA GPU visible to {sys.executable} (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}; set ALLOW_CPU=1 to run anyway)"
        )
        return 2
    from vitscale.strategy import devices

    fails = []
    try:
        devices.apply_backend_flags(devices.backend_flags("cuda", True, True))
    except Exception as e:  # noqa: BLE001
        fails.append(f"apply_backend_flags raised {type(e).__name__}: {e}")
    # every reader torch.compile calls (inductor's autotuning keys, its conv templates) and the new
    # ones: devices.backend_readers, each value or the RuntimeError it raised
    read = {}
    for name, value in devices.backend_readers().items():
        label = f"torch.{name}()" if name.startswith("get_") else f"torch.backends.{name}"
        if isinstance(value, str) and value.startswith("RuntimeError: "):
            fails.append(f"{label} raised {value.splitlines()[0][:174]}")
            out(f"  {fails[-1]}")
        else:
            read[name] = value
            out(f"  {label} = {value!r}")
    prec, new = read.get("get_float32_matmul_precision"), read.get("cuda.matmul.fp32_precision")
    if prec is not None and prec == "highest":
        fails.append(
            "train.tf32=true applied but get_float32_matmul_precision() says 'highest' (IEEE)"
        )
    if new is not None and new != "tf32":
        fails.append(f"train.tf32=true applied but matmul.fp32_precision is {new!r}")
    if fails:
        out(f"gpu_check: FAIL: TF32 flags: {fails[0]}")
        return 1
    if not cuda:
        out(
            "gpu_check: PASS (TF32 flags readable both ways; compiled matmul skipped: no GPU, ALLOW_CPU=1)"
        )
        return 0
    err, secs = compiled_matmul(torch, {})
    if isinstance(err, str):
        out(f"gpu_check: FAIL: torch.compile'd matmul on {torch.cuda.get_device_name()}: {err}")
        return 1
    out(
        f"gpu_check: PASS (TF32 flags readable both ways; torch.compile'd fp32 matmul ran in {secs:.1f} s with "
        f"relative error {err:.1e}: {'TF32' if err > 1e-5 else 'IEEE'}) on {torch.cuda.get_device_name()}"
    )
    return 0


def compiled_matmul(torch, kwargs: dict):
    """(relative error against float64, seconds incl. compile) of a compiled 1024^3 fp32 matmul, or (why, s)."""
    t0 = time.perf_counter()
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        a, b = (torch.randn(1024, 1024, device="cuda", generator=g) for _ in range(2))
        f = torch.compile(lambda x, y: torch.relu(x @ y), **kwargs)
        y = f(a, b)
        torch.cuda.synchronize()
        ref = torch.relu(a.double() @ b.double())
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    except Exception as e:  # noqa: BLE001
        return (
            f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
            time.perf_counter() - t0,
        )
    if not err < 1e-2:
        return f"wrong result (relative error {err:.1e})", time.perf_counter() - t0
    return err, time.perf_counter() - t0


def autotune() -> int:
    import torch

    if not torch.cuda.is_available():
        out("autotune: SKIP: no GPU")
        return 0
    from vitscale.strategy import devices

    devices.apply_backend_flags(devices.backend_flags("cuda", True, True))
    err, secs = compiled_matmul(torch, {"mode": "max-autotune-no-cudagraphs"})
    if isinstance(err, str):
        out(f"autotune: FAIL: max-autotune-no-cudagraphs matmul with train.tf32 flags: {err}")
        return 1
    out(
        f"autotune: PASS (max-autotune-no-cudagraphs matmul with train.tf32 flags: {secs:.1f} s, relative error {err:.1e})"
    )
    return 0


def cpu_adam() -> int:
    """DeepSpeed's CPU Adam (what strategy.offload_optimizer steps with on CUDA) is compiled on first
    use: C++ only (DeepSpeed >= 0.18 builds it with the CPU builder on every accelerator), so it needs
    ninja, a C++ compiler with OpenMP and Python.h; nvcc is listed because other ops need it."""
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001
        out(
            f"cpu_adam: SKIP: DeepSpeed is not importable ({type(e).__name__}: {str(e).splitlines()[0]}); "
            "carry it as a wheel (bash scripts/gpu_wheels.sh; docs/gpu.md)"
        )
        return 0
    import torch

    found = tools()
    for k, v in found.items():
        out(f"  {k}: {v}")
    from deepspeed.accelerator import get_accelerator

    out(
        f"  deepspeed {deepspeed.__version__}, accelerator {get_accelerator().device_name()}, "
        f"TORCH_EXTENSIONS_DIR={os.environ.get('TORCH_EXTENSIONS_DIR', '(default: ~/.cache/torch_extensions)')}"
    )
    lacking = [k for k in ("ninja", "c++", "Python.h") if found[k].startswith("missing")]
    if lacking:
        out(f"cpu_adam: FAIL: cannot JIT-build DeepSpeedCPUAdam here: {', '.join(lacking)} missing")
        return 1
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.manual_seed(0)
    w = torch.randn(4099)
    p, q = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    t0 = time.perf_counter()
    try:
        opt = DeepSpeedCPUAdam(
            [p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, adamw_mode=True
        )
    except Exception as e:  # noqa: BLE001
        out(
            f"cpu_adam: FAIL: DeepSpeedCPUAdam did not build ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
        )
        return 1
    built = time.perf_counter() - t0
    ref = torch.optim.AdamW([q], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
    for step in range(3):
        g = torch.randn(4099, generator=torch.Generator().manual_seed(step))
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    diff = (p.detach() - q.detach()).abs().max().item()
    if not diff < 1e-5:
        out(
            f"cpu_adam: FAIL: built in {built:.0f} s, but 3 steps differ from torch.optim.AdamW by {diff:.1e}"
        )
        return 1
    out(
        f"cpu_adam: PASS (JIT-built and loaded in {built:.0f} s; 3 steps match torch.optim.AdamW to {diff:.1e})"
    )
    return 0


def attention() -> int:
    """Each scaled_dot_product_attention backend (flash, cudnn, efficient, math) forward and backward
    in bf16 at ViT-B/16's shape (197 tokens: not a multiple of 128, where cuDNN < 9.15.1 was wrong)
    against the math backend in float64 (vitscale.lab.sdpa_check); one line per backend
    ("sdpa_<backend>: PASS|FAIL|SKIP ...": gpu_session.sh times only the passing ones), then the
    verdict. Without a GPU (ALLOW_CPU=1) the CPU's backends run and the CUDA ones are skipped."""
    import torch

    from vitscale.lab.sdpa_check import describe, passing

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        out(f"  cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name(device)}")
    results = passing(device, torch.bfloat16)
    for r in results.values():
        out(describe(r))
    failed = [b for b, r in results.items() if r["status"] == "FAIL"]
    ran = [b for b, r in results.items() if r["status"] == "PASS"]
    if failed:
        out(
            f"attention: FAIL: {', '.join(failed)} off the float64 reference (passed: {', '.join(ran)})"
        )
        return 1
    out(f"attention: PASS ({', '.join(ran)} within the bound on {device.type}; the others skipped)")
    return 0


def main(argv: list[str]) -> int:
    what = argv[0] if argv else ""
    allow_cpu = bool(os.environ.get("ALLOW_CPU"))
    checks = {
        "versions": versions,
        "gpu": lambda: gpu(allow_cpu),
        "autotune": autotune,
        "cpu_adam": cpu_adam,
        "attention": attention,
    }
    if what not in checks:
        print(f"usage: python scripts/gpu_checks.py {'|'.join(checks)}", file=sys.stderr)
        return 2
    return checks[what]()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
