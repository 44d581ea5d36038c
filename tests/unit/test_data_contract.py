"""The batch contract every data path keeps (data/types.py), labelled and image-text pairs alike:
in memory (Fashion-MNIST files, synthetic, OpenClipArt), folder, CSV, webdataset shards read by
seeking and streamed, and a labelled set captioned for CLIP (data/loaders/captions.py)."""

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import make_tree, shard_jpeg, write_fmnist, write_shards
from PIL import Image

from vitscale.config import DataConfig
from vitscale.data import build_data, build_image_text
from vitscale.data.types import EvalLoader, TrainLoader

L = 12  # context length
HAS_VOCAB = (
    importlib.util.find_spec("open_clip") is not None
)  # the BPE vocabulary ships in open-clip-torch


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    write_fmnist(root / "fmnist", n_train=12, n_test=5)
    make_tree(root / "tree")
    write_shards(root / "shards" / "train", n_shards=4, per=6)  # 24 samples
    write_shards(root / "shards" / "test", n_shards=2, per=4, start=100)  # 8 held-out samples
    (root / "img").mkdir()
    rows = ["filepath,title"]
    for i in range(24):
        (root / "img" / f"{i}.jpg").write_bytes(shard_jpeg(i))
        rows.append(f'img/{i}.jpg,"caption number {i}"')
    (root / "pairs.csv").write_text("\n".join(rows) + "\n")
    write_openclipart(root / "openclipart")
    return root


def write_openclipart(root):
    """OpenClipArt's layout (png/<category>/NAME.png, svg/<category>/NAME.svg): 16 drawings."""
    rng = np.random.default_rng(0)
    for i in range(16):
        category = ("animals", "food", "special")[i % 3]
        for kind in ("png", "svg"):
            (root / kind / category).mkdir(parents=True, exist_ok=True)
        a = rng.integers(0, 256, (12 + i, 20, 4), dtype=np.uint8)
        Image.fromarray(a, "RGBA").save(root / "png" / category / f"thing_{i}.png")
        (root / "svg" / category / f"thing_{i}.svg").write_text("<svg/>")


def data_config(path: str, root) -> DataConfig:
    shards = dict(
        name="webdataset",
        root=str(root / "shards" / "train"),
        test_root=str(root / "shards" / "test"),
    )
    synthetic = dict(name="synthetic", train_size=12, test_size=5, num_classes=3, channels=3)
    kw = {
        "memory": dict(name="fashion_mnist", root=str(root / "fmnist"), image_size=0),
        "synthetic": synthetic,
        "folder": dict(name="folder", root=str(root / "tree")),
        "csv": dict(name="csv", root=str(root / "pairs.csv"), test_fraction=0.25),
        "openclipart": dict(name="openclipart", root=str(root / "openclipart"), test_fraction=0.4),
        "seek": dict(shards, reader="seek"),
        "stream": dict(shards, reader="stream"),
        "captions-memory": dict(synthetic, captions=True),
        "captions-folder": dict(name="folder", root=str(root / "tree"), captions=True),
    }[path]
    base = dict(
        image_size=16,
        batch_size=4,
        eval_batch_size=3,
        num_workers=0,
        on_device=False,
        drop_last=True,
        hflip=True,
    )
    return replace(DataConfig(), **{**base, **kw})


LABELLED = ["memory", "synthetic", "folder", "seek", "stream"]
PAIRS = ["csv", "openclipart", "seek", "stream", "captions-memory", "captions-folder"]
CASES = [(p, "labels") for p in LABELLED] + [(p, "pairs") for p in PAIRS]


def check_images(x, bundle, n=None):
    """float32 [n,C,S,S] on the CPU, normalized with the bundle's mean/std."""
    assert x.dtype == torch.float32 and x.device == torch.device("cpu")
    assert x.shape[1:] == (bundle.channels, bundle.image_size, bundle.image_size)
    assert n is None or x.shape[0] == n
    assert torch.isfinite(x).all()


def check_normalized(x, bundle):
    """Evaluation images are decoded pixels, normalized: undone, they are integers in 0..255."""
    mean = torch.tensor(bundle.mean).view(1, -1, 1, 1)
    std = torch.tensor(bundle.std).view(1, -1, 1, 1)
    pixels = (x * std + mean) * 255
    assert (pixels - pixels.round()).abs().max() < 0.02
    assert pixels.min() > -0.02 and pixels.max() < 255.02


def check_second(batch, bundle, kind, n, num_classes):
    """labels int64 [n] in range, or tokens int64 [n,L] and dataset index int64 [n]."""
    if kind == "labels":
        assert len(batch) == 2
        y = batch[1]
        assert y.dtype == torch.int64 and y.shape == (n,)
        assert ((0 <= y) & (y < num_classes)).all()
    else:
        assert len(batch) == 3
        tokens, index = batch[1], batch[2]
        assert tokens.dtype == torch.int64 and tokens.shape == (n, L)
        assert index.dtype == torch.int64 and index.shape == (n,)
        assert ((0 <= index) & (index < max(bundle.train_size, bundle.test_size))).all()


@pytest.mark.parametrize("path,kind", CASES, ids=[f"{p}-{k}" for p, k in CASES])
def test_batch_contract(roots, path, kind, tmp_path, monkeypatch):
    if kind == "pairs" and not HAS_VOCAB:
        pytest.skip("the BPE vocabulary ships in open-clip-torch")
    monkeypatch.setenv(
        "VITSCALE_DATA", str(tmp_path)
    )  # caches (OpenClipArt's decoded set, shard indexes)
    cfg = data_config(path, roots)
    if kind == "labels":
        bundle = build_data(cfg, device="cpu", seed=0)
        num_classes = bundle.num_classes
        assert num_classes >= 2 and len(bundle.class_names) == num_classes
    else:
        bundle = build_image_text(cfg, device="cpu", seed=0, context_length=L)
        num_classes = 0
    try:
        train = bundle.train
        assert isinstance(train, TrainLoader) and isinstance(
            bundle.test, EvalLoader
        )  # data/types.py
        steps = bundle.train_size // cfg.batch_size
        assert len(train) == steps > 0  # whole global batches, the same on every path
        batches = list(train.iterate(0))
        assert len(batches) == steps
        for batch in batches:
            check_images(batch[0], bundle, n=train.batch_size)  # always full (substitutes)
            check_second(batch, bundle, kind, train.batch_size, num_classes)
        evaluated = 0
        for n, batch in enumerate(bundle.test.iterate(), 1):  # noqa: B007 - n is read after the loop
            b = len(batch[0])
            assert 0 < b <= cfg.eval_batch_size
            check_images(batch[0], bundle)
            check_normalized(batch[0], bundle)
            check_second(batch, bundle, kind, b, num_classes)
            evaluated += b
        assert n == len(bundle.test) and 0 < evaluated <= bundle.test_size
        for zs in bundle.zeroshot.values():  # the captioned sets' labels
            for x, y in zs.loader.iterate():
                check_images(x, bundle)
                assert y.dtype == torch.int64 and ((0 <= y) & (y < len(zs.class_names))).all()
    finally:
        bundle.close()
