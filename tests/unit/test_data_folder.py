"""ImageNet-style folder datasets: odd image modes, broken files, worker-count independence, grey
folders (data.channels = 1)."""

import logging

import numpy as np
import pytest
import torch
from helpers import BLUE, RED, make_tree
from PIL import Image

from vitscale.config import DataConfig
from vitscale.data import build_data
from vitscale.data.build import dataset_normalization, geometry
from vitscale.data.jpeg import decode, grey, to_rgb
from vitscale.data.loaders.worker_datasets import collate
from vitscale.errors import DataError


def cfg(root, **kw):
    return DataConfig(
        **{
            **dict(
                name="folder",
                root=str(root),
                image_size=16,
                batch_size=4,
                eval_batch_size=2,
                num_workers=0,
                hflip=True,
            ),
            **kw,
        }
    )


def test_to_rgb_modes():
    sixteen = Image.fromarray(np.array([[0, 257 * 100, 65535]], dtype=np.uint16))
    assert sixteen.mode == "I;16"
    assert np.array(to_rgb(sixteen))[0, :, 0].tolist() == [0, 100, 255]
    i32 = Image.fromarray(np.array([[65535, 257 * 7]], dtype=np.int32), "I")
    assert np.array(to_rgb(i32))[0, :, 1].tolist() == [255, 7]
    cmyk = Image.new("CMYK", (2, 2), (0, 255, 255, 0))  # pure red in CMYK
    assert np.array(to_rgb(cmyk))[0, 0].tolist() == [255, 0, 0]
    for img in (
        Image.new("L", (2, 2), 9),
        Image.new("1", (2, 2), 1),
        Image.new("LA", (2, 2), (5, 0)),
        Image.new("P", (2, 2), 3),
        Image.new("RGBA", (2, 2), (1, 2, 3, 0)),
    ):
        assert to_rgb(img).mode == "RGB"


def test_folder_loads_and_skips_bad_files(tmp_path, caplog):
    make_tree(tmp_path)
    with caplog.at_level(logging.WARNING, logger="vitscale.data"):
        b = build_data(cfg(tmp_path), device="cpu", seed=0)
    assert "empty class folder" in caplog.text and "empty" in caplog.text
    assert b.class_names == ["cat", "dog"] and b.num_classes == 2 and b.channels == 3
    assert (b.train_size, b.test_size, b.image_size) == (14, 3, 16)
    assert len(b.train) == 3  # 14 // 4, drop_last
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitscale.data"):
        out = list(b.train.iterate(0))
    n_seen = sum(len(y) for _, y in out)
    used = set(b.train.indices(0).tolist())
    bad = {
        i for i, p in enumerate(b.train.dataset.paths) if "truncated" in p or "not_an_image" in p
    }
    assert b.train.skipped == len(bad & used) and n_seen == 12  # full batches: substitutes
    assert caplog.text.count("skipped unreadable image") == b.train.skipped
    for x, y in out:
        assert x.dtype == torch.float32 and x.shape[1:] == (3, 16, 16) and len(x) == len(y)
        assert torch.isfinite(x).all() and y.dtype == torch.int64


def test_bad_files_counted_over_full_epoch(tmp_path):
    make_tree(tmp_path)
    b = build_data(cfg(tmp_path, drop_last=False), device="cpu", seed=0)
    n = sum(len(y) for _, y in b.train.iterate(0))
    assert b.train.skipped == 2 and n == 14  # each replaced, counted once
    assert sum(len(y) for _, y in b.train.iterate(1)) == 14 and b.train.skipped == 4


def test_eval_transform_centre_crop_and_labels(tmp_path):
    make_tree(tmp_path)
    b = build_data(cfg(tmp_path), device="cpu", seed=0)
    xs, ys = zip(*b.test.iterate())
    assert [len(y) for y in ys] == [2, 1] and len(b.test) == 2 and b.test.num_samples == 3
    x, y = torch.cat(xs), torch.cat(ys)
    assert y.tolist() == [0, 1, 1]
    pix = x * torch.tensor(b.std).view(1, 3, 1, 1) + torch.tensor(b.mean).view(1, 3, 1, 1)
    assert torch.allclose(pix[0].mean((1, 2)) * 255, torch.tensor(RED, dtype=torch.float), atol=1.0)
    assert torch.allclose(
        pix[1].mean((1, 2)) * 255, torch.tensor(BLUE, dtype=torch.float), atol=1.0
    )


def test_workers_do_not_change_batches(tmp_path):
    make_tree(tmp_path)
    extra = dict(randaugment_ops=1, mixup_alpha=0.5)
    a = build_data(cfg(tmp_path, **extra), device="cpu", seed=3)
    b = build_data(cfg(tmp_path, num_workers=2, **extra), device="cpu", seed=3)
    for epoch in (0, 1):
        ba, bb = list(a.train.iterate(epoch)), list(b.train.iterate(epoch))
        assert len(ba) == len(bb) == 3
        for (xa, ya), (xb, yb) in zip(ba, bb):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.train.skipped == b.train.skipped > 0
    tail = list(b.train.iterate(1, start_batch=1))  # resume mid-epoch
    assert len(tail) == 2 and all(torch.equal(p[0], q[0]) for p, q in zip(tail, bb[1:]))
    ea, eb = list(a.test.iterate()), list(b.test.iterate())
    assert all(torch.equal(p[0], q[0]) for p, q in zip(ea, eb))
    workers = b.train.worker_processes()
    assert len(workers) == 2 and all(w.is_alive() for w in workers)  # persistent across epochs
    b.close()
    assert not any(w.is_alive() for w in workers)
    assert torch.equal(
        next(b.train.iterate(0))[0], next(a.train.iterate(0))[0]
    )  # restarts after close


def test_train_crops_are_random_but_seeded(tmp_path):
    make_tree(tmp_path)
    a, b = (build_data(cfg(tmp_path), device="cpu", seed=s) for s in (0, 1))
    ka = [x for x, _ in a.train.iterate(0)]
    assert not torch.equal(ka[0], next(b.train.iterate(0))[0])
    assert all(torch.equal(p, q) for p, q in zip(ka, (x for x, _ in a.train.iterate(0))))


def test_folder_sharding(tmp_path):
    make_tree(tmp_path)
    r = [
        build_data(cfg(tmp_path, drop_last=False), device="cpu", seed=0, rank=k, world_size=2)
        for k in (0, 1)
    ]
    idx = torch.cat([r[0].train.indices(0), r[1].train.indices(0)]).tolist()
    assert sorted(idx) == list(range(14))
    assert torch.equal(torch.cat([r[0].test.indices(), r[1].test.indices()]), torch.arange(3))


def test_folder_errors(tmp_path):
    with pytest.raises(DataError, match="data.root must be set"):
        build_data(cfg(""), device="cpu", seed=0)
    with pytest.raises(DataError, match="train not found"):
        build_data(cfg(tmp_path), device="cpu", seed=0)
    (tmp_path / "train/a").mkdir(parents=True)
    (tmp_path / "val/a").mkdir(parents=True)
    (tmp_path / "train/a/readme.txt").write_text("no images")
    with pytest.raises(DataError, match="no images"):
        build_data(cfg(tmp_path), device="cpu", seed=0)
    Image.new("RGB", (8, 8)).save(tmp_path / "train/a/1.png")
    with pytest.raises(DataError, match="no images.*/val/"):
        build_data(cfg(tmp_path), device="cpu", seed=0)
    (tmp_path / "val/zebra").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "val/zebra/1.png")
    with pytest.raises(DataError, match="class 'zebra'"):
        build_data(cfg(tmp_path, batch_size=1), device="cpu", seed=0)


def test_alternative_eval_split_name(tmp_path):
    for split in ("train/a", "train/b", "validation/b"):
        (tmp_path / split).mkdir(parents=True)
        Image.new("RGB", (8, 8), (9, 9, 9)).save(tmp_path / split / "1.PNG")
    b = build_data(cfg(tmp_path, batch_size=2), device="cpu", seed=0)
    assert b.test_size == 1 and [y.tolist() for _, y in b.test.iterate()] == [[1]]


def test_collate_drops_failures_even_a_whole_batch():
    """What the evaluation batches do (training batches are filled before collation)."""
    ok = torch.full((3, 8, 8), 7, dtype=torch.uint8)
    x, y, i, keep, fails = collate(
        [(None, 0, 4, "a.jpg", "OSError: x"), (ok, 1, 5, "b.png", "")], size=8, pairs=False
    )
    assert (
        x.shape == (1, 3, 8, 8) and y.tolist() == [1] and i.tolist() == [5] and keep.tolist() == [1]
    )
    assert fails == [("a.jpg", "OSError: x")]
    x, y, i, keep, fails = collate([(None, 0, 4, "a.jpg", "e")], size=8, pairs=False)
    assert (
        x.shape == (0, 3, 8, 8)
        and x.dtype == torch.uint8
        and len(y) == len(i) == 0
        and len(fails) == 1
    )


def grey_tree(root):
    """train/{dark,light}: grey PNGs (one a transparent RGBA, one RGB), test/ one flat image each."""
    rng = np.random.default_rng(0)
    for d in ("train/dark", "train/light", "test/dark", "test/light"):
        (root / d).mkdir(parents=True)
    for i in range(3):
        Image.fromarray(rng.integers(0, 100, (20, 24), dtype=np.uint8), "L").save(
            root / f"train/dark/{i}.png"
        )
        Image.fromarray(rng.integers(150, 256, (24, 20), dtype=np.uint8), "L").save(
            root / f"train/light/{i}.png"
        )
    Image.new("RGB", (18, 18), (200, 180, 160)).save(root / "train/light/rgb.png")
    Image.new("RGBA", (18, 18), (10, 20, 30, 0)).save(root / "train/dark/rgba.png")
    Image.new("L", (20, 20), 40).save(root / "test/dark/flat.png")
    Image.new("L", (20, 20), 220).save(root / "test/light/flat.png")
    return root


def test_grey_is_pillows_luma():
    rgb = np.random.default_rng(0).integers(0, 256, (9, 11, 3), dtype=np.uint8)
    x = torch.from_numpy(rgb).permute(2, 0, 1)
    expect = np.asarray(Image.fromarray(rgb).convert("L"))
    assert grey(x).shape == (1, 9, 11) and np.array_equal(grey(x)[0].numpy(), expect)
    same = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(3, 16, 16)
    assert torch.equal(grey(same), same[:1])  # a grey image read as RGB comes back unchanged


def test_grey_folder(tmp_path):
    """data.channels=1: one channel in training and evaluation, the model's geometry says so, and
    the normalization is the training images' own (not ImageNet's, not Fashion-MNIST's)."""
    grey_tree(tmp_path)
    c = cfg(tmp_path, channels=1, batch_size=4)
    b = build_data(c, device="cpu", seed=0)
    assert b.channels == 1 and b.class_names == ["dark", "light"] and b.train_size == 8
    for x, y in b.train.iterate(0):
        assert x.shape == (4, 1, 16, 16) and x.dtype == torch.float32 and len(y) == 4
    # the statistics: the training images' eval view (jpeg.py), every pixel counted
    views = [grey(decode(p, 16, -1, False, "pil")).double() / 255 for p in b.train.dataset.paths]
    pix = torch.stack(views)
    assert b.mean == (round(pix.mean().item(), 4),) and b.std == (round(pix.std(False).item(), 4),)
    assert 0.3 < b.mean[0] < 0.7 and b.std[0] > 0.2
    assert dataset_normalization(c, 0, pairs=False) == (b.mean, b.std)  # rebuilt from the config
    xs, ys = zip(*b.test.iterate())
    x = torch.cat(xs) * b.std[0] + b.mean[0]
    assert x.shape == (2, 1, 16, 16) and torch.cat(ys).tolist() == [0, 1]
    assert torch.allclose(x.mean((1, 2, 3)) * 255, torch.tensor([40.0, 220.0]), atol=0.01)
    assert geometry(c) == (16, 1, 2) and geometry(cfg(tmp_path)) == (16, 3, 2)
    # the same batches with a decoding worker (the collate knows the channels)
    w = build_data(cfg(tmp_path, channels=1, batch_size=4, num_workers=1), device="cpu", seed=0)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(b.train.iterate(1), w.train.iterate(1)))
    w.close()
    # named constants: ImageNet's averaged over the channels; RGB folders keep ImageNet's
    imagenet = build_data(cfg(tmp_path, channels=1, normalize="imagenet"), device="cpu", seed=0)
    assert imagenet.mean == pytest.approx((0.449,)) and imagenet.std == pytest.approx((0.226,))
    assert build_data(cfg(tmp_path), device="cpu", seed=0).mean == (0.485, 0.456, 0.406)
    assert dataset_normalization(cfg(tmp_path / "gone"), 0, False)[0] == (0.485, 0.456, 0.406)
    with pytest.raises(DataError, match="data.channels=2"):
        build_data(cfg(tmp_path, channels=2), device="cpu", seed=0)
    x, *_ = collate([(None, 0, 4, "a.png", "e")], size=8, pairs=False, channels=1)
    assert x.shape == (0, 1, 8, 8)


def test_grey_statistics_of_evenly_spaced_images(tmp_path, monkeypatch):
    from vitscale.data.sources import folder

    paths = []
    for v in range(0, 250, 10):  # 25 flat images, levels 0, 10, ..., 240
        paths.append(str(tmp_path / f"{v:03d}.png"))
        Image.new("L", (8, 8), v).save(paths[-1])
    monkeypatch.setattr(folder, "STATS_IMAGES", 5)  # images 0, 6, 12, 18, 24: 0, 60, ..., 240
    (mean,), (std,) = folder.grey_statistics(np.array(paths), 8)
    levels = np.array([0, 60, 120, 180, 240]) / 255
    assert (mean, std) == (round(levels.mean(), 4), round(levels.std(), 4))
    Image.new("L", (8, 8), 0).save(paths[24])
    with pytest.raises(DataError, match="one flat grey"):
        folder.grey_statistics(np.array(paths[:1] + paths[24:]), 8)
