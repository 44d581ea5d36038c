"""vitscale ladder and tune: rung construction, a tiny ladder end to end, tune's search logic with a
fake measure function, tune end to end with a fake harness, one-line errors. No timing is asserted."""

import contextlib
import json

import pytest
import torch

from vitscale.cli import main
from vitscale.config import load_config
from vitscale.fastpaths import resolve
from vitscale.lab import rounds as lab_rounds
from vitscale.lab import sdpa_check
from vitscale.lab import timing as lab_timing
from vitscale.lab.ladder import BASELINE, build_rungs
from vitscale.lab.tune import accum_choices, search

TINY = "configs/tests/tiny.toml"
pytestmark = pytest.mark.usefixtures("fixed_peak_and_threads")


# -- ladder ---------------------------------------------------------------------------------------
def test_rungs_are_cumulative():
    cfg = load_config(TINY)
    rungs = build_rungs(cfg, world_size=1)
    assert [r.key for r in rungs] == [
        "baseline",
        "tf32",
        "precision",
        "foreach",
        "fused",
        "pool",
        "sdpa",
        "sdpa_backend",
        "compile",
        "autotune",
        "cudagraphs",
        "capture",
        "batch",
        "sharding",
    ]
    assert rungs[0].overrides == BASELINE
    for prev, r in zip(rungs, rungs[1:]):
        if r.skip is None:
            assert r.overrides == {**prev.overrides, **r.delta}
        else:
            assert r.overrides == prev.overrides  # a skipped rung adds nothing
    top = rungs[-2].overrides
    assert top == {
        "train.precision": "bf16",
        "train.tf32": False,
        "model.head": "pool",
        "optim.impl": "fused",
        "model.attention": "sdpa",
        "train.compile": True,
        "train.compile_mode": "default",
        "train.capture": "none",
        "data.batch_size": 32,
    }
    assert [r.numerics for r in rungs] == [
        True,
        True,
        True,
        False,
        False,
        True,
        True,
        True,
        False,
        False,
        False,
        False,
        True,
        False,
    ]
    assert rungs[-1].skip and "more than one process" in rungs[-1].skip
    # on a CPU the CUDA-only rungs are skipped with the reason (they would change nothing)
    assert all("CUDA feature" in rungs[i].skip for i in (1, 7, 9, 10, 11))
    assert rungs[0].name.startswith("baseline (fp32,")


def test_rungs_on_a_gpu_add_tf32_and_cuda_graphs(monkeypatch):
    """The rungs a CUDA machine gets (decided from the device type; built here on a CPU)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    rungs = {r.key: r for r in build_rungs(load_config(TINY), world_size=1)}
    assert (
        "TF32 off" in rungs["baseline"].name and rungs["baseline"].overrides["train.tf32"] is False
    )
    assert rungs["tf32"].skip is None and rungs["tf32"].overrides["train.tf32"] is True
    assert rungs["cudagraphs"].skip is None
    # with the autotune rung taken, the graph rungs keep its kernels: max-autotune, then the whole
    # step captured around compile without graphs of its own
    assert rungs["sdpa_backend"].overrides["train.sdpa_backend"] == "cudnn"
    assert rungs["autotune"].overrides["train.compile_mode"] == "max-autotune-no-cudagraphs"
    assert rungs["cudagraphs"].overrides["train.compile_mode"] == "max-autotune"
    assert rungs["capture"].skip is None
    assert rungs["batch"].overrides["train.compile_mode"] == "max-autotune-no-cudagraphs"
    assert (
        rungs["batch"].overrides["train.capture"] == "step"
        and rungs["batch"].overrides["train.compile"]
    )
    plain = {r.key: r for r in build_rungs(load_config(TINY), world_size=1, skip=("autotune",))}
    assert plain["cudagraphs"].overrides["train.compile_mode"] == "reduce-overhead"
    assert plain["capture"].overrides["train.compile_mode"] == "default"
    # CUDA graphs are for one GPU: with the compile rung left out, the cudagraphs rung does not validate
    off = {r.key: r for r in build_rungs(load_config(TINY), world_size=1, skip=("compile",))}
    assert "needs train.compile=true" in off["cudagraphs"].skip


def test_rungs_two_processes_and_invalid_ones():
    cfg = load_config(TINY, ["optim.name=lamb"])
    rungs = {r.key: r for r in build_rungs(cfg, world_size=2, skip=("compile",))}
    assert rungs["sharding"].skip is None
    assert rungs["sharding"].overrides["strategy.name"] == "fsdp"
    assert rungs["sharding"].overrides.get("train.compile", False) is False  # compile was left out
    # FSDP2 keeps the compile rung's compile (each block compiled before it is sharded)
    assert {r.key: r for r in build_rungs(load_config(TINY), world_size=2)}["sharding"].overrides[
        "train.compile"
    ]
    assert rungs["batch"].overrides["data.batch_size"] == 32  # 8 -> 16 per device on 2 processes
    assert "LAMB" in rungs["foreach"].skip and "LAMB" in rungs["fused"].skip
    assert rungs["compile"].skip == "left out (--skip)"
    assert (
        "optim.impl" not in rungs["sharding"].overrides
        or rungs["sharding"].overrides["optim.impl"] == "forloop"
    )


def test_vs_previous_round_by_round():
    from vitscale.lab.ladder import vs_previous_paired

    prev, cur = [1.0, 2.0, 1.5], [2.0, 2.0, 3.3]  # each rung's per-round speedup over the baseline
    assert vs_previous_paired(cur, prev) == pytest.approx(2.0)  # median of 2.0, 1.0, 2.2
    assert vs_previous_paired(cur, None) == 1.0 and vs_previous_paired(None, prev) is None


def test_tiny_ladder_end_to_end(capsys, tmp_path):
    out = tmp_path / "ladder"
    rc = main(
        [
            "ladder",
            TINY,
            "--set",
            "run.threads=1",
            "--steps",
            "1",
            "--trials",
            "2",
            "--warmup",
            "1",
            "--train-steps",
            "2",
            "--skip",
            "compile",
            "--json",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert (out / "ladder.md").exists() and (out / "ladder.png").stat().st_size > 0
    assert json.loads((out / "ladder.json").read_text())["rungs"] == r["rungs"]
    rows = {row["rung"].split(" (")[0]: row for row in r["rungs"]}
    assert rows["baseline"]["speedup_vs_baseline"] == 1.0
    measured = [row for row in r["rungs"] if not row["skipped"]]
    assert len(measured) == 7 and r["complete"]
    for prev, row in zip([None] + measured, measured):
        assert row["images_per_s"] > 0
        # against the baseline's median round in the rung's own rounds (each rung is timed beside it)
        assert row["speedup_vs_baseline"] == pytest.approx(
            row["images_per_s"] / row["baseline_images_per_s"]
        )
        assert row["speedup_vs_previous"] == pytest.approx(
            row["speedup_vs_baseline"] / prev["speedup_vs_baseline"] if prev else 1.0
        )
        assert row["speedup_vs_baseline_paired"] > 0
    assert measured[0]["baseline_images_per_s"] == measured[0]["images_per_s"]
    assert measured[0]["speedup_vs_baseline_paired"] == 1.0
    assert measured[0]["speedup_vs_previous_paired"] == 1.0 and all(
        row["speedup_vs_previous_paired"] > 0 for row in measured
    )
    # numerics-changing rungs were trained and tested; the others not
    trained = [row["rung"].split(" (")[0] for row in measured if "accuracy" in row]
    assert trained == [
        "baseline",
        "+ mixed precision",
        "+ pooled head",
        "+ fused attention",
        "+ larger batch",
    ]
    assert all(
        0 <= row["accuracy"]["test_accuracy"] <= 1 and row["accuracy"]["steps"] == 2
        for row in measured
        if "accuracy" in row
    )
    assert "| rung |" in (out / "ladder.md").read_text()


def test_ladder_times_each_rung_under_its_own_tf32_flags(monkeypatch, tmp_path, capsys):
    """Issue 25, item 2: the rungs were all built (each strategy setting the process-wide TF32
    flags) and then timed together, so the "fp32 IEEE, TF32 off" baseline ran in TF32 like the
    rungs built after it. Driven on a CPU: the strategies set the flags a GPU run sets, and the
    tf32 rung is measured here."""
    from vitscale.lab import ladder as lab_ladder
    from vitscale.loop import Trainer
    from vitscale.strategy import devices, single

    monkeypatch.setattr(
        lab_ladder, "CUDA_ONLY", ("cudagraphs", "capture", "sdpa_backend", "autotune")
    )
    cuda_flags = lambda device_type, tf32, bench: {  # noqa: E731
        "matmul_tf32": tf32,
        "conv_tf32": tf32,
        "cudnn_benchmark": bench,
    }
    monkeypatch.setattr(single, "backend_flags", cuda_flags)
    monkeypatch.setattr(devices, "backend_flags", cuda_flags)
    seen, step = [], Trainer.train_step

    def recording(self, batch, *a, **k):
        seen.append(
            (
                self.cfg.train.tf32,
                torch.backends.cuda.matmul.fp32_precision == "tf32",
                torch.backends.cudnn.conv.fp32_precision == "tf32",
            )
        )
        return step(self, batch, *a, **k)

    monkeypatch.setattr(Trainer, "train_step", recording)
    legacy = (torch._C._get_float32_matmul_precision(), torch._C._get_cudnn_allow_tf32())
    new = {
        k: torch._C._get_fp32_precision_getter(*k)
        for k in [("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"), ("mkldnn", "matmul")]
    }
    try:
        rc = main(
            [
                "ladder",
                TINY,
                "--set",
                "run.threads=1",
                "--steps",
                "1",
                "--trials",
                "2",
                "--warmup",
                "1",
                "--train-steps",
                "0",
                "--skip",
                "foreach,fused,pool,sdpa,compile,batch",
                "--json",
                "--out",
                str(tmp_path),
            ]
        )
    finally:
        torch.set_float32_matmul_precision(legacy[0])
        torch._C._set_cudnn_allow_tf32(legacy[1])
        for k, v in new.items():
            torch._C._set_fp32_precision_setter(*k, v)
    assert rc == 0
    rows = [row for row in json.loads(capsys.readouterr().out)["rungs"] if not row["skipped"]]
    assert [row["rung"].split(" (")[0] for row in rows] == [
        "baseline",
        "+ TF32 matmuls and convolutions",
        "+ mixed precision",
    ]
    assert {tf32 for tf32, _, _ in seen} == {False, True}
    assert all(matmul == conv == tf32 for tf32, matmul, conv in seen), seen


def test_ladder_frees_each_rung_and_writes_its_row_at_once(monkeypatch, tmp_path, capsys):
    """Issue 25, item 9: at most two rungs' benches alive at a time (the baseline and the rung
    timed beside it), and each row on disk as soon as its rung is measured: the run stopped
    (Ctrl-C, a time limit) while building the third rung keeps the baseline's row and two rungs'."""
    import gc
    import weakref

    alive, most = weakref.WeakSet(), []

    class CountingBench(lab_timing.Bench):
        def __init__(self, *a, **k):
            if len(most) == 3:  # the baseline and two rungs were built (and measured): stop here
                raise KeyboardInterrupt
            super().__init__(*a, **k)
            alive.add(self)
            gc.collect()
            most.append(len(alive))

    monkeypatch.setattr(lab_timing, "Bench", CountingBench)
    out = tmp_path / "ladder"
    rc = main(
        [
            "ladder",
            TINY,
            "--set",
            "run.threads=1",
            "--steps",
            "1",
            "--trials",
            "2",
            "--warmup",
            "1",
            "--train-steps",
            "1",
            "--skip",
            "compile",
            "--out",
            str(out),
        ]
    )
    assert rc == 130
    assert most == [1, 2, 2]
    r = json.loads((out / "ladder.json").read_text())
    measured = [row["rung"].split(" (")[0] for row in r["rungs"] if not row["skipped"]]
    assert measured == ["baseline", "+ mixed precision", "+ multi-tensor optimizer"]
    assert not r["complete"] and "accuracy" in r["rungs"][0]  # the baseline's training, written too
    md = (out / "ladder.md").read_text()
    assert "+ multi-tensor optimizer" in md and "+ fused optimizer" not in md and "incomplete" in md


def test_measure_against_first_when_memory_runs_out(monkeypatch):
    """A rung that does not fit is reported and the next one built; a baseline that runs out of
    memory next to a rung is closed (then the memory freed), the rung reported without a
    round-by-round ratio, and the baseline built again for the next rung. Once measured in full,
    the baseline runs `reference_steps` per round (after a 1-step warm-up); ratios are per image."""
    import types

    built, emitted = [], []

    class FakeBench:
        def __init__(self, name):
            self.name, self.closed, self.global_batch, self.calls = name, False, 8, []
            self.cfg = types.SimpleNamespace(train=types.SimpleNamespace(compile=False))
            self.trainer = types.SimpleNamespace(flops_per_image=1.0)
            self.s = types.SimpleNamespace(world_size=1, device=torch.device("cpu"))
            built.append(self)

        def settings(self):
            return contextlib.nullcontext()

        def steps(self, n):
            self.calls.append(n)
            if self.name == "base" and any(b.name == "big" and not b.closed for b in built):
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return ({"base": 0.4, "big": 0.1, "ok": 0.2, "ok2": 0.1}[self.name] * n, 0.0)

        def close(self):
            self.closed = True

    def fake_build(cfg, synthetic=False):
        return (None, "out of memory") if cfg == "huge" else (FakeBench(cfg), None)

    monkeypatch.setattr(lab_rounds, "build_bench", fake_build)
    res = lab_rounds.measure_against_first(
        ["base", "huge", "big", "ok", "ok2"],
        steps=3,
        rounds=3,
        warmup=2,
        on_result=lambda i, r: emitted.append(i),
        reference_steps=1,
    )
    assert emitted == [
        1,
        2,
        0,
        3,
        4,
    ]  # the baseline's own row comes from the first pair it completed
    assert res[1] == {"error": "out of memory"}
    assert res[2]["images_per_s"] == pytest.approx(80.0) and res[2]["paired_vs_first"] is None
    assert res[2]["reference_images_per_s"] is None
    assert res[0]["images_per_s"] == pytest.approx(20.0) and res[0]["paired_vs_first"] == 1.0
    assert res[3]["paired_vs_first"] == pytest.approx(2.0) and res[3][
        "reference_images_per_s"
    ] == pytest.approx(20.0)
    assert res[4]["paired_vs_first"] == pytest.approx(4.0) and res[4][
        "reference_images_per_s"
    ] == pytest.approx(20.0)
    assert [b.name for b in built] == ["base", "big", "base", "ok", "ok2"] and all(
        b.closed for b in built
    )
    # the rebuilt baseline: in full beside "ok" (warm-up 2, 3 rounds of 3), then 1 + 3 x 1 beside "ok2"
    assert built[2].calls == [2, 3, 3, 3, 1, 1, 1, 1] and built[3].calls == built[4].calls == [
        2,
        3,
        3,
        3,
    ]


# -- tune: the search -----------------------------------------------------------------------------
def fake_measure(speed, log):
    def measure(cands):
        log.extend(cands)
        return [speed(c) for c in cands]

    return measure


def speed_of(c):
    s = 100.0
    s *= {"fp32": 1.0, "bf16": 1.8}[c.get("train.precision", "fp32")]
    s *= {"sdpa": 1.0, "explicit": 1.3}[c.get("model.attention", "sdpa")]
    s *= {"forloop": 1.0, "foreach": 0.9, "fused": 1.2}[c.get("optim.impl", "forloop")]
    micro = 128 // c.get("train.accum_steps", 1)
    s *= {16: 0.6, 32: 0.8, 64: 0.82, 128: 1.5}[micro]  # 32 -> 64 gains < 3%: stop there
    s *= 0.9 if c.get("train.compile") else 1.0
    return s


CHOICES = [
    ("model.attention", ["sdpa", "explicit"]),
    ("optim.impl", ["forloop", "foreach", "fused"]),
    "micro",
    ("train.compile", [False, True]),
]


def test_search_picks_the_fastest_and_respects_allowed_precisions():
    seen = []
    best, history = search(
        [("train.precision", ["fp32"])] + CHOICES,
        accum_choices(128, 1),
        fake_measure(speed_of, seen),
    )
    assert best["model.attention"] == "explicit" and best["optim.impl"] == "fused"
    assert best["train.compile"] is False
    assert all(c.get("train.precision", "fp32") == "fp32" for c in seen)  # bf16 was not allowed
    best2, _ = search(
        [("train.precision", ["fp32", "bf16"])] + CHOICES,
        accum_choices(128, 1),
        fake_measure(speed_of, []),
    )
    assert best2["train.precision"] == "bf16"
    assert len(history) == len(seen)


def test_micro_batch_doubling_keeps_global_batch_and_stops_below_3_percent():
    assert accum_choices(128, 1) == [8, 4, 2, 1]  # micro 16, 32, 64, 128: 128 = micro x accum
    assert accum_choices(256, 1, min_micro=64) == [4, 2, 1]
    assert accum_choices(48, 3) == [3, 2, 1]  # micro 16, 24, 48: the recipe's own accum stays
    seen = []
    best, _ = search(["micro"], accum_choices(128, 1), fake_measure(speed_of, seen))
    accums = {c.get("train.accum_steps", 1) for c in seen}
    # 16 -> 32 gained 33%, 32 -> 64 only 2.5%: stop; micro 128 (accum 1) is never tried by the walk,
    # but the recipe's own accum 1 is compared with the walk's pick at the end
    assert accums == {8, 4, 2, 1}
    assert [c.get("train.accum_steps", 1) for c in seen] == [8, 4, 4, 2, 1, 4]
    assert seen[4] == {}  # the recipe itself, against the walk's pick
    assert best == {}  # the recipe (micro 128) is the fastest


def test_micro_batch_doubling_on_gpu_until_out_of_memory():
    speed = lambda c: {8: 50.0, 4: 70.0, 2: 70.5, 1: None}[c.get("train.accum_steps", 8)]  # noqa: E731
    best, _ = search(["micro"], [8, 4, 2, 1], fake_measure(speed, []), gpu=True, start_accum=8)
    assert (
        best["train.accum_steps"] == 2
    )  # the largest micro-batch that fits (micro 128 ran out of memory)


def test_search_keeps_the_incumbent_within_noise_and_stops_on_budget():
    speed = lambda c: 101.0 if c.get("model.attention") == "sdpa" else 100.0  # noqa: E731
    best, _ = search([("model.attention", ["explicit", "sdpa"])], [1], fake_measure(speed, []))
    assert best["model.attention"] == "explicit"  # 1% is noise: the recipe's value stays
    best, hist = search(CHOICES, [1], fake_measure(speed_of, []), out_of_time=lambda: True)
    assert best == {} and hist == []


# -- tune: end to end with a fake harness -----------------------------------------------------------
def test_tune_writes_recipe_with_gain(capsys, tmp_path, monkeypatch):
    def fake_measure_configs(cfgs, steps, rounds, warmup, synthetic=False, names=None):
        out = []
        for c in cfgs:
            over = {
                "train.precision": c.train.precision,
                "model.attention": c.model.attention,
                "optim.impl": c.optim.impl if c.optim.impl != "auto" else "forloop",
                "train.accum_steps": c.train.accum_steps * 128 // c.data.batch_size,
                "train.compile": c.train.compile,
            }
            out.append(
                {
                    "images_per_s": speed_of(over),
                    "flops_per_image": 1e6,
                    "world_size": 1,
                    "device": torch.device("cpu"),
                    "step_time_s": {},
                }
            )
        return out

    monkeypatch.setattr(lab_rounds, "measure_configs", fake_measure_configs)
    out = tmp_path / "tuned.toml"
    rc = main(
        [
            "tune",
            TINY,
            "--set",
            "data.batch_size=64",
            "--set",
            "data.train_size=128",
            "--allow-precision",
            "fp32",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    text = out.read_text()
    assert "# machine:" in text and "tuned MFU" in text and "recipe" in text
    cfg = load_config(out)
    assert cfg.data.batch_size == 64  # the global batch never changes
    assert (
        cfg.train.precision == "fp32"
        and cfg.model.attention == "explicit"
        and cfg.optim.impl == "fused"
    )
    assert 64 % cfg.train.accum_steps == 0
    assert "tuned MFU" in printed.out and "x round by round)" in printed.out
    assert "img/s" in printed.err  # a progress line per candidate


def test_tune_keeps_the_recipe_when_the_winner_loses_the_final_comparison(
    capsys, tmp_path, monkeypatch
):
    def fake_measure_configs(cfgs, steps, rounds, warmup, synthetic=False, names=None):
        final = names and names[0] == "(the recipe as written)"  # noise: the recipe wins at the end
        return [
            {
                "images_per_s": (
                    200.0 if final and i == 0 else 100.0 + 10 * (c.model.attention == "sdpa")
                ),
                "flops_per_image": 1e6,
                "world_size": 1,
                "device": torch.device("cpu"),
                "step_time_s": {},
            }
            for i, c in enumerate(cfgs)
        ]

    monkeypatch.setattr(lab_rounds, "measure_configs", fake_measure_configs)
    out = tmp_path / "tuned.toml"
    rc = main(
        [
            "tune",
            TINY,
            "--set",
            "data.batch_size=64",
            "--set",
            "data.train_size=128",
            "--no-compile",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    text = out.read_text()
    assert "# chosen overrides: none" in text and "# rejected (slower than the recipe" in text
    tuned, recipe = (
        load_config(out),
        load_config(TINY, ["data.batch_size=64", "data.train_size=128"]),
    )
    assert (
        tuned.to_dict() == resolve(recipe).cfg.to_dict()
    )  # the recipe, unchanged (its auto keys answered)
    assert "(1.00x round by round)" in printed.out and "keeping the recipe" in printed.err


def test_paired_speedups_cancel_drift_between_rounds():
    """Round 3 ran 10x slower for everyone (the machine, not the configs): the ratio of median
    rounds says bench 1 is 20x slower, the round-by-round ratio says 2x, which it is."""
    times = [
        [(1.0, 0), (1.0, 0), (10.0, 0)],  # bench 0: 1 s per round, then a slow round
        [(2.0, 0), (20.0, 0), (20.0, 0)],  # bench 1: 2x bench 0 in every round; slow from round 2
        [(1.0, 0), (1.0, 0), (10.0, 0)],
    ]  # bench 2: the same as bench 0 but twice the batch
    assert lab_rounds.paired_speedups(times, [8, 8, 16]) == [1.0, 0.5, 2.0]
    assert (
        lab_rounds.rate(times[1], 1, 8)["images_per_s"]
        / lab_rounds.rate(times[0], 1, 8)["images_per_s"]
        == 0.05
    )
    assert lab_rounds.paired_speedups([None, times[1]], [8, 8]) == [None, None]
    assert lab_rounds.paired_speedups([times[0], None], [8, 8]) == [1.0, None]


def test_paired_rounds_and_the_consistency_rule():
    times = [
        [(1.0, 0), (2.0, 0), (1.0, 0)],  # bench 0, 8 images per step
        [(0.5, 0), (2.5, 0), (0.8, 0)],
    ]  # bench 1: 2x, 0.8x, 1.25x bench 0
    rounds = lab_rounds.paired_rounds(times, [8, 8])
    assert rounds[0] == [1.0, 1.0, 1.0] and rounds[1] == pytest.approx([2.0, 0.8, 1.25])
    assert lab_rounds.paired_speedups(times, [8, 8])[1] == pytest.approx(1.25)  # the median
    assert not lab_rounds.faster_in_most_rounds(rounds[1])  # 2 of 3 rounds: not more than 2/3
    assert lab_rounds.faster_in_most_rounds([1.1, 1.02, 1.3])
    assert lab_rounds.faster_in_most_rounds([1.1, 0.9, 1.3, 1.2, 1.05])  # 4 of 5
    assert not lab_rounds.faster_in_most_rounds([1.1, 0.9, 1.3, 0.99, 1.05])  # 3 of 5
    assert not lab_rounds.faster_in_most_rounds([]) and not lab_rounds.faster_in_most_rounds(None)
    assert lab_rounds.paired_rounds([None, times[1]], [8, 8]) == [None, None]


def test_beats_first_is_the_rule_the_tune_test_below_applies():
    from vitscale.lab.tune import beats_first

    assert not beats_first(1.10, [1.3, 0.9, 1.1, 0.95, 1.2])  # 3 of 5 rounds: noise
    assert beats_first(1.05, [1.05] * 5)
    assert not beats_first(1.005, [1.01, 1.005, 1.002])  # every round, but within the 1% margin
    assert beats_first(1.05, None) and not beats_first(
        None, [1.2] * 3
    )  # no per-round data: the median decides


def test_tune_needs_a_gain_in_most_rounds(capsys, tmp_path, monkeypatch):
    """sdpa's median round-by-round ratio is 1.10x, from 3 of 5 rounds (noise): the recipe's
    explicit attention stays. The for-loop optimizer wins 5 of 5 rounds at 1.05x: it is taken."""

    def fake_measure_configs(cfgs, steps, rounds, warmup, synthetic=False, names=None):
        out = []
        for i, c in enumerate(cfgs):
            r = (
                [1.0] * 5
                if i == 0
                else [1.3, 0.9, 1.1, 0.95, 1.2]
                if c.model.attention == "sdpa"
                else [1.05] * 5
                if c.optim.impl == "forloop" and cfgs[0].optim.impl != "forloop"
                else [1.0] * 5
            )
            out.append(
                {
                    "images_per_s": 100.0,
                    "paired_vs_first": sorted(r)[2],
                    "paired_rounds": r,
                    "flops_per_image": 1e6,
                    "world_size": 1,
                    "device": torch.device("cpu"),
                    "step_time_s": {},
                }
            )
        return out

    monkeypatch.setattr(lab_rounds, "measure_configs", fake_measure_configs)
    out = tmp_path / "tuned.toml"
    over = ["data.batch_size=64", "model.attention=explicit", "optim.impl=fused"]
    rc = main(
        ["tune", TINY, "--no-compile", "--out", str(out)] + [x for o in over for x in ("--set", o)]
    )
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    tuned = load_config(out)
    assert tuned.model.attention == "explicit" and tuned.optim.impl == "forloop"
    assert (
        "model.attention=sdpa: 100.0 img/s (1.100x the first, round by round, but faster in only 3 of 5 "
        "rounds: counted as no faster)" in printed.err
    )
    assert "(1.05x round by round)" in printed.out


def test_tune_decides_by_the_round_by_round_ratio(capsys, tmp_path, monkeypatch):
    """Every challenger's median round looks 1.5x faster (drift), its rounds paired with the
    incumbent's say 0.9x: tune keeps the recipe's settings."""

    def fake_measure_configs(cfgs, steps, rounds, warmup, synthetic=False, names=None):
        return [
            {
                "images_per_s": 150.0 if i else 100.0,
                "paired_vs_first": 0.9 if i else 1.0,
                "flops_per_image": 1e6,
                "world_size": 1,
                "device": torch.device("cpu"),
                "step_time_s": {},
            }
            for i, c in enumerate(cfgs)
        ]

    monkeypatch.setattr(lab_rounds, "measure_configs", fake_measure_configs)
    out = tmp_path / "tuned.toml"
    over = ["data.batch_size=64", "model.attention=explicit"]
    rc = main(
        ["tune", TINY, "--no-compile", "--out", str(out)] + [x for o in over for x in ("--set", o)]
    )
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert (
        load_config(out).to_dict() == resolve(load_config(TINY, over)).cfg.to_dict()
    )  # the median rounds said otherwise
    assert "# chosen overrides: none" in out.read_text()
    assert "model.attention=sdpa: 150.0 img/s (0.900x the first, round by round)" in printed.err


def test_tune_keeps_its_pick_when_the_recipe_itself_fails_the_final_comparison(
    capsys, tmp_path, monkeypatch
):
    """E.g. the recipe runs out of GPU memory where the tuned settings fit: the tuned recipe is still
    written, saying the recipe did not run; when nothing runs, one line and exit code 2."""
    fail_all = []

    def fake_measure_configs(cfgs, steps, rounds, warmup, synthetic=False, names=None):
        final = names and names[0] == "(the recipe as written)"
        return [
            {"error": "out of memory"}
            if final and (i == 0 or fail_all)
            else {
                "images_per_s": 100.0 + 10 * (c.model.attention == "sdpa"),
                "flops_per_image": 1e6,
                "world_size": 1,
                "device": torch.device("cpu"),
                "step_time_s": {},
            }
            for i, c in enumerate(cfgs)
        ]

    monkeypatch.setattr(lab_rounds, "measure_configs", fake_measure_configs)
    out = tmp_path / "tuned.toml"
    argv = ["tune", TINY, "--set", "model.attention=explicit", "--no-compile", "--out", str(out)]
    rc = main(argv)
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert load_config(out).model.attention == "sdpa"
    assert "recipe failed (out of memory), tuned 110.0 img/s" in out.read_text()
    assert "the recipe itself did not run" in printed.out
    fail_all.append(True)
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        rc == 2 and err[-1] == "vitscale: error: tune: the final comparison failed: out of memory"
    )


@pytest.mark.parametrize("allow", [False, True])
def test_tune_keeps_the_micro_batch_of_a_batch_norm_model(capsys, tmp_path, monkeypatch, allow):
    """The conv stem's BatchNorm takes its statistics from the micro-batch: accumulation would change
    the numerics, so tune does not search it unless told to (then it does, as for other models)."""
    accums = set()

    def fake_measure_configs(cfgs, steps, rounds, warmup, synthetic=False, names=None):
        accums.update(c.train.accum_steps for c in cfgs)
        return [
            {
                "images_per_s": 100.0 * c.train.accum_steps,
                "flops_per_image": 1e6,
                "world_size": 1,
                "device": torch.device("cpu"),
                "step_time_s": {},
            }
            for c in cfgs
        ]  # accumulation "wins"

    monkeypatch.setattr(lab_rounds, "measure_configs", fake_measure_configs)
    out = tmp_path / "tuned.toml"
    rc = main(
        [
            "tune",
            TINY,
            "--set",
            "model.stem=conv",
            "--set",
            "data.batch_size=64",
            "--no-compile",
            "--out",
            str(out),
        ]
        + (["--allow-bn-micro-batch"] if allow else [])
    )
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    tuned = load_config(out)
    if allow:
        assert accums == {1, 2, 4} and tuned.train.accum_steps == 4  # micro-batches 64, 32, 16
        assert "BatchNorm" not in out.read_text()
    else:
        assert accums == {1} and tuned.train.accum_steps == 1
        note = (
            "micro-batch kept at 64: 2 BatchNorm layer(s) (patch_embed.proj.1, patch_embed.proj.4)"
        )
        assert note in printed.err and f"# {note}" in out.read_text()


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["tune", TINY, "--allow-precision", "fp8"], "unknown precision fp8"),
        (["tune", TINY, "--budget-s", "0"], "--budget-s must be > 0"),
        (["ladder", TINY, "--skip", "turbo"], "unknown rung turbo"),
        (["ladder", TINY, "--steps", "0"], "--steps must be >= 1"),
        (["ladder", "nope.toml"], "config file not found"),
    ],
)
def test_bad_input_one_line(capsys, argv, expect):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and expect in err and len(err.strip().splitlines()) == 1, err


def fake_grad_check(failing, seen=None):
    """sdpa_check.grad_check as a GPU answers it: the kernels in `failing` FAIL, the others PASS;
    `seen` collects (kernel, dtype, shape) of each call."""

    def check(kernel, device, dtype, **shape):
        if seen is not None:
            seen.append((kernel, dtype, shape))
        status = "FAIL" if kernel in failing else "PASS"
        errors = {"out": 0.5 if status == "FAIL" else 1e-3, "dq": 1e-3, "dk": 1e-3, "dv": 1e-3}
        return {
            "backend": kernel,
            "status": status,
            "errors": errors,
            "bound": 0.0156,
            "dtype": str(dtype),
            "shape": list(shape.values()),
            "why": "out off by 5.0e-01",
        }

    return check


def test_tune_tries_the_gpu_switches_only_on_a_gpu(monkeypatch):
    """Issues 31 and 32: on a GPU tune also tries the attention kernel, inductor's autotuned
    templates and the whole step captured; on a CPU none of them (they change nothing there or
    cannot run)."""
    import types

    from vitscale.lab.tune import search_space

    args = types.SimpleNamespace(
        allow_precision="", no_compile=False, synthetic=True, allow_bn_micro_batch=False
    )
    cfg = load_config(TINY, ["model.attention=sdpa"])
    keys = lambda space: [c[0] for c in space["choices"] if c != "micro"]  # noqa: E731
    cpu = keys(search_space(cfg, args))
    assert not {"train.sdpa_backend", "train.compile_mode", "train.capture", "train.fp8"} & set(cpu)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    # each kernel's gradient check (lab/sdpa_check.py) as the GPU would answer it: all pass
    monkeypatch.setattr(sdpa_check, "grad_check", fake_grad_check(()))
    space = search_space(cfg, args)
    gpu = dict(c for c in space["choices"] if c != "micro")
    assert gpu["train.sdpa_backend"] == ["auto", "flash", "cudnn", "efficient"]
    assert gpu["train.compile_mode"] == ["default", "max-autotune-no-cudagraphs"]
    assert gpu["train.capture"] == ["none", "step"] and gpu["train.fp8"] == [
        "none",
        "rowwise",
        "tensorwise",
    ]
    assert keys(space).index("train.compile_mode") > keys(space).index(
        "train.compile"
    )  # after compile is decided
    # inductor's knobs (issue 51), each off first, after the compile and its mode are decided
    assert [k for k in keys(space) if k.startswith("train.inductor_")] == [
        "train.inductor_coordinate_descent",
        "train.inductor_combo_kernels",
        "train.inductor_mix_order",
        "train.inductor_gemm",
    ]
    assert gpu["train.inductor_mix_order"][0] == "default" and gpu["train.inductor_gemm"] == [
        "default",
        "cutlass",
    ]
    assert keys(space).index("train.inductor_gemm") > keys(space).index("train.compile_mode")
    assert not {k for k in cpu if k.startswith("train.inductor_")}  # no effect on a CPU


def test_tune_times_only_the_kernels_that_pass_their_gradient_check(monkeypatch, capsys):
    """Issue 51: a kernel off the float64 reference at the recipe's shape (cuDNN's bug at 197
    tokens) is said in one line and never timed; the check runs in each allowed precision's dtype."""
    import types

    from vitscale.lab.tune import search_space

    args = types.SimpleNamespace(
        allow_precision="bf16,bf16_act,fp32",
        no_compile=False,
        synthetic=True,
        allow_bn_micro_batch=False,
    )
    cfg = load_config(TINY, ["model.attention=sdpa"])
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    seen = []
    monkeypatch.setattr(sdpa_check, "grad_check", fake_grad_check(("cudnn",), seen))
    space = search_space(cfg, args)
    kernels = dict(c for c in space["choices"] if c != "micro")["train.sdpa_backend"]
    assert kernels == ["auto", "flash", "efficient"]
    assert "train.sdpa_backend=cudnn: not timed (sdpa_cudnn: FAIL" in capsys.readouterr().err
    assert {d for _, d, _ in seen} == {torch.bfloat16, torch.float32}
    # the tiny recipe's own attention: 2 heads of 16, 4 patches and the class token
    assert {(s["tokens"], s["heads"], s["head_dim"]) for _, _, s in seen} == {(5, 2, 16)}
