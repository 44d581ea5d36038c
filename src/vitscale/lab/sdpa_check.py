"""Each scaled_dot_product_attention backend checked against the math backend in float64 before it is
timed (issue 51: cuDNN's SDPA computed wrong results at sequence lengths not divisible by 128 before
cuDNN 9.15.1, and ViT-B/16's 197 tokens are one).

`grad_check` runs one backend (train.sdpa_backend's names: flash, cudnn, efficient, math) forward and
backward on random q, k, v in a dtype, and the math backend in float64 on the same (rounded) inputs
and output gradient; the output and the three input gradients must be within `bound(dtype)` of it,
normwise. On a CPU only math and flash (torch's CPU flash kernel) run; the CUDA kernels are skipped
with the reason. `vitscale tune` asks it before timing a kernel; scripts/gpu_checks.py attention
runs it on the GPU for the GPU session."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..strategy.devices import CUDA_SDPA, sdpa_context

BACKENDS = ("math", "flash", "efficient", "cudnn")
# ViT-B/16 at 224 px: 196 patches and the class token, 12 heads of 64
VIT_B16 = {"batch": 4, "tokens": 197, "heads": 12, "head_dim": 64}
# unit roundoff: half the distance from 1 to the next number (2^-(significand bits))
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def bound(dtype: torch.dtype) -> float:
    """The normwise relative error a correct kernel stays within: 4 u (u: the dtype's unit
    roundoff). With the inputs exact in the dtype (the reference gets the same rounded inputs), a
    flash-style kernel rounds the probabilities P before P @ V and its output once each (u each);
    backward rounds dP, dS = P (dP - rowsum(dO * O)) and each gradient once more, the sums
    accumulated in fp32. Independent roundings add in quadrature normwise, so a correct kernel is
    within about 2-3 u (1 u measured for torch's CPU flash kernel in bf16 at ViT-B/16's shape); a
    wrong one (the cuDNN bug's rows) is off by the order of the values themselves. fp32 kernels may
    compute in TF32 on a GPU (10 stored mantissa bits): u = 2^-11 for them."""
    u = UNIT_ROUNDOFF[dtype] if dtype != torch.float32 else 2.0**-11
    return 4 * u


def skip_reason(backend: str, device: torch.device) -> str | None:
    """Why `backend` cannot run on `device` at all (a CUDA kernel on a CPU), or None."""
    if backend in CUDA_SDPA and device.type != "cuda":
        return f"a CUDA kernel, not on {device.type}"
    return None


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().double() - ref).norm() / ref.norm().clamp_min(1e-300))


def grad_check(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    batch: int,
    tokens: int,
    heads: int,
    head_dim: int,
    causal: bool = False,
    seed: int = 0,
) -> dict:
    """{"backend", "status": PASS | FAIL | SKIP, "errors": {out, dq, dk, dv: normwise relative
    error against float64 math}, "bound", "why"} for one backend at one shape."""
    out: dict = {
        "backend": backend,
        "dtype": str(dtype).replace("torch.", ""),
        "bound": bound(dtype),
    }
    out["shape"] = [batch, heads, tokens, head_dim]
    why = skip_reason(backend, device)
    if why:
        return {**out, "status": "SKIP", "why": why}
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (batch, heads, tokens, head_dim)
    q, k, v, do = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    try:
        with sdpa_context(backend):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            o.backward(do)
    except RuntimeError as e:  # no kernel of this backend for this shape / dtype / device
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return {**out, "status": "SKIP", "why": f"not available here: {first}"}
    ref = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    with sdpa_context("math"):
        o64 = F.scaled_dot_product_attention(*ref, is_causal=causal)
        o64.backward(do.double())
    errors = {
        "out": _rel(o, o64.detach()),
        **{f"d{n}": _rel(t.grad, r.grad) for n, t, r in zip("qkv", (q, k, v), ref)},
    }
    worst = max(errors, key=lambda n: errors[n])
    ok = all(e <= out["bound"] for e in errors.values())
    why = "" if ok else f"{worst} off by {errors[worst]:.2e} (bound {out['bound']:.2e})"
    return {**out, "status": "PASS" if ok else "FAIL", "errors": errors, "why": why}


def describe(r: dict) -> str:
    """One line: "sdpa_<backend>: PASS|FAIL|SKIP (...)" (the line scripts/gpu_session.sh reads)."""
    where = f"{r['dtype']} [B, h, T, d] = {r['shape']}"
    if r["status"] == "SKIP":
        return f"sdpa_{r['backend']}: SKIP: {r['why']} ({where})"
    errs = ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())
    head = "PASS" if r["status"] == "PASS" else f"FAIL: {r['why']};"
    return f"sdpa_{r['backend']}: {head} ({where}; against float64 math: {errs}; bound {r['bound']:.1e})"


def passing(device: torch.device, dtype: torch.dtype, shape: dict | None = None) -> dict[str, dict]:
    """Every backend's check at `shape` (default ViT-B/16's), by name."""
    shape = shape or VIT_B16
    return {b: grad_check(b, device, dtype, **shape) for b in BACKENDS}
