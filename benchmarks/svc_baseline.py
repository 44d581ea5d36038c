"""A pixel baseline for a small grey class folder (ROOT/train/<class>/*.png and ROOT/test/<class>/,
or val/ or validation/, as vitscale's folder loader scans them): scikit-learn's SVC with an RBF
kernel (default C = 1, gamma = "scale") on the raw pixels scaled to 0-1 and flattened. Prints the
test accuracy in one line, then the same as one JSON line.

  nice -n 19 python benchmarks/svc_baseline.py /work/data/heldout/digits
  nice -n 19 python benchmarks/svc_baseline.py /work/data/heldout/glyphs --max-train 2000

Every image is read as Pillow's "L" (grey) and must have the first image's size; the classes and
the image order are those of vitscale.data.sources.folder.scan. --max-train N fits on N training
images drawn with --seed (without replacement; all when N is larger). libsvm is single-threaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vitscale.data.sources.folder import scan  # noqa: E402
from vitscale.errors import DataError  # noqa: E402


def pixels(paths) -> np.ndarray:
    """-> float32 [n, h*w] in 0-1; every image the size of the first."""
    rows, size = [], None
    for p in paths:
        with Image.open(p) as img:
            img = img.convert("L")
            if size is None:
                size = img.size
            elif img.size != size:
                raise ValueError(f"{p} is {img.size[0]}x{img.size[1]}, not {size[0]}x{size[1]}")
            rows.append(np.asarray(img, dtype=np.float32).reshape(-1) / 255.0)
    return np.stack(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("root", help="the class folder (ROOT/train, ROOT/test)")
    p.add_argument("--max-train", type=int, default=None, help="fit on at most N training images")
    p.add_argument("--seed", type=int, default=0, help="which --max-train images")
    a = p.parse_args(argv)

    try:
        from sklearn.svm import SVC
    except ImportError:
        print(
            "svc_baseline: needs scikit-learn (pip install -c constraints.txt scikit-learn)",
            file=sys.stderr,
        )
        return 2
    if a.max_train is not None and a.max_train < 1:
        print("svc_baseline: --max-train must be at least 1", file=sys.stderr)
        return 2
    root = Path(a.root)
    try:
        classes, (train_paths, y_train), (test_paths, y_test) = scan(root)
    except (DataError, OSError) as e:
        print(f"svc_baseline: {e}", file=sys.stderr)
        return 2
    n_all = len(train_paths)
    if a.max_train is not None and a.max_train < n_all:
        pick = np.sort(np.random.default_rng(a.seed).permutation(n_all)[: a.max_train])
        train_paths, y_train = train_paths[pick], y_train[pick]
    if len(set(y_train.tolist())) < 2:
        print("svc_baseline: the training images hold fewer than 2 classes", file=sys.stderr)
        return 2

    t0 = time.time()
    try:
        x_train, x_test = pixels(train_paths), pixels(test_paths)
    except (OSError, ValueError) as e:
        print(f"svc_baseline: {e}", file=sys.stderr)
        return 2
    if x_train.shape[1] != x_test.shape[1]:
        print("svc_baseline: train and test images differ in size", file=sys.stderr)
        return 2
    t_read = time.time() - t0
    svc = SVC(kernel="rbf", gamma="scale")
    t0 = time.time()
    svc.fit(x_train, y_train)
    t_fit = time.time() - t0
    t0 = time.time()
    accuracy = float((svc.predict(x_test) == y_test).mean())
    t_predict = time.time() - t0

    result = {
        "root": str(root),
        "model": "SVC(kernel='rbf', C=1.0, gamma='scale') on pixels/255",
        "classes": len(classes),
        "train": len(y_train),
        "train_available": n_all,
        "test": len(y_test),
        "pixels": x_train.shape[1],
        "accuracy": round(accuracy, 4),
        "support_vectors": int(svc.n_support_.sum()),
        "seconds": {
            "read": round(t_read, 1),
            "fit": round(t_fit, 1),
            "predict": round(t_predict, 1),
        },
        "max_train": a.max_train,
        "seed": a.seed,
    }
    print(
        f"{root}: RBF-SVC test accuracy {accuracy:.2%} ({len(y_test)} test images, fit on "
        f"{len(y_train)} of {n_all} training images, {len(classes)} classes, "
        f"{x_train.shape[1]} pixels; fit {t_fit:.1f} s, predict {t_predict:.1f} s)"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
