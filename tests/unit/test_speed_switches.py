"""The switches issue 32 adds for a faster step, on a CPU: each is the same function within the
kernels' rounding, does what it names, and is refused in one line where it cannot run. Whether
each wins is measured on a GPU (`vitscale tune` tries them; docs/performance.md)."""

from __future__ import annotations

import pytest
import torch

from vitscale.config import load_config
from vitscale.errors import ConfigError
from vitscale.loop import Trainer
from vitscale.tasks import check_config

TINY = "configs/tests/tiny.toml"


def _trainer(tmp_path, name, *sets):
    return Trainer(
        load_config(TINY, ["model.attention=sdpa", "run.eval_every=0", *sets]), tmp_path / name
    )


@pytest.mark.parametrize(
    "backend, flash, math", [("math", False, True), ("flash", True, False), ("auto", True, True)]
)
def test_sdpa_backend_restricts_attention_to_its_kernel_during_forward(
    tmp_path, backend, flash, math
):
    """train.sdpa_backend: inside every training forward only the named kernel is enabled (torch's
    sdpa_kernel flags), and the loss is the one torch's own choice gives, within fp32 rounding."""
    seen = []
    losses = {}
    for b in ("auto", backend):
        tr = _trainer(tmp_path, b + str(len(losses)), f"train.sdpa_backend={b}")
        try:
            tr.strategy.module.register_forward_pre_hook(
                lambda m, a: seen.append(
                    (
                        torch.backends.cuda.flash_sdp_enabled(),
                        torch.backends.cuda.math_sdp_enabled(),
                    )
                )
            )
            torch.manual_seed(0)
            batch = next(tr.data.train.iterate(0))
            losses[b], _ = tr.train_step(batch)
        finally:
            tr.close()
    assert seen[-1] == (flash, math)
    # the same forward: only the summation order inside attention differs (tolerance: a few ulps of
    # the fp32 loss, ~log(4) for 4 classes)
    torch.testing.assert_close(losses[backend], losses["auto"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "sets, words",
    [
        (["train.sdpa_backend=cudnn"], "a CUDA kernel"),
        (["train.sdpa_backend=efficient"], "a CUDA kernel"),
    ],
)
def test_sdpa_backend_refusals_on_a_cpu(tmp_path, sets, words):
    with pytest.raises(ConfigError) as e:
        _trainer(tmp_path, "r", *sets)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_sdpa_backend_needs_fused_attention():
    with pytest.raises(ConfigError, match="needs model.attention=sdpa"):
        load_config(TINY, ["model.attention=explicit", "train.sdpa_backend=flash"])


# -- train.fp8 (issue 32 item 3) ---------------------------------------------------------------------
def test_fp8_converts_the_blocks_linear_layers_only():
    """ViT-B/16: the 4 Linear layers of each of the 12 blocks; not the head, not the patch stem."""
    from vitscale.models import vit
    from vitscale.strategy.fp8 import fp8_layers

    names = fp8_layers(vit("vit_base_patch16"))
    assert len(names) == 48 and all(n.startswith("blocks.") for n in names)
    assert {n.split(".", 2)[2] for n in names} == {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"}


@pytest.mark.parametrize(
    "recipe, width, refused",
    [
        ("tensorwise", 768, "0.805x"),
        ("tensorwise", 384, "0.805x"),
        ("tensorwise", 1024, None),
        ("rowwise", 768, "0.781x"),
        ("rowwise", 1024, "0.781x"),
        ("rowwise", 1280, None),
    ],
)
def test_fp8_is_refused_where_measured_slower_and_not_elsewhere(recipe, width, refused):
    """The measured table decides: a width as narrow as one measured slower is refused naming the
    ratio; wider ones and the other recipe are not (they have not been measured slower)."""
    from vitscale.precision import fp8_slower

    got = fp8_slower(recipe, width)
    assert (got is None) == (refused is None)
    if refused:
        assert refused in got and f"width {width}" in got and "\n" not in got


def test_fp8_refused_for_vit_b16_from_the_config_before_anything_is_built():
    """The width check runs in the config's checks (tune and bench --beside skip such a candidate
    without building the recipe's model first)."""
    with pytest.raises(ConfigError, match="0.805x"):
        check_config(load_config("configs/vit_b16_imagenet.toml", ["train.fp8=tensorwise"]))
    with pytest.raises(
        ConfigError, match="0.781x"
    ):  # rowwise: measured slower at L/16's width 1024
        check_config(load_config("configs/vit_b16_imagenet.toml", ["train.fp8=rowwise"]))
    check_config(
        load_config(
            "configs/vit_b16_imagenet.toml", ["train.fp8=rowwise", "model.arch=vit_huge_patch14"]
        )
    )


@pytest.mark.parametrize(
    "sets, device, capability, words",
    [
        (["train.precision=bf16"], "cpu", None, "needs a GPU with float8 tensor cores"),
        (["train.precision=bf16"], "cuda", (8, 0), "this GPU has 8.0"),
    ],
)
def test_fp8_device_refusals(sets, device, capability, words):
    from vitscale.strategy.fp8 import fp8_refusal

    assert words in fp8_refusal("tensorwise", device, capability)
    assert (
        fp8_refusal("rowwise", "cuda", (9, 0)) is None and fp8_refusal("none", "cpu", None) is None
    )


def test_fp8_config_refusals_in_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["train.fp8=rowwise", "train.precision=fp32"])
    assert "set train.precision=bf16" in str(e.value) and "\n" not in str(e.value)


def test_fp8_is_refused_by_the_sharding_engines_in_one_line():
    """FSDP2 and DeepSpeed do not convert their sharded or partitioned weights: each refuses it
    (their own list of what they do not support), before a process group is joined: FSDP2's mesh
    at config time (strategy.check_engine, issue 49: its constructor does not ask again),
    DeepSpeed also in its constructor."""
    from vitscale.config import OptimConfig, StrategyConfig, TrainConfig
    from vitscale.strategy import check_engine
    from vitscale.strategy.deepspeed import DeepSpeedStrategy

    train = TrainConfig(precision="bf16", fp8="rowwise")
    cfg = load_config(TINY, ["strategy.name=fsdp", "train.fp8=rowwise", "train.precision=bf16"])
    with pytest.raises(ConfigError, match="fsdp does not support train.fp8=rowwise"):
        check_engine(cfg, 2)
    with pytest.raises(ConfigError, match="deepspeed does not support train.fp8=rowwise"):
        DeepSpeedStrategy(
            train, OptimConfig(), StrategyConfig(name="deepspeed"), batch_size=16, device_type="cpu"
        )


def test_fp8_on_a_cpu_trainer_is_refused_in_one_line(tmp_path, monkeypatch):
    for where in (
        "vitscale.strategy.fp8",
        "vitscale.tasks.classification",
    ):  # the device check, not the width's
        monkeypatch.setattr(f"{where}.fp8_slower", lambda *a: None)
    with pytest.raises(ConfigError, match="needs a GPU with float8 tensor cores"):
        _trainer(tmp_path, "fp8", "train.fp8=rowwise", "train.precision=bf16")


def test_fp8_without_torchao_says_so_in_one_line(monkeypatch):
    import builtins

    from vitscale.models import vit
    from vitscale.strategy.fp8 import convert_fp8

    real = builtins.__import__
    monkeypatch.setattr(
        builtins,
        "__import__",
        lambda name, *a, **k: (
            (_ for _ in ()).throw(ImportError("no torchao"))
            if name.startswith("torchao")
            else real(name, *a, **k)
        ),
    )
    with pytest.raises(ConfigError, match="needs torchao's float8 training"):
        convert_fp8(
            vit("vit_pico", image_size=8, patch_size=4, in_chans=1, num_classes=4, dim=64, heads=2),
            "rowwise",
        )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_path_runs_with_the_same_parameters(tmp_path, monkeypatch, recipe):
    """With the GPU refusal lifted (torch runs float8 matmuls on a CPU too, slowly), a bf16 run with
    train.fp8 converts the blocks' Linear layers, keeps every parameter name, trains (the loss goes
    down) and ends near the bf16 run's loss: float8 e4m3 keeps 3 mantissa bits, so the losses agree
    to the ten percent such rounding allows, not to bf16's rounding."""
    pytest.importorskip(
        "torchao.float8", reason="torchao is not installed (bash scripts/setup.sh --with-peers)"
    )
    import vitscale.strategy.single as single

    monkeypatch.setattr(single, "fp8_refusal", lambda *a: None)
    for where in (
        "vitscale.strategy.fp8",
        "vitscale.tasks.classification",
    ):  # width 64: narrower than measured
        monkeypatch.setattr(
            f"{where}.fp8_slower", lambda *a: None
        )  # width 64 is narrower than any measured
    runs = {}
    for fp8 in ("none", recipe):
        cfg = load_config(
            TINY,
            [
                "model.dim=64",
                "train.precision=bf16",
                f"train.fp8={fp8}",
                "train.epochs=4",
                "run.eval_every=0",
            ],
        )
        tr = Trainer(cfg, tmp_path / fp8)
        try:
            summary = tr.fit()
        finally:
            tr.close()
        kinds = {type(m).__name__ for m in tr.strategy.module.modules()}
        runs[fp8] = (summary, list(tr.strategy.module.state_dict()), kinds)
    (base, keys, kinds), (fp8, keys8, kinds8) = runs["none"], runs[recipe]
    assert "Float8Linear" in kinds8 and "Float8Linear" not in kinds
    assert keys8 == keys
    assert fp8["test_loss"] == pytest.approx(base["test_loss"], rel=0.1)
