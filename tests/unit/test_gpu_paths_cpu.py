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
        monkeypatch.setattr(
            torch.cuda, "get_rng_state_all", lambda: [self.get(i) for i in range(visible)]
        )

        def set_all(states):
            for i, st in enumerate(states):
                self.set(st, i)

        monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)

    def _index(self, device):
        i = (
            self.current
            if device in (None, "cuda")
            else device
            if isinstance(device, int)
            else device.index
        )
        if i >= self.visible:
            raise IndexError(f"cuda:{i} is not visible ({self.visible} GPUs)")
        return i

    def get(self, device="cuda"):
        return self.states[self._index(device)].clone()

    def set(self, state, device="cuda"):
        self.states[self._index(device)] = state.clone()


def test_checkpoint_holds_this_process_gpu_rng_and_resumes_where_fewer_gpus_are_visible(
    monkeypatch,
):
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
    ckpt.set_rng_state(
        {**saved, "cuda": [torch.full((8,), i, dtype=torch.uint8) for i in range(8)]}
    )
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
    for k, v in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "LOCAL_WORLD_SIZE": "2",
    }.items():
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
            FSDPStrategy(
                TrainConfig(),
                OptimConfig(),
                StrategyConfig(name="fsdp", cpu_offload=offload),
                "cuda",
            )
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
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        c = comm.Counter()
        all_reduce = c.wrap(dist.all_reduce, "allreduce", 0, "tensor")
        t = torch.ones(1000)
        with c.window():
            all_reduce(t, async_op=True).wait()  # async: end event in the future's callback
            all_reduce(t)  # synchronous: end event after the call
        assert FakeEvent.syncs == 0  # nothing waited for the GPU inside the step
        r = c.take(2)
        assert FakeEvent.syncs == 2
        assert (
            r["comm_allreduce_calls_per_step"] == 1.0 and r["comm_allreduce_bytes_per_step"] == 4000
        )
        assert r["comm_allreduce_s_per_step"] == pytest.approx(0.125)  # (2 x 1/8 s) / 2 steps
        # the functional all-reduce is only queued when it returns: bytes and calls, no time
        funcol = c.wrap(lambda self, op, group: self, "allreduce", 0, "self", completes=False)
        with c.window():
            funcol(t, "sum", None)
        r = c.take(1)
        assert r["comm_allreduce_calls_per_step"] == 1 and r["comm_allreduce_s_per_step"] == 0
    finally:
        dist.destroy_process_group()


# -- no host sync in the training step ------------------------------------------------------------
def _count_host_reads(monkeypatch) -> dict:
    """Counts every read of a tensor's value on the host (what waits for a GPU) made by vitscale's
    code (torch's optimizers read their step counters, which they keep on the CPU). vitscale's code
    is the package's own folder, not any path containing "vitscale": in a clone named vitscale with
    its virtualenv inside, torch's files lie under .../vitscale/.venv/ (issue 33)."""
    import sys
    from pathlib import Path

    import vitscale

    package = Path(vitscale.__file__).resolve().parent
    ours: dict[str, bool] = {}  # code file -> inside the package (resolved once per file)

    def in_package(filename: str) -> bool:
        if filename not in ours:
            ours[filename] = Path(filename).resolve().is_relative_to(package)
        return ours[filename]

    n = {"reads": 0}
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def counting(self, *a, _real=real, **k):
            if in_package(sys._getframe(1).f_code.co_filename):
                n["reads"] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return n


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16 capture"])
def test_training_steps_between_log_steps_read_nothing_from_the_device(
    tmp_path, monkeypatch, precision
):
    """torchtitan's rule: the loss and gradient norm stay on the device and are read at log steps.
    Two runs of 4 and 12 steps logging only at their last step read the device equally often
    (before: loss.item() and float(grad_norm) every step); the log line still has the values."""
    import json

    from vitscale.config import load_config
    from vitscale.loop import train

    def reads(steps: int) -> tuple[int, dict]:
        cfg = load_config(
            "configs/tests/tiny.toml",
            [
                f"run.max_steps={steps}",
                "run.log_every=1000",
                "train.epochs=4",
                "run.eval_every=0",
                f"train.precision={precision.split()[0]}",
                "train.ema_decay=0.9",
                "optim.grad_clip=1.0",
                f"train.capture={'step' if 'capture' in precision else 'none'}",
            ],
        )
        out = tmp_path / f"r{steps}"
        n = _count_host_reads(monkeypatch)
        orig_fit = __import__("vitscale.loop", fromlist=["Trainer"]).Trainer.fit

        def fit_counting(self):  # only the training loop: not set-up, evaluation or the summary
            real_train_epoch = self.train_epoch

            def epoch():
                start = n["reads"]
                r = real_train_epoch()
                counted.append(n["reads"] - start)
                return r

            self.train_epoch = epoch
            return orig_fit(self)

        counted = []
        monkeypatch.setattr("vitscale.loop.Trainer.fit", fit_counting)
        train(cfg, run_dir=out)
        monkeypatch.undo()
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return sum(counted), [r for r in recs if r["kind"] == "train"][-1]

    few, rec_few = reads(4)
    many, rec_many = reads(12)
    assert many == few, (few, many)
    assert rec_many["step"] == 12 and rec_many["loss"] > 0 and rec_many["grad_norm"] > 0
    assert rec_many["skipped"] == 0


def test_a_nan_loss_between_log_steps_is_found_before_the_next_checkpoint(
    tmp_path, capsys, monkeypatch
):
    """With no per-step read, a NaN at step 3 (log lines every 1000 steps) is still reported with
    its own step, before the checkpoint of step 4 is written."""
    from helpers import poison_loss

    from vitscale import checkpoint as ckpt
    from vitscale.cli import main

    poison_loss(monkeypatch, 3, float("inf"))
    out = tmp_path / "inf"
    rc = main(
        [
            "train",
            "configs/tests/tiny.toml",
            "--out",
            str(out),
            "--set",
            "run.checkpoint_every=2",
            "--set",
            "run.log_every=1000",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "loss is inf at step 3 (epoch 0)" in err and "step_00000002.pt" in err
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000002.pt"]


# -- evaluation: no forward on an empty batch ------------------------------------------------------
class _Loader:
    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def iterate(self, *a, **k):
        return iter(self.batches)


class _NoEmptyBatches(torch.nn.Module):
    """Refuses a batch of 0 as flash attention does on older torch; counts forwards."""

    def __init__(self, clip: bool = False):
        super().__init__()
        self.lin, self.clip, self.sizes = torch.nn.Linear(4, 3), clip, []

    def forward(self, x, tokens=None):
        if x is not None and x.shape[0] == 0:
            raise RuntimeError("batch of 0")
        self.sizes.append(x.shape[0])
        out = self.lin(x)
        return (out, out if tokens is not None else None, None) if self.clip else out


def test_evaluation_pads_a_short_shard_with_one_sample_forwards_not_empty_batches():
    """A rank with 1 test batch where another has 3 (FSDP2 / ZeRO-3: every rank in every forward)
    runs 2 padding forwards of one real sample, whose outputs are not counted."""
    import contextlib

    from vitscale.config import load_config
    from vitscale.tasks import build_task

    task = build_task(load_config("configs/tests/tiny.toml"))
    torch.manual_seed(0)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    model = _NoEmptyBatches()
    r = task.evaluate(model, _Loader([(x, y)]), contextlib.nullcontext, batches=3)
    expect = task.evaluate(
        torch.nn.Sequential(model.lin), _Loader([(x, y)]), contextlib.nullcontext
    )
    assert r == expect and r["count"] == 5
    assert model.sizes == [5, 1, 1]
    # a rank whose shard is empty has no sample to pad with: one line
    from vitscale.errors import UserError

    with pytest.raises(UserError, match="too small"):
        task.evaluate(model, _Loader([]), contextlib.nullcontext, batches=1)
    # CLIP's encoder does the same
    from vitscale.tasks.clip_eval import encode

    clip = _NoEmptyBatches(clip=True)
    img, txt, toks = encode(
        clip,
        _Loader([(x, torch.zeros(5, 7, dtype=torch.long))]),
        contextlib.nullcontext,
        lambda t: t,
        batches=3,
        pairs=True,
    )
    assert img.shape == (5, 3) and txt.shape == (5, 3) and clip.sizes == [5, 1, 1]


def test_strategies_pad_evaluation_only_where_forwards_are_collective():
    from vitscale.strategy.ddp import DDPStrategy
    from vitscale.strategy.fsdp import FSDPStrategy
    from vitscale.strategy.single import SingleDevice

    assert not SingleDevice.forward_is_collective and not DDPStrategy.forward_is_collective
    assert FSDPStrategy.forward_is_collective
