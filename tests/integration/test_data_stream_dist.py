"""Streamed webdataset shards under torchrun (the `shards` fixture: conftest.py)."""

import importlib.util

import pytest
import torch
from helpers import torchrun

from vitscale import checkpoint as ckpt

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None,
    reason="the BPE vocabulary ships in open-clip-torch",
)


def test_two_ranks_stream_disjoint_shards_under_ddp(shards, tmp_path):
    """torchrun, 2 gloo ranks under DDP, FastCLIP: the ranks stay in lockstep on streamed shards and one
    epoch touches every sample's u exactly as the indices route it (24 samples, 3 steps of 8)."""
    base = [
        "run.threads=1",
        "data.name=webdataset",
        "data.reader=stream",
        f"data.root={shards / 'train'}",
        f"data.test_root={shards / 'test'}",
        "data.image_size=16",
        "data.batch_size=8",
        "data.eval_batch_size=8",
        "data.num_workers=1",
        "data.on_device=false",
        "model.patch_size=4",
        "clip.loss=fastclip_v3",
        "train.epochs=1",
    ]
    p = torchrun(
        tmp_path / "two", ["strategy.name=ddp"], config="configs/tests/clip_tiny.toml", base=base
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s = torch.load(ckpt.list_checkpoints(tmp_path / "two")[-1], weights_only=False)
    assert s["step"] == 3 and (s["task"]["lu1"] != 0).sum() == 24
