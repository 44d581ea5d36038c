"""`vitscale data prepare`: folder / CSV -> webdataset shards of pre-resized JPEGs + manifest.json.

Shards are read back with webdataset itself; tiny generated images keep each test ~1 s."""

import csv
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from helpers import make_tree
from PIL import Image

from vitscale.cli import _parser, main
from vitscale.data.offline import prepare as prep
from vitscale.data.offline import shard_writer
from vitscale.data.sources.csv import read_csv
from vitscale.data.sources.folder import scan
from vitscale.data.sources.held_out import held_out
from vitscale.errors import DataError

SIZE = 16


def noise(h, w, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def run(src, out, **kw):
    kw.setdefault("size", SIZE)
    kw.setdefault("shard_size", 4)
    kw.setdefault("workers", 1)
    return prep.prepare_shards(src, out, progress=False, **kw)


def samples(out, split):
    """[(shard name, sample dict)] for one split, in shard order, read with webdataset."""
    m = json.loads((out / "manifest.json").read_text())
    urls = [str(out / s) for s in m["splits"][split]["shards"]]
    return [(Path(s["__url__"]).name, s) for s in wds.WebDataset(urls, shardshuffle=False)]


def shard_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.tar"))}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """make_tree (assorted modes, small images, a truncated JPEG and a fake PNG) + 2 large images."""
    root = tmp_path_factory.mktemp("tree")
    make_tree(root)
    noise(48, 64, 1).save(root / "train/dog/z_wide.jpg", quality=95)  # -> 21x16
    noise(100, 40, 2).save(root / "train/cat/z_tall.png")  # -> 16x40
    return root


@pytest.fixture(scope="module")
def folder_out(tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("fo") / "shards"
    return out, run(tree, out)


def test_folder_manifest_labels_indices(tree, folder_out):
    out, done = folder_out
    m = json.loads((out / "manifest.json").read_text())
    assert m == done.manifest
    classes, (tr_p, tr_y), (ev_p, ev_y) = scan(tree)
    assert list(m) == [
        "format",
        "version",
        "kind",
        "classes",
        "image",
        "source",
        "seed",
        "shard_size",
        "skipped",
        "splits",
    ]
    assert (m["format"], m["version"], m["kind"], m["classes"]) == (
        "vitscale-shards",
        1,
        "classification",
        ["cat", "dog"],
    )
    assert m["image"] == {"short_side": SIZE, "quality": 90}
    assert (m["source"], m["seed"], m["shard_size"]) == (str(tree), 0, 4)
    assert m["skipped"] == {"unreadable": 2, "no_caption": 0}  # truncated JPEG, fake PNG
    tr, ev = m["splits"]["train"], m["splits"]["val"]
    assert tr["samples"] == len(tr_p) - 2 and ev["samples"] == len(ev_p)
    assert tr["shards"] == [f"train-{j:06d}.tar" for j in range(len(tr["counts"]))]
    assert tr["counts"] == [4] * (tr["samples"] // 4) + (
        [tr["samples"] % 4] if tr["samples"] % 4 else []
    )
    assert ev == {"shards": ["val-000000.tar"], "counts": [3], "samples": 3}
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", "prepare.json", *tr["shards"], *ev["shards"]]
    )
    label_of = {os.path.relpath(p, tree): int(y) for p, y in zip([*tr_p, *ev_p], [*tr_y, *ev_y])}
    for split, info in m["splits"].items():
        got = samples(out, split)
        assert [int(s["__key__"]) for _, s in got] == list(
            range(info["samples"])
        )  # contiguous, in order
        for name, s in got:
            i, meta = int(s["__key__"]), json.loads(s["json"])
            assert set(s) - {"__url__", "__local_path__"} == {"__key__", "jpg", "cls", "json"}
            assert s["__key__"] == f"{i:09d}" and meta["index"] == i
            assert name == info["shards"][i // 4]  # shard j: [4j, 4j+4)
            assert meta["source"].startswith(f"{split}/") and meta["label"] == int(
                s["cls"].decode("ascii")
            )
            assert (
                meta["label"]
                == label_of[meta["source"]]
                == classes.index(meta["source"].split("/")[1])
            )
            assert Image.open(io.BytesIO(s["jpg"])).format == "JPEG"
    sources = [json.loads(s["json"])["source"] for _, s in samples(out, "val")]
    assert sources == [os.path.relpath(p, tree) for p in ev_p]  # val: source order


def test_images_resized_never_upscaled(tree, folder_out):
    out, _ = folder_out
    by_source = {
        json.loads(s["json"])["source"]: Image.open(io.BytesIO(s["jpg"]))
        for split in ("train", "val")
        for _, s in samples(out, split)
    }
    assert by_source["train/dog/z_wide.jpg"].size == (21, SIZE)  # 64x48: short side 16
    assert by_source["train/cat/z_tall.png"].size == (SIZE, 40)  # 40x100
    for src, img in by_source.items():
        assert img.mode == "RGB"
        w, h = Image.open(tree / src).size
        if min(w, h) <= SIZE:
            assert img.size == (w, h), src  # not upscaled
        else:
            assert min(img.size) == SIZE and abs(img.size[0] / img.size[1] - w / h) < 0.05, src


def test_train_shuffled_by_seed(tree, folder_out, tmp_path):
    out, _ = folder_out
    order = lambda o: [json.loads(s["json"])["source"] for _, s in samples(o, "train")]  # noqa: E731
    run(tree, tmp_path / "same")
    run(tree, tmp_path / "other", seed=1)
    assert shard_bytes(tmp_path / "same") == shard_bytes(out)  # deterministic
    assert order(tmp_path / "other") != order(out)
    assert sorted(order(tmp_path / "other")) == sorted(order(out))
    classes = [s.split("/")[1] for s in order(out)]
    assert classes != sorted(classes)  # not sorted by class


def test_quality_changes_size(tmp_path):
    root = tmp_path / "q"
    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True)
        noise(40, 40, 3).save(root / split / "a" / "x.png")
    run(root, tmp_path / "lo", quality=20, size=32)
    run(root, tmp_path / "hi", quality=95, size=32)
    jpg = lambda o: samples(o, "train")[0][1]["jpg"]  # noqa: E731
    assert len(jpg(tmp_path / "lo")) < 0.7 * len(jpg(tmp_path / "hi"))
    assert Image.open(io.BytesIO(jpg(tmp_path / "lo"))).size == (32, 32)


def test_workers_give_same_bytes(tree, folder_out, tmp_path):
    out, _ = folder_out
    done = run(tree, tmp_path / "w2", workers=2)
    assert shard_bytes(tmp_path / "w2") == shard_bytes(out)
    assert (tmp_path / "w2" / "manifest.json").read_bytes() == (out / "manifest.json").read_bytes()
    assert done.images == done.manifest["splits"]["train"]["samples"] + 3


@pytest.fixture
def pairs(tmp_path):
    """40 rows: one empty caption, one truncated JPEG, unicode and commas in captions."""
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(40):
        noise(20 + i, 30, i).save(tmp_path / "img" / f"{i}.jpg")
        rows.append({"filepath": f"img/{i}.jpg", "title": f"photo {i}, café ☕"})
    rows[5]["title"] = " "
    data = (tmp_path / "img/7.jpg").read_bytes()
    (tmp_path / "img/7.jpg").write_bytes(data[: len(data) // 2])
    with open(tmp_path / "pairs.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, ["filepath", "title"])
        w.writeheader()
        w.writerows(rows)
    return tmp_path / "pairs.csv"


def test_csv_pairs_and_val_split(pairs, tmp_path):
    out = tmp_path / "out"
    m = run(pairs, out, val_fraction=0.3, workers=2).manifest
    assert m["kind"] == "pairs" and "classes" not in m
    assert m["skipped"] == {"unreadable": 1, "no_caption": 1}
    rec = read_csv(str(pairs), "filepath", "title")
    keep = [
        (k, c)
        for k, c in zip(rec.keys.tolist(), rec.captions.tolist())
        if k != "img/7.jpg" and c.strip()
    ]
    want_val = [(k, c) for k, c in keep if held_out(k, 0.3)]
    assert 0 < len(want_val) < len(keep)
    got = {
        split: [(json.loads(s["json"]), s) for _, s in samples(out, split)]
        for split in ("train", "val")
    }
    assert [(j["source"], j["caption"]) for j, _ in got["val"]] == want_val  # source order
    assert sorted((j["source"], j["caption"]) for j, _ in got["train"]) == sorted(
        set(keep) - set(want_val)
    )
    for split, items in got.items():
        assert [j["index"] for j, _ in items] == list(range(m["splits"][split]["samples"]))
        for j, s in items:
            assert s["txt"].decode("utf-8") == j["caption"] and "cls" not in s
            w, h = Image.open(pairs.parent / j["source"]).size
            want = (round(w * SIZE / h), SIZE) if h < w else (SIZE, round(h * SIZE / w))
            assert Image.open(io.BytesIO(s["jpg"])).size == want

    run(pairs, tmp_path / "noval", val_fraction=0.0)
    m0 = json.loads((tmp_path / "noval/manifest.json").read_text())
    assert list(m0["splits"]) == ["train"] and m0["splits"]["train"]["samples"] == 38


def test_resume_rewrites_only_missing_shards(tree, folder_out, tmp_path):
    ref, _ = folder_out
    out = tmp_path / "r"
    run(tree, out)
    (out / "train-000001.tar").unlink()
    (out / "manifest.json").unlink()
    (out / "train-000002.tar.tmp").write_bytes(b"half a shard")  # a killed run's leftover
    done = run(tree, out, workers=2)
    assert done.written == ["train-000001.tar"] and done.reused == len(shard_bytes(ref)) - 1
    assert shard_bytes(out) == shard_bytes(ref) and not list(out.glob("*.tmp"))
    assert (out / "manifest.json").read_bytes() == (ref / "manifest.json").read_bytes()


def test_interrupt_leaves_no_half_shard(tree, folder_out, tmp_path, monkeypatch):
    ref, _ = folder_out
    out, real, calls = tmp_path / "i", shard_writer.encode, []

    def encode(*a):
        calls.append(1)
        if len(calls) == 6:  # inside the 2nd shard
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(shard_writer, "encode", encode)
    with pytest.raises(KeyboardInterrupt):
        run(tree, out)
    assert sorted(p.name for p in out.iterdir()) == ["prepare.json", "train-000000.tar"]
    monkeypatch.setattr(shard_writer, "encode", real)
    assert run(tree, out).reused == 1
    assert shard_bytes(out) == shard_bytes(ref)


def test_other_arguments_refused(tree, folder_out, capsys):
    out, _ = folder_out
    before = shard_bytes(out)
    with pytest.raises(DataError, match="size 16 then, 24 now") as e:
        run(tree, out, size=24)
    assert "\n" not in str(e.value)
    assert (
        main(
            [
                "data",
                "prepare",
                str(tree),
                "--out",
                str(out),
                "--size",
                "16",
                "--shard-size",
                "5",
                "--workers",
                "1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1].startswith("vitscale: error: prepare: ") and "shard_size 4 then, 5 now" in err[-1]
    )
    assert shard_bytes(out) == before


def test_cli_errors_and_summary(tree, tmp_path, capsys):
    assert main(["data", "prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("vitscale: error: prepare: ")
        and "missing not found" in err
        and err.count("\n") == 1
    )
    (tmp_path / "x.txt").write_text("")
    assert main(["data", "prepare", str(tmp_path / "x.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "neither a folder" in capsys.readouterr().err
    assert main(["data", "prepare", str(tree), "--out", str(tmp_path / "o"), "--quality", "0"]) == 2
    assert "--quality" in capsys.readouterr().err
    out = tmp_path / "ok"
    assert (
        main(
            [
                "data",
                "prepare",
                str(tree),
                "--out",
                str(out),
                "--size",
                "16",
                "--shard-size",
                "4",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    o = capsys.readouterr().out.strip()
    assert (
        o.startswith("prepared 17 samples (train 14, val 3) in 5 shards")
        and "skipped 2 unreadable" in o
    )
    assert (
        main(
            [
                "data",
                "prepare",
                str(tree),
                "--out",
                str(out),
                "--size",
                "16",
                "--shard-size",
                "4",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    assert "5 of 5 shards already done" in capsys.readouterr().err


def test_parser_keeps_download():
    p = _parser()
    a = p.parse_args(["data", "download", "cifar10"])
    assert (a.data_command, a.name) == ("download", "cifar10")
    a = p.parse_args(["data", "prepare", "SRC", "--out", "D"])
    assert (
        a.src,
        a.out,
        a.size,
        a.quality,
        a.shard_size,
        a.workers,
        a.seed,
        a.image_key,
        a.caption_key,
        a.val_fraction,
    ) == ("SRC", "D", 256, 90, 1000, None, 0, "filepath", "title", 0.1)


def test_large_images_without_warnings(tmp_path, monkeypatch):
    """An image over PIL's pixel limit (but under twice it) is prepared without PIL's multi-line
    warning; one over twice the limit is a decompression bomb: skipped and counted."""
    import warnings

    root = tmp_path / "big"
    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True)
        noise(40, 40, 4).save(root / split / "a" / "ok.png")
    noise(40, 40, 5).save(root / "train" / "a" / "large.png")  # 1600 px: over 1000, under 2000
    noise(50, 50, 6).save(root / "train" / "a" / "bomb.png")  # 2500 px: over 2000
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        r = run(root, tmp_path / "out")
    assert (
        r.manifest["splits"]["train"]["samples"] == 2 and r.manifest["skipped"]["unreadable"] == 1
    )


def test_transparency_over_white(tmp_path):
    """A transparent PNG (clip art) becomes a white-backed JPEG, not a black-backed one."""
    root = tmp_path / "alpha"
    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True)
        a = np.zeros((20, 20, 4), np.uint8)  # transparent black everywhere ...
        a[5:15, 5:15] = (200, 0, 0, 255)  # ... but an opaque red square
        Image.fromarray(a, "RGBA").save(root / split / "a" / "x.png")
        Image.fromarray(a[..., :3]).convert("P").save(root / split / "a" / "p.png", transparency=0)
    run(root, tmp_path / "out", size=20)
    for _, s in samples(tmp_path / "out", "train"):
        px = np.asarray(Image.open(io.BytesIO(s["jpg"])).convert("RGB")).astype(int)
        assert (px[0, 0] > 240).all() and px[10, 10, 0] > 150 and px[10, 10, 1] < 60, s["json"]
