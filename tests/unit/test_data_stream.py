"""Streamed webdataset shards (data.reader=stream): resume, ranks, index routing, sources, bad input
(2 ranks under torchrun: integration/test_data_stream_dist.py). The `shards` fixture: conftest.py."""

import gzip
import importlib.util
import logging
import os
import tarfile
from dataclasses import replace

import pytest
import torch
from helpers import shard_jpeg, tar_add, write_shards

from vitscale.config import DataConfig
from vitscale.data import build_data, build_image_text
from vitscale.data.build import resolve_reader
from vitscale.data.loaders.stream_plan import StreamPlan
from vitscale.data.sources.shard_sets import shard_sets
from vitscale.data.sources.shards import is_remote, open_url
from vitscale.data.tokenizer import tokenize
from vitscale.errors import DataError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None,
    reason="the BPE vocabulary ships in open-clip-torch",
)
L = 12


def cfg(root, test_root, **kw):
    base = dict(
        name="webdataset",
        reader="stream",
        root=str(root),
        test_root=str(test_root),
        image_size=16,
        batch_size=4,
        eval_batch_size=5,
        num_workers=2,
        on_device=False,
        shuffle_buffer=8,
        hflip=True,
    )
    base.update(kw)
    return replace(DataConfig(), **base)


def pairs(c, **kw):
    return build_image_text(c, device="cpu", seed=kw.pop("seed", 0), context_length=L, **kw)


def epoch(loader, e, start=0):
    return [tuple(t.clone() for t in b) for b in loader.iterate(e, start)]


def test_index_routing_and_resume(shards):
    """Every row's tokens are the caption of the sample its index names (FastCLIP's state routing);
    a resume at batch 3 gives the uninterrupted run's batches, bit for bit."""
    b = pairs(cfg(shards / "train", shards / "test"))
    assert (b.train_size, b.test_size, len(b.train)) == (24, 8, 6)
    full = epoch(b.train, 1)
    assert len(full) == 6
    idx = torch.cat([i for _, _, i in full])
    assert sorted(idx.tolist()) == list(range(24))  # 4 shards over 2 streams: all once
    for x, t, i in full:
        assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32
        assert torch.equal(t, tokenize([f"sample {k}" for k in i.tolist()], L))
    for a, r in zip(full[3:], epoch(b.train, 1, 3), strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, r))
    other = torch.cat([i for _, _, i in epoch(b.train, 2)])
    assert other.tolist() != idx.tolist() and sorted(other.tolist()) == list(
        range(24)
    )  # a new order
    seen = torch.cat([i for _, _, i in b.test.iterate()])
    assert sorted(seen.tolist()) == list(range(8)) and len(b.test) == 2
    b.close()


def test_index_equals_seek_reader(shards, tmp_path):
    """Without a manifest the index is the count of earlier samples + the position in the shard:
    what the seek reader gives the same sample."""
    c = cfg(shards / "train", shards / "test", num_workers=0)
    stream = pairs(c)
    seek = pairs(replace(c, reader="seek"))
    caps = seek.train.dataset.rec.captions
    for _x, t, i in stream.train.iterate(0):
        assert torch.equal(t, tokenize([str(caps[k]) for k in i.tolist()], L))
    assert resolve_reader(replace(c, reader="auto")) == "seek"  # local .tar: exact epochs


def test_two_ranks_disjoint_equal_steps(shards):
    c = cfg(shards / "train", shards / "test", num_workers=1)
    ranks = [pairs(c, rank=r, world_size=2) for r in (0, 1)]
    got = [epoch(b.train, 0) for b in ranks]
    assert len(got[0]) == len(got[1]) == len(ranks[0].train) == 6
    i0, i1 = (torch.cat([i for _, _, i in g]) for g in got)
    assert all(len(i) == 2 for g in got for _, _, i in g)  # 4 = 2 + 2 per step
    assert not set(i0.tolist()) & set(i1.tolist())
    assert sorted(i0.tolist() + i1.tolist()) == list(range(24))
    tests = [torch.cat([i for _, _, i in b.test.iterate()]) for b in ranks]
    assert sorted(torch.cat(tests).tolist()) == list(range(8))
    for b in ranks:
        b.close()


def test_uneven_shards_equal_steps(tmp_path):
    """3 shards of 5, 9 and 2 samples over 2 ranks: both ranks give floor(16/4) steps; the short
    rank starts its shards over (a documented approximation of an exact epoch)."""
    root = tmp_path / "u"
    for s, n in enumerate((5, 9, 2)):
        write_shards(root / f"p{s}", n_shards=1, per=n, start=100 * s)
        os.rename(root / f"p{s}" / "00000.tar", root / f"{s:05d}.tar")
    write_shards(tmp_path / "t", n_shards=2, per=2, start=900)
    c = cfg(root, tmp_path / "t", num_workers=0)
    ranks = [pairs(c, rank=r, world_size=2) for r in (0, 1)]
    counts = [len(epoch(b.train, e)) for b in ranks for e in (0, 1)]
    assert counts == [4] * 4


def test_pipe_gz_and_compressed_members(shards, tmp_path):
    """pipe:cat URLs, .tar.gz shards and KEY.txt.gz members give the same batches as plain files."""
    gz = write_shards(tmp_path / "gz", gz=True, gz_members=True)
    base = cfg(shards / "train", shards / "test", num_workers=0)
    plain = epoch(pairs(base).train, 0)
    piped = epoch(
        pairs(replace(base, root=f"pipe:cat {shards}/train/{{00000..00003}}.tar")).train, 0
    )
    zipped = epoch(pairs(replace(base, root=str(gz))).train, 0)
    for a, b, z in zip(plain, piped, zipped, strict=True):
        assert all(torch.equal(u, v) and torch.equal(u, w) for u, v, w in zip(a, b, z))
    assert resolve_reader(replace(base, reader="auto", root=str(gz))) == "stream"
    assert is_remote("pipe:cat x") and is_remote("s3://b/k.tar") and is_remote("https://h/a.tar")
    assert (
        not is_remote("/data/{0..3}.tar")
        and open_url("s3://b/0.tar") == "pipe:aws s3 cp s3://b/0.tar -"
    )


def test_classification_from_streamed_shards(shards):
    c = cfg(shards / "train", shards / "test", batch_size=6)
    d = build_data(c, device="cpu", seed=0)
    assert (d.num_classes, d.train_size, d.test_size, len(d.train)) == (3, 24, 8, 4)
    ys = torch.cat([y for _, y in d.train.iterate(0)])
    assert len(ys) == 24 and set(ys.tolist()) == {0, 1, 2}
    x, y = next(iter(d.test.iterate()))
    assert x.shape[1:] == (3, 16, 16) and y.dtype == torch.int64
    d.close()
    seek = build_data(
        replace(c, reader="seek"), device="cpu", seed=0
    )  # the same set, read by seeking
    assert (seek.num_classes, seek.train_size, seek.test_size) == (3, 24, 8)
    assert sorted(torch.cat([y for _, y in seek.train.iterate(0)]).tolist()) == sorted(ys.tolist())
    assert sorted(torch.cat([y for _, y in seek.test.iterate()]).tolist()) == sorted(
        k % 3 for k in range(100, 108)
    )


def test_bad_input_skipped_and_counted(tmp_path, caplog):
    """A corrupt JPEG and a sample without caption are skipped and counted; a truncated shard
    and one that vanishes mid-epoch stop that shard with a warning: the epoch still has all its steps."""
    root = write_shards(tmp_path / "bad", bad_jpeg=(2,), no_caption=(7,))
    write_shards(tmp_path / "t", n_shards=2, per=2, start=900)
    data = (root / "00002.tar").read_bytes()
    (root / "00002.tar").write_bytes(data[: len(data) // 2])  # truncated
    c = cfg(root, tmp_path / "t", num_workers=0, shuffle_buffer=0)
    b = pairs(c)
    with caplog.at_level(logging.WARNING, logger="vitscale.data"):
        got = epoch(b.train, 0)
    assert len(got) == len(b.train)
    assert b.train.skipped >= 1 and any(
        "not a jpeg" in r.getMessage() or "skipped sample" in r.getMessage() for r in caplog.records
    )
    assert any("no caption" in r.getMessage() for r in caplog.records)
    assert any(
        "00002.tar" in r.getMessage() and "stopped" in r.getMessage() for r in caplog.records
    )
    os.remove(root / "00003.tar")  # vanishes after counting
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitscale.data"):
        assert len(epoch(b.train, 1)) == len(b.train)
    assert any("00003.tar" in r.getMessage() for r in caplog.records)
    for name in ("00000.tar", "00001.tar", "00002.tar"):
        os.remove(root / name)  # nothing left to read: one line
    with pytest.raises(DataError, match="none of the"):
        epoch(b.train, 2)


def test_one_line_errors(shards, tmp_path):
    with pytest.raises(DataError, match="not found"):
        pairs(cfg(tmp_path / "nope" / "{0..3}.tar", shards / "test"))
    with pytest.raises(DataError, match="non-empty shard"):
        pairs(cfg(shards / "test", shards / "test", num_workers=4, batch_size=2))
    with pytest.raises(DataError, match="larger than the training set"):
        pairs(cfg(shards / "test", shards / "test", batch_size=64))
    train, _ = shard_sets(cfg(shards / "train", shards / "test"), "txt")
    plan = StreamPlan(train, 4, seed=0, rank=1, world_size=2, streams=2)
    assert len(plan) == 6 and [plan.batches_of(v) for v in (0, 1)] == [3, 3]


def _train(out, config, shards, *extra):
    from helpers import sets

    from vitscale.cli import main

    base = [
        "run.threads=1",
        "data.name=webdataset",
        "data.reader=stream",
        f"data.root={shards / 'train'}",
        f"data.test_root={shards / 'test'}",
        "data.image_size=16",
        "data.batch_size=8",
        "data.eval_batch_size=8",
        "data.num_workers=2",
        "data.on_device=false",
        "model.patch_size=4",
    ]
    assert main(["train", config, "--out", str(out), *sets([*base, *extra])]) == 0
    return out


@pytest.mark.integration
def test_fastclip_trains_and_resumes_exactly_from_streamed_shards(shards, tmp_path):
    import json

    from helpers import interrupted_copy, rel_diff

    from vitscale import checkpoint as ckpt
    from vitscale.cli import main

    full = _train(
        tmp_path / "full",
        "configs/tests/clip_tiny.toml",
        shards,
        "clip.loss=fastclip_v3",
        "run.checkpoint_every=2",
        "run.keep_last=100",
        "train.epochs=3",
    )
    s = json.loads((full / "summary.json").read_text())
    assert s["steps"] == 9 and s["test_pairs"] == 8
    part = interrupted_copy(full, tmp_path / "part", step=4)  # mid-epoch 2
    assert main(["train", "--resume", str(part)]) == 0
    a, b = (torch.load(ckpt.list_checkpoints(r)[-1], weights_only=False) for r in (part, full))
    assert a["step"] == b["step"] == 9
    assert rel_diff(a["strategy"]["model"], b["strategy"]["model"]) == 0.0
    assert (
        torch.equal(a["task"]["lu1"], b["task"]["lu1"]) and (b["task"]["lu1"] != 0).sum() == 24
    )  # all 24 touched


@pytest.mark.integration
def test_classification_trains_from_streamed_shards(shards, tmp_path):
    import json

    out = _train(tmp_path / "vit", "configs/tests/tiny.toml", shards, "data.hflip=true")
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 6 and s["test_count"] == 8 and 0.0 <= s["test_accuracy"] <= 1.0


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A 3-class folder (8 train + 2 val images each) and a 24-pair CSV through `data prepare`."""
    from vitscale.data.offline.prepare import prepare

    root = tmp_path_factory.mktemp("prep")
    rows = ["filepath,title"]
    for c in range(3):
        for split, n in (("train", 8), ("val", 2)):
            d = root / "folder" / split / f"class{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                (d / f"{i}.jpg").write_bytes(shard_jpeg(100 * c + i))
    for i in range(24):
        (root / f"p{i}.jpg").write_bytes(shard_jpeg(500 + i))
        rows.append(f"p{i}.jpg,picture {i}")
    (root / "pairs.csv").write_text("\n".join(rows) + "\n")
    prepare(
        str(root / "folder"), str(root / "cls"), size=20, shard_size=6, workers=1, progress=False
    )
    prepare(
        str(root / "pairs.csv"),
        str(root / "pairs"),
        size=20,
        shard_size=5,
        workers=1,
        val_fraction=0.25,
        progress=False,
    )
    return root


def test_prepared_shards_stream_and_seek(prepared):
    """Prepared shards: index = int(KEY) (tokens match the captions the manifest's json holds),
    the val split is the held-out set, and the seek reader gives the same indices."""
    import json

    import webdataset as wds

    m = json.loads((prepared / "pairs" / "manifest.json").read_text())
    caption = {}
    for s in wds.WebDataset(
        [str(prepared / "pairs" / f) for f in m["splits"]["train"]["shards"]], shardshuffle=False
    ):
        caption[int(s["__key__"])] = s["txt"].decode()
    n = m["splits"]["train"]["samples"]
    assert sorted(caption) == list(range(n))
    for reader in ("stream", "seek"):
        c = replace(
            DataConfig(),
            name="webdataset",
            reader=reader,
            root=str(prepared / "pairs"),
            image_size=16,
            batch_size=4,
            eval_batch_size=4,
            num_workers=0,
            on_device=False,
        )
        b = pairs(c)
        assert (b.train_size, b.test_size) == (n, m["splits"]["val"]["samples"])
        seen = []
        for _x, t, i in b.train.iterate(0):
            assert torch.equal(t, tokenize([caption[k] for k in i.tolist()], L))
            seen += i.tolist()
        assert len(seen) == n // 4 * 4 and len(set(seen)) == len(seen)
        assert sum(len(i) for _, _, i in b.test.iterate()) == b.test_size
        b.close()
    assert resolve_reader(replace(c, reader="auto")) == "seek"


@pytest.mark.integration
def test_classification_trains_from_prepared_shards(prepared, tmp_path):
    import json

    from helpers import sets

    from vitscale.cli import main

    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "configs/tests/tiny.toml",
                "--out",
                str(out),
                *sets(
                    [
                        "run.threads=1",
                        "data.name=webdataset",
                        f"data.root={prepared / 'cls'}",
                        "data.image_size=16",
                        "data.batch_size=6",
                        "data.num_workers=2",
                        "model.patch_size=4",
                        "data.on_device=false",
                    ]
                ),
            ]
        )
        == 0
    )
    s = json.loads((out / "summary.json").read_text())
    assert (
        s["steps"] == 8 and s["test_count"] == 6 and 0.0 <= s["test_accuracy"] <= 1.0
    )  # 24 / 6 x 2 epochs


def test_unreadable_compressed_member_is_skipped(tmp_path, caplog):
    root = write_shards(tmp_path / "z", n_shards=2, per=4)
    with tarfile.open(root / "00002.tar", "w") as tf:  # one more shard: 4 samples, 1 bad .gz
        for k in range(50, 54):
            tar_add(tf, f"s{k:04d}.jpg", shard_jpeg(k))
            tar_add(
                tf,
                f"s{k:04d}.txt.gz",
                b"not gzip" if k == 51 else gzip.compress(f"sample {k}".encode()),
            )
    write_shards(tmp_path / "t", n_shards=1, per=2, start=900)
    b = pairs(cfg(root, tmp_path / "t", num_workers=0, shuffle_buffer=0, batch_size=11))
    assert b.train_size == 11  # counted without the bad one
    with caplog.at_level(logging.WARNING, logger="vitscale.data"):
        n = sum(len(i) for _, _, i in b.train.iterate(0))
    assert n == 11 and any("unreadable member .txt.gz" in r.getMessage() for r in caplog.records)
