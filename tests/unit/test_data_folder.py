"""ImageNet-style folder datasets: odd image modes, broken files, worker-count independence."""

import logging

import numpy as np
import pytest
import torch
from helpers import BLUE, RED, make_tree
from PIL import Image

from vitscale.config import DataConfig
from vitscale.data import build_data
from vitscale.data.jpeg import to_rgb
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
