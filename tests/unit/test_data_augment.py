"""Batched augmentation ops: exact behaviour on forced parameters, reproducibility."""

import math

import pytest
import torch

from vitscale.config import DataConfig
from vitscale.data.sampler import generator
from vitscale.data.transforms import (
    OP,
    BatchAugment,
    Normalizer,
    crop_flip,
    cutmix,
    cutout,
    rand_augment,
    resize_u8,
)


def test_crop_with_padding_forced_offsets():
    x = torch.ones(3, 1, 4, 4, dtype=torch.uint8)
    off = torch.tensor([[0, 0], [4, 4], [1, 3]])  # (dy, dx) into the 8x8 padded image
    out = crop_flip(x, off, None, pad=2)
    assert out.shape == (3, 1, 4, 4) and out.dtype == torch.uint8
    expect0 = torch.zeros(4, 4, dtype=torch.uint8)
    expect0[2:, 2:] = 1  # content starts 2 px in
    assert torch.equal(out[0, 0], expect0)
    assert torch.equal(out[1, 0], expect0.flip(0).flip(1))  # bottom-right corner crop
    expect2 = torch.zeros(4, 4, dtype=torch.uint8)
    expect2[1:, :3] = 1  # 1 row of pad on top, 1 col right
    assert torch.equal(out[2, 0], expect2)


def test_crop_centre_offset_is_identity_and_flip_mirrors():
    x = torch.randint(0, 256, (5, 3, 6, 7), dtype=torch.uint8)
    assert torch.equal(crop_flip(x, torch.full((5, 2), 3), None, pad=3), x)
    flip = torch.tensor([True, False, True, False, True])
    out = crop_flip(x, None, flip, pad=0)
    assert torch.equal(out[flip], x[flip].flip(-1)) and torch.equal(out[~flip], x[~flip])
    off = torch.randint(0, 5, (5, 2))  # crop then flip, in one gather
    both = crop_flip(x, off, flip, pad=2)
    assert torch.equal(both[flip], crop_flip(x, off, None, pad=2)[flip].flip(-1))


def _ops(name, b, k=1):
    return torch.full((b, k), OP[name]), torch.ones(b, k)


def test_randaugment_zero_magnitude_is_identity():
    x = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8).float() / 255
    ops = torch.randint(0, len(OP), (16, 3))
    signs = torch.where(torch.rand(16, 3) < 0.5, -1.0, 1.0)
    assert torch.allclose(rand_augment(x.clone(), ops, signs, 0.0), x, atol=1e-6)


def test_randaugment_ops_exact():
    x = torch.randint(0, 256, (4, 1, 10, 10), dtype=torch.uint8).float() / 255
    assert torch.allclose(rand_augment(x.clone(), *_ops("solarize", 4), 1.0), 1 - x)  # threshold 0
    post = rand_augment(x.clone(), *_ops("posterize", 4), 1.0)  # keep 4 bits
    assert torch.allclose(post * 255, torch.floor(x * 255 / 16) * 16, atol=1e-4)
    bright = rand_augment(x.clone(), *_ops("brightness", 4), 0.5)  # x * 1.45
    assert torch.allclose(bright, (x * 1.45).clamp(0, 1), atol=1e-6)
    # translate_x by exactly one pixel: tx = 0.9 * m in normalized units = 1 px at W = 10
    shifted = rand_augment(x.clone(), *_ops("translate_x", 4), 1 / 4.5)
    assert torch.allclose(shifted[..., :-1], x[..., 1:], atol=1e-5)
    assert torch.all(shifted[..., -1] == 0)  # zero fill from outside


def test_randaugment_only_touches_chosen_samples():
    x = torch.rand(6, 3, 8, 8)
    ops = torch.tensor([[OP["identity"]], [OP["rotate"]]] * 3)
    out = rand_augment(x.clone(), ops, torch.ones(6, 1), 0.8)
    assert torch.equal(out[0::2], x[0::2]) and not torch.allclose(out[1::2], x[1::2])


def test_cutout_square_at_centre():
    x = torch.ones(2, 1, 8, 8)
    out = cutout(x.clone(), torch.tensor([True, False]), torch.full((2, 2), 0.5), 1.0)
    expect = torch.ones(8, 8)
    expect[2:6, 2:6] = 0  # side 0.5 * 8 = 4
    assert torch.equal(out[0, 0], expect) and torch.equal(out[1], x[1])


def _constant_batch(b=8, k=4):
    vals = torch.arange(b) * 30 + 10  # distinct per image
    x = vals.view(b, 1, 1, 1).expand(b, 2, 6, 6).to(torch.uint8).contiguous()
    y = torch.arange(b) % k
    return x, y, vals.float() / 255


def test_mixup_weight_matches_pixel_mix():
    cfg = DataConfig(mixup_alpha=1.0, mix_prob=1.0)
    aug = BatchAugment(cfg, mean=(0.0, 0.0), std=(1.0, 1.0), num_classes=4)
    x, y, v = _constant_batch()
    p = aug.draw(generator("t", 1), len(x))
    assert p.mix == "mixup" and 0 < p.lam < 1
    out, t = aug(x, y, p)
    assert t.shape == (8, 4) and t.dtype == torch.float32
    assert torch.allclose(t.sum(1), torch.ones(8))
    lam_pix = (out[:, 0, 0, 0] - v.flip(0)) / (v - v.flip(0))  # recovered from the pixels
    lam_tgt = t[torch.arange(8), y]  # y_i != y_flip(i) here
    assert torch.allclose(lam_pix, lam_tgt, atol=1e-5) and torch.allclose(
        lam_tgt, torch.tensor(p.lam)
    )


def test_cutmix_area_matches_target():
    x = torch.rand(6, 3, 20, 20)
    t = torch.eye(6)
    out, tt, lam = cutmix(x, t, 0.6, (0.5, 0.3))
    from_partner = (out == x.flip(0)).all(1).float().mean(dim=(1, 2))  # [6] pixel fraction
    assert torch.allclose(from_partner, torch.full((6,), 1 - lam))
    assert torch.allclose(tt.diagonal(), torch.full((6,), lam)) and torch.allclose(
        tt.sum(1), torch.ones(6)
    )
    assert abs(lam - 0.6) < 0.1


def test_mix_prob_zero_gives_one_hot_targets():
    aug = BatchAugment(
        DataConfig(cutmix_alpha=1.0, mix_prob=0.0), mean=(0.0, 0.0), std=(1.0, 1.0), num_classes=4
    )
    x, y, v = _constant_batch()
    out, t = aug(x, y, aug.draw(generator("t", 2), len(x)))
    assert torch.equal(t, torch.eye(4)[y]) and torch.allclose(out[:, 0, 0, 0], v)


def test_both_mixers_are_used():
    aug = BatchAugment(
        DataConfig(mixup_alpha=0.5, cutmix_alpha=0.5), mean=(0.0,), std=(1.0,), num_classes=3
    )
    kinds = {aug.draw(generator("t", i), 4).mix for i in range(40)}
    assert kinds == {"mixup", "cutmix"}


def test_draw_reproducible_by_seed():
    aug = BatchAugment(
        DataConfig(crop_padding=4, hflip=True, randaugment_ops=2, mixup_alpha=0.2),
        mean=(0.5,),
        std=(0.5,),
        num_classes=10,
    )
    a, b, c = (aug.draw(generator("aug", s, 0, 3), 64) for s in (7, 7, 8))
    assert torch.equal(a.offset, b.offset) and torch.equal(a.ops, b.ops) and a.lam == b.lam
    assert not torch.equal(a.offset, c.offset)
    x = torch.randint(0, 256, (64, 1, 12, 12), dtype=torch.uint8)
    y = torch.randint(0, 10, (64,))
    assert torch.equal(aug(x, y, a)[0], aug(x, y, b)[0])
    assert not torch.equal(aug(x, y, a)[0], aug(x, y, c)[0])


def test_normalizer_and_resize():
    norm = Normalizer((0.5, 0.25), (0.5, 0.25))
    x = torch.tensor([0, 255], dtype=torch.uint8).view(1, 1, 1, 2).expand(1, 2, 1, 2)
    assert torch.allclose(norm(x), torch.tensor([[-1.0, 1.0], [-1.0, 3.0]]).view(1, 2, 1, 2))
    img = torch.full((2, 1, 28, 28), 77, dtype=torch.uint8)
    up = resize_u8(img, 32)
    assert up.shape == (2, 1, 32, 32) and up.dtype == torch.uint8 and torch.all(up == 77)


@pytest.mark.parametrize("m", [0.3, 1.0])
def test_full_pipeline_finite(m):
    aug = BatchAugment(
        DataConfig(
            crop_padding=2,
            hflip=True,
            randaugment_ops=3,
            randaugment_magnitude=m,
            mixup_alpha=0.8,
            cutmix_alpha=1.0,
        ),
        mean=(0.3,) * 3,
        std=(0.3,) * 3,
        num_classes=5,
    )
    x = torch.randint(0, 256, (32, 3, 16, 16), dtype=torch.uint8)
    out, t = aug(x, torch.randint(0, 5, (32,)), aug.draw(generator(m), 32))
    assert out.shape == (32, 3, 16, 16) and torch.isfinite(out).all()
    assert (
        out.min() >= -1 - 1e-5
        and out.max() <= 0.7 / 0.3 + 1e-5
        and math.isclose(t.sum().item(), 32, rel_tol=1e-5)
    )
