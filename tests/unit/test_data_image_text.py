"""Image-text pairs for CLIP: CSV/TSV, webdataset shards, OpenClipArt, classification captions."""

import importlib.util
import io
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitscale.config import DataConfig
from vitscale.data import build_image_text
from vitscale.data.build import openclipart_bundle
from vitscale.data.sources import openclipart as oca
from vitscale.errors import DataError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None,
    reason="the BPE vocabulary ships in open-clip-torch",
)
L = 16


def _png(i, fmt="PNG"):
    a = np.full((20 + i % 5, 24, 3), (i * 37) % 256, np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, fmt)
    return buf.getvalue()


def cfg(**kw):
    base = dict(
        image_size=16,
        batch_size=4,
        eval_batch_size=3,
        num_workers=0,
        on_device=False,
        test_fraction=0.25,
    )
    base.update(kw)
    return replace(DataConfig(), **base)


@pytest.fixture
def csv_file(tmp_path):
    (tmp_path / "img").mkdir()
    rows = ["filepath,title"]
    for i in range(24):
        (tmp_path / "img" / f"{i}.png").write_bytes(_png(i))
        rows.append(f'img/{i}.png,"caption number {i}, a thing"')
    p = tmp_path / "pairs.csv"
    p.write_text("\n".join(rows) + "\n")
    return p


def _shards(folder, n_shards=3, per=7, bad_key=None):
    folder.mkdir(exist_ok=True)
    k = 0
    for s in range(n_shards):
        with tarfile.open(folder / f"{s:05d}.tar", "w") as tf:
            for _ in range(per):
                key = f"s{k:04d}"
                members = {
                    f"{key}.jpg": b"not an image" if key == bad_key else _png(k, "JPEG"),
                    f"{key}.txt": f"sample {k}".encode(),
                    f"{key}.json": b"{}",
                }
                for name, data in members.items():
                    ti = tarfile.TarInfo(name)
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
                k += 1
    return folder


def _epoch(loader, epoch, start=0):
    return [(x, t, i) for x, t, i in loader.iterate(epoch, start)]


def _check_bundle(b, n_total):
    assert b.train_size + b.test_size == n_total and b.test_size > 0
    assert len(b.captions_test) == b.test_size
    batches = _epoch(b.train, 0)
    assert len(batches) == len(b.train) == b.train_size // 4
    x, t, i = batches[0]
    assert x.dtype == torch.float32 and x.shape == (4, b.channels, 16, 16)
    assert t.dtype == torch.int64 and t.shape == (4, L) and (t[:, 0] == 49406).all()
    idx = torch.cat([i for _, _, i in batches])
    assert len(set(idx.tolist())) == len(idx) and 0 <= idx.min() and idx.max() < b.train_size
    # resume: the tail of a full epoch
    tail = _epoch(b.train, 0, 2)
    for (x1, t1, i1), (x2, t2, i2) in zip(batches[2:], tail):
        assert torch.equal(x1, x2) and torch.equal(t1, t2) and torch.equal(i1, i2)
    seen = torch.cat([i for _, _, i in b.test.iterate()])
    assert seen.tolist() == list(range(b.test_size))
    return batches


def _ranks(build, c):
    """Two ranks: same step count; for every batch, disjoint slices whose union is the global batch."""
    b0, b1 = (
        build(c, device="cpu", seed=3, rank=r, world_size=2, context_length=L) for r in (0, 1)
    )
    one = build(c, device="cpu", seed=3, context_length=L)
    assert len(b0.train) == len(b1.train) == len(one.train)
    for (_, _, i0), (_, _, i1), (_, _, ig) in zip(
        b0.train.iterate(1), b1.train.iterate(1), one.train.iterate(1)
    ):
        assert len(i0) == len(i1) == 2 and not set(i0.tolist()) & set(i1.tolist())
        assert torch.cat([i0, i1]).tolist() == ig.tolist()
    for b in (b0, b1, one):
        b.close()


def test_csv_and_tsv(csv_file, tmp_path):
    b = build_image_text(
        cfg(name="csv", root=str(csv_file)), device="cpu", seed=0, context_length=L
    )
    _check_bundle(b, 24)
    b2 = build_image_text(
        cfg(name="csv", root=str(csv_file)), device="cpu", seed=5, context_length=L
    )
    assert b.captions_test == b2.captions_test  # a fixed split
    _ranks(build_image_text, cfg(name="csv", root=str(csv_file)))
    tsv = tmp_path / "pairs.tsv"
    held = tmp_path / "held.tsv"
    for f, rng in ((tsv, range(12)), (held, range(12, 17))):
        f.write_text(
            "".join(
                f"{p}\t{c}\n"
                for p, c in [("image", "text")] + [(f"img/{i}.png", f"t {i}") for i in rng]
            )
        )
    b = build_image_text(
        cfg(
            name="csv",
            root=str(tsv),
            csv_image_key="image",
            csv_caption_key="text",
            test_root=str(held),
        ),
        device="cpu",
        seed=0,
        context_length=L,
    )
    assert (b.train_size, b.test_size) == (12, 5) and b.captions_test[0] == "t 12"


def test_csv_errors(csv_file, tmp_path):
    with pytest.raises(DataError, match="no column 'caption'.*columns: filepath, title"):
        build_image_text(
            cfg(name="csv", root=str(csv_file), csv_caption_key="caption"), device="cpu", seed=0
        )
    with pytest.raises(DataError, match="not found"):
        build_image_text(cfg(name="csv", root=str(tmp_path / "nope.csv")), device="cpu", seed=0)
    with pytest.raises(DataError, match="mixing"):
        build_image_text(cfg(name="csv", root=str(csv_file), mixup_alpha=0.2), device="cpu", seed=0)


def test_unreadable_image_skipped(csv_file, tmp_path):
    (tmp_path / "img" / "3.png").write_bytes(b"garbage")
    (tmp_path / "img" / "4.png").unlink()
    b = build_image_text(
        cfg(name="csv", root=str(csv_file), test_fraction=0.0),
        device="cpu",
        seed=0,
        context_length=L,
    )
    idx = torch.cat([i for _, _, i in b.train.iterate(0)])
    assert b.train.skipped == 2 and len(idx) == 24  # full batches: substitutes
    assert not {3, 4} & set(idx.tolist())


@pytest.mark.parametrize("workers", [0, 2])
def test_webdataset(tmp_path, workers):
    root = _shards(tmp_path / "shards", bad_key="s0005")
    c = cfg(name="webdataset", root=str(root / "{00000..00002}.tar"), num_workers=workers)
    b = build_image_text(c, device="cpu", seed=0, context_length=L)
    assert b.train_size + b.test_size == 21
    idx = torch.cat([i for _, _, i in b.train.iterate(0)])
    assert b.train.skipped <= 1 and len(set(idx.tolist())) == len(idx)
    b.close()
    if workers:
        return
    # folder form, held-out split stable and disjoint, captions from the .txt files
    b2 = build_image_text(replace(c, root=str(root)), device="cpu", seed=1, context_length=L)
    assert b2.captions_test == b.captions_test and all(
        s.startswith("sample ") for s in b.captions_test
    )
    train_caps = {str(c) for c in b2.train.dataset.rec.captions}
    assert not train_caps & set(b2.captions_test) and len(train_caps) == b2.train_size
    # every sample once per epoch over ranks
    b0, b1 = (
        build_image_text(
            replace(c, root=str(root)), device="cpu", seed=1, rank=r, world_size=2, context_length=L
        )
        for r in (0, 1)
    )
    assert len(b0.train) == len(b1.train)
    both = torch.cat([b0.train.indices(2), b1.train.indices(2)]).tolist()
    assert len(set(both)) == len(both) == len(b0.train) * 4
    _ranks(build_image_text, replace(c, root=str(_shards(tmp_path / "clean")), test_fraction=0.0))
    with pytest.raises(DataError, match="not found"):
        build_image_text(replace(c, root=str(root / "{00000..00009}.tar")), device="cpu", seed=0)


SVG_META = """<svg xmlns="http://www.w3.org/2000/svg"><metadata><rdf:RDF><cc:Work rdf:about="">
<dc:title>2 dead frogs</dc:title><dc:subject><rdf:Bag><rdf:li>kwaakwaa</rdf:li><rdf:li>squeleton</rdf:li>
<rdf:li>unsorted</rdf:li><rdf:li>froggies</rdf:li><rdf:li>green &amp; brown</rdf:li></rdf:Bag></dc:subject>
<dc:publisher><cc:Agent><dc:title>Open Clip Art Library</dc:title></cc:Agent></dc:publisher>
<dc:creator><cc:Agent><dc:title>Matthew Gates</dc:title></cc:Agent></dc:creator></cc:Work></rdf:RDF></metadata></svg>"""
SVG_BARE = """<svg xmlns="http://www.w3.org/2000/svg"><metadata><rdf:RDF><cc:Work rdf:about="">
<dc:creator><cc:Agent><dc:title>Matthew Gates</dc:title></cc:Agent></dc:creator></cc:Work></rdf:RDF></metadata></svg>"""


def test_svg_captions():
    assert oca.caption_for(SVG_META, "x_01") == (
        "clip art of 2 dead frogs: kwaakwaa, squeleton, froggies, green & brown",
        True,
        True,
    )
    assert oca.caption_for(SVG_BARE, "chemistry_flask_matthew__01") == (
        "clip art of chemistry flask",
        False,
        False,
    )
    assert oca.caption_for("<svg/>", "old_house_7") == ("clip art of old house", False, False)


def test_classification_captions():
    c = cfg(
        name="synthetic",
        captions=True,
        image_size=0,
        channels=1,
        num_classes=3,
        train_size=24,
        test_size=8,
        caption_template="a picture of a {}.",
    )
    b = build_image_text(c, device="cpu", seed=0, context_length=L)
    assert b.channels == 1 and b.test_size == 8 and b.captions_test[0].startswith("a picture of a ")
    batches = _epoch(b.train, 0)
    assert len(batches) == 6
    idx = torch.cat([i for _, _, i in batches])
    assert sorted(idx.tolist()) == list(range(24))
    zs = b.zeroshot["synthetic"]
    assert len(zs.class_names) == 3 and zs.templates[0] == "a picture of a {}."
    x, y = next(iter(zs.loader.iterate()))
    assert x.shape[1] == 1 and y.dtype == torch.int64
    _ranks(build_image_text, c)
    with pytest.raises(DataError, match="captions"):
        build_image_text(replace(c, captions=False), device="cpu", seed=0)


@pytest.mark.skipif(
    not Path("/usr/share/openclipart/png").is_dir(), reason="openclipart-png not installed"
)
def test_openclipart_subset():
    c = cfg(name="openclipart", image_size=32, test_fraction=0.3)
    b = openclipart_bundle(
        c, device="cpu", seed=0, rank=0, world_size=1, context_length=L, limit=48
    )
    assert b.train_size + b.test_size == 48 and b.channels == 3 and b.image_size == 32
    assert all(s.startswith("clip art of ") for s in b.captions_test)
    zs = b.zeroshot["openclipart"]
    assert "signs and symbols" in zs.class_names and "special" not in zs.class_names
    x, t, i = next(iter(b.train.iterate(0)))
    assert x.shape == (4, 3, 32, 32) and t.shape == (4, L)
