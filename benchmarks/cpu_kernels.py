"""Why the CPU targets sit where they do: the default recipe's kernels timed on their own.

1. Attention, forward + backward, at the default recipe's shape (batch 256, 3 heads, 16 tokens,
   head dim 64): explicit (q @ k^T, softmax, @ v) against scaled_dot_product_attention with
   torch's default choice, the math backend and the flash backend, in fp32 and bf16.
2. The recipe's matmul shapes (the linear layers of a block at batch 256 x 16 tokens, forward and
   weight-gradient) against one large square matmul, the kind of peak MFU divides by.

  python benchmarks/cpu_kernels.py [--threads 2] [--repeats 30]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from vitscale.models.layers import attention_kernel


def timed(fn, repeats: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


BACKENDS = {
    "sdpa default": None,
    "sdpa math": [SDPBackend.MATH],
    "sdpa flash": [SDPBackend.FLASH_ATTENTION],
}


def forward_fn(kind: str, q, k, v):
    """The attention forward that `kind` names, as a call without arguments."""
    if kind == "explicit":
        return lambda: ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(-1) @ v
    if kind == "vitscale sdpa":
        return lambda: attention_kernel(q, k, v)

    def sdpa():
        with sdpa_kernel(BACKENDS[kind]) if BACKENDS[kind] else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v)

    return sdpa


def qkv(dtype, shape=(256, 3, 16, 64)):
    return [torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3)]


def attention(dtype, kind: str, repeats: int) -> float:
    """Forward + backward (into .grad), in seconds."""
    fwd = forward_fn(kind, *qkv(dtype))
    return timed(lambda: fwd().sum().backward(), repeats)


def attention_split(kind: str, repeats: int) -> tuple[float, float]:
    """bf16 forward alone (no autograd) and backward alone (from a kept graph), in seconds."""
    q, k, v = qkv(torch.bfloat16)
    fwd = forward_fn(kind, q, k, v)
    with torch.no_grad():
        t_fwd = timed(fwd, repeats)
    out = fwd()
    grad = torch.randn_like(out)
    return t_fwd, timed(
        lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), repeats
    )


def matmul_gflops(m: int, k: int, n: int, repeats: int) -> float:
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    return 2 * m * k * n / timed(lambda: a @ b, repeats) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| attention, fwd+bwd, [256, 3, 16, 64] | fp32 ms | bf16 ms |\n|---|---:|---:|")
    for kind in ("explicit", "sdpa default", "sdpa math", "sdpa flash", "vitscale sdpa"):
        ms = [1e3 * attention(dt, kind, args.repeats) for dt in (torch.float32, torch.bfloat16)]
        print(f"| {kind} | {ms[0]:.2f} | {ms[1]:.2f} |")
    print("\n| bf16 attention, [256, 3, 16, 64] | forward ms | backward ms |\n|---|---:|---:|")
    for kind in ("explicit", "sdpa default", "vitscale sdpa"):
        f, b = attention_split(kind, args.repeats)
        print(f"| {kind} | {1e3 * f:.2f} | {1e3 * b:.2f} |")
    peak = matmul_gflops(2048, 2048, 2048, max(3, args.repeats // 6))
    print("\n| bf16 matmul [M, K] x [K, N] | GFLOP/s | of the 2048^3 matmul |\n|---|---:|---:|")
    print(f"| 2048 x 2048 x 2048 (square) | {peak:.0f} | 1.00 |")
    for name, (m, k, n) in {
        "qkv / fc1: 4096 x 192 x 576": (4096, 192, 576),
        "proj: 4096 x 192 x 192": (4096, 192, 192),
        "fc2: 4096 x 576 x 192": (4096, 576, 192),
        "weight grad of fc1: 576 x 4096 x 192": (576, 4096, 192),
    }.items():
        g = matmul_gflops(m, k, n, args.repeats)
        print(f"| {name} | {g:.0f} | {g / peak:.2f} |")


if __name__ == "__main__":
    main()
