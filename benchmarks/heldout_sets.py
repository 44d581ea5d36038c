"""Held-out small grey-scale sets, made offline from installed packages' images, for checking that
the default recipe (tuned on Fashion-MNIST alone) travels to data no one tuned on. Each is written
as a class folder that `vitscale train --set data.name=folder` reads (docs/data.md):

  python benchmarks/heldout_sets.py digits --out /work/data/heldout/digits
  nice -n 19 python benchmarks/heldout_sets.py glyphs --out /work/data/heldout/glyphs

- digits: scikit-learn's load_digits() (1,797 8x8 hand-written digits, 10 classes, bundled with
  scikit-learn: no download), each image's 0-16 levels scaled to 0-255 and the 8x8 grid resized to
  --fit px (bilinear) in the middle of a black --size px square. The default fit of 24 in 28 leaves
  a 2 px margin, as openclipart_grey.py does: the digits fill all 8 rows of their grid, and folder
  data evaluates on the central 87.5% (data/jpeg.py), which would cut the tops and bottoms of a
  28 px upscale (--fit 28 writes that). A stratified split: --test-fraction of each class (rounded)
  to test/, drawn with --seed. Light strokes on black, as the source (and MNIST) draws them;
- glyphs: 10 capital letters (--letters, default A-H, J, K: a sans I is a bare bar, and so is a
  sans J at 28 px once its small hook blurs, so I is left out) rendered with Pillow from every TrueType face
  under --fonts (Debian's DejaVu: Sans, Serif, Mono, their Bold/Oblique/Condensed/ExtraLight
  faces) that draws all of them. Each sample draws, with its own seeded generator: a face, a stroke
  widening (Pillow's stroke_width at the --render px size), a shear, a rotation, the glyph's longer
  side (the scale), an aspect change, a shift from the centre and a level of Gaussian pixel noise
  (the ranges: JITTER). Light glyph on black in a --size px square; the glyph box stays inside the
  central 87.5% before the shift. test/ holds independent draws from the same faces (another seed
  stream), not held-out faces;
- OUT/{train,test}/<class>/<n>.png (grey, Pillow "L"), OUT/manifest.json (how, counts, the pixel
  mean/std of train/) and OUT/README.md. --force replaces an earlier run's output.

Train one with data.channels=1 (grey folders: docs/data.md):

  vitscale train --set data.name=folder --set data.root=/work/data/heldout/glyphs --set data.channels=1
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

FONTS = Path("/usr/share/fonts")
LETTERS = "ABCDEFGHJK"  # not I: a bare bar in the sans faces, as a sans J nearly is at 28 px
# glyphs: each sample's draws (uniform in [lo, hi]; stroke: an integer in [lo, hi])
JITTER = {
    "rotation_deg": (-15.0, 15.0),
    "shear": (-0.25, 0.25),  # x += shear * y, before the rotation
    "fit_px": (14.0, 20.0),  # the glyph's longer side after the affine, px at --size 28
    "aspect": (0.8, 1.2),  # the width's extra factor
    "shift_px": (-2.0, 2.0),  # x and y, each
    "stroke": (0, 3),  # Pillow's stroke_width at the --render px size (64: up to ~1.3 px at 28)
    "noise_std": (0.0, 12.0),  # Gaussian, on 0-255
}
# --jitter strong: wider ranges, a harder set (an RBF-SVC on the pixels: about 87% against 99%)
JITTER_STRONG = {
    "rotation_deg": (-25.0, 25.0),
    "shear": (-0.4, 0.4),
    "fit_px": (12.0, 21.0),
    "aspect": (0.8, 1.2),
    "shift_px": (-3.0, 3.0),
    "stroke": (0, 3),
    "noise_std": (0.0, 25.0),
}
JITTERS = {"light": JITTER, "strong": JITTER_STRONG}
SPLITS = ("train", "test")


class Refused(Exception):
    """A one-line refusal: printed to stderr, exit 2."""


def prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise Refused(f"{out} is not a folder")
    if out.exists() and any(out.iterdir()):
        if not (force and (out / "manifest.json").exists()):
            raise Refused(f"{out} is not empty (--force replaces an earlier run's output)")
        for part in SPLITS:
            shutil.rmtree(out / part, ignore_errors=True)


def write_split(out: Path, items: dict[str, dict[str, list[np.ndarray]]]) -> dict:
    """items[split][class] -> images; writes OUT/split/class/<n>.png, returns the counts."""
    counts = {c: {} for c in items["train"]}
    for split in SPLITS:
        for cls, images in items[split].items():
            d = out / split / cls
            d.mkdir(parents=True, exist_ok=True)
            for i, x in enumerate(images):
                Image.fromarray(x, "L").save(d / f"{i:05d}.png")
            counts[cls][split] = len(images)
    return counts


def finish(out: Path, manifest: dict, items: dict, t0: float) -> dict:
    px = np.stack([x for xs in items["train"].values() for x in xs]).astype(np.float64) / 255.0
    counts = manifest["counts"]
    manifest["totals"] = {s: sum(c[s] for c in counts.values()) for s in SPLITS}
    manifest["train_pixels"] = {"mean": round(px.mean(), 4), "std": round(px.std(), 4)}
    manifest["seconds"] = round(time.time() - t0, 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "README.md").write_text(readme(manifest))
    t = manifest["totals"]
    print(
        f"{manifest['name']}: {t['train']} train + {t['test']} test images in {len(counts)} "
        f"classes in {out} ({manifest['seconds']:.0f} s)"
    )
    return manifest


# ---- digits ----


def sklearn_digits():
    """scikit-learn's load_digits (bundled data: no download); refused without scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise Refused(
            "digits needs scikit-learn (pip install -c constraints.txt scikit-learn)"
        ) from None
    return load_digits


def make_digits(out: Path, size: int, fit: int, test_fraction: float, seed: int) -> dict:
    load_digits = sklearn_digits()
    t0 = time.time()
    d = load_digits()
    grids = np.clip(np.rint(d.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    items = {s: {} for s in SPLITS}
    for cls in sorted(set(d.target.tolist())):
        idx = np.flatnonzero(d.target == cls)
        rng = np.random.default_rng([seed, int(cls)])
        n_test = round(len(idx) * test_fraction)
        test = set(rng.permutation(len(idx))[:n_test].tolist())
        for s in SPLITS:
            items[s][str(cls)] = []
        for j, i in enumerate(idx):  # in load_digits' order within each split
            img = Image.fromarray(grids[i], "L").resize((fit, fit), Image.BILINEAR)
            square = Image.new("L", (size, size), 0)
            square.paste(img, ((size - fit) // 2, (size - fit) // 2))
            items["test" if j in test else "train"][str(cls)].append(np.asarray(square))
    counts = write_split(out, items)
    manifest = {
        "name": "digits",
        "source": "sklearn.datasets.load_digits (UCI optical recognition of hand-written digits, "
        "the 1,797-image test part)",
        "how": f"8x8 levels 0-16 scaled to 0-255, resized to {fit}x{fit} (bilinear), centred on "
        f"a black {size}x{size} square; light digits on black",
        "image": {"size": size, "fit": fit, "mode": "L"},
        "split": {"test_fraction": test_fraction, "seed": seed, "stratified": True},
        "counts": counts,
    }
    return finish(out, manifest, items, t0)


# ---- glyphs ----


def _drawn(font: ImageFont.FreeTypeFont, ch: str, render: int) -> np.ndarray:
    img = Image.new("L", (2 * render, 2 * render), 0)
    ImageDraw.Draw(img).text((render, render), ch, fill=255, font=font, anchor="mm")
    return np.asarray(img)


def usable_fonts(folder: Path, letters: str, render: int) -> list[Path]:
    """The TrueType faces under `folder` (sorted) that draw every letter: each one a glyph of its
    own (not the face's missing-glyph box)."""
    found = []
    for path in sorted(folder.rglob("*.ttf")):
        try:
            font = ImageFont.truetype(str(path), render)
        except OSError:
            continue
        drawn = [_drawn(font, ch, render) for ch in letters]
        missing = _drawn(font, "\ufffe", render)  # the face's missing-glyph box (or nothing)
        if all(d.any() and not np.array_equal(d, missing) for d in drawn) and len(
            {d.tobytes() for d in drawn}
        ) == len(drawn):
            found.append(path)
    return found


def _affine(img: Image.Image, shear: float, rotation: float) -> Image.Image:
    """Shear (x += shear * y) then rotate, about the glyph's centre, on a canvas that holds it."""
    w, h = img.size
    side = int(2 * max(w, h) + 4)
    canvas = Image.new("L", (side, side), 0)
    canvas.paste(img, ((side - w) // 2, (side - h) // 2))
    c = side / 2
    t = np.deg2rad(rotation)
    fwd = np.array([[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]]) @ np.array(
        [[1.0, shear], [0.0, 1.0]]
    )
    inv = np.linalg.inv(fwd)  # Image.transform maps output pixels to input ones
    off = np.array([c, c]) - inv @ np.array([c, c])
    data = (inv[0, 0], inv[0, 1], off[0], inv[1, 0], inv[1, 1], off[1])
    return canvas.transform(canvas.size, Image.AFFINE, data, Image.BICUBIC)


def glyph(
    font: ImageFont.FreeTypeFont, letter: str, render: int, size: int, rng, j: dict = JITTER
) -> np.ndarray:
    """One jittered sample (`j`: the ranges): uint8 [size, size], light glyph on black."""
    stroke = int(rng.integers(j["stroke"][0], j["stroke"][1] + 1))
    shear, rotation = rng.uniform(*j["shear"]), rng.uniform(*j["rotation_deg"])
    fit, aspect = rng.uniform(*j["fit_px"]) * size / 28, rng.uniform(*j["aspect"])
    dx, dy = rng.uniform(*j["shift_px"], size=2) * size / 28
    noise = rng.uniform(*j["noise_std"])

    big = Image.new("L", (3 * render, 3 * render), 0)
    ImageDraw.Draw(big).text(
        (1.5 * render, 1.5 * render),
        letter,
        fill=255,
        font=font,
        anchor="mm",
        stroke_width=stroke,
        stroke_fill=255,
    )
    img = big.crop(big.getbbox())
    img = _affine(img, shear, rotation)
    img = img.crop(img.getbbox())
    w, h = img.size[0] * aspect, img.size[1]
    scale = fit / max(w, h)
    nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
    img = img.resize((nw, nh), Image.LANCZOS)
    out = Image.new("L", (size, size), 0)
    out.paste(img, (round((size - nw) / 2 + dx), round((size - nh) / 2 + dy)))
    x = np.asarray(out, dtype=np.float64) + rng.normal(0.0, noise, (size, size))
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def make_glyphs(
    out: Path,
    size: int,
    letters: str,
    fonts_dir: Path,
    train_per_class: int,
    test_per_class: int,
    seed: int,
    render: int = 64,
    jitter: dict = JITTER,
) -> dict:
    if len(set(letters)) < 2 or len(set(letters)) != len(letters) or not letters.isalnum():
        raise Refused(f"--letters {letters!r}: need 2 or more distinct letters or digits")
    if not fonts_dir.is_dir():
        raise Refused(f"{fonts_dir} not found (apt-get install fonts-dejavu-core)")
    t0 = time.time()
    paths = usable_fonts(fonts_dir, letters, render)
    if not paths:
        raise Refused(f"no TrueType face under {fonts_dir} draws all of {letters!r}")
    fonts = [ImageFont.truetype(str(p), render) for p in paths]
    per = {"train": train_per_class, "test": test_per_class}
    items = {s: {} for s in SPLITS}
    faces = {s: {} for s in SPLITS}
    for k, letter in enumerate(letters):
        for s_id, s in enumerate(SPLITS):
            items[s][letter] = []
            for i in range(per[s]):
                rng = np.random.default_rng([seed, s_id, k, i])  # each sample its own stream
                f = int(rng.integers(len(fonts)))
                faces[s][paths[f].stem] = faces[s].get(paths[f].stem, 0) + 1
                items[s][letter].append(glyph(fonts[f], letter, render, size, rng, jitter))
    counts = write_split(out, items)
    manifest = {
        "name": "glyphs",
        "source": f"the TrueType faces under {fonts_dir} that draw all of {letters!r}",
        "fonts": [str(p) for p in paths],
        "how": f"each letter drawn at {render} px (Pillow, stroke_width jittered), sheared, rotated, "
        f"resized (Lanczos) to a random longer side and aspect, shifted, on a black {size}x{size} "
        "square, plus Gaussian noise; light glyphs on black; test: independent draws from the "
        "same faces",
        "image": {"size": size, "render_px": render, "mode": "L"},
        "jitter": jitter,
        "split": {
            "train_per_class": train_per_class,
            "test_per_class": test_per_class,
            "seed": seed,
        },
        "faces_drawn": faces,
        "counts": counts,
    }
    return finish(out, manifest, items, t0)


def readme(m: dict) -> str:
    rows = "\n".join(f"| {c} | {n['train']} | {n['test']} |" for c, n in m["counts"].items())
    fonts = "".join(f"- {f}\n" for f in m.get("fonts", []))
    fonts = f"\nFaces ({len(m['fonts'])}):\n\n{fonts}" if fonts else ""
    return f"""# Held-out grey set: {m["name"]}

Made by `benchmarks/heldout_sets.py {m["name"]}` (vitscale) from {m["source"]}: {m["how"]}.
Split: {json.dumps(m["split"])}. Training pixels: mean {m["train_pixels"]["mean"]}, std
{m["train_pixels"]["std"]} (0-1 scale). manifest.json holds the details.

| class | train | test |
|---|---:|---:|
{rows}
| **total** | {m["totals"]["train"]} | {m["totals"]["test"]} |
{fonts}
Train (vitscale's default recipe, 1-channel):

    vitscale train --set data.name=folder --set data.root=THIS_FOLDER --set data.channels=1
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="set", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", required=True, help="the class folder to write")
    common.add_argument("--size", type=int, default=28, help="the square side, px")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--force", action="store_true", help="replace an earlier run's output")
    d = sub.add_parser("digits", parents=[common], help="scikit-learn's 8x8 digits, upscaled")
    d.add_argument("--fit", type=int, default=24, help="the 8x8 grid's side after resizing, px")
    d.add_argument("--test-fraction", type=float, default=0.2)
    g = sub.add_parser("glyphs", parents=[common], help="letters drawn from installed fonts")
    g.add_argument("--letters", default=LETTERS, help="the classes: one character each")
    g.add_argument("--fonts", default=str(FONTS), help="a folder searched for *.ttf faces")
    g.add_argument("--train-per-class", type=int, default=800)
    g.add_argument("--test-per-class", type=int, default=200)
    g.add_argument("--jitter", choices=list(JITTERS), default="light", help="the ranges' width")
    a = p.parse_args(argv)

    out = Path(a.out)
    try:
        if a.size < 8:
            raise Refused("--size must be at least 8")
        if a.set == "digits":
            if not 0 < a.fit <= a.size or not 0 < a.test_fraction < 1:
                raise Refused("need 0 < --fit <= --size and 0 < --test-fraction < 1")
            sklearn_digits()
            prepare_out(out, a.force)
            make_digits(out, a.size, a.fit, a.test_fraction, a.seed)
        else:
            if a.train_per_class < 1 or a.test_per_class < 1:
                raise Refused("--train-per-class and --test-per-class must be at least 1")
            prepare_out(out, a.force)
            make_glyphs(
                out,
                a.size,
                a.letters,
                Path(a.fonts),
                a.train_per_class,
                a.test_per_class,
                a.seed,
                jitter=JITTERS[a.jitter],
            )
    except Refused as e:
        print(f"heldout_sets {a.set}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
