"""Datasets and loaders: build.py builds a DataBundle (types.py) from the `data` config.

    bundle.train.iterate(epoch, start_batch) -> (x float32 [B,C,H,W] on device, y) or
                                                (x, tokens [B,L], index [B]) for image-text pairs
    bundle.test.iterate()                    -> the same over this rank's test shard

Layout: sources/ (one module per format), loaders/ (how batches reach the device), offline/
(download, `vitscale data prepare`), transforms.py, jpeg.py, tokenizer.py.
"""

from .build import (
    IMAGE_TEXT,
    PAIRS_ONLY,
    build_data,
    build_image_text,
    check_data,
    geometry,
    synthetic_stand_in,
)
from .types import DataBundle

__all__ = [
    "IMAGE_TEXT",
    "PAIRS_ONLY",
    "DataBundle",
    "build_data",
    "check_data",
    "build_image_text",
    "geometry",
    "synthetic_stand_in",
]
