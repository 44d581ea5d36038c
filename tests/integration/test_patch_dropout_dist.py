"""Patch dropout (issue 43) under every engine the CLIP step runs on: 2 gloo ranks under DDP, FSDP2
and ZeRO-2, and one compiled process (inductor), with the losses that tests/unit/test_patch_dropout.py
does not train (v0, v1, v2; and v3 under ZeRO); the tail switches once (announced by rank 0 alone),
the run counts the masked FLOPs, and every loss value is finite."""

import json

import pytest
import torch
from helpers import CLIP, torchrun

from vitscale.config import load_config
from vitscale.tasks import build_task


@pytest.mark.parametrize(
    "nproc,extra",
    [
        (2, ["strategy.name=ddp", "clip.loss=fastclip_v0"]),
        (2, ["strategy.name=fsdp", "clip.loss=fastclip_v2"]),
        (2, ["strategy.name=deepspeed", "strategy.zero_stage=2", "clip.loss=fastclip_v3"]),
        (1, ["train.compile=true", "clip.loss=fastclip_v1"]),
    ],
    ids=["ddp", "fsdp", "zero2", "compile"],
)
def test_patch_dropout_trains_under_each_engine(tmp_path, nproc, extra):
    if "strategy.name=deepspeed" in extra:
        pytest.importorskip("deepspeed")
    pd = ["model.patch_dropout=0.5", "model.patch_dropout_until=0.5", "run.progress=plain"]
    base = ["run.threads=1", *pd]
    p = torchrun(tmp_path / "r", extra, nproc=nproc, config=CLIP, base=base)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("patch dropout off from epoch 1") == 1, p.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if r["kind"] == "train")
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    task = build_task(load_config(CLIP, [*base, *extra]))
    assert s["flops_per_image"] == task.flops(task.build_spec(8, 1, 4)) and s["steps"] == 8
