"""CpuFlashAttention (torch's CPU flash forward + a matmul backward) against independent references:
fp64 explicit attention for values and gradients, finite differences, torch's own SDPA in bf16,
and the model-level switch (it is used exactly where torch's backward is slow)."""

import pytest
import torch
import torch.nn.functional as F

from vitscale.models.layers import Attention, CpuFlashAttention, attention_kernel


def explicit64(q, k, v, causal):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v, (q, k, v)


def qkv(dtype, shape=(3, 2, 13, 16), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True])
def test_values_and_gradients_match_fp64_explicit_attention(causal):
    q, k, v = qkv(torch.float32)
    o = CpuFlashAttention.apply(q, k, v, causal, q.shape[-1] ** -0.5)
    ref, leaves = explicit64(q, k, v, causal)
    gout = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), gout)
    want = torch.autograd.grad(ref, leaves, gout.double())
    torch.testing.assert_close(o.double(), ref, rtol=0, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5)


def test_backward_passes_finite_differences_in_fp64():
    """The backward formula checked against central differences (flash CPU takes fp64 too)."""
    q, k, v = qkv(torch.float64, shape=(1, 2, 5, 4), seed=1)
    assert torch.autograd.gradcheck(
        lambda a, b, c: CpuFlashAttention.apply(a, b, c, True, 0.5), (q, k, v)
    )


def test_bf16_is_as_close_to_fp64_as_torchs_own_sdpa():
    q, k, v = qkv(torch.bfloat16, shape=(8, 3, 16, 64))
    gout = torch.randn(8, 3, 16, 64).bfloat16()
    ref, leaves = explicit64(q, k, v, False)
    want = torch.autograd.grad(ref, leaves, gout.double())
    ours = torch.autograd.grad(CpuFlashAttention.apply(q, k, v, False, 0.125), (q, k, v), gout)
    torchs = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), gout)
    for a, b, w in zip(ours, torchs, want):
        err_ours, err_torch = (a.double() - w).norm() / w.norm(), (b.double() - w).norm() / w.norm()
        assert err_ours < 2 * err_torch + 1e-3, (err_ours, err_torch)


def test_attention_kernel_uses_it_only_where_torchs_backward_is_slow(monkeypatch):
    calls = []
    real = CpuFlashAttention.apply
    monkeypatch.setattr(CpuFlashAttention, "apply", lambda *a: calls.append(a[0].dtype) or real(*a))
    bf = qkv(torch.bfloat16)
    attention_kernel(*bf)  # CPU, bf16, gradients: ours
    attention_kernel(*qkv(torch.float32))  # fp32: torch's backward is fast there
    attention_kernel(*bf, dropout=0.1)  # dropout: torch's
    with torch.no_grad():
        attention_kernel(*bf)  # inference: torch's forward alone
    assert calls == [torch.bfloat16]


def test_fused_attention_module_matches_explicit_in_bf16_autocast():
    torch.manual_seed(0)
    a, b = Attention(64, 4, fused=False), Attention(64, 4, fused=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 9, 64)
    outs, grads = [], []
    for m in (a, b):
        with torch.autocast("cpu", torch.bfloat16):
            y = m(x)
        y.float().square().sum().backward()
        outs.append(y.float())
        grads.append(m.qkv.weight.grad)
    torch.testing.assert_close(outs[0], outs[1], rtol=0.02, atol=0.02)
    assert (grads[0] - grads[1]).norm() / grads[0].norm() < 0.02


def test_compiles_without_graph_breaks():
    q, k, v = qkv(torch.bfloat16)
    fn = torch.compile(lambda a, b, c: attention_kernel(a, b, c, causal=True), fullgraph=True)
    o = fn(q, k, v)
    g = torch.autograd.grad(o.float().sum(), (q, k, v))
    ref, leaves = explicit64(q, k, v, True)
    want = torch.autograd.grad(ref.sum(), leaves)
    for a, w in zip(g, want):
        assert (a.double() - w).norm() / w.norm() < 0.02
