import math

import pytest
import torch

from vitscale.config import OptimConfig, TrainConfig
from vitscale.errors import ConfigError
from vitscale.models import vit
from vitscale.optim import Lamb, build_optimizer, lr_factor, param_groups
from vitscale.strategy import SingleDevice


def tiny():
    torch.manual_seed(0)
    return vit(
        "vit_pico", image_size=8, patch_size=4, in_chans=1, num_classes=4, dim=16, depth=2, heads=2
    )


def test_no_weight_decay_on_norms_biases_pos_embed_cls_token():
    m = tiny()
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    d = {names[id(p)] for p in decay["params"]}
    assert "pos_embed" in nd and "cls_token" in nd and "norm.weight" in nd and "head.bias" in nd
    assert "blocks.0.attn.qkv.weight" in d and "head.weight" in d and "patch_embed.proj.weight" in d
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(d) + len(nd) == len(list(m.parameters()))


def test_lamb_matches_naive_formula():
    torch.manual_seed(0)
    w0 = torch.randn(5, 3)
    grads = [torch.randn(5, 3) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = Lamb([p], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    w, m, v = w0.double().clone(), torch.zeros(5, 3).double(), torch.zeros(5, 3).double()
    for t, g in enumerate(grads, 1):
        p.grad = g.clone()
        opt.step()
        g = g.double()
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        u = (m / (1 - 0.9**t)) / ((v / (1 - 0.99**t)).sqrt() + 1e-6) + 0.01 * w
        w = w - 0.1 * (w.norm() / u.norm()) * u
    torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["forloop", "foreach", "fused"])
def test_adamw_implementations_agree(impl):
    ref, m = tiny(), tiny()
    cfg = OptimConfig(impl=impl, lr=1e-2)
    o_ref = build_optimizer(ref, OptimConfig(impl="forloop", lr=1e-2))
    o = build_optimizer(m, cfg)
    x = torch.randn(4, 1, 8, 8)
    for _ in range(3):
        for model, opt in ((ref, o_ref), (m, o)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(
        ref.parameters(), m.parameters()
    ):  # 3 steps of size lr=1e-2: equal to fp32 rounding
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_lr_scaling_rules():
    from vitscale.optim import scaled_lr

    cfg = OptimConfig(lr=1e-3, lr_ref_batch=256)
    assert scaled_lr(cfg, 1024) == 1e-3
    assert scaled_lr(
        OptimConfig(lr=1e-3, lr_ref_batch=256, lr_scaling="linear"), 1024
    ) == pytest.approx(4e-3)
    assert scaled_lr(
        OptimConfig(lr=1e-3, lr_ref_batch=256, lr_scaling="sqrt"), 1024
    ) == pytest.approx(2e-3)
    assert scaled_lr(
        OptimConfig(lr=1e-3, lr_ref_batch=256, lr_scaling="linear"), 64
    ) == pytest.approx(2.5e-4)


def test_lr_schedule_formulas():
    # warmup 10 steps (linear from 1/10 to 1), then cosine to min_ratio over the remaining 90
    assert lr_factor(0, 100, 10, "cosine", 0.0) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, "cosine", 0.0) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10, "cosine", 0.0) == pytest.approx(1.0)
    assert lr_factor(55, 100, 10, "cosine", 0.0) == pytest.approx(0.5)
    assert lr_factor(100, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(32, 100, 10, "cosine", 0.0) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 22 / 90))
    )
    assert lr_factor(55, 100, 10, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(70, 100, 0, "constant", 0.0) == 1.0


def _run(accum: int, precision="fp32", steps=3, batch=16, dtype=torch.float32):
    torch.manual_seed(0)
    m = tiny().to(dtype)
    s = SingleDevice(
        TrainConfig(accum_steps=accum, precision=precision),
        OptimConfig(lr=1e-2, grad_clip=1.0),
        torch.device("cpu"),
    )
    s.setup(m)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = (
            torch.randn(batch, 1, 8, 8, generator=g, dtype=dtype),
            torch.randint(0, 4, (batch,), generator=g),
        )
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            with s.autocast():
                loss = torch.nn.functional.cross_entropy(s.model(s.prepare(xm)).float(), ym) / accum
            s.backward(loss)
        s.step()
    return s.module


@pytest.mark.parametrize("accum", [2, 4])
def test_gradient_accumulation_equals_big_batch(accum):
    # float64 so that only the summation order differs; Adam would magnify fp32 rounding
    big, acc = _run(1, dtype=torch.float64), _run(accum, dtype=torch.float64)
    for a, b in zip(big.parameters(), acc.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the comparison can fail: a different batch gives different weights
    assert not torch.equal(_run(1, dtype=torch.float64, batch=8).head.weight, big.head.weight)


def test_pure_bf16_with_master_weights_tracks_fp32():
    ref, pure = _run(1, "fp32"), _run(1, "pure_bf16")
    assert all(p.dtype == torch.bfloat16 for p in pure.parameters())
    diffs = [
        (a - b.float()).abs().max().item() for a, b in zip(ref.parameters(), pure.parameters())
    ]
    assert max(diffs) < 0.05  # bf16 weights: ~3 significant digits


def test_fp16_refused_on_cpu():
    """Asked once, at config time (strategy.check_engine), not by the strategy's constructor."""
    from vitscale.config import Config, RunConfig
    from vitscale.strategy import check_engine

    cfg = Config(run=RunConfig(device="cpu"), train=TrainConfig(precision="fp16"))
    with pytest.raises(ConfigError, match="refused on CPU"):
        check_engine(cfg)


def test_ema_follows_formula():
    torch.manual_seed(0)
    m = tiny()
    s = SingleDevice(TrainConfig(ema_decay=0.5), OptimConfig(lr=1e-2), torch.device("cpu"))
    s.setup(m)
    w0 = m.head.weight.detach().clone()
    x = torch.randn(4, 1, 8, 8)
    s.backward(s.model(x).square().mean())
    s.step()
    w1 = m.head.weight.detach().clone()
    # AveragedModel copies on the first update, then ema = d*ema + (1-d)*w
    torch.testing.assert_close(s.eval_module().head.weight, w1)
    s.backward(s.model(x).square().mean())
    s.step()
    torch.testing.assert_close(s.eval_module().head.weight, 0.5 * w1 + 0.5 * m.head.weight.detach())
    assert not torch.equal(w0, w1)
