"""Fashion-MNIST idx files and CIFAR pickles: parsing, validation, error messages."""

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import _dump, write_cifar, write_fmnist, write_idx

from vitscale.config import DataConfig
from vitscale.data import build_data
from vitscale.data.sources import cifar, fashion_mnist
from vitscale.errors import DataError

REAL_FMNIST = Path("/usr/share/datasets/fashion-mnist")


def test_idx_reader_roundtrip(tmp_path):
    data = write_fmnist(tmp_path)
    splits = fashion_mnist.load(tmp_path)
    assert splits.train_x.shape == (12, 1, 28, 28) and splits.train_x.dtype == torch.uint8
    assert torch.equal(splits.train_x[:, 0], torch.from_numpy(data["train"][0].astype(np.uint8)))
    assert splits.test_y.tolist() == data["t10k"][1].tolist() and splits.test_y.dtype == torch.int64
    assert splits.class_names[0] == "T-shirt/top" and len(splits.class_names) == 10


def test_idx_uncompressed_accepted(tmp_path):
    write_fmnist(tmp_path)
    raw = gzip.decompress((tmp_path / "t10k-labels-idx1-ubyte.gz").read_bytes())
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(raw)
    assert len(fashion_mnist.load(tmp_path).test_y) == 5


def test_idx_truncated_gz(tmp_path):
    write_fmnist(tmp_path)
    f = tmp_path / "train-images-idx3-ubyte.gz"
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz.*truncated"):
        fashion_mnist.load(tmp_path)


def test_idx_bad_magic(tmp_path):
    write_fmnist(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.zeros(5), magic=0x0000_0D01)
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz: bad magic"):
        fashion_mnist.load(tmp_path)


def test_idx_length_mismatch(tmp_path):
    write_fmnist(tmp_path)
    f = tmp_path / "train-images-idx3-ubyte.gz"
    f.write_bytes(gzip.compress(gzip.decompress(f.read_bytes())[:-10]))  # valid gzip, short data
    with pytest.raises(DataError, match="train-images.*expected"):
        fashion_mnist.load(tmp_path)
    write_fmnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(11))  # 11 labels, 12 images
    with pytest.raises(DataError, match="11 labels for 12 images"):
        fashion_mnist.load(tmp_path)


def test_fmnist_missing_names_the_fix(tmp_path):
    with pytest.raises(DataError, match="vitscale data download fashion-mnist") as e:
        build_data(
            DataConfig(name="fashion_mnist", root=str(tmp_path / "nowhere")), device="cpu", seed=0
        )
    assert str(tmp_path / "nowhere") in str(e.value) and "\n" not in str(e.value)


def test_fmnist_resize_at_load(tmp_path):
    write_fmnist(tmp_path)
    b = build_data(
        DataConfig(name="fashion_mnist", root=str(tmp_path), image_size=32, batch_size=4),
        device="cpu",
        seed=0,
    )
    x, y = next(b.train.iterate(0))
    assert x.shape == (4, 1, 32, 32) and b.image_size == 32 and b.channels == 1
    assert next(b.test.iterate())[0].shape == (5, 1, 32, 32)


@pytest.mark.skipif(
    not (REAL_FMNIST / "train-images-idx3-ubyte.gz").exists(),
    reason="dataset-fashion-mnist not installed",
)
def test_real_fashion_mnist():
    s = fashion_mnist.load(REAL_FMNIST)
    assert s.train_x.shape == (60000, 1, 28, 28) and s.test_x.shape == (10000, 1, 28, 28)
    assert torch.bincount(s.train_y).tolist() == [6000] * 10
    assert torch.bincount(s.test_y).tolist() == [1000] * 10
    mean = s.train_x.float().mean().item() / 255
    assert abs(mean - fashion_mnist.MEAN[0]) < 1e-3  # the constant we normalize with


# ---- CIFAR, written in the exact official format (protocol-2 pickles, bytes keys) ----


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_pixel_order_labels_names(tmp_path, name):
    base, files = write_cifar(tmp_path, name)
    first = "data_batch_1" if name == "cifar10" else "train"
    files[first][0][0, :] = 0
    files[first][0][0, 2 * 1024 + 5 * 32 + 7] = 201  # blue plane, row 5, column 7
    _dump(
        base / first,
        {
            b"data": files[first][0],
            (b"labels" if name == "cifar10" else b"fine_labels"): files[first][1],
        },
    )
    for root in (tmp_path, base):  # parent or the folder itself
        s = cifar.load(name, root)
        assert s.train_x.shape == (15, 3, 32, 32) and s.test_x.shape == (4, 3, 32, 32)
        assert s.train_x[0, 2, 5, 7] == 201 and s.train_x[0].sum() == 201
        train_files = [f for f in files if "test" not in f]
        assert s.train_y.tolist() == sum((files[f][1] for f in train_files), [])
        assert s.test_y.tolist() == files["test_batch" if name == "cifar10" else "test"][1]
    assert len(s.class_names) == (10 if name == "cifar10" else 100)
    assert s.class_names[1] == ("automobile" if name == "cifar10" else "c1")


def test_cifar_build_data_normalizes(tmp_path):
    write_cifar(tmp_path, "cifar10")
    b = build_data(
        DataConfig(name="cifar10", root=str(tmp_path), batch_size=5), device="cpu", seed=0
    )
    assert (b.num_classes, b.channels, b.image_size, b.train_size, b.test_size) == (
        10,
        3,
        32,
        15,
        4,
    )
    x, y = next(b.test.iterate())
    raw = cifar.load("cifar10", tmp_path).test_x.float() / 255
    expect = (raw - torch.tensor(b.mean).view(1, 3, 1, 1)) / torch.tensor(b.std).view(1, 3, 1, 1)
    assert torch.allclose(x, expect, atol=1e-5)


def test_cifar_corrupt_and_missing(tmp_path):
    base, _ = write_cifar(tmp_path, "cifar10")
    (base / "data_batch_3").write_bytes(b"\x80\x02}q\x00(garbage")
    with pytest.raises(DataError, match="data_batch_3: not a valid CIFAR pickle"):
        cifar.load("cifar10", tmp_path)
    _dump(base / "data_batch_3", {b"data": np.zeros((2, 1000), np.uint8), b"labels": [0, 1]})
    with pytest.raises(DataError, match=r"data_batch_3: data is uint8 \(2, 1000\)"):
        cifar.load("cifar10", tmp_path)
    with pytest.raises(DataError, match="vitscale data download cifar100"):
        cifar.load("cifar100", tmp_path)


def test_cifar_pickle_cannot_run_code(tmp_path):
    base, _ = write_cifar(tmp_path, "cifar10")

    class Evil:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    _dump(base / "test_batch", {b"data": Evil(), b"labels": []})
    with pytest.raises(DataError, match="test_batch"):
        cifar.load("cifar10", tmp_path)
    assert not (tmp_path / "pwned").exists()
