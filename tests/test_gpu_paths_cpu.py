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


# -- FSDP2 cpu_offload on NCCL: a gloo backend for the CPU DTensors too --------------------------------
class _Joined(Exception):
    pass


def test_fsdp_cpu_offload_joins_nccl_with_a_cpu_backend(monkeypatch):
    """The group a GPU run joins: NCCL alone normally; "cuda:nccl,cpu:gloo" with FSDP2's
    cpu_offload, whose grad-norm full_tensor() and full state dict run on CPU DTensors."""
    from vitscale.config import OptimConfig, StrategyConfig, TrainConfig
    from vitscale.strategy import dist as vdist
    from vitscale.strategy.fsdp import FSDPStrategy
    seen = []
    monkeypatch.setattr(vdist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(vdist.dist, "TCPStore", lambda *a, **k: object())
    monkeypatch.setattr(vdist.dist, "PrefixStore", lambda prefix, store: store)
    monkeypatch.setattr(vdist.dist, "init_process_group", lambda **kw: seen.append(kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    vdist.init_process_group("cuda", "auto", 60.0)
    vdist.init_process_group("cuda", "auto", 60.0, cpu_collectives=True)
    vdist.init_process_group("cpu", "auto", 60.0, cpu_collectives=True)
    assert [kw["backend"] for kw in seen] == ["nccl", "cuda:nccl,cpu:gloo", "gloo"]
    assert seen[1]["device_id"] == torch.device("cuda", 1)
    # FSDPStrategy asks for the CPU backend exactly when it offloads
    asked = []

    def record(device_type, backend, timeout_s, cpu_collectives=False):
        asked.append(cpu_collectives)
        raise _Joined
    monkeypatch.setattr(vdist, "init_process_group", record)
    for offload in (False, True):
        with pytest.raises(_Joined):
            FSDPStrategy(TrainConfig(), OptimConfig(), StrategyConfig(name="fsdp", cpu_offload=offload), "cuda")
    assert asked == [False, True]


# -- communication time on NCCL: CUDA events, read at the log step ----------------------------------
class FakeEvent:
    """torch.cuda.Event on a fake clock: each record() advances it by 1/8 s."""
    clock, syncs = 0.0, 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self, stream=None):
        FakeEvent.clock += 0.125
        self.t = FakeEvent.clock

    def synchronize(self):
        FakeEvent.syncs += 1

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_collective_time_on_cuda_comes_from_events_read_at_take(tmp_path, monkeypatch):
    """A NCCL work's future completes when its kernel is queued, so the host clock times the launch
    (microseconds). Payloads on a GPU are timed with CUDA events instead (start on the issuing
    stream, end in the future's callback), synchronized only when take() reads them."""
    import torch.distributed as dist

    from vitscale.strategy import comm
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(comm, "on_cuda", lambda payload: True)  # the payload "is on a GPU"
    FakeEvent.clock, FakeEvent.syncs = 0.0, 0
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        c = comm.Counter()
        all_reduce = c.wrap(dist.all_reduce, "allreduce", 0, "tensor")
        t = torch.ones(1000)
        with c.window():
            all_reduce(t, async_op=True).wait()  # async: end event in the future's callback
            all_reduce(t)                        # synchronous: end event after the call
        assert FakeEvent.syncs == 0              # nothing waited for the GPU inside the step
        r = c.take(2)
        assert FakeEvent.syncs == 2
        assert r["comm_allreduce_calls_per_step"] == 1.0 and r["comm_allreduce_bytes_per_step"] == 4000
        assert r["comm_allreduce_s_per_step"] == pytest.approx(0.125)  # (2 x 1/8 s) / 2 steps
        # the functional all-reduce is only queued when it returns: bytes and calls, no time
        funcol = c.wrap(lambda self, op, group: self, "allreduce", 0, "self", completes=False)
        with c.window():
            funcol(t, "sum", None)
        r = c.take(1)
        assert r["comm_allreduce_calls_per_step"] == 1 and r["comm_allreduce_s_per_step"] == 0
    finally:
        dist.destroy_process_group()
