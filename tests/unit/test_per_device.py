"""A recipe's [per_device.CLASS.SECTION] tables (issue 50): keys a recipe sets on one class of
device only (a CPU without bf16 instructions, one with them, a CUDA GPU). fastpaths.resolve applies
the machine's table over the recipe, under the user's --set, announces it in the fast-paths line
and records it; the run's config.toml holds the values it ran with and no tables, so a resume (on
any machine) continues the same run."""

import json

import pytest

from vitscale.cli import main
from vitscale.config import Config, load_config
from vitscale.errors import ConfigError
from vitscale.fastpaths import Machine, device_class, resolve

AVX2 = Machine("cpu", cpu_bf16=False)
BF16_CPU = Machine("cpu", cpu_bf16=True)
H200 = Machine("cuda", (9, 0), "NVIDIA H200")
TABLES = """
[per_device.cpu_bf16.train]
epochs = 3
label_smoothing = 0.2

[per_device.cuda.data]
batch_size = 32

[per_device.cuda.optim]
lr = 0.002
"""


@pytest.fixture
def recipe(tmp_path):
    """The tiny test recipe with per-device tables appended."""
    path = tmp_path / "recipe.toml"
    path.write_text(open("configs/tests/tiny.toml").read() + TABLES)
    return path


def test_each_machine_class_gets_its_own_table_and_no_other(recipe):
    base = load_config(recipe)
    assert base.train.epochs != 3 and base.per_device.keys() == {"cpu_bf16", "cuda"}
    on_bf16 = resolve(base, BF16_CPU)
    assert (on_bf16.cfg.train.epochs, on_bf16.cfg.train.label_smoothing) == (3, 0.2)
    assert on_bf16.cfg.data.batch_size == base.data.batch_size and on_bf16.cfg.per_device == {}
    on_gpu = resolve(base, H200)
    assert (on_gpu.cfg.data.batch_size, on_gpu.cfg.optim.lr) == (32, 0.002)
    assert on_gpu.cfg.train.epochs == base.train.epochs
    on_avx2 = resolve(base, AVX2)  # no table for this class: the recipe as written
    plain = Config.to_dict(on_avx2.cfg)
    assert {k: v for k, v in plain.items() if k != "per_device"} == {
        k: v
        for k, v in resolve(load_config("configs/tests/tiny.toml"), AVX2).cfg.to_dict().items()
        if k != "per_device"
    }
    assert on_avx2.chosen["per_device"][0] == "cpu"
    assert "per_device: no table for cpu (the recipe's: cpu_bf16, cuda)" in on_avx2.line()
    # announced in the one fast-paths line, with what it set; recorded for summary.json
    assert "; per_device.cpu_bf16: train.epochs=3, train.label_smoothing=0.2" in on_bf16.line()
    assert on_bf16.record()["per_device"]["value"] == "cpu_bf16"
    # a resolved config resolves to itself (a resumed run's config.toml on another machine)
    assert resolve(on_bf16.cfg, H200).cfg.to_dict() == on_bf16.cfg.to_dict()


def test_the_command_line_wins_over_every_table(recipe):
    cfg = load_config(recipe, ["train.epochs=5", "optim.lr=0.01"])
    for machine in (BF16_CPU, H200, AVX2):
        out = resolve(cfg, machine).cfg
        assert (out.train.epochs, out.optim.lr) == (5, 0.01), machine
    # the table's other keys still apply
    assert resolve(cfg, BF16_CPU).cfg.train.label_smoothing == 0.2
    assert resolve(cfg, H200).cfg.data.batch_size == 32


def test_the_tables_round_trip_through_to_toml(recipe, tmp_path):
    cfg = load_config(recipe)
    again = tmp_path / "again.toml"
    again.write_text(cfg.to_toml())
    assert load_config(again).to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "tables,message",
    [
        (
            "[per_device.gpu.train]\nepochs = 3\n",
            "[per_device.gpu]: unknown device class (classes: cpu, cpu_bf16, cuda)",
        ),
        ("[per_device.cuda.train]\nepoch = 3\n", "[per_device.cuda] unknown key 'train.epoch'"),
        ("[per_device.cuda.train]\nepochs = -1\n", "[per_device.cuda] train.epochs must be >= 0"),
        (
            "[per_device]\ncuda = 1\n",
            "[per_device.cuda] must hold tables such as [per_device.cuda.train]",
        ),
        ("per_device = 3\n", "[per_device] must hold tables"),
        # each class's recipe meets the cross-key rules, refused on any machine
        (
            '[per_device.cuda.train]\ncompile_mode = "reduce-overhead"\n',
            "[per_device.cuda]: config: train.compile_mode=reduce-overhead needs train.compile=true",
        ),
    ],
)
def test_a_bad_table_is_refused_in_one_line_on_any_machine(tmp_path, tables, message):
    path = tmp_path / "bad.toml"
    text = open("configs/tests/tiny.toml").read()
    path.write_text(tables + "\n" + text if tables.startswith("per_device =") else text + tables)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_device_classes():
    assert [device_class(m) for m in (AVX2, BF16_CPU, H200, Machine("cpu"))] == [
        "cpu",
        "cpu_bf16",
        "cuda",
        "cpu",  # flags unreadable: the class without bf16, as train.precision=auto decides
    ]


def test_a_run_records_the_table_it_ran_with_and_resumes_on_it(
    recipe, tmp_path, monkeypatch, capsys
):
    """The run's config.toml holds the table's values and no tables; summary.json says which
    table; the resume takes config.toml as it is, on whatever machine."""
    from vitscale import fastpaths

    monkeypatch.setattr(fastpaths, "cpu_has_bf16", lambda *a: True)
    run = tmp_path / "run"
    sets = ["--set", "train.epochs=1", "--set", "run.progress=plain"]
    assert main(["train", str(recipe), "--out", str(run), *sets]) == 0
    err = capsys.readouterr().err
    assert "per_device.cpu_bf16: train.label_smoothing=0.2" in err
    saved = (run / "config.toml").read_text()
    assert "per_device" not in saved and "label_smoothing = 0.2" in saved
    summary = json.loads((run / "summary.json").read_text())
    assert summary["auto"]["per_device"]["value"] == "cpu_bf16"
    monkeypatch.setattr(fastpaths, "cpu_has_bf16", lambda *a: False)  # another machine
    assert (
        main(
            ["train", "--resume", str(run), "--set", "train.epochs=2", "--set", "run.progress=off"]
        )
        == 0
    )
    assert "label_smoothing = 0.2" in (run / "config.toml").read_text()


def test_a_searched_or_swept_key_wins_over_the_tables_too(recipe, monkeypatch):
    """The lab's commands change a recipe by dotted keys (lab.recipes.with_overrides: search
    trials, sweeps, ladders): like --set, those win over the machine's table."""
    from vitscale import fastpaths
    from vitscale.lab.recipes import with_overrides

    monkeypatch.setattr(fastpaths, "cpu_has_bf16", lambda *a: True)  # the table's machine
    cfg = load_config(recipe)
    out = with_overrides(cfg, {"train.epochs": 2, "train.precision": "fp32"})
    assert (out.train.epochs, out.train.label_smoothing) == (2, 0.2)  # the table: 3 and 0.2
    assert cfg.per_device["cpu_bf16"]["train"]["epochs"] == 3  # the given config is untouched


def test_a_table_the_command_line_emptied_is_not_printed(recipe):
    out = load_config(recipe, ["train.epochs=5", "train.label_smoothing=0.1"]).to_toml()
    assert "[per_device.cpu_bf16.train]" not in out and "[per_device.cuda.data]" in out
