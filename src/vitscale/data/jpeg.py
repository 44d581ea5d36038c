"""One image (a path, a file object or bytes) -> uint8 [3,S,S]: the random-resized crop and flip of
training (sample_seed >= 0) or the eval transform (sample_seed < 0: shorter side -> S/0.875, then the
central S x S). Used by the folder, image-text and webdataset loaders, in their worker processes.

Two decoders (data.decoder; resolve_decoder turns "auto" into one of them):

  pil         Pillow with draft mode: the reference, unchanged from earlier versions.
  simplejpeg  libjpeg-turbo through simplejpeg, "random-resized crop before full decode": the crop
              box comes from the header's size first, the JPEG is decoded at the smallest DCT scale
              that leaves the crop >= S pixels on its shorter side (dct_eighths), the box is mapped
              into the scaled image, cut out and resized (crop_resize: torch's antialiased bilinear
              on uint8, ~4x faster than Pillow's resize). Anything else goes the PIL way: PNG, WebP,
              BMP, CMYK/YCCK JPEGs (Pillow's colour conversion, as to_rgb has it), and JPEGs that
              libjpeg-turbo's strict mode refuses (Pillow then decodes them or raises, as before).

For a seed both decoders crop the same region and make the same flip decision: the PIL path draws
its box on the image as draft mode reduced it (by 1, 2, 4 or 8: draft_factor), so the simplejpeg
path draws it on that size too and scales it back to full resolution (drawing it on the full size
instead would change Python's rejection sampling in randint: a different region for ~2% of seeds,
a different flip for ~2-3%). The pixels differ by the DCT scaling and the resize kernel: mean
absolute difference to the PIL path ~0.03-0.5 grey levels at 224 px, up to ~2 at 32 px (the box is
rounded to whole pixels of a 1/8-scale decode).
"""

from __future__ import annotations

import io
import math
import os
import random

import numpy as np
import torch
from PIL import Image

from ..errors import DataError

SCALE, RATIO, CROP_FRACTION = (0.35, 1.0), (3 / 4, 4 / 3), 0.875
DECODERS = ("auto", "pil", "simplejpeg")
# DCT scales M/8 that the simplejpeg path decodes at. libjpeg-turbo has SIMD inverse DCTs only for
# 1/8, 1/4, 1/2 and 1; its 3/8, 5/8, 3/4, 7/8 are plain C and slower than a full decode (measured
# on a 500x375 q95 JPEG: 1/8 0.74 ms, 1/4 0.86, 3/8 0.98, 1/2 0.86, 5/8 1.18, 3/4 1.33, 7/8 1.61,
# full 1.01 ms), so the crop never asks for those.
EIGHTHS = (1, 2, 4, 8)
# fastdct (libjpeg's integer "ifast" IDCT) and fastupsample (chroma replicated, not interpolated):
# measured on ImageNet-like JPEGs (~450x395, ~110 kB, q90-95; decode + crop + resize to 224, one
# core, median of 9 rounds) they save 1.6%, 2.7% and 2.9% together (1.31 -> 1.27 ms/image), while
# the mean absolute difference to a full-resolution Pillow decode grows from 0.03 to 1.05 (fastdct),
# 2.62 (fastupsample) and 2.84 grey levels (both). Not worth it: both off.
FASTDCT = FASTUPSAMPLE = False


def resolve_decoder(name: str) -> str:
    """data.decoder -> "pil" or "simplejpeg" (auto = simplejpeg when it imports)."""
    if name not in DECODERS:
        raise DataError(
            f"data.decoder: unknown decoder '{name}' (choose from {', '.join(DECODERS)})"
        )
    if name == "pil":
        return "pil"
    try:
        import simplejpeg  # noqa: F401
    except ImportError as e:
        if name == "simplejpeg":
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(
                f"data.decoder=simplejpeg but simplejpeg does not import ({why}); "
                "pip install simplejpeg, or set data.decoder=pil"
            ) from None
        return "pil"
    return "simplejpeg"


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB; 16/32-bit greyscale scaled to 8 bit (65535 -> 255)."""
    if img.mode == "RGB":
        return img
    if img.mode.startswith("I") or img.mode == "F":
        a = np.asarray(img).astype(np.float64)
        a = a / 257.0 if img.mode != "F" else a * (255.0 if a.max() <= 1.0 else 1.0)
        return Image.fromarray(np.clip(np.round(a), 0, 255).astype(np.uint8), "L").convert("RGB")
    if img.mode == "P":
        img = img.convert("RGBA")  # applies palette transparency without a warning
    return img.convert("RGB")


def grey(x: torch.Tensor) -> torch.Tensor:
    """uint8 [3,S,S] -> [1,S,S]: ITU-R 601 luma in Pillow's fixed-point arithmetic (what
    convert("L") gives an RGB image), so a grey image decoded as three equal channels comes back
    unchanged. After the crop and resize: both decoders' crops, flips and resizes stay as they are."""
    r, g, b = x.to(torch.int32).unbind(0)
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).to(torch.uint8).unsqueeze(0)


def rrc_box(w: int, h: int, rng: random.Random):
    """Random-resized-crop box (left, top, right, bottom), torchvision's algorithm."""
    area, (lo, hi) = w * h, (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target, ar = area * rng.uniform(*SCALE), math.exp(rng.uniform(lo, hi))
        cw, ch = round(math.sqrt(target * ar)), round(math.sqrt(target / ar))
        if 0 < cw <= w and 0 < ch <= h:
            x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
            return x0, y0, x0 + cw, y0 + ch
    ratio = min(max(w / h, RATIO[0]), RATIO[1])  # fallback: central crop
    cw, ch = (w, round(w / ratio)) if w / h < ratio else (round(h * ratio), h)
    return (w - cw) // 2, (h - ch) // 2, (w - cw) // 2 + cw, (h - ch) // 2 + ch


def eval_box(w: int, h: int, size: int):
    """The eval crop (float box): shorter side -> size/0.875, then the central size x size."""
    side = size * min(w, h) / round(size / CROP_FRACTION)
    return (w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2


def draft_factor(w: int, h: int, request: int) -> int:
    """The reduction (1, 2, 4 or 8) that Pillow's JPEG draft mode applies for draft(mode, (r, r))."""
    scale = min(w // request, h // request)
    return next((s for s in (8, 4, 2) if scale >= s), 1)


def train_box(w: int, h: int, size: int, rng: random.Random):
    """The random-resized-crop box at full resolution, drawn as the PIL path draws it (on the image
    reduced by Pillow's draft mode; clamped to the image: the reduced size rounds up)."""
    s = draft_factor(w, h, 2 * size)
    box = rrc_box(-(-w // s), -(-h // s), rng)
    return min(box[0] * s, w), min(box[1] * s, h), min(box[2] * s, w), min(box[3] * s, h)


def dct_eighths(box, size: int) -> int:
    """The DCT scale M/8 (M in EIGHTHS) to decode at: the smallest that leaves the crop `box`
    at least `size` pixels on its shorter side (8 = full resolution when none does)."""
    short = min(box[2] - box[0], box[3] - box[1])
    return next((m for m in EIGHTHS if short * m >= 8 * size), 8)


def _tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).contiguous()


def decode(src, size: int, sample_seed: int, hflip: bool, decoder: str = "auto") -> torch.Tensor:
    """One image (path, file object or bytes) -> uint8 [3,size,size]; sample_seed < 0 means the
    eval transform. decoder: "pil", "simplejpeg" or "auto" (see resolve_decoder)."""
    if resolve_decoder(decoder) == "simplejpeg":
        return decode_simplejpeg(src, size, sample_seed, hflip)
    return decode_pil(src, size, sample_seed, hflip)


def decode_pil(src, size: int, sample_seed: int, hflip: bool) -> torch.Tensor:
    """Pillow with draft mode (the reference path)."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        src = io.BytesIO(src)
    train = sample_seed >= 0
    with Image.open(src) as img:
        if img.format == "JPEG":  # decode at reduced scale when the image is large
            img.draft("RGB", (2 * size, 2 * size) if train else (round(size / CROP_FRACTION),) * 2)
        img = to_rgb(img)
        img.load()
    w, h = img.size
    if train:
        rng = random.Random(sample_seed)
        img = img.resize((size, size), Image.BILINEAR, box=rrc_box(w, h, rng))
        if hflip and rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
    else:
        img = img.resize((size, size), Image.BILINEAR, box=eval_box(w, h, size))
    return _tensor(img)


def read_bytes(src):
    """A path, a file object or bytes -> bytes (or the bytes-like object given)."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        return src
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:
            return f.read()
    return src.read()


def jpeg_size(data):
    """(width, height) of a JPEG that the simplejpeg path takes, else None (not a JPEG, CMYK/YCCK,
    a header libjpeg-turbo cannot read)."""
    import simplejpeg

    if bytes(data[:3]) != b"\xff\xd8\xff":
        return None
    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return (w, h) if colorspace in ("YCbCr", "Gray", "RGB") else None


def decode_simplejpeg(src, size: int, sample_seed: int, hflip: bool) -> torch.Tensor:
    """libjpeg-turbo at the DCT scale the crop needs; other files go to decode_pil."""
    import simplejpeg

    data = read_bytes(src)
    wh = jpeg_size(data)
    # PIL's errors name a path
    fallback = src if isinstance(src, (str, os.PathLike)) else io.BytesIO(data)
    if wh is None:
        return decode_pil(fallback, size, sample_seed, hflip)
    w, h = wh
    limit = Image.MAX_IMAGE_PIXELS and 2 * Image.MAX_IMAGE_PIXELS
    if limit and w * h > limit:  # as Image.open refuses it
        raise Image.DecompressionBombError(
            f"Image size ({w * h} pixels) exceeds limit of {limit} pixels, "
            "could be decompression bomb DOS attack."
        )
    train = sample_seed >= 0
    rng = random.Random(sample_seed) if train else None
    box = train_box(w, h, size, rng) if train else eval_box(w, h, size)
    m = dct_eighths(box, size)
    try:
        a = simplejpeg.decode_jpeg(
            data,
            "RGB",
            fastdct=FASTDCT,
            fastupsample=FASTUPSAMPLE,
            min_height=-(-h * m // 8),
            min_width=-(-w * m // 8),
        )
    # strict mode: truncated or corrupt data, or a libjpeg warning Pillow tolerates
    except ValueError:
        return decode_pil(fallback, size, sample_seed, hflip)
    if a.shape[:2] != (-(-h * m // 8), -(-w * m // 8)):
        raise RuntimeError(
            f"simplejpeg decoded {a.shape[1]}x{a.shape[0]}, expected scale {m}/8 of {w}x{h}"
        )
    x = crop_resize(a, [c * m / 8 for c in box], size)
    if train and hflip and rng.random() < 0.5:
        x = x.flip(-1)
    return x


def crop_resize(a: np.ndarray, box, size: int) -> torch.Tensor:
    """uint8 [H,W,3] array, box (left, top, right, bottom) in its pixels, rounded to whole pixels
    -> uint8 [3,size,size], antialiased bilinear: torch's uint8 kernel, 0.2 ms against 0.93 ms for
    Pillow's resize(box=...) + the tensor conversion on ImageNet-sized crops (one core), with a mean
    absolute difference of 0.03 grey levels (Pillow also reads the pixels just outside the box)."""
    h, w = a.shape[:2]
    x0, y0 = min(round(box[0]), w - 1), min(round(box[1]), h - 1)
    x1, y1 = max(min(round(box[2]), w), x0 + 1), max(min(round(box[3]), h), y0 + 1)
    t = torch.from_numpy(a)[y0:y1, x0:x1].permute(2, 0, 1).unsqueeze(0)  # a channels-last view
    # the crop copied: the kernel's fast path (-15%)
    t = t.contiguous(memory_format=torch.channels_last)
    return torch.nn.functional.interpolate(
        t, size=(size, size), mode="bilinear", antialias=True, align_corners=False
    )[0].contiguous()
