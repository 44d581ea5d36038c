from functools import partial

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vitscale.config import load_config
from vitscale.models import (
    REGISTRY,
    SIZES,
    VisionTransformer,
    count_params,
    resolve_spec,
    vit,
    vit_forward_flops,
    vit_forward_macs,
)
from vitscale.tasks import model_info


@pytest.mark.parametrize("size", sorted(SIZES))
def test_every_registered_size_builds_with_expected_shapes(size):
    dim, depth, heads, _ = SIZES[size]
    spec = resolve_spec(f"vit_{size}_patch4", image_size=16, in_chans=3, num_classes=7, depth=1)
    with torch.device("meta"):
        m = VisionTransformer(spec)
        feats = m.forward_features(torch.empty(2, 3, 16, 16))
        out = m.forward_head(feats)
    assert feats.shape == (2, 16 + 1, dim)
    assert out.shape == (2, 7)
    assert len(REGISTRY) >= 7 * len(SIZES)


def test_vit_b16_params_and_flops():
    spec = resolve_spec("vit_base_patch16")
    with torch.device("meta"):
        m = VisionTransformer(spec)
    assert count_params(m) == 86_567_656  # the published ViT-B/16 count (timm vit_base_patch16_224)
    assert abs(vit_forward_macs(spec) / 1e9 - 17.56) < 0.01
    assert vit_forward_flops(spec) == 2 * vit_forward_macs(spec)


def test_info_of_shipped_recipe():
    info = model_info(load_config("configs/vit_b16_imagenet.toml"))
    assert round(info["params"] / 1e6, 1) == 86.6
    assert abs(info["flops_per_image"] / 1e9 - 35.1) < 0.1
    assert info["train_flops_per_image"] == 3 * info["flops_per_image"]


@pytest.mark.parametrize("head", ["token", "pool"])
@pytest.mark.parametrize("size,patch", [(28, 4), (32, 8), (28, 7)])
def test_flops_match_torch_flop_counter(head, size, patch):
    # explicit attention: on CPU the counter does not see inside fused SDPA
    m = vit(
        "vit_pico",
        image_size=size,
        patch_size=patch,
        in_chans=1,
        num_classes=10,
        head=head,
        attention="explicit",
        depth=2,
    )
    x = torch.randn(3, 1, size, size)
    with FlopCounterMode(display=False) as fc:
        m(x)
    assert fc.get_total_flops() == 3 * vit_forward_flops(m.spec)
    with FlopCounterMode(display=False) as fc:
        m(x).sum().backward()
    # training = 3x forward, less the input gradient of the patch embedding (images need none)
    patch = 2 * (size // patch) ** 2 * patch**2 * 1 * m.spec.dim
    assert fc.get_total_flops() == 3 * (3 * vit_forward_flops(m.spec) - patch)


def test_fused_and_explicit_attention_agree():
    torch.manual_seed(0)
    a = vit("vit_pico", image_size=28, in_chans=1, num_classes=10, attention="explicit")
    b = vit("vit_pico", image_size=28, in_chans=1, num_classes=10, attention="sdpa")
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 1, 28, 28)
    torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)


def test_pool_head_has_no_class_token_and_token_head_does():
    assert vit("vit_pico", image_size=28, in_chans=1, head="pool").cls_token is None
    m = vit("vit_pico", image_size=28, in_chans=1, head="token")
    assert m.cls_token is not None and m.pos_embed.shape[1] == 50
    assert {"pos_embed", "cls_token"} <= m.no_weight_decay()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16]
)  # bf16: CpuFlashAttention recomputed
def test_activation_checkpointing_gives_same_gradients(dtype):
    torch.manual_seed(0)
    m = vit("vit_pico", image_size=28, in_chans=1, num_classes=10, depth=2)
    x = torch.randn(2, 1, 28, 28)

    def backward():
        with torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
            y = m(x)
        y.float().square().sum().backward()

    backward()
    g1 = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.set_grad_checkpointing(True)
    backward()
    for a, p in zip(g1, m.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_stochastic_depth_only_in_training():
    m = vit("vit_pico", image_size=28, in_chans=1, num_classes=10, drop_path=0.5, depth=4).eval()
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(m(x), m(x))
    m.train()
    torch.manual_seed(1)
    a = m(x)
    torch.manual_seed(2)
    assert not torch.allclose(a, m(x))


def test_unknown_arch_suggests_closest():
    with pytest.raises(KeyError, match="vit_tiny"):
        resolve_spec("vit_tinny")


@pytest.mark.parametrize("patch", [2, 4, 8])
def test_conv_stem_flops_and_grid(patch):
    m = vit(
        "vit_pico",
        image_size=32,
        patch_size=patch,
        in_chans=3,
        num_classes=10,
        stem="conv",
        attention="explicit",
        depth=1,
    )
    x = torch.randn(2, 3, 32, 32)
    assert m.patch_embed(x).shape == (2, (32 // patch) ** 2, m.spec.dim)
    with FlopCounterMode(display=False) as fc:
        m(x)
    assert fc.get_total_flops() == 2 * vit_forward_flops(m.spec)


@pytest.mark.parametrize("stem", ["patch", "conv"])
def test_tokens_leave_the_stem_token_major(stem):
    """The residual stream inherits the stem output's memory order; a [B, D, N]-ordered stream made
    every layer norm reduce over strided memory (the default recipe's step was 4-19% slower)."""
    m = vit(
        "vit_pico",
        image_size=32,
        patch_size=8,
        in_chans=3,
        num_classes=10,
        stem=stem,
        depth=1,
        head="pool",
        attention="explicit",
    )
    tokens = m.patch_embed(torch.randn(2, 3, 32, 32))
    assert tokens.is_contiguous()
    assert (tokens + m.pos_embed).stride() == (16 * m.spec.dim, m.spec.dim, 1)


def test_conv_stem_rejects_odd_patch():
    with pytest.raises(ValueError, match="power-of-two"):
        vit("vit_pico", image_size=28, patch_size=7, in_chans=1, stem="conv")


def test_conv_stem_batchnorm_runs_with_half_weights_and_fp32_statistics():
    # FSDP2 / DeepSpeed bf16 cast parameters but not buffers: the stem must still run, normalize
    # in fp32 and update its fp32 running statistics exactly as the fp32 module would
    from vitscale.models.layers import ConvStem

    torch.manual_seed(0)
    ref = ConvStem(16, 4, 1, 32)
    half = ConvStem(16, 4, 1, 32)
    half.load_state_dict(ref.state_dict())
    for m in half.modules():
        for _name, prm in m.named_parameters(recurse=False):
            prm.data = prm.data.to(torch.bfloat16)
    x = torch.randn(4, 1, 16, 16)
    out = half(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    want = ref(x)
    bn_ref = [m for m in ref.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    bn_half = [m for m in half.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for a, b in zip(bn_ref, bn_half):
        assert b.running_mean.dtype == torch.float32 and int(b.num_batches_tracked) == 1
        torch.testing.assert_close(b.running_mean, a.running_mean, rtol=0.05, atol=0.02)
    torch.testing.assert_close(out.float(), want, rtol=0.05, atol=0.05)  # bf16 weights: ~2 digits
    # under autocast (fp32 weights and statistics, bf16 input) PyTorch's own batch norm runs, as
    # it did before this class existed: bit-identical to nn.BatchNorm2d
    plain = torch.nn.BatchNorm2d(4)
    ours = type(bn_ref[0])(4)
    ours.load_state_dict(plain.state_dict())
    h = torch.randn(8, 4, 5, 5).to(torch.bfloat16)
    assert torch.equal(ours(h), plain(h)) and torch.equal(ours.running_var, plain.running_var)


def keep_input(seen: dict, name: str, module, inputs, output) -> None:
    seen[name] = inputs[0]


@pytest.mark.parametrize("in_chans", [1, 3])
def test_the_channels_last_conv_stem_computes_the_nchw_one(in_chans):
    """ConvStem computes its convolutions in NHWC order (oneDNN's fastest on CPUs,
    docs/performance.md) with contiguous parameters (FSDP2 and DeepSpeed take no other): the same
    state-dict and, within fp32 rounding of a different summation order, the same tokens, input
    gradient, weight gradients and batch-norm statistics as the NCHW stem; in float64 the two
    agree to 1e-12."""
    from vitscale.models.layers import ConvStem

    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        torch.manual_seed(0)
        a = ConvStem(32, 8, in_chans, 96)
        b = ConvStem(32, 8, in_chans, 96, channels_last=False)
        b.load_state_dict(a.state_dict())
        assert list(a.state_dict()) == list(b.state_dict())
        a, b = a.to(dtype), b.to(dtype)
        assert all(p.is_contiguous() for p in [*a.parameters(), *b.parameters()])
        seen = {}  # what each stem's last conv (the 1x1 to the width) was handed

        for name, m in (("a", a), ("b", b)):
            m.proj[-1].register_forward_hook(partial(keep_input, seen, name))
        x = torch.randn(16, in_chans, 32, 32, dtype=dtype)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = a(xa), b(xb)
        assert seen["a"].is_contiguous(memory_format=torch.channels_last)
        assert not seen["a"].is_contiguous() and seen["b"].is_contiguous()
        assert ya.shape == (16, 16, 96) and ya.is_contiguous()
        g = torch.randn_like(ya)
        (ya * g).sum().backward()
        (yb * g).sum().backward()
        torch.testing.assert_close(ya, yb, rtol=tol, atol=tol)
        torch.testing.assert_close(xa.grad, xb.grad, rtol=tol, atol=tol)
        for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert pa.grad.is_contiguous(), n
            torch.testing.assert_close(pa.grad, pb.grad, rtol=tol, atol=tol * 10, msg=n)
        for ba, bb in zip(a.buffers(), b.buffers()):  # the batch-norm statistics
            torch.testing.assert_close(ba, bb, rtol=tol, atol=tol)
