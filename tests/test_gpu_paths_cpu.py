"""CUDA-only paths of issue 25 driven on a CPU through fakes of the few torch.cuda / NCCL calls they
make: checkpoint RNG states per device, communication timing with CUDA events, no host sync in the
training step, no forward on empty evaluation batches."""
from __future__ import annotations

import pytest
import torch

from vitscale import checkpoint as ckpt


class FakeCuda:
    """torch.cuda's RNG calls for `visible` GPUs, this process on `current`."""

    def __init__(self, monkeypatch, visible: int, current: int = 0):
        self.states = {i: torch.full((8,), i, dtype=torch.uint8) for i in range(visible)}
        self.visible, self.current = visible, current
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [self.get(i) for i in range(visible)])

        def set_all(states):
            for i, st in enumerate(states):
                self.set(st, i)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)

    def _index(self, device):
        i = self.current if device in (None, "cuda") else device if isinstance(device, int) else device.index
        if i >= self.visible:
            raise IndexError(f"cuda:{i} is not visible ({self.visible} GPUs)")
        return i

    def get(self, device="cuda"):
        return self.states[self._index(device)].clone()

    def set(self, state, device="cuda"):
        self.states[self._index(device)] = state.clone()


def test_checkpoint_holds_this_process_gpu_rng_and_resumes_where_fewer_gpus_are_visible(monkeypatch):
    """Rank 3 of a node with 8 GPUs saves its own GPU's state; a resume on a machine (or an srun
    task) that sees one GPU restores it there instead of failing with IndexError."""
    node = FakeCuda(monkeypatch, visible=8, current=3)
    node.states[3] = torch.arange(8, dtype=torch.uint8)
    saved = ckpt.rng_state()
    assert torch.equal(saved["cuda"], torch.arange(8, dtype=torch.uint8))  # one tensor: cuda:3's
    one = FakeCuda(monkeypatch, visible=1, current=0)
    ckpt.set_rng_state(saved)
    assert torch.equal(one.states[0], torch.arange(8, dtype=torch.uint8))
    # a checkpoint of the older format (every visible GPU's state) resumes on one GPU too
    one.states[0] = torch.zeros(8, dtype=torch.uint8)
    ckpt.set_rng_state({**saved, "cuda": [torch.full((8,), i, dtype=torch.uint8) for i in range(8)]})
    assert torch.equal(one.states[0], torch.zeros(8, dtype=torch.uint8))  # list[0] for cuda:0
