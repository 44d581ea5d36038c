"""Each SDPA backend's gradient check against float64 math (issue 51), on the CPU: math and torch's
CPU flash kernel pass at ViT-B/16's shape (197 tokens, 12 heads of 64) in bf16 and fp32; the CUDA
kernels are skipped with the reason; a kernel that is wrong on some rows (the cuDNN bug's kind)
fails, naming the tensor. The GPU's run: scripts/gpu_checks.py attention."""

import types

import pytest
import torch
import torch.nn.functional as F

from vitscale.lab import sdpa_check
from vitscale.lab.sdpa_check import VIT_B16, bound, describe, grad_check, passing

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cpu_backends_pass_at_vit_b16s_shape_and_cuda_ones_are_skipped(dtype):
    results = passing(CPU, dtype, {**VIT_B16, "batch": 1})
    assert {b: r["status"] for b, r in results.items()} == {
        "math": "PASS",
        "flash": "PASS",
        "efficient": "SKIP",
        "cudnn": "SKIP",
    }
    assert results["cudnn"]["why"] == "a CUDA kernel, not on cpu"
    for r in results.values():
        line = describe(r)
        assert line.startswith(f"sdpa_{r['backend']}: {r['status']}") and "\n" not in line
    errs = results["flash"]["errors"]
    assert set(errs) == {"out", "dq", "dk", "dv"} and max(errs.values()) < bound(dtype)


def test_bound_from_the_dtypes_roundoff():
    assert bound(torch.bfloat16) == 4 * 2.0**-8
    assert bound(torch.float16) == 4 * 2.0**-11
    assert bound(torch.float32) == 4 * 2.0**-11  # TF32 on a GPU


def test_a_kernel_wrong_on_some_rows_fails(monkeypatch):
    """A stand-in for cuDNN's bug: the rows past the last multiple of 128 tokens computed wrong."""

    def wrong(q, k, v, **kw):
        o = F.scaled_dot_product_attention(q, k, v, **kw)
        if q.dtype == torch.float64:  # the reference stays right
            return o
        keep = torch.ones_like(o)
        keep[..., 128:, :] = 0.5
        return o * keep

    monkeypatch.setattr(sdpa_check, "F", types.SimpleNamespace(scaled_dot_product_attention=wrong))
    r = grad_check("flash", CPU, torch.bfloat16, batch=1, tokens=197, heads=2, head_dim=64)
    assert r["status"] == "FAIL" and r["errors"]["out"] > 10 * bound(torch.bfloat16)
    assert describe(r).startswith("sdpa_flash: FAIL: ")


def test_a_backend_without_a_kernel_for_the_shape_is_skipped_with_torchs_reason(monkeypatch):
    def none(q, k, v, **kw):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(sdpa_check, "F", types.SimpleNamespace(scaled_dot_product_attention=none))
    r = grad_check("flash", CPU, torch.float32, batch=1, tokens=8, heads=1, head_dim=8)
    assert (
        r["status"] == "SKIP"
        and r["why"] == "not available here: No available kernel. Aborting execution."
    )
