import pytest

from vitscale.config import Config, load_config, parse_override
from vitscale.errors import ConfigError


def test_default_recipe_loads_and_validates():
    cfg = load_config()
    assert cfg.data.name == "fashion_mnist"
    assert (
        cfg.train.precision == "auto" and cfg.train.capture == "auto"
    )  # answered per machine (test_fastpaths)


def test_overrides_are_typed():
    cfg = load_config(
        "configs/tests/tiny.toml",
        [
            "optim.lr=0.5",
            "train.compile=true",
            "data.batch_size=8",
            "model.head=pool",
            "train.epochs=3",
        ],
    )
    assert cfg.optim.lr == 0.5 and isinstance(cfg.optim.lr, float)
    assert cfg.train.compile is True
    assert cfg.data.batch_size == 8
    assert cfg.model.head == "pool"
    assert cfg.train.epochs == 3.0 and isinstance(cfg.train.epochs, float)


def test_recipe_by_name():
    assert load_config("vit_b16_imagenet").model.arch == "vit_base_patch16"


@pytest.mark.parametrize(
    "override,needle",
    [
        ("optim.lrr=1", "did you mean 'optim.lr'"),
        ("optm.lr=1", "did you mean 'optim'"),
        ("train.precision=fp8", "train.precision must be one of fp32, bf16"),
        ("data.batch_size=abc", "data.batch_size must be an integer"),
        ("data.batch_size=-4", "data.batch_size must be >= 1"),
        ("train.compile=maybe", "train.compile must be true or false"),
        ("optim.lr=fast", "optim.lr must be a number"),
        ("lr=1", "must look like section.key"),
    ],
)
def test_bad_overrides_give_one_line_errors(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_file_key_names_the_file_and_closest_key(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[optim]\nweight_decy = 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and "optim.weight_decay" in str(e.value)


def test_invalid_toml_and_missing_file(tmp_path):
    p = tmp_path / "broken.toml"
    p.write_text("[optim\nlr = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")


def test_cross_field_check(tmp_path):
    """The batch's split over processes x micro-batches: checked once, by the Trainer, before data
    or an engine is built (the number of processes is known there)."""
    from vitscale.loop import Trainer

    with pytest.raises(
        ConfigError,
        match=r"batch_size \(10\) must be a multiple of processes \(1\) x train.accum_steps \(3\)",
    ):
        Trainer(load_config(None, ["data.batch_size=10", "train.accum_steps=3"]), tmp_path / "run")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config("configs/tests/tiny.toml", ["optim.lr=0.25", "run.name=x y"])
    p = tmp_path / "resolved.toml"
    p.write_text(cfg.to_toml())
    assert load_config(p) == cfg


def test_parse_override_keeps_strings():
    assert parse_override("data.root=/tmp/some dir") == ("data.root", "/tmp/some dir")
    assert parse_override("optim.lr=1e-3") == ("optim.lr", 1e-3)
    assert Config().run.seed == 0


def test_config_command_prints_resolved_toml(capsys, tmp_path):
    from vitscale.cli import main

    assert main(["config", "configs/tests/tiny.toml", "--set", "optim.lr=0.125"]) == 0
    text = capsys.readouterr().out
    p = tmp_path / "printed.toml"
    p.write_text(text)
    assert load_config(p) == load_config("configs/tests/tiny.toml", ["optim.lr=0.125"])


def test_pure_fp16_without_master_weights_is_refused_in_one_line(monkeypatch):
    """The combination crashes at the first step ("Attempting to unscale FP16 gradients", shown
    below on a CPU with the speed-only fp16 refusal lifted): the config check refuses it first."""
    import torch

    from vitscale.config import OptimConfig, TrainConfig
    from vitscale.models import vit
    from vitscale.strategy.single import SingleDevice

    with pytest.raises(ConfigError) as e:
        load_config(
            "configs/tests/tiny.toml", ["train.precision=pure_fp16", "train.master_weights=false"]
        )
    assert "master_weights=true" in str(e.value) and "\n" not in str(e.value)
    load_config("configs/tests/tiny.toml", ["train.precision=pure_fp16"])  # with masters: accepted
    load_config(
        "configs/tests/tiny.toml", ["train.precision=pure_bf16", "train.master_weights=false"]
    )
    # why: torch's scaler refuses half gradients at the first step
    monkeypatch.setattr(
        "vitscale.strategy.single.fp16_refusal", lambda device_type, precision: None
    )
    s = SingleDevice(
        TrainConfig(precision="pure_fp16", master_weights=False), OptimConfig(), torch.device("cpu")
    )
    s.setup(vit("vit_pico", image_size=8, patch_size=4, in_chans=1, num_classes=4, depth=1))
    s.backward(s.model(s.prepare(torch.randn(2, 1, 8, 8))).float().mean())
    with pytest.raises(ValueError, match="unscale FP16 gradients"):
        s.step()


@pytest.mark.parametrize(
    "command", ["train", "info", "config", "bench", "ladder", "tune", "predict"]
)
def test_the_tasks_model_init_checks_run_before_every_command_starts(capsys, tmp_path, command):
    """model.init options are the task's to check (tasks.check_config): every command on a recipe
    refuses them in one "config: ..." line, exit code 2, before anything is built."""
    from vitscale.cli import main

    out = ["--out", str(tmp_path / "x")] if command in ("train", "ladder", "tune") else []
    assert (
        main(
            [
                command,
                "configs/tests/tiny.toml",
                *out,
                "--set",
                "model.init_arch=vit_base_patch16_224",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        "config: model.init_arch names the timm architecture of ViT classifier weights given "
        "with model.init (a ViT model.arch)"
    ), err
    assert not (tmp_path / "x").exists()
