"""In-memory loaders: determinism, exact resume, sharding over ranks, synthetic data, errors."""

import pytest
import torch

from vitscale.config import DataConfig
from vitscale.data import build_data
from vitscale.errors import DataError

AUG = dict(crop_padding=2, hflip=True, randaugment_ops=2, randaugment_magnitude=0.5)


def synth(**kw):
    base = dict(
        name="synthetic",
        channels=1,
        image_size=12,
        num_classes=4,
        train_size=50,
        test_size=23,
        batch_size=8,
        eval_batch_size=5,
    )
    return DataConfig(**{**base, **kw})


def batches(loader, epoch, start=0):
    return list(loader.iterate(epoch, start))


def test_train_batches_shapes_and_len():
    b = build_data(synth(**AUG), device="cpu", seed=0)
    assert len(b.train) == 6 and b.train.skipped == 0  # 50 // 8, drop_last
    out = batches(b.train, 0)
    assert len(out) == 6 and all(
        x.shape == (8, 1, 12, 12) and x.dtype == torch.float32 for x, _ in out
    )
    assert all(y.dtype == torch.int64 and y.shape == (8,) for _, y in out)
    b2 = build_data(synth(drop_last=False), device="cpu", seed=0)
    assert len(b2.train) == 7 and len(batches(b2.train, 0)[-1][1]) == 2


def test_deterministic_by_seed_epoch_and_batch():
    a, b, c = (build_data(synth(**AUG), device="cpu", seed=s) for s in (3, 3, 4))
    for (xa, ya), (xb, yb) in zip(batches(a.train, 1), batches(b.train, 1)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(batches(a.train, 1)[0][0], batches(c.train, 1)[0][0])
    assert not torch.equal(batches(a.train, 1)[0][0], batches(a.train, 2)[0][0])  # epochs differ


def test_start_batch_equals_tail_of_full_iteration():
    cfg = synth(**AUG, mixup_alpha=0.4, cutmix_alpha=1.0, mix_prob=0.7)
    b = build_data(cfg, device="cpu", seed=11)
    full = batches(b.train, 2)
    for k in (0, 3, 5):
        tail = batches(b.train, 2, k)
        assert len(tail) == len(full) - k
        for (xa, ya), (xb, yb) in zip(full[k:], tail):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert batches(b.train, 2, len(full)) == []


def test_epoch_is_a_permutation():
    b = build_data(synth(drop_last=False), device="cpu", seed=5)
    idx = b.train.indices(0)
    assert sorted(idx.tolist()) == list(range(50))
    assert not torch.equal(idx, b.train.indices(1))
    # the labels yielded are the labels of those indices, in order
    ys = torch.cat([y for _, y in batches(b.train, 0)])
    assert torch.equal(ys, b.train.y[idx])


@pytest.mark.parametrize("drop_last,n", [(True, 48), (False, 50)])
def test_sharding_covers_each_sample_once(drop_last, n):
    cfg = synth(drop_last=drop_last, **AUG)
    r0, r1 = (build_data(cfg, device="cpu", seed=1, rank=r, world_size=2) for r in (0, 1))
    assert len(r0.train) == len(r1.train)  # same number of steps per rank
    i0, i1 = r0.train.indices(0), r1.train.indices(0)
    both = torch.cat([i0, i1]).tolist()
    assert len(both) == n and len(set(both)) == n  # no sample twice
    # rank batches are slices of the single-process global batch, augmentation included
    # (up to float rounding of the warp's matmul, which depends on the batch size)
    single = build_data(cfg, device="cpu", seed=1)
    for (x, y), (xa, ya), (xb, yb) in zip(
        batches(single.train, 0), batches(r0.train, 0), batches(r1.train, 0)
    ):
        assert torch.allclose(torch.cat([xa, xb]), x, atol=1e-5) and torch.equal(
            torch.cat([ya, yb]), y
        )
        assert len(xa) == len(xb) or not drop_last


def test_eval_shards_partition_test_set():
    single = build_data(synth(), device="cpu", seed=0)
    assert len(single.test) == 5 and single.test.num_samples == 23
    ys = torch.cat([y for _, y in single.test.iterate()])
    shards = [
        build_data(synth(batch_size=9), device="cpu", seed=0, rank=r, world_size=3).test
        for r in range(3)
    ]
    assert [s.num_samples for s in shards] == [8, 8, 7]
    idx = torch.cat([s.indices() for s in shards])
    assert torch.equal(idx, torch.arange(23))
    assert torch.equal(torch.cat([y for s in shards for _, y in s.iterate()]), ys)
    x0, _ = next(shards[0].iterate())
    assert x0.shape == (5, 1, 12, 12)


def test_eval_has_no_augmentation_and_int_labels():
    a = build_data(synth(**AUG, mixup_alpha=1.0), device="cpu", seed=0)
    b = build_data(synth(), device="cpu", seed=0)
    for (xa, ya), (xb, yb) in zip(a.test.iterate(), b.test.iterate()):
        assert torch.equal(xa, xb) and ya.dtype == torch.int64 and torch.equal(ya, yb)


def test_soft_targets_with_mixing():
    b = build_data(synth(mixup_alpha=0.5, cutmix_alpha=0.5), device="cpu", seed=0)
    for _, y in batches(b.train, 0):
        assert y.shape == (8, 4) and y.dtype == torch.float32
        assert torch.allclose(y.sum(1), torch.ones(8))


def test_on_device_false_gives_same_batches():
    a = build_data(synth(**AUG), device="cpu", seed=2)
    b = build_data(synth(**AUG, on_device=False), device="cpu", seed=2)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(batches(a.train, 0), batches(b.train, 0)))


def test_batch_size_errors():
    with pytest.raises(
        DataError, match=r"data\.batch_size \(64\) is larger than the training set \(50"
    ):
        build_data(synth(batch_size=64), device="cpu", seed=0)
    # a batch that does not split over the ranks: the Trainer's one check, where the world size is
    # known (tests/integration/test_distributed.py::test_ddp_batch_not_divisible_is_a_clear_error)
    with pytest.raises(DataError, match="rank 2"):
        build_data(synth(), device="cpu", seed=0, rank=2, world_size=2)


def test_synthetic_deterministic_and_learnable():
    cfg = synth(channels=3, image_size=16, num_classes=5, train_size=200, test_size=100)
    a, b, c = (build_data(cfg, device="cpu", seed=s) for s in (0, 0, 1))
    assert torch.equal(a.train.x, b.train.x) and not torch.equal(a.train.x, c.train.x)
    assert a.train.x.shape == (200, 3, 16, 16) and a.channels == 3 and a.image_size == 16
    assert a.class_names == [f"class_{i}" for i in range(5)] and a.num_classes == 5
    # nearest class mean (fit on train) classifies the test split: the labels carry signal
    xtr, ytr = a.train.x.float().flatten(1), a.train.y
    means = torch.stack([xtr[ytr == k].mean(0) for k in range(5)])
    xte, yte = a.test.x.float().flatten(1), a.test.y
    acc = (torch.cdist(xte, means).argmin(1) == yte).float().mean().item()
    assert acc > 0.9
    assert all(0.2 < m < 0.8 for m in a.mean) and all(0.05 < s < 0.5 for s in a.std)
