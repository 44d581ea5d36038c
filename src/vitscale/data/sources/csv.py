"""A CSV/TSV of (image path, caption) -> Records (paths relative to the file's folder)."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

from ...errors import DataError
from ..types import Records


def read_csv(path: str, image_key: str, caption_key: str) -> Records:
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"csv dataset: {p} not found")
    sep = "\t" if p.suffix.lower() == ".tsv" else ","
    with open(p, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=sep)
        cols = reader.fieldnames or []
        for key, what in ((image_key, "data.csv_image_key"), (caption_key, "data.csv_caption_key")):
            if key not in cols:
                raise DataError(
                    f"csv dataset {p}: no column '{key}' ({what}); columns: "
                    f"{', '.join(cols) or 'none (empty file)'}"
                )
        rows = [(r[image_key] or "", r[caption_key] or "") for r in reader]
    if not rows:
        raise DataError(f"csv dataset {p}: no rows")
    base = p.parent
    paths = [str(Path(i) if os.path.isabs(i) else base / i) for i, _ in rows]
    return Records(np.array([c for _, c in rows]), np.array([i for i, _ in rows]), np.array(paths))
