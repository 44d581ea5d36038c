"""The two JPEG decoders (data/jpeg.py): simplejpeg (DCT-scaled, crop first) vs Pillow and vs an
independent full-resolution reference; inputs, fallbacks, errors, data.decoder resolution."""

import io
import random
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from vitscale.config import DataConfig
from vitscale.data import build_data, jpeg
from vitscale.data.jpeg import decode
from vitscale.data.loaders.worker_datasets import FolderDataset
from vitscale.errors import DataError

simplejpeg = pytest.importorskip("simplejpeg")


def smooth(w, h, seed=0, grey=False):
    """A smooth photo-like image (colour gradients, a few soft blobs), darker on the left."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w] / max(w, h)
    a, b, c = rng.uniform(1, 4, 3)
    img = (
        np.stack([np.sin(a * xx * 3 + 1), np.cos(b * yy * 3), np.sin((xx + yy) * c)], -1) * 60 + 120
    )
    img += 40 * (xx[..., None] - 0.5)
    if grey:
        img = img.mean(-1)
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg_bytes(w, h, seed=0, grey=False, quality=95, mode=None):
    buf = io.BytesIO()
    im = Image.fromarray(smooth(w, h, seed, grey))
    (im.convert(mode) if mode else im).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def reference(data, size, sample_seed, hflip):
    """Full-resolution Pillow decode (no draft) + the PIL path's crop + resize + flip. The PIL path
    draws its box on the image as draft mode reduces it: that size is asked from Pillow itself."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    if sample_seed >= 0:
        rng = random.Random(sample_seed)
        drafted = Image.open(io.BytesIO(data))
        s = round(w / drafted.draft("RGB", (2 * size, 2 * size))[1][2])  # its box: (0, 0, w/s, h/s)
        box = [c * s for c in jpeg.rrc_box(*drafted.size, rng)]
        box = (min(box[0], w), min(box[1], h), min(box[2], w), min(box[3], h))
        img = img.resize((size, size), Image.BILINEAR, box=box)
        if hflip and rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
    else:
        img = img.resize((size, size), Image.BILINEAR, box=jpeg.eval_box(w, h, size))
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)


def mad(a, b):
    return (a.float() - b.float()).abs().mean().item()


@pytest.fixture
def scales(monkeypatch):
    """Records (full w, h, crop box, decoded w, h) for each image the simplejpeg path decodes."""
    seen, boxes = [], []
    real_eighths, real_decode = jpeg.dct_eighths, simplejpeg.decode_jpeg

    def eighths(box, size):
        boxes.append((box, size))
        return real_eighths(box, size)

    def decode_jpeg(data, *a, **kw):
        out = real_decode(data, *a, **kw)
        h, w = simplejpeg.decode_jpeg_header(data)[:2]
        seen.append((w, h, *boxes[-1], out.shape[1], out.shape[0]))
        return out

    monkeypatch.setattr(jpeg, "dct_eighths", eighths)
    monkeypatch.setattr(simplejpeg, "decode_jpeg", decode_jpeg)
    return seen


@pytest.mark.parametrize(
    "w,h,size",
    [
        (500, 375, 224),
        (375, 500, 224),
        (1200, 900, 224),
        (2400, 1800, 224),
        (640, 480, 64),
        (120, 90, 224),
        (500, 375, 32),
    ],
)
def test_simplejpeg_matches_full_resolution_reference(w, h, size, scales):
    data = jpeg_bytes(w, h, seed=w + h)
    for seed in [-1, *range(12)]:
        fast = decode(data, size, seed, True, decoder="simplejpeg")
        assert fast.shape == (3, size, size) and fast.dtype == torch.uint8
        assert mad(fast, reference(data, size, seed, True)) < 3, (
            seed,
            mad(fast, reference(data, size, seed, True)),
        )
    assert len(scales) == 13
    for fw, fh, box, sz, dw, dh in scales:  # the DCT scale never starves the crop
        m = dw * 8 / fw
        assert min(box[2] - box[0], box[3] - box[1]) * m / 8 >= sz or (dw, dh) == (fw, fh)
        assert (dw, dh) == (-(-fw * round(m) // 8), -(-fh * round(m) // 8))
    if min(w, h) >= 4 * size:  # large images are decoded at a reduced scale
        assert all(dw < fw for fw, _, _, _, dw, _ in scales)


def test_same_region_and_flip_as_pil_when_no_draft():
    data = jpeg_bytes(500, 375, seed=3)
    flips = []
    for seed in range(40):
        pil, fast = (decode(data, 224, seed, True, decoder=d) for d in ("pil", "simplejpeg"))
        assert mad(pil, fast) < 1.0
        unflipped = decode(data, 224, seed, False, decoder="simplejpeg")
        flipped = not torch.equal(fast, unflipped)
        assert flipped == (not torch.equal(pil, decode(data, 224, seed, False, decoder="pil")))
        if flipped:
            assert torch.equal(fast, unflipped.flip(-1))
        flips.append(flipped)
    assert 5 < sum(flips) < 35  # both decisions occur


def test_large_images_same_region_and_flip_as_pil():
    """Pillow's draft mode reduces a large JPEG before its box is drawn; simplejpeg draws it alike."""
    for w, h in ((1800, 1400), (1000, 900), (4000, 1000)):
        data = jpeg_bytes(w, h, seed=5)
        for seed in range(-1, 25):
            pil, fast = (decode(data, 224, seed, True, decoder=d) for d in ("pil", "simplejpeg"))
            assert mad(pil, fast) < 1.5, (w, h, seed, mad(pil, fast))


def test_draft_factor_is_pillows():
    data = {
        (w, h): jpeg_bytes(w, h, quality=50)
        for w in (17, 100, 447, 448, 895, 896, 1791, 1792, 3600)
        for h in (17, 300, 448, 897, 1800, 3584, 3590)
    }
    for (w, h), blob in data.items():
        for r in (32, 256, 448):
            img = Image.open(io.BytesIO(blob))
            img.draft("RGB", (r, r))
            s = jpeg.draft_factor(w, h, r)
            assert img.size == (-(-w // s), -(-h // s)), (w, h, r, s, img.size)


def test_dct_eighths_is_the_smallest_scale_that_keeps_the_crop():
    rng = random.Random(0)
    for _ in range(5000):
        size = rng.choice([16, 32, 64, 160, 224, 256, 384])
        cw, ch = rng.uniform(1, 5000), rng.uniform(1, 5000)
        box = (rng.uniform(0, 50), rng.uniform(0, 50))
        box = (*box, box[0] + cw, box[1] + ch)
        m = jpeg.dct_eighths(box, size)
        assert m in jpeg.EIGHTHS
        assert min(cw, ch) * m / 8 >= size or m == 8
        smaller = [k for k in jpeg.EIGHTHS if k < m]
        assert not smaller or min(cw, ch) * smaller[-1] / 8 < size
    assert (
        jpeg.dct_eighths((0, 0, 448, 500), 224) == 4
        and jpeg.dct_eighths((0, 0, 447, 500), 224) == 8
    )
    assert (
        jpeg.dct_eighths((0, 0, 1792, 1792), 224) == 1
        and jpeg.dct_eighths((0, 0, 100, 100), 224) == 8
    )


def test_inputs_path_file_bytes(tmp_path):
    data = jpeg_bytes(300, 200)
    p = tmp_path / "a.jpg"
    p.write_bytes(data)
    for d in ("pil", "simplejpeg"):
        for seed in (-1, 7):
            want = decode(str(p), 48, seed, True, decoder=d)
            with open(p, "rb") as f:
                got = [
                    decode(p, 48, seed, True, decoder=d),
                    decode(data, 48, seed, True, decoder=d),
                    decode(io.BytesIO(data), 48, seed, True, decoder=d),
                    decode(f, 48, seed, True, decoder=d),
                    decode(bytearray(data), 48, seed, True, decoder=d),
                ]
            assert all(torch.equal(want, g) for g in got)
    # the old positional signature, auto = simplejpeg here
    assert torch.equal(
        decode(str(p), 48, 7, True), decode(str(p), 48, 7, True, decoder="simplejpeg")
    )


def test_fallbacks_png_webp_cmyk_and_greyscale(tmp_path, scales):
    rgb = Image.fromarray(smooth(200, 150))
    for fmt in ("PNG", "WEBP", "BMP"):
        buf = io.BytesIO()
        rgb.save(buf, fmt)
        for seed in (-1, 4):
            assert torch.equal(
                decode(buf.getvalue(), 32, seed, True, decoder="simplejpeg"),
                jpeg.decode_pil(buf.getvalue(), 32, seed, True),
            )
    cmyk = jpeg_bytes(200, 150, mode="CMYK")
    assert Image.open(io.BytesIO(cmyk)).mode == "CMYK"
    for seed in (-1, 4):
        assert torch.equal(
            decode(cmyk, 32, seed, True, decoder="simplejpeg"),
            jpeg.decode_pil(cmyk, 32, seed, True),
        )
    assert scales == []  # none of these went through libjpeg-turbo
    grey = jpeg_bytes(500, 375, grey=True)  # greyscale: libjpeg-turbo, grey replicated
    assert Image.open(io.BytesIO(grey)).mode == "L"
    for seed in (-1, 4):
        fast = decode(grey, 224, seed, True, decoder="simplejpeg")
        assert mad(fast, jpeg.decode_pil(grey, 224, seed, True)) < 0.2
        assert torch.equal(fast[0], fast[1]) and torch.equal(fast[1], fast[2])
    assert len(scales) == 2


def test_corrupt_and_truncated_jpegs_raise(tmp_path):
    data = jpeg_bytes(400, 300, quality=90)
    bad = {
        "truncated": data[: len(data) // 2],
        "header only": data[:200],
        "garbage": b"\xff\xd8\xff" + b"\x00" * 500,
        "empty": b"",
        "not an image": b"hello",
    }
    for _name, blob in bad.items():
        for d in ("pil", "simplejpeg"):
            with pytest.raises(OSError):  # simplejpeg's and PIL's errors both
                decode(blob, 32, 3, True, decoder=d)
    (tmp_path / "t.jpg").write_bytes(bad["truncated"])
    ds = FolderDataset(np.array([str(tmp_path / "t.jpg")]), np.array([0]), 32, True, "simplejpeg")
    x, y, i, path, err = ds[(0, 5)]
    assert x is None and i == 0 and path.endswith("t.jpg") and "truncated" in err


def test_decompression_bomb_refused(monkeypatch):
    data = jpeg_bytes(200, 150)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    for d in ("pil", "simplejpeg"):
        with pytest.raises(Image.DecompressionBombError):
            decode(data, 32, 1, False, decoder=d)


def test_resolve_decoder_and_missing_simplejpeg(tmp_path, monkeypatch):
    assert jpeg.resolve_decoder("auto") == "simplejpeg" and jpeg.resolve_decoder("pil") == "pil"
    with pytest.raises(DataError, match="unknown decoder 'turbo'"):
        jpeg.resolve_decoder("turbo")
    for split in ("train/a", "val/a"):
        (tmp_path / split).mkdir(parents=True)
        (tmp_path / split / "1.jpg").write_bytes(jpeg_bytes(40, 30))
    c = DataConfig(name="folder", root=str(tmp_path), image_size=16, batch_size=1, num_workers=0)
    assert build_data(c, device="cpu", seed=0).train.dataset.decoder == "simplejpeg"
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # not importable
    assert jpeg.resolve_decoder("auto") == "pil"
    assert build_data(c, device="cpu", seed=0).train.dataset.decoder == "pil"
    with pytest.raises(
        DataError, match="data.decoder=simplejpeg but simplejpeg does not import"
    ) as e:
        build_data(DataConfig(**{**c.__dict__, "decoder": "simplejpeg"}), device="cpu", seed=0)
    assert "\n" not in str(e.value)


def test_folder_loader_decoders_agree(tmp_path):
    for split, n in (("train", 8), ("val", 2)):
        for i in range(n):
            d = tmp_path / split / f"c{i % 2}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{i}.jpg").write_bytes(jpeg_bytes(320, 240, seed=i))
    out = {}
    for dec in ("pil", "simplejpeg"):
        c = DataConfig(
            name="folder",
            root=str(tmp_path),
            image_size=64,
            batch_size=4,
            num_workers=0,
            hflip=True,
            decoder=dec,
        )
        b = build_data(c, device="cpu", seed=1)
        out[dec] = (
            torch.cat([x for x, _ in b.train.iterate(0)]),
            torch.cat([x for x, _ in b.test.iterate()]),
        )
    for a, b in zip(out["pil"], out["simplejpeg"]):
        assert (
            a.shape == b.shape and (a - b).abs().mean() < 0.05
        )  # normalized units (~3 grey levels)
