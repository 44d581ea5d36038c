"""CUDA precision paths. CI has no GPU: these skip there, with the reason."""

import json

import pytest
import torch
from helpers import trainer_state

from vitscale.capture import CudaGraph
from vitscale.cli import main

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"
)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "pure_bf16", "pure_fp16"])
def test_cuda_precisions_train(tmp_path, capsys, precision):
    out = tmp_path / precision
    rc = main(
        [
            "train",
            "configs/tests/tiny.toml",
            "--out",
            str(out),
            "--set",
            "run.device=cuda",
            "--set",
            f"train.precision={precision}",
            "--set",
            "train.epochs=4",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    s = json.loads((out / "summary.json").read_text())
    assert s["device"].startswith("cuda") and s["test_accuracy"] > 0.4


def test_fp16_loss_scaler_skips_overflowing_steps():
    from vitscale.config import OptimConfig, TrainConfig
    from vitscale.models import vit
    from vitscale.strategy import SingleDevice

    s = SingleDevice(
        TrainConfig(precision="fp16", loss_scale=2.0**40), OptimConfig(), torch.device("cuda")
    )
    m = vit("vit_pico", image_size=8, patch_size=4, in_chans=1, num_classes=4, depth=1)
    s.setup(m)
    before = [p.detach().clone() for p in m.parameters()]
    x = torch.randn(4, 1, 8, 8, device="cuda")
    with s.autocast():
        loss = s.model(x).float().square().mean() * 1e6
    s.backward(loss)
    info = s.step()
    assert info["skipped"]  # 2^40 * 1e6 overflows fp16 gradients: the step is skipped, scale cut
    assert s.amp.scaler.get_scale() < 2.0**40
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))


def _train(tmp_path, capsys, name, *sets):
    out = tmp_path / name
    args = ["train", "configs/tests/tiny.toml", "--out", str(out), "--set", "run.device=cuda"]
    for s in sets:
        args += ["--set", s]
    rc = main(args)
    assert rc == 0, capsys.readouterr().err
    return json.loads((out / "summary.json").read_text())


def test_cuda_graphs_train(tmp_path, capsys):
    s = _train(
        tmp_path,
        capsys,
        "graphs",
        "train.compile=true",
        "train.compile_mode=reduce-overhead",
        "train.precision=bf16",
        "train.epochs=4",
    )
    assert s["test_accuracy"] > 0.4


def test_tf32_flags_and_peak(tmp_path, capsys):
    s = _train(
        tmp_path, capsys, "tf32", "train.precision=fp32", "train.tf32=true", "train.epochs=1"
    )
    assert torch.backends.cuda.matmul.fp32_precision == "tf32" and torch.backends.cudnn.benchmark
    assert "tf32" in s["peak_source"] or "measured" in s["peak_source"]
    _train(tmp_path, capsys, "ieee", "train.precision=fp32", "train.tf32=false", "train.epochs=1")
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"


def test_host_data_through_pinned_memory_and_device_augmentation(tmp_path, capsys):
    # The reference is the same run on the CPU: this recipe (heavy augmentation, 4 epochs of 64
    # images) ends near chance on either device (the first GPU session, H200: 25.00% / loss 1.2980 on
    # cuda, 25.00% / 1.2980 on cpu), so an accuracy floor tests nothing; the CPU run's loss does.
    sets = (
        "data.on_device=false",
        "data.pin_memory=true",
        "data.hflip=true",
        "data.crop_padding=2",
        "data.randaugment_ops=2",
        "data.mixup_alpha=0.2",
        "train.epochs=4",
        "train.channels_last=true",
    )
    s = _train(tmp_path, capsys, "pinned", *sets)
    ref = _train(tmp_path, capsys, "cpu", *sets, "run.device=cpu")
    assert s["device"].startswith("cuda") and ref["device"] == "cpu"
    assert abs(s["test_loss"] - ref["test_loss"]) < 0.01 * ref["test_loss"]
    assert (
        abs(s["test_accuracy"] - ref["test_accuracy"]) <= 1 / 32 + 1e-9
    )  # at most one of 32 images


def test_fused_adamw_on_pure_bf16_weights_without_masters(tmp_path, capsys):
    s = _train(
        tmp_path,
        capsys,
        "fused",
        "train.precision=pure_bf16",
        "train.master_weights=false",
        "optim.impl=fused",
        "train.epochs=4",
    )
    assert s["test_accuracy"] > 0.3


def _fit(tmp_path, name, sets, eager_whole=False):
    """A tiny run on the GPU through the Trainer; `eager_whole`: the captured step's function run
    eagerly every step (capture.WholeStep(eager=True)) instead of replayed as a graph."""
    from vitscale.capture import WholeStep
    from vitscale.config import load_config
    from vitscale.loop import Trainer
    from vitscale.optim import lr_table

    tr = Trainer(
        load_config("configs/tests/tiny.toml", ["run.device=cuda", *sets]), tmp_path / name
    )
    if eager_whole:  # the parts the loop's own WholeStep gets (Trainer.run_step)
        s = tr.strategy
        table = lr_table(tr.scheduler, tr.total_steps, s.device)
        tr.whole = WholeStep(
            tr.train_step, s.optimizer.param_groups, table, tr.step, tr.watch, eager=True
        )
    try:
        summary = tr.fit()
    finally:
        tr.close()
    state = trainer_state(tr)
    recs = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]
    return tr, summary, state, losses


# TF32 off, no drop-path or dropout (a captured step's RNG is the graph's own), EMA and clipping on,
# 6 epochs of 4 steps: 3 eager warm-up steps, one capture, 20 replays
CAPTURE_RECIPE = (
    "train.tf32=false",
    "train.ema_decay=0.9",
    "optim.grad_clip=1.0",
    "optim.impl=fused",
    "train.epochs=6",
    "train.capture=step",
)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_captured_step_replays_exactly_what_it_runs_eagerly(tmp_path, precision):
    """train.capture=step on CUDA (issues 31, 39): the step replayed as one CUDA graph against the
    very same step function run eagerly on the same GPU (the same fp32 lr table, the same capturable
    fused AdamW, the same kernels): bit-equal weights, EMA, optimizer state and losses after 20
    replays. The comparison with capture=none is not exact by design (there the fused AdamW takes
    the lr as a host double, here as an fp32 tensor: 2^-24 relative per step), and AdamW turns
    such last-bit differences in gradients that are only rounding noise (the key bias of attention,
    which softmax ignores) into full-size steps: so that comparison is the run-level one below."""
    sets = (*CAPTURE_RECIPE, f"train.precision={precision}")
    graphed, s_graph, a, loss_a = _fit(tmp_path, "graphed", sets)
    eager, s_eager, b, loss_b = _fit(tmp_path, "eager", sets, eager_whole=True)
    assert isinstance(graphed.whole.graph, CudaGraph)
    assert graphed.whole.static is not None and eager.whole.graph is None  # one captured, one not
    assert s_graph["steps"] == s_eager["steps"] == 24
    assert a.keys() == b.keys()
    diff = {
        k: float((a[k].double() - b[k].double()).abs().max())
        for k in a
        if not torch.equal(a[k], b[k])
    }
    assert not diff, (
        f"graph replay differs from the same step run eagerly: {sorted(diff.items())[:5]}"
    )
    assert loss_a == loss_b
    assert (
        s_graph["test_loss"] == s_eager["test_loss"]
        and s_graph["test_accuracy"] == s_eager["test_accuracy"]
    )


def test_the_captured_run_trains_as_the_uncaptured_one_within_what_seeds_move(tmp_path):
    """Run level: capture=step against capture=none (bf16, the default recipe's precision on a
    GPU): its loss curve stays within the spread that changing the seed gives the uncaptured run,
    and so does its test accuracy."""
    sets = (*CAPTURE_RECIPE, "train.precision=bf16")
    _, cap, _, loss_cap = _fit(tmp_path, "cap", sets)
    _, none0, _, loss_0 = _fit(tmp_path, "none0", (*sets, "train.capture=none"))
    _, none1, _, loss_1 = _fit(tmp_path, "none1", (*sets, "train.capture=none", "run.seed=1"))
    assert [s for s, _ in loss_cap] == [s for s, _ in loss_0] == [s for s, _ in loss_1]
    seeds = max(abs(x - y) for (_, x), (_, y) in zip(loss_0, loss_1))
    capture = max(abs(x - y) for (_, x), (_, y) in zip(loss_cap, loss_0))
    assert capture <= seeds, (capture, seeds)
    assert (
        abs(cap["test_accuracy"] - none0["test_accuracy"])
        <= max(abs(none1["test_accuracy"] - none0["test_accuracy"]), 1 / 32) + 1e-9
    )  # one image of 32
