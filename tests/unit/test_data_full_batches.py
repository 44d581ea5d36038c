"""Issue 25 item 8: every rank's training batch is full when samples are unreadable.

An unreadable training image is replaced before batching (map-style readers: a seeded draw of
another index; the streamed reader: a sample of the stream's previous batch), so the CLIP losses'
cross-rank gathers see equal sizes. The bad sample is counted, never appears in a batch, a
substitute carries its own caption/label and index, batches stay independent of the number of
workers (map-style) and exact on resume, and batches without a bad sample are bit-identical to
those of the same data without it."""

import importlib.util
import io
import logging
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import make_tree
from PIL import Image

from vitscale.config import DataConfig
from vitscale.data import build_data, build_image_text
from vitscale.data.tokenizer import tokenize
from vitscale.errors import DataError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None,
    reason="the BPE vocabulary ships in open-clip-torch",
)
L = 12


def _jpeg(i: int) -> bytes:
    a = np.full((12, 14, 3), ((i * 37) % 256, (i * 91) % 256, (i * 13) % 256), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _csv(root, n=24, bad=()):
    """root/pairs.csv of n pairs (caption 'picture i' for img/i.jpg); `bad` images truncated."""
    (root / "img").mkdir(parents=True, exist_ok=True)
    rows = ["filepath,title"]
    for i in range(n):
        data = _jpeg(i)
        (root / "img" / f"{i}.jpg").write_bytes(data[:40] if i in bad else data)
        rows.append(f"img/{i}.jpg,picture {i}")
    (root / "pairs.csv").write_text("\n".join(rows) + "\n")
    return root / "pairs.csv"


def cfg(**kw):
    base = dict(
        image_size=8,
        batch_size=8,
        eval_batch_size=4,
        num_workers=0,
        on_device=False,
        test_fraction=0.0,
        hflip=True,
    )
    return replace(DataConfig(), **{**base, **kw})


def _epoch(loader, e, start=0):
    return [tuple(t.clone() for t in b) for b in loader.iterate(e, start)]


def _check_pairs(batches, bad, caption, local):
    """Full local batches; the bad indices never appear; each slot's tokens are its index's caption."""
    for x, tok, idx in batches:
        assert len(x) == len(tok) == len(idx) == local
        assert not set(idx.tolist()) & set(bad)
        assert torch.equal(tok, tokenize([caption(i) for i in idx.tolist()], L))


def test_csv_two_ranks_full_batches_with_a_corrupt_image(tmp_path):
    """The loader alone, both ranks: every batch full, the corrupt index never in a batch, counted
    once per epoch (by the rank whose slice holds it), the substitute's index and caption its own."""
    n, bad = 24, 5
    c = cfg(name="csv", root=str(_csv(tmp_path, n, bad=(bad,))))
    ranks = [
        build_image_text(c, device="cpu", seed=1, rank=r, world_size=2, context_length=L)
        for r in (0, 1)
    ]
    for e in range(3):
        before = [b.train.skipped for b in ranks]
        for r, b in enumerate(ranks):
            got = _epoch(b.train, e)
            assert len(got) == n // 8
            _check_pairs(got, [bad], lambda i: f"picture {i}", local=4)
            scheduled = bad in b.train.indices(e).tolist()
            assert b.train.skipped - before[r] == int(scheduled)
        assert sum(b.train.skipped for b in ranks) == e + 1
    for b in ranks:
        b.close()


def test_only_the_bad_slot_changes_and_workers_do_not_matter(tmp_path):
    """Batches without the bad sample are bit-identical to those of the same data without it; the one
    with it differs only in its slot; 0 or 2 decoding workers and a resume give the same batches
    (with the batch augmentation on, whose per-slot parameters the substitute takes)."""
    n, bad = 24, 9
    c = cfg(name="csv", root=str(_csv(tmp_path / "bad", n, bad=(bad,))), randaugment_ops=1)
    clean = build_image_text(
        replace(c, root=str(_csv(tmp_path / "clean", n))), device="cpu", seed=2, context_length=L
    )
    broken = build_image_text(c, device="cpu", seed=2, context_length=L)
    ref, got = _epoch(clean.train, 0), _epoch(broken.train, 0)
    order = clean.train.indices(0).tolist()
    b_bad, j_bad = divmod(order.index(bad), 8)
    for b, ((x0, t0, i0), (x1, t1, i1)) in enumerate(zip(ref, got)):
        same = torch.ones(8, dtype=torch.bool)
        if b == b_bad:
            same[j_bad] = False
            assert i0[j_bad] == bad and i1[j_bad] != bad
        assert (
            torch.equal(x0[same], x1[same])
            and torch.equal(t0[same], t1[same])
            and torch.equal(i0[same], i1[same])
        )
    assert broken.train.skipped == 1 and clean.train.skipped == 0
    w0 = build_image_text(c, device="cpu", seed=2, context_length=L)
    w2 = build_image_text(replace(c, num_workers=2), device="cpu", seed=2, context_length=L)
    for e in (0, 1):
        a, b = _epoch(w0.train, e), _epoch(w2.train, e)
        assert all(torch.equal(p, q) for u, v in zip(a, b) for p, q in zip(u, v))
    tail = _epoch(w2.train, 1, start=1)
    assert all(torch.equal(p, q) for u, v in zip(tail, b[1:]) for p, q in zip(u, v))
    assert w0.train.skipped == 2 and w2.train.skipped == 3  # 2 epochs + the resumed one
    for d in (clean, broken, w0, w2):
        d.close()


def test_folder_classification_and_folder_pairs_full_batches(tmp_path):
    """ImageNet-style folders with a truncated JPEG and a fake PNG: classification batches are full
    (the loop's skip of an all-empty batch no longer triggers), and as CLIP pairs (captions from
    class names) every slot's index and caption are its own."""
    root = make_tree(tmp_path)  # 14 train images, 2 unreadable
    c = cfg(name="folder", root=str(root), batch_size=4, drop_last=False)
    d = build_data(c, device="cpu", seed=0)
    sizes = [len(y) for _, y in d.train.iterate(0)]
    assert sizes == [4, 4, 4, 2] and d.train.skipped == 2
    one = build_data(replace(c, batch_size=1), device="cpu", seed=0)
    assert all(len(y) == 1 for _, y in one.train.iterate(0)) and one.train.skipped == 2
    paths = d.train.dataset.paths
    bad = [i for i, p in enumerate(paths) if "truncated" in p or "not_an_image" in p]
    labels = d.train.dataset.labels
    for r in (0, 1):
        p = build_image_text(
            replace(c, captions=True, caption_template="a {}"),
            device="cpu",
            seed=0,
            rank=r,
            world_size=2,
            context_length=L,
        )
        names = p.zeroshot["folder"].class_names
        got = _epoch(p.train, 1)
        assert len(got) == 3  # drop_last for CLIP
        _check_pairs(got, bad, lambda i: f"a {names[labels[i]]}", local=2)  # noqa: B023 - called here
        p.close()
    for b in (d, one):
        b.close()


def _tar(path, samples):
    import tarfile

    with tarfile.open(path, "w") as tf:
        for name, data in samples:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


def _shards(folder, n_shards=4, per=6, bad=(), label=False):
    """Shards of samples s0000.. with 'sample k' captions (or labels k % 3); `bad` JPEGs corrupt."""
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(n_shards):
        members = []
        for k in range(s * per, (s + 1) * per):
            members += [
                (f"s{k:04d}.jpg", b"not a jpeg" if k in bad else _jpeg(k)),
                (
                    f"s{k:04d}.cls" if label else f"s{k:04d}.txt",
                    str(k % 3).encode() if label else f"sample {k}".encode(),
                ),
            ]
        _tar(folder / f"{s:05d}.tar", members)
    return folder


@pytest.mark.parametrize("reader", ["seek", "stream"])
def test_shards_two_ranks_full_batches_with_a_corrupt_image(tmp_path, reader):
    """Shards with a corrupt JPEG, both readers, both ranks: full batches, the bad sample's index
    never in a batch, every slot's caption its own index's; the stream's resume is exact."""
    root, held = _shards(tmp_path / "train", bad=(3, 13)), _shards(tmp_path / "held", 2, 2)
    c = cfg(
        name="webdataset",
        reader=reader,
        root=str(root),
        test_root=str(held),
        batch_size=4,
        num_workers=1 if reader == "stream" else 0,
        shuffle_buffer=4,
    )
    skipped = 0
    for r in (0, 1):
        b = build_image_text(c, device="cpu", seed=0, rank=r, world_size=2, context_length=L)
        for e in (0, 1):
            got = _epoch(b.train, e)
            assert len(got) == len(b.train) == 6
            _check_pairs(got, [3, 13], lambda i: f"sample {i}", local=2)
        skipped += b.train.skipped
        if reader == "stream":
            tail = _epoch(b.train, 1, start=2)
            assert all(torch.equal(p, q) for u, v in zip(tail, got[2:]) for p, q in zip(u, v))
        b.close()
    assert skipped == 2 * 2  # every sample once per epoch over the ranks: each bad one counted


def test_stream_substitute_comes_from_the_previous_batch(tmp_path):
    """Without a shuffle buffer the stream's order is the shards': a bad sample in a stream's first
    batch is replaced by a good one of the same batch, later ones by the previous batch's sample
    at the same slot; labelled (classification) shards too."""
    root = _shards(tmp_path / "train", 2, 8, bad=(1, 6, 9, 14), label=True)
    held = _shards(tmp_path / "held", 2, 2, label=True)
    c = cfg(
        name="webdataset",
        reader="stream",
        root=str(root),
        test_root=str(held),
        batch_size=4,
        num_workers=0,
        shuffle_buffer=0,
    )
    for r in (0, 1):
        d = build_data(c, device="cpu", seed=0, rank=r, world_size=2)
        shards = d.train.plan.stream_shards(0, 0)
        assert len(shards) == 1
        ys = [y for _, y in d.train.iterate(0)]
        assert [len(y) for y in ys] == [2] * 4 and d.train.skipped == 2
        first = shards[0] * 8  # this rank's samples in order: first + p, 2 a batch
        want = [(first + p) % 3 for p in range(8)]
        want[1] = want[0]  # batch 0, slot 1: no previous batch, this batch's other sample
        want[6] = want[4]  # batch 3, slot 0: batch 2's slot 0
        assert torch.cat(ys).tolist() == want
        d.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_unreadable_everything_is_a_one_line_error(tmp_path, workers):
    """No substitute to be found: a one-line DataError from the main process, not a worker's traceback."""
    c = cfg(
        name="csv", root=str(_csv(tmp_path, 8, bad=range(8))), batch_size=4, num_workers=workers
    )
    root, held = _shards(tmp_path / "s", 2, 4, bad=range(8)), _shards(tmp_path / "h", 2, 2)
    s = cfg(
        name="webdataset",
        reader="stream",
        root=str(root),
        test_root=str(held),
        batch_size=4,
        num_workers=workers,
    )
    for conf, what in (
        (c, "data: no readable substitute for"),
        (s, "webdataset: no readable image in a batch"),
    ):
        b = build_image_text(conf, device="cpu", seed=0, context_length=L)
        with pytest.raises(DataError) as e:
            next(iter(b.train.iterate(0)))
        assert str(e.value).startswith(what) and "\n" not in str(e.value), str(e.value)
        b.close()


def test_evaluation_still_drops_unreadable_images(tmp_path, caplog):
    """Held-out data is evaluated once per sample: an unreadable one is dropped and counted."""
    train, held = _csv(tmp_path / "t", 8), _csv(tmp_path / "h", 6, bad=(2,))
    b = build_image_text(
        cfg(name="csv", root=str(train), test_root=str(held)),
        device="cpu",
        seed=0,
        context_length=L,
    )
    with caplog.at_level(logging.WARNING, logger="vitscale.data"):
        idx = torch.cat([i for _, _, i in b.test.iterate()])
    assert idx.tolist() == [0, 1, 3, 4, 5] and b.test.skipped == 1
