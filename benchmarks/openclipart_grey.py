"""OpenClipArt-grey-10: a small grey-scale classification set from Debian's OpenClipArt PNGs, written
as a class folder that `vitscale train --set data.name=folder` reads (docs/data.md).

  nice -n 19 python benchmarks/openclipart_grey.py --out /work/data/openclipart_grey10

- classes: the --classes largest top-level category folders of /usr/share/openclipart/png (every
  PNG below a category, its sub-folders included), leaving out "special" (CD covers, templates,
  gradients, patterns) and "unsorted" (no concept either), as vitscale's OpenClipArt zero-shot set
  does;
- each drawing: transparency composited over white and decompression bombs refused (the helpers of
  `vitscale data prepare`: data/offline/shard_writer.py), grey-scale (Pillow's "L": ITU-R 601
  luma), cut to the drawing's box (the pixels darker than 250: many PNGs are a page with a small
  drawing on it; a blank page is skipped and counted), the longer side resized to --fit px
  (Lanczos; aspect kept), centred on a white --size px square. The default fit of 24 in 28 leaves
  a 2 px white margin, as MNIST centres its digits in 20 of 28 px: the central 87.5% that folder
  data evaluates on (data/jpeg.py) then still holds the whole drawing. Dark drawings on white, as
  the source draws them (not inverted);
- exact duplicates (the same --size px image) are kept once: within a class the first by file
  name; one image under two classes is left out of both (its label is ambiguous). A drawing
  filed twice would otherwise land on both sides of the split;
- the split: --test-fraction of each class (rounded) to test/, drawn with --seed (stratified);
- OUT/{train,test}/<class>/<sub-folders joined by "__">__<name>.png, OUT/manifest.json (counts,
  what was skipped and why, the pixel mean/std of train/) and OUT/README.md.

Train it with data.channels=1 (grey folders: docs/data.md):

  vitscale train --set data.name=folder --set data.root=/work/data/openclipart_grey10 --set data.channels=1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vitscale.data.offline.shard_writer import _open, flatten  # noqa: E402
from vitscale.data.sources.openclipart import NO_ZEROSHOT  # noqa: E402

SOURCE = Path("/usr/share/openclipart/png")
NAME = "OpenClipArt-grey-10"
TRIM_LEVEL = 250  # a pixel lighter than this is paper


def grey_square(path: str, size: int, fit: int, trim: bool = True) -> np.ndarray:
    """A PNG -> uint8 [size, size]: over white, grey, cut to the drawing's box (`trim`), the longer
    side `fit` px, centred on white."""
    with _open(path) as img:
        img = flatten(img)  # RGB, transparency over white; a decompression bomb raises here
        img.load()
    img = img.convert("L")
    if trim:  # the drawing's box: pixels darker than TRIM_LEVEL (None: a blank page)
        box = img.point(lambda v: 255 if v < TRIM_LEVEL else 0).getbbox()
        if box is None:
            raise ValueError(f"blank: no pixel darker than {TRIM_LEVEL}")
        with warnings.catch_warnings():  # crop checks the size again; open refused bombs
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = img.crop(box)
    w, h = img.size
    scale = fit / max(w, h)
    nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
    img = img.resize((nw, nh), Image.LANCZOS, reducing_gap=3.0)
    out = Image.new("L", (size, size), 255)
    out.paste(img, ((size - nw) // 2, (size - nh) // 2))
    return np.asarray(out, dtype=np.uint8)


def _one(job):
    path, size, fit = job
    try:
        return grey_square(path, size, fit), ""
    except Exception as e:  # noqa: BLE001 - unreadable, truncated, decompression bomb: counted
        return None, f"{type(e).__name__}: {e}"


def categories(source: Path, k: int) -> list[tuple[str, list[Path]]]:
    """The k largest category folders (by PNG count, then name), without NO_ZEROSHOT."""
    found = []
    for d in sorted(p for p in source.iterdir() if p.is_dir() and p.name not in NO_ZEROSHOT):
        files = sorted(d.rglob("*.png"))
        if files:
            found.append((d.name, files))
    found.sort(key=lambda c: (-len(c[1]), c[0]))
    return found[:k]


def file_name(cat_dir: Path, f: Path) -> str:
    return "__".join(f.relative_to(cat_dir).parts)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="the class folder to write (refused if not empty)")
    p.add_argument("--source", default=str(SOURCE), help="OpenClipArt's png/ folder")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--size", type=int, default=28, help="the square side, px")
    p.add_argument("--fit", type=int, default=24, help="the longer side of the drawing, px")
    p.add_argument("--test-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="decoding processes (1: none)")
    p.add_argument("--force", action="store_true", help="replace what an earlier run wrote")
    a = p.parse_args()

    source, out = Path(a.source), Path(a.out)
    if not source.is_dir():
        print(
            f"openclipart_grey: {source} not found (apt-get install openclipart-png)",
            file=sys.stderr,
        )
        return 2
    if not 0 < a.fit <= a.size or not 0 < a.test_fraction < 1:
        print(
            "openclipart_grey: need 0 < --fit <= --size and 0 < --test-fraction < 1",
            file=sys.stderr,
        )
        return 2
    if out.exists() and any(out.iterdir()):
        if not (a.force and (out / "manifest.json").exists()):
            print(
                f"openclipart_grey: {out} is not empty (--force replaces an earlier run's output)",
                file=sys.stderr,
            )
            return 2
        for part in ("train", "test"):
            shutil.rmtree(out / part, ignore_errors=True)
    cats = categories(source, a.classes)
    if len(cats) < a.classes:
        print(f"openclipart_grey: only {len(cats)} categories in {source}", file=sys.stderr)
        return 2

    t0 = time.time()
    pool = multiprocessing.get_context("fork").Pool(a.workers) if a.workers > 1 else None
    images: dict[str, list[tuple[str, np.ndarray]]] = {}
    skipped: dict[str, list[dict]] = {}
    try:
        for cat, files in cats:
            t = time.time()
            jobs = [(str(f), a.size, a.fit) for f in files]
            results = pool.imap(_one, jobs, chunksize=8) if pool else map(_one, jobs)
            images[cat], skipped[cat] = [], []
            for f, (x, err) in zip(files, results):
                if x is None:
                    kind = (
                        "decompression bomb"
                        if "DecompressionBomb" in err
                        else "blank"
                        if "blank:" in err
                        else "unreadable"
                    )
                    skipped[cat].append(
                        {"file": str(f.relative_to(source)), "why": kind, "error": err}
                    )
                else:
                    images[cat].append((file_name(source / cat, f), x))
            print(
                f"{cat}: {len(files)} drawings, {len(images[cat])} read, {len(skipped[cat])} "
                f"skipped ({time.time() - t:.0f} s)",
                flush=True,
            )
    finally:
        if pool:
            pool.close()
            pool.join()

    # exact duplicates: once per class; an image under two classes is left out of both
    owners: dict[bytes, set] = {}
    for cat, items in images.items():
        for _, x in items:
            owners.setdefault(hashlib.blake2b(x.tobytes(), digest_size=16).digest(), set()).add(cat)
    duplicates = {cat: 0 for cat in images}
    ambiguous = {cat: 0 for cat in images}
    for cat in images:
        seen, kept = set(), []
        for name, x in images[cat]:
            h = hashlib.blake2b(x.tobytes(), digest_size=16).digest()
            if len(owners[h]) > 1:
                ambiguous[cat] += 1
            elif h in seen:
                duplicates[cat] += 1
            else:
                seen.add(h)
                kept.append((name, x))
        images[cat] = kept

    counts, train_pixels = {}, []
    for cat in images:
        items = images[cat]
        rng = np.random.default_rng([a.seed, int.from_bytes(cat.encode()[:8], "little")])
        n_test = round(len(items) * a.test_fraction)
        test = set(rng.permutation(len(items))[:n_test].tolist())
        for split in ("train", "test"):
            (out / split / cat).mkdir(parents=True, exist_ok=True)
        for i, (name, x) in enumerate(items):
            split = "test" if i in test else "train"
            Image.fromarray(x, "L").save(out / split / cat / name)
            if split == "train":
                train_pixels.append(x)
        counts[cat] = {"train": len(items) - n_test, "test": n_test}
    px = np.stack(train_pixels).astype(np.float64) / 255.0
    totals = {s: sum(c[s] for c in counts.values()) for s in ("train", "test")}
    manifest = {
        "name": NAME,
        "source": str(source),
        "classes": list(counts),
        "image": {
            "size": a.size,
            "fit": a.fit,
            "mode": "L",
            "how": f"alpha over white, grey-scale (Pillow L), cut to the pixels darker than "
            f"{TRIM_LEVEL}, longer side to {a.fit} px (Lanczos), centred on white",
        },
        "split": {"test_fraction": a.test_fraction, "seed": a.seed, "stratified": True},
        "counts": counts,
        "totals": totals,
        "train_pixels": {"mean": round(px.mean(), 4), "std": round(px.std(), 4)},
        "dropped": {
            "duplicates_within_class": duplicates,
            "same_image_in_two_classes": ambiguous,
        },
        "skipped": {cat: s for cat, s in skipped.items() if s},
        "seconds": round(time.time() - t0),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "README.md").write_text(readme(manifest))
    n_skip = sum(len(s) for s in skipped.values())
    print(
        f"{NAME}: {totals['train']} train + {totals['test']} test images in {len(counts)} classes "
        f"in {out} ({n_skip} skipped, {sum(duplicates.values())} duplicates and "
        f"{sum(ambiguous.values())} two-class images dropped; {time.time() - t0:.0f} s)"
    )
    return 0


def readme(m: dict) -> str:
    rows = "\n".join(
        f"| {cat} | {c['train']} | {c['test']} | {m['dropped']['duplicates_within_class'][cat]} "
        f"| {m['dropped']['same_image_in_two_classes'][cat]} | {len(m['skipped'].get(cat, []))} |"
        for cat, c in m["counts"].items()
    )
    skipped = "\n".join(
        f"- {s['file']}: {s['why']} ({s['error']})" for ss in m["skipped"].values() for s in ss
    )
    return f"""# {m["name"]}

Made by `benchmarks/openclipart_grey.py` (vitscale) from {m["source"]} (Debian's openclipart-png):
the {len(m["classes"])} largest category folders but "special" and "unsorted", each drawing
{m["image"]["how"]}, {m["image"]["size"]}x{m["image"]["size"]} px (the drawing {m["image"]["fit"]} px
on its longer side). Test: {m["split"]["test_fraction"]:.0%} of each class, seed {m["split"]["seed"]}.
Training pixels: mean {m["train_pixels"]["mean"]}, std {m["train_pixels"]["std"]} (0-1 scale).

| class | train | test | duplicates dropped | in two classes, dropped | unreadable or bombs |
|---|---:|---:|---:|---:|---:|
{rows}
| **total** | {m["totals"]["train"]} | {m["totals"]["test"]} | {sum(m["dropped"]["duplicates_within_class"].values())} | {sum(m["dropped"]["same_image_in_two_classes"].values())} | {sum(len(s) for s in m["skipped"].values())} |

Skipped:
{skipped or "- none"}

Train (vitscale's default recipe, 1-channel):

    vitscale train --set data.name=folder --set data.root=THIS_FOLDER --set data.channels=1
"""


if __name__ == "__main__":
    sys.exit(main())
