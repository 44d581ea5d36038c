"""train.capture=step (issue 31) on a CPU.

The CUDA graph's semantics are emulated by `ReplayGraph`: capture records every aten operation the
step runs (below autograd and autocast: what a CUDA graph records as kernels) and a replay runs
them again on the same tensors without running any Python of the step, writing each result into
the tensor the capture produced (a graph's static memory). A value the step took from the host
during the capture stays frozen in every replay, as on a GPU. So a captured run that equals the
eager run bit for bit shows that the step takes nothing from the host that changes per step."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ReplayGraph, assert_equal_states, fit_with_graphs, trainer_state

from vitscale.config import load_config
from vitscale.errors import ConfigError
from vitscale.loop import Trainer

TINY = "configs/tests/tiny.toml"
# EMA, clipping, weight decay, warm-up and decay, mirrored images, label smoothing: every part of
# the step that the capture must carry
RECIPE = [
    "train.ema_decay=0.9",
    "optim.grad_clip=1.0",
    "optim.weight_decay=0.05",
    "optim.impl=fused",
    "optim.schedule=cosine",
    "data.hflip=true",
    "data.crop_padding=1",
    "train.label_smoothing=0.1",
    "train.epochs=3",
    "run.eval_every=1",
    "model.drop_path=0.1",
]


def _run(tmp_path, name, sets, graph=None, monkeypatch=None, resume=None):
    cfg = load_config(TINY, [*RECIPE, *sets])
    return fit_with_graphs(cfg, tmp_path / name, graph, monkeypatch, resume)


_state = trainer_state
_assert_equal_states = assert_equal_states


def _losses(run_dir) -> list:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["kind"], r.get("loss"), r.get("test_accuracy"), r.get("lr")) for r in recs]


@pytest.mark.parametrize(
    "extra", [[], ["data.drop_last=false", "data.train_size=72", "train.precision=bf16"]]
)
def test_the_captured_step_replayed_equals_the_eager_step_bit_for_bit(tmp_path, monkeypatch, extra):
    """capture=none against capture=step whose step is recorded once and replayed as a graph
    would be: the same weights, EMA, optimizer state, losses, lr and accuracy at every log. With
    drop_last=false the last partial batch of each epoch runs the same step eagerly; bf16 too."""
    eager, s_eager, _ = _run(tmp_path, "eager", extra)
    cap, s_cap, graphs = _run(
        tmp_path, "cap", ["train.capture=step", *extra], ReplayGraph, monkeypatch
    )
    (g,) = graphs
    steps = s_cap["steps"]
    partial = 3 if extra else 0  # one partial batch per epoch
    assert (g.warmups, g.captures, g.replays) == (3, 1, steps - 3 - partial)
    assert g.host_reads == 0, "the captured step reads the device"
    _assert_equal_states(_state(eager), _state(cap))
    assert _losses(eager.run_dir) == _losses(cap.run_dir)
    assert s_eager["test_accuracy"] == s_cap["test_accuracy"]


def test_without_a_graph_the_capture_path_runs_eagerly_with_the_same_numbers(tmp_path):
    """On a CPU (no graph) capture=step is the same function run every step, with the epoch's
    batches prepared at once: bit-identical to capture=none."""
    eager, _, _ = _run(tmp_path, "eager", [])
    cap, _, _ = _run(tmp_path, "cap", ["train.capture=step"])
    assert cap.ahead > 1 and cap.whole is not None and cap.whole.graph is None
    _assert_equal_states(_state(eager), _state(cap))
    assert _losses(eager.run_dir) == _losses(cap.run_dir)


def test_a_captured_run_resumed_from_its_checkpoint_continues_exactly(tmp_path, monkeypatch):
    """Resumed from its step-5 checkpoint (a new capture after the state is loaded), a captured
    run ends where the uninterrupted one ended, bit for bit."""
    sets = ["train.capture=step", "run.checkpoint_every=5", "run.keep_last=5"]
    whole, _, _ = _run(tmp_path, "whole", sets, ReplayGraph, monkeypatch)
    from vitscale.run_state import open_resume

    ckpt = tmp_path / "whole" / "checkpoints" / "step_00000005.pt"
    resumed, _, graphs = _run(
        tmp_path, "resumed", sets, ReplayGraph, monkeypatch, resume=open_resume(ckpt)
    )
    assert graphs[-1].captures == 1 and resumed.step == whole.step == 12
    _assert_equal_states(_state(whole), _state(resumed))


@pytest.mark.parametrize(
    "sets, words",
    [
        (["train.precision=fp16"], "loss scaler"),
        (["optim.name=sgd"], "optim.name=sgd"),
        (["optim.schedule_clock=time", "train.time_limit_s=10"], "schedule_clock=time"),
        (["train.compile=true", "train.compile_mode=reduce-overhead"], "CUDA graphs of its own"),
        (["strategy.name=ddp"], "strategy.name=single"),
    ],
)
def test_what_a_captured_step_cannot_hold_is_refused_in_one_line(sets, words):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["train.capture=step", *sets])
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "aug",
    [
        ["data.crop_padding=2", "data.hflip=true"],
        ["data.randaugment_ops=2", "data.randaugment_magnitude=0.5", "data.hflip=true"],
        ["data.mixup_alpha=0.8", "data.cutmix_alpha=1.0", "data.crop_padding=1"],
    ],
)
def test_batches_prepared_many_at_once_equal_batches_prepared_one_by_one(aug):
    """The in-memory loader's `ahead`: the same batches, whatever the block (drop_last=false: the
    short last batch too), from any start batch (exact resume)."""
    from vitscale.data.build import build_data

    cfg = load_config(TINY, ["data.train_size=70", "data.drop_last=false", "data.channels=3", *aug])
    data = build_data(cfg.data, device="cpu", seed=3)
    one = list(data.train.iterate(1, start_batch=1))
    for ahead in (2, 3, 100):
        many = list(data.train.iterate(1, start_batch=1, ahead=ahead))
        assert len(many) == len(one) == len(data.train) - 1
        for (x1, y1), (x2, y2) in zip(one, many):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_the_ema_update_without_host_reads_is_averaged_models_arithmetic():
    """The strategy's EMA update (ema.Ema: no read of the count per step) against torch's
    AveragedModel.update_parameters on a copy: the same EMA weights and count, bit for bit, from
    the first update (a copy) on."""
    import copy

    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from vitscale.config import OptimConfig, TrainConfig
    from vitscale.models import vit
    from vitscale.strategy import SingleDevice

    torch.manual_seed(0)
    s = SingleDevice(TrainConfig(ema_decay=0.9), OptimConfig(), torch.device("cpu"))
    s.setup(vit("vit_pico", image_size=8, patch_size=4, in_chans=1, num_classes=4, depth=1))
    ref = AveragedModel(
        copy.deepcopy(s.module), multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True
    )
    for _ in range(4):
        s.backward(s.model(torch.randn(4, 1, 8, 8)).square().mean())
        s.step()
        ref.update_parameters(s.module)
        for a, b in zip(ref.state_dict().values(), s.ema.state_dict().values()):
            assert torch.equal(a, b)
    assert int(s.ema.averaged.n_averaged) == s.ema.updates == 4


def test_evaluation_reads_the_device_a_fixed_number_of_times_whatever_its_batches(
    tmp_path, monkeypatch
):
    """Issue 31 item 3: evaluation sums on the device and reads once at the end: 4 batches of 8 and
    1 batch of 32 read the device equally often (checkpoints' and evaluations' state check aside)."""
    from test_gpu_paths_cpu import _count_host_reads

    reads = []
    for eval_batch in (8, 32):
        cfg = load_config(TINY, [f"data.eval_batch_size={eval_batch}", "train.eval_hflip_tta=true"])
        tr = Trainer(cfg, tmp_path / f"e{eval_batch}")
        try:
            n = _count_host_reads(monkeypatch)
            r = tr.task.evaluate_all(tr.strategy, tr.data)
            monkeypatch.undo()
            reads.append(n["reads"])
        finally:
            tr.close()
        assert r["test_count"] == 32
    assert reads[0] == reads[1], reads
