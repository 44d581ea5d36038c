"""train.precision=auto and train.capture=auto (issue 39): one resolver (fastpaths.resolve) answers
them for the machine from plain inputs (device type, compute capability, the CPU's bf16 flag,
processes), so the GPU branches are driven here on a CPU; what it chose goes into config.toml and
summary.json, and keys the user named are never touched."""

import json
from dataclasses import replace

import pytest

from vitscale import fastpaths
from vitscale.cli import main
from vitscale.config import load_config
from vitscale.datafit import fit_to_data
from vitscale.errors import ConfigError
from vitscale.fastpaths import Machine, resolve
from vitscale.strategy import devices

TINY = "configs/tests/tiny.toml"
AVX2 = Machine("cpu", cpu_bf16=False)
AVX512_BF16 = Machine("cpu", cpu_bf16=True)
H200 = Machine("cuda", (9, 0), "NVIDIA H200")
T4 = Machine("cuda", (7, 5), "Tesla T4")


@pytest.mark.parametrize(
    "flags,expected",
    [
        ("fpu sse2 avx avx2 fma", "fp32"),  # an AVX2 laptop or EPYC: bf16 emulated
        ("fpu avx2 avx512f avx512bw avx512_vnni", "fp32"),  # AVX-512 without its BF16 extension
        ("fpu avx2 avx512f avx512_bf16", "bf16"),  # Zen 4, Cooper Lake
        ("fpu avx2 avx512f amx_bf16 amx_tile", "bf16"),  # Sapphire Rapids (AMX)
    ],
)
def test_auto_precision_reads_the_cpu_flags(tmp_path, flags, expected):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    precision, why = devices.auto_precision("cpu", cpu_bf16=devices.cpu_has_bf16(str(info)))
    assert precision == expected, why
    assert devices.auto_precision("cpu", cpu_bf16=None)[0] == "fp32"  # flags unreadable (not Linux)


@pytest.mark.parametrize(
    "capability,expected",
    [
        ((7, 0), "fp32"),
        ((7, 5), "fp32"),
        ((8, 0), "bf16"),
        ((8, 9), "bf16"),
        ((9, 0), "bf16"),
        ((10, 0), "bf16"),
    ],
)
def test_auto_precision_on_cuda_follows_the_compute_capability(capability, expected):
    precision, why = devices.auto_precision("cuda", capability)
    assert precision == expected and f"{capability[0]}.{capability[1]}" in why


def sections(cfg) -> dict:
    """A config's keys without its [per_device] tables (a resolved config has none)."""
    return {k: v for k, v in cfg.to_dict().items() if k != "per_device"}


def test_the_default_recipe_resolves_per_machine():
    cfg = load_config()
    assert (cfg.train.precision, cfg.train.capture) == ("auto", "auto")
    got = {m: resolve(cfg, m) for m in (AVX2, AVX512_BF16, H200, T4)}
    # the CPUs train the recipe's Muon (issue 50; its Newton-Schulz iteration follows the
    # precision); a GPU its [per_device.cuda] table: the AdamW recipe measured there, captured
    assert {
        m: (f.cfg.optim.name, f.cfg.train.precision, f.cfg.train.capture, f.cfg.optim.muon_ns_dtype)
        for m, f in got.items()
    } == {
        AVX2: ("muon", "fp32", "none", "fp32"),
        AVX512_BF16: ("muon", "bf16", "none", "bf16"),
        H200: ("adamw", "bf16", "step", "auto"),
        T4: ("adamw", "fp32", "step", "auto"),
    }
    assert set(got[H200].record()) == {"train.precision", "train.capture", "per_device"}
    assert {m: f.cfg.train.epochs for m, f in got.items()} == {
        AVX2: 11,
        AVX512_BF16: 18,
        H200: 12,
        T4: 12,
    }
    line = got[H200].line()
    assert (
        line.startswith("fast paths on cuda (NVIDIA H200, sm_90): precision bf16 (auto: ")
        and "capture step (auto: " in line
        and "; per_device.cuda: run.log_every=50, data.batch_size=128, model.dim=128" in line
    )
    # on a GPU the default job is the recipe of 2026-11-27 that an H200 measured (docs/performance.md)
    # with the data rule (issue 59), which leaves Fashion-MNIST's batch of 128 and lr as they were
    rule = ["data.batch_rule=min_steps", "optim.lr_scaling=sqrt", "optim.lr_ref_batch=128"]
    old = load_config(
        "docs/search/avx2_200s/recipe.toml",
        ["train.targets=[0.9,0.91]", *rule, "train.min_steps=600"],
    )
    assert sections(got[H200].cfg) == sections(resolve(old, H200).cfg)
    fitted = fit_to_data(got[H200].cfg, 60000, 1).cfg
    assert (fitted.data.batch_size, fitted.train.epochs) == (128, 12)
    assert "compile off" in line
    assert cfg.train.precision == "auto"  # the recipe itself is left as it was
    # with AdamW the default job's step is captured on a GPU
    adamw = load_config(None, ["optim.name=adamw"])
    assert {resolve(adamw, m).cfg.train.capture for m in (H200, T4)} == {"step"}


def test_on_a_bf16_cpu_the_default_job_is_the_recipe_as_it_was():
    """The default job on a CPU with bf16 instructions: auto gives exactly the config of the recipe
    with its choices written out (bf16, uncaptured, its [per_device.cpu_bf16] table's epochs), so
    the run is the same run, bit for bit; on a CPU without them, fp32 and the recipe's epochs."""

    bf16 = ["train.precision=bf16", "train.capture=none", "optim.muon_ns_dtype=bf16"]
    before = load_config(None, [*bf16, "train.epochs=18", "train.min_steps=1000"])
    assert sections(resolve(load_config(), AVX512_BF16).cfg) == sections(before)
    fp32 = load_config(
        None, ["train.precision=fp32", "train.capture=none", "optim.muon_ns_dtype=fp32"]
    )
    assert sections(resolve(load_config(), AVX2).cfg) == sections(fp32)
    assert fp32.train.epochs == 11


@pytest.mark.parametrize(
    "sets",
    [
        ["train.precision=fp32"],
        ["train.precision=pure_bf16"],
        ["train.capture=none"],
        ["optim.name=adamw", "train.capture=step"],  # the recipe's Muon is not captured
        ["train.precision=fp32", "train.capture=none"],
        ["optim.muon_ns_dtype=fp32"],
    ],
)
def test_named_keys_are_never_changed(sets):
    cfg = load_config(None, sets)
    for m in (AVX2, AVX512_BF16, H200, T4):
        out = resolve(cfg, m)
        for s in sets:
            key, value = s.split("=")
            section, name = key.split(".")
            assert str(getattr(getattr(out.cfg, section), name)) == value
            assert key not in out.record()
        assert resolve(out.cfg, m).cfg == out.cfg  # idempotent: resolved resolves to itself


@pytest.mark.parametrize(
    "sets,world,needle",
    [
        (["strategy.name=ddp"], 2, "2 processes"),
        (["train.precision=fp16"], 1, "loss scaler"),
        (["optim.name=sgd"], 1, "optim.name=sgd"),
        (
            ["optim.name=adamw", "train.compile=true", "train.compile_mode=reduce-overhead"],
            1,
            "CUDA graphs of its own",
        ),
        (["optim.name=muon"], 1, "optim.name=muon"),  # the CPUs' optimizer, named on a GPU
    ],
)
def test_auto_capture_on_a_gpu_runs_uncaptured_with_the_reason(sets, world, needle):
    cfg = load_config(None, sets)
    out = resolve(cfg, replace(H200, world_size=world))
    value, why = out.record()["train.capture"].values()
    assert value == "none" and needle in why, why
    assert needle in out.line()


def test_auto_capture_of_a_clip_model_names_the_task():
    out = resolve(load_config("configs/tests/clip_tiny.toml"), H200)
    assert out.cfg.train.capture == "none" and "clip models" in out.record()["train.capture"]["why"]


def test_auto_precision_that_becomes_fp32_refuses_fp8_in_one_line():
    cfg = load_config(None, ["train.fp8=rowwise"])  # auto: not refused before it is resolved
    with pytest.raises(
        ConfigError, match="train.fp8=rowwise runs float8 matmuls inside bf16 training"
    ):
        resolve(cfg, T4)


def _train(tmp_path, capsys, name, *sets):
    out = tmp_path / name
    args = ["train", TINY, "--out", str(out), "--set", "run.progress=plain"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0, capsys.readouterr().err
    return out, json.loads((out / "summary.json").read_text()), capsys.readouterr()


@pytest.mark.parametrize("has_bf16,expected", [(False, "fp32"), (True, "bf16")])
def test_a_run_announces_and_records_what_auto_chose(
    tmp_path, capsys, monkeypatch, has_bf16, expected
):
    monkeypatch.setattr(fastpaths, "cpu_has_bf16", lambda: has_bf16)
    out, summary, said = _train(
        tmp_path, capsys, expected, "train.precision=auto", "train.epochs=1"
    )
    assert summary["precision"] == expected and summary["capture"] == "none"
    assert summary["auto"]["train.precision"]["value"] == expected
    assert f'precision = "{expected}"' in (out / "config.toml").read_text()
    lines = [x for x in (said.out + said.err).splitlines() if x.startswith("fast paths on cpu")]
    assert len(lines) == 1 and f"precision {expected} (auto: " in lines[0], said
    # resumed on a machine that would answer otherwise: the run keeps what it was trained with
    monkeypatch.setattr(fastpaths, "cpu_has_bf16", lambda: not has_bf16)
    assert main(["train", "--resume", str(out), "--set", "train.epochs=2"]) == 0
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["precision"] == expected and resumed["auto"] == {}
