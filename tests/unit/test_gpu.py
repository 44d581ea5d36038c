"""CUDA precision paths. CI has no GPU: these skip there, with the reason."""
import json

import pytest
import torch

from vitscale.cli import main

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")


@pytest.mark.parametrize("precision", ["bf16", "fp16", "pure_bf16", "pure_fp16"])
def test_cuda_precisions_train(tmp_path, capsys, precision):
    out = tmp_path / precision
    rc = main(["train", "configs/tests/tiny.toml", "--out", str(out), "--set", "run.device=cuda",
               "--set", f"train.precision={precision}", "--set", "train.epochs=4"])
    assert rc == 0, capsys.readouterr().err
    s = json.loads((out / "summary.json").read_text())
    assert s["device"].startswith("cuda") and s["test_accuracy"] > 0.4


def test_fp16_loss_scaler_skips_overflowing_steps():
    from vitscale.config import OptimConfig, TrainConfig
    from vitscale.models import vit
    from vitscale.strategy import SingleDevice
    s = SingleDevice(TrainConfig(precision="fp16", loss_scale=2.0 ** 40), OptimConfig(), torch.device("cuda"))
    m = vit("vit_pico", image_size=8, patch_size=4, in_chans=1, num_classes=4, depth=1)
    s.setup(m)
    before = [p.detach().clone() for p in m.parameters()]
    x = torch.randn(4, 1, 8, 8, device="cuda")
    with s.autocast():
        loss = s.model(x).float().square().mean() * 1e6
    s.backward(loss)
    info = s.step()
    assert info["skipped"]  # 2^40 * 1e6 overflows fp16 gradients: the step is skipped, scale cut
    assert s.scaler.get_scale() < 2.0 ** 40
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
    s = _train(tmp_path, capsys, "graphs", "train.compile=true", "train.compile_mode=reduce-overhead",
               "train.precision=bf16", "train.epochs=4")
    assert s["test_accuracy"] > 0.4


def test_tf32_flags_and_peak(tmp_path, capsys):
    s = _train(tmp_path, capsys, "tf32", "train.precision=fp32", "train.tf32=true", "train.epochs=1")
    assert torch.backends.cuda.matmul.fp32_precision == "tf32" and torch.backends.cudnn.benchmark
    assert "tf32" in s["peak_source"] or "measured" in s["peak_source"]
    _train(tmp_path, capsys, "ieee", "train.precision=fp32", "train.tf32=false", "train.epochs=1")
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"


def test_host_data_through_pinned_memory_and_device_augmentation(tmp_path, capsys):
    # The reference is the same run on the CPU: this recipe (heavy augmentation, 4 epochs of 64
    # images) ends near chance on either device (the first GPU session, H200: 25.00% / loss 1.2980 on
    # cuda, 25.00% / 1.2980 on cpu), so an accuracy floor tests nothing; the CPU run's loss does.
    sets = ("data.on_device=false", "data.pin_memory=true", "data.hflip=true", "data.crop_padding=2",
            "data.randaugment_ops=2", "data.mixup_alpha=0.2", "train.epochs=4", "train.channels_last=true")
    s = _train(tmp_path, capsys, "pinned", *sets)
    ref = _train(tmp_path, capsys, "cpu", *sets, "run.device=cpu")
    assert s["device"].startswith("cuda") and ref["device"] == "cpu"
    assert abs(s["test_loss"] - ref["test_loss"]) < 0.01 * ref["test_loss"]
    assert abs(s["test_accuracy"] - ref["test_accuracy"]) <= 1 / 32 + 1e-9  # at most one of 32 images


def test_fused_adamw_on_pure_bf16_weights_without_masters(tmp_path, capsys):
    s = _train(tmp_path, capsys, "fused", "train.precision=pure_bf16", "train.master_weights=false",
               "optim.impl=fused", "train.epochs=4")
    assert s["test_accuracy"] > 0.3


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_captured_step_on_a_gpu_trains_as_the_eager_step(tmp_path, capsys, precision):
    """train.capture=step on CUDA (issue 31): the step replayed as one CUDA graph after 3 eager
    warm-up steps ends near the eager run. Not bit-equal: the lr reaches the fused AdamW kernel as
    an fp32 tensor (the eager run passes the double), so the weights may differ by the lr's
    rounding (2^-24 relative) times the steps: far below the 1e-3 asked here. TF32 off, no
    drop-path or dropout (the captured RNG is the graph's own)."""
    sets = ("train.tf32=false", f"train.precision={precision}", "train.ema_decay=0.9", "optim.grad_clip=1.0",
            "train.epochs=4")
    eager = _train(tmp_path, capsys, "eager", *sets)
    captured = _train(tmp_path, capsys, "captured", *sets, "train.capture=step")
    assert captured["steps"] == eager["steps"] > 4
    assert captured["test_loss"] == pytest.approx(eager["test_loss"], rel=1e-3)
    from vitscale.checkpoint import load_checkpoint
    a, b = (load_checkpoint(s["checkpoint"])["strategy"]["model"] for s in (eager, captured))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5, msg=k)
