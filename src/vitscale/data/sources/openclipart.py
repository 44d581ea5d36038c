"""OpenClipArt (Debian openclipart-png + openclipart-svg): ~8k clip art images with captions.

Captions come from each SVG's RDF metadata: the work's <dc:title> and the keywords (<rdf:li>)
of <dc:subject>, e.g. "clip art of 2 dead frogs: kwaakwaa, squeleton, froggies, green" (at most
8 keywords, "unsorted" dropped). Without a title the file name is used (underscores, the _NN
suffix and the creator's name removed). Images: alpha composited on white, scaled to fit and
padded to a white square of data.image_size (64 when 0), decoded once by a process pool and
cached in data_home()/openclipart_<size>_<tag>.pt (tag: a hash of the file list).

Held-out: the images whose crc32(relative path) falls below data.test_fraction. Zero-shot
classes: the top-level category folders, except "special" (CD covers, templates, gradients and
patterns: no visual concept) and "unsorted" (no concept either), on the held-out images.
"""

from __future__ import annotations

import hashlib
import html
import logging
import multiprocessing
import os
import re
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ...errors import DataError
from ..home import data_home

log = logging.getLogger("vitscale.data")
ROOT = Path("/usr/share/openclipart")
NO_ZEROSHOT = ("special", "unsorted")
TEMPLATES = ("clip art of {}.", "a drawing of {}.", "an icon of {}.", "a cartoon of {}.")
MAX_KEYWORDS = 8
FORMAT = "v1"  # bump when captions or decoding change (cache key)
MAX_PIXELS = 40_000_000  # 18 posters of 100-230 Mpixel would take minutes and GBs: skipped
DROP_KEYWORDS = {
    "unsorted",
    "hash",
    "clip art",
    "clipart",
    "image",
    "svg",
    "png",
    "media",
    "public domain",
}


def _text(s: str) -> str:
    s = re.sub(r"<!\[CDATA\[(.*?)\]\]>", r"\1", s, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]*>", " ", s)).split())


def svg_metadata(svg: str) -> tuple[str, list[str], str]:
    """-> (title, keywords, creator) of the work described in the SVG's RDF metadata ('' if none)."""
    m = re.search(r"<(\w+:)?Work\b.*?</(\w+:)?Work>", svg, flags=re.S)
    work = m.group(0) if m else ""
    creator = ""
    c = re.search(r"<dc:creator\b.*?<dc:title[^>]*>(.*?)</dc:title>", work, flags=re.S)
    if c:
        creator = _text(c.group(1))
    work = re.sub(r"<(\w+:)?Agent\b.*?</(\w+:)?Agent>", "", work, flags=re.S)  # publisher etc.
    t = re.search(r"<dc:title[^>]*>(.*?)</dc:title>", work, flags=re.S)
    title = _text(t.group(1)) if t else ""
    keywords: list[str] = []
    s = re.search(r"<dc:subject\b[^>]*>(.*?)</dc:subject>", work, flags=re.S)
    if s:
        for li in re.findall(r"<rdf:li[^>]*>(.*?)</rdf:li>", s.group(1), flags=re.S):
            for kw in _text(li).split(","):
                kw = kw.strip()
                if (
                    kw
                    and kw.lower() not in DROP_KEYWORDS
                    and kw.lower() != title.lower()
                    and kw.lower() not in (k.lower() for k in keywords)
                ):
                    keywords.append(kw)
    return title, keywords, creator


def name_from_file(stem: str, creator: str = "") -> str:
    """'chemistry_flask_matthew__01' -> 'chemistry flask' (creator 'Matthew Gates')."""
    words = [w for w in re.split(r"[_\-\s]+", stem) if w]
    while words and (words[-1].isdigit() or len(words[-1]) == 1):
        words.pop()
    if creator:  # file names are "<title>_<creator>" cut to 24 characters
        author = [w.lower() for w in re.split(r"[_\-\s]+", creator) if w]
        for k in range(min(len(words) - 1, len(author)), 0, -1):
            tail = [w.lower() for w in words[-k:]]
            if all(
                a.startswith(t) if i == k - 1 else a == t
                for i, (t, a) in enumerate(zip(tail, author))
            ):
                words = words[:-k]
                break
    return " ".join(words)


def caption_for(svg: str, stem: str) -> tuple[str, bool, bool]:
    """-> (caption, title found, keywords found)."""
    title, keywords, creator = svg_metadata(svg)
    name = title or name_from_file(stem, creator) or stem
    cap = f"clip art of {name}"
    if keywords:
        cap += ": " + ", ".join(keywords[:MAX_KEYWORDS])
    return cap, bool(title), bool(keywords)


def load_image(path: str, size: int) -> np.ndarray:
    """PNG -> uint8 [size,size,3]: alpha over white, fit inside the square, white padding."""
    with Image.open(path) as img:
        if img.size[0] * img.size[1] > MAX_PIXELS:
            raise ValueError(f"{img.size[0]}x{img.size[1]} is over {MAX_PIXELS // 10**6} Mpixel")
        img = img.convert("RGBA")
        bg = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(bg, img).convert("RGB")
    w, h = img.size
    scale = size / max(w, h)
    nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
    img = img.resize((nw, nh), Image.BICUBIC, reducing_gap=3.0)
    out = Image.new("RGB", (size, size), (255, 255, 255))
    out.paste(img, ((size - nw) // 2, (size - nh) // 2))
    return np.asarray(out, dtype=np.uint8)


def _one(args):
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # MAX_PIXELS guards us
    Image.MAX_IMAGE_PIXELS = None
    root, rel, size = args
    png = os.path.join(root, "png", rel)
    svg = os.path.join(root, "svg", rel[:-4] + ".svg")
    try:
        with open(svg, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    cap, has_title, has_kw = caption_for(text, Path(rel).stem)
    try:
        return load_image(png, size), cap, has_title, has_kw, ""
    except Exception as e:  # noqa: BLE001 - unreadable image: skipped and counted
        return None, cap, has_title, has_kw, f"{type(e).__name__}: {e}"


def scan(root: Path) -> list[str]:
    if not (root / "png").is_dir() or not (root / "svg").is_dir():
        raise DataError(
            f"OpenClipArt is not installed ({root}/png, {root}/svg): "
            f"apt-get install openclipart-png openclipart-svg"
        )
    rels = sorted(str(p.relative_to(root / "png")) for p in (root / "png").rglob("*.png"))
    if not rels:
        raise DataError(f"OpenClipArt: no PNG files under {root}/png")
    return rels


def _pool_context():
    """fork where there is one: the workers only run PIL (no torch, no CUDA), and fork does not
    re-import the caller's __main__ as spawn does."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def decode_all(root: Path, rels: list[str], size: int, workers: int | None = None) -> dict:
    """-> {images uint8 [N,3,S,S], captions, categories, rels, titles, keywords, skipped}."""
    jobs = [(str(root), r, size) for r in rels]
    workers = (
        workers if workers is not None else (min(os.cpu_count() or 1, 8) if len(jobs) > 200 else 0)
    )
    t0, out = time.time(), []
    if workers > 1:
        with _pool_context().Pool(workers) as pool:
            for i, r in enumerate(pool.imap(_one, jobs, chunksize=16), 1):
                out.append(r)
                if i % 1000 == 0:
                    log.info(
                        "OpenClipArt: decoded %d/%d images (%.0fs)", i, len(jobs), time.time() - t0
                    )
    else:
        out = [_one(j) for j in jobs]
    keep = [i for i, r in enumerate(out) if r[0] is not None]
    for i, r in enumerate(out):
        if r[0] is None:
            log.warning("OpenClipArt: skipped unreadable image %s (%s)", rels[i], r[4])
    images = np.stack([out[i][0] for i in keep]) if keep else np.zeros((0, size, size, 3), np.uint8)
    return {
        "images": torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
        "captions": [out[i][1] for i in keep],
        "rels": [rels[i] for i in keep],
        "categories": [rels[i].split("/", 1)[0] for i in keep],
        "titles": sum(out[i][2] for i in keep),
        "keywords": sum(out[i][3] for i in keep),
        "skipped": len(out) - len(keep),
        "seconds": time.time() - t0,
    }


def load(root: str = "", size: int = 64, *, limit: int | None = None) -> dict:
    """The decoded dataset (cached on disk); `limit` decodes an evenly spread subset, uncached."""
    root_p = Path(root).expanduser() if root else ROOT
    rels = scan(root_p)
    if limit is not None:
        small = [r for r in rels if (root_p / "png" / r).stat().st_size < 256_000]  # fast subset
        step = max(1, len(small) // limit)
        return decode_all(root_p, small[::step][:limit], size)
    tag = hashlib.blake2b(
        ("\n".join([FORMAT, str(root_p.resolve())] + rels)).encode(), digest_size=6
    ).hexdigest()
    cache = data_home() / f"openclipart_{size}_{tag}.pt"
    if cache.exists():
        try:
            return torch.load(cache, weights_only=True)
        except Exception as e:  # noqa: BLE001 - a corrupt cache is rebuilt
            log.warning("OpenClipArt: rebuilding unreadable cache %s (%s)", cache, e)
    log.info(
        "OpenClipArt: decoding %d images at %dx%d once (cache: %s)", len(rels), size, size, cache
    )
    print(f"OpenClipArt: decoding {len(rels)} images once into {cache} ...", flush=True)
    data = decode_all(root_p, rels, size)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    torch.save(data, tmp)
    os.replace(tmp, cache)
    return data


def pairs(cfg, context_length: int, *, limit=None) -> dict:
    """The decoded set as loaders/memory.py's memory_bundle arguments: held-out images by
    crc32(relative path), the zero-shot set of the held-out images' categories (module docstring)."""
    from ..tokenizer import readable, tokenize
    from ..transforms import NORMALIZATIONS
    from .held_out import held_out

    data = load(cfg.root, cfg.image_size or 64, limit=limit)
    test = torch.tensor([held_out(r, cfg.test_fraction) for r in data["rels"]], dtype=torch.bool)
    tokens = tokenize(data["captions"], context_length)
    x = data["images"]
    caps = np.array(data["captions"], dtype=object)
    cats = np.array(data["categories"])
    classes = sorted(set(cats.tolist()) - set(NO_ZEROSHOT))
    label = {c: i for i, c in enumerate(classes)}
    test_idx = test.nonzero().flatten()
    zs_idx = [int(i) for i in test_idx if cats[int(i)] in label]
    zs_y = torch.tensor([label[cats[i]] for i in zs_idx], dtype=torch.long)
    zs = {"openclipart": ([readable(c) for c in classes], list(TEMPLATES), x[zs_idx], zs_y)}
    mean, std = NORMALIZATIONS["clip"]
    return dict(
        train_x=x[~test],
        train_tokens=tokens[~test],
        test_x=x[test],
        test_tokens=tokens[test],
        captions_test=caps[test.numpy()].tolist(),
        mean=mean,
        std=std,
        zeroshot_sets=zs,
    )
