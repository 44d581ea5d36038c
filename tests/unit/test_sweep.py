"""Sweep bookkeeping with a fake bench (grids, study presets, resume, failures, report files) and one
real point through `vitscale bench` when it exists."""

import json
import sys

import pytest

from vitscale.cli import main
from vitscale.errors import UserError
from vitscale.lab import sweep

TINY = "configs/tests/tiny.toml"


def sets_of(argv):
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--set")


def fake_bench(argv, timeout):
    """What `vitscale bench --json` returns, from the --set values in argv; batch 48 fails."""
    s = sets_of(argv)
    nproc = int(argv[argv.index("--nproc-per-node") + 1]) if "--nproc-per-node" in argv else 1
    batch = int(s.get("data.batch_size", 16))
    if batch == 48:
        return None, "vitscale: error: out of memory (fake)"
    step = 0.01 * batch / nproc + 0.002 * (nproc > 1)
    split = {
        "data": 0.0,
        "forward": step / 3,
        "backward": step / 2,
        "comm_exposed": 0.002 * (nproc > 1),
        "comm_overlapped": None,
        "optimizer": step / 6 - 0.002 * (nproc > 1),
    }
    return {
        "images_per_s": batch / step,
        "images_per_s_per_device": batch / step / nproc,
        "mfu": 0.3,
        "peak_flops": 1e11,
        "step_time_s": {"min": step, "median": step, "max": step},
        "split": split,
        "peak_memory_bytes": 2**20 * (10 + int(s.get("strategy.zero_stage", 4))),
        "world_size": nproc,
        "state_bytes": 2**20 * (16 - 2 * int(s.get("strategy.zero_stage", 4))),
        "batch_size": batch,
        "params": 1000,
        "config": {},
        "versions": {},
        "hardware": {},
        "comm_allreduce_bytes_per_step": 4000 if nproc > 1 else None,
    }, None


def test_grid_expansion():
    pts = sweep.expand(
        [("data.batch_size", ["16", "32"]), ("train.precision", ["fp32", "bf16"])], [1, 2]
    )
    assert len(pts) == 8
    assert {
        (p["nproc"], p["overrides"]["data.batch_size"], p["overrides"]["train.precision"])
        for p in pts
    } == {(n, b, pr) for n in (1, 2) for b in ("16", "32") for pr in ("fp32", "bf16")}
    pts = sweep.expand([("nproc", ["1", "2", "4"]), ("a.b", ["x"])], [1])  # nproc as a grid key
    assert [p["nproc"] for p in pts] == [1, 2, 4] and all(
        p["overrides"] == {"a.b": "x"} for p in pts
    )
    assert sweep.parse_grid("data.batch_size=16, 32") == ("data.batch_size", ["16", "32"])
    with pytest.raises(UserError, match="expected KEY=V1,V2"):
        sweep.parse_grid("data.batch_size")


def test_study_presets():
    strong = sweep.study_points("strong", 64, [1], [])
    assert [(p["nproc"], p["overrides"]) for p in strong] == [
        (1, {}),
        (2, {}),
    ]  # global batch fixed
    weak = sweep.study_points("weak", 16, [1, 2, 4], [])
    assert [(p["nproc"], p["overrides"]["data.batch_size"]) for p in weak] == [
        (1, 16),
        (2, 32),
        (4, 64),
    ]
    weak = sweep.study_points(
        "weak", 16, [1, 2], [("data.batch_size", ["8"])]
    )  # per-device batch from the grid
    assert [p["overrides"]["data.batch_size"] for p in weak] == [8, 16]
    batch = sweep.study_points("batch", 64, [1], [])
    assert [p["overrides"]["data.batch_size"] for p in batch] == [16, 32, 64, 128]
    accum = sweep.study_points("accum", 12, [2], [])
    assert [p["overrides"]["train.accum_steps"] for p in accum] == [1, 2, 4, 8][:3] and all(
        p["nproc"] == 2 for p in accum
    )
    mem = sweep.study_points("memory", 16, [1], [])
    assert [p["nproc"] for p in mem] == [2] * 6
    assert [p["overrides"].get("strategy.zero_stage") for p in mem] == [None, 0, 1, 2, 3, None]
    assert [p["overrides"]["strategy.name"] for p in mem] == ["ddp"] + ["deepspeed"] * 4 + ["fsdp"]


def test_bench_argv():
    one = sweep.bench_argv(
        TINY, {"nproc": 1, "overrides": {"data.batch_size": 8}}, ["run.threads=1"], ["--steps", "2"]
    )
    assert (
        one[:4] == [sys.executable, "-m", "vitscale", "bench"]
        and "--json" in one
        and one[-2:] == ["--steps", "2"]
    )
    assert sets_of(one) == {"run.threads": "1", "data.batch_size": "8"}
    two = sweep.bench_argv(TINY, {"nproc": 2, "overrides": {}}, [], [])
    assert two[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
    assert sets_of(two) == {"strategy.name": "ddp"}
    fsdp = sweep.bench_argv(TINY, {"nproc": 2, "overrides": {"strategy.name": "fsdp"}}, [], [])
    assert sets_of(fsdp) == {"strategy.name": "fsdp"}
    base = sweep.bench_argv(TINY, {"nproc": 2, "overrides": {}}, ["strategy.name=fsdp"], [])
    assert sets_of(base) == {"strategy.name": "fsdp"}


def test_sweep_failure_resume_and_report(tmp_path):
    pts = sweep.study_points("weak", 16, [1, 2], [("data.batch_size", ["16", "24"])])
    assert [p["overrides"]["data.batch_size"] for p in pts] == [16, 24, 32, 48]
    logs = []
    recs = sweep.run_sweep(TINY, pts, tmp_path, runner=fake_bench, study="weak", log=logs.append)
    assert [r["ok"] for r in recs] == [True, True, True, False]  # the failure did not stop it
    assert recs[3]["error"] == "vitscale: error: out of memory (fake)" and "FAILED" in logs[3]
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert (
        len(lines) == 4
        and lines[2]["overrides"] == {"data.batch_size": 32}
        and lines[2]["bench"]["world_size"] == 2
    )
    md = (tmp_path / "results.md").read_text()
    assert "failed: vitscale: error: out of memory (fake)" in md and md.count("\n| n=") == 4
    # weak efficiency: img/s(2 procs, 32) / (2 x img/s(1 proc, 16)) = 0.16 / (2 * 0.162) ... via the fake's formula
    eff = (32 / 0.162) / 2 / (16 / 0.16)
    assert f"{100 * eff:.0f}%" in md
    for png in ("split.png", "scaling.png"):
        assert (tmp_path / png).stat().st_size > 1000
    calls = []
    again = sweep.run_sweep(
        TINY,
        pts,
        tmp_path,
        runner=lambda a, t: calls.append(a) or fake_bench(a, t),
        study="weak",
        log=logs.append,
    )
    assert calls == [] and len(again) == 4  # resumed: nothing re-run
    sweep.run_sweep(
        TINY,
        pts,
        tmp_path,
        runner=lambda a, t: calls.append(a) or fake_bench(a, t),
        study="weak",
        retry_failed=True,
        log=logs.append,
    )
    assert len(calls) == 1 and len((tmp_path / "results.jsonl").read_text().splitlines()) == 5


def test_accum_and_memory_reports(tmp_path):
    recs = sweep.run_sweep(
        TINY,
        sweep.study_points("accum", 16, [2], []),
        tmp_path / "a",
        runner=fake_bench,
        study="accum",
        log=lambda s: None,
    )
    md = (tmp_path / "a" / "results.md").read_text()
    # bench's 4000 bytes all-reduced per step / 16 images = 250 bytes per sample; x accum without accumulation
    assert "| 250 | 2000 |" in md and len(recs) == 4
    sweep.run_sweep(
        TINY,
        sweep.study_points("memory", 16, [2], []),
        tmp_path / "m",
        runner=fake_bench,
        study="memory",
        log=lambda s: None,
    )
    assert (tmp_path / "m" / "memory.png").stat().st_size > 1000
    md = (tmp_path / "m" / "results.md").read_text()
    assert (
        "state MiB/process" in md and "| 10.0 |" in md and "| 12.0 |" in md
    )  # ZeRO-3, ZeRO-2 (fake)
    sweep.run_sweep(
        TINY,
        sweep.study_points("batch", 16, [1], []),
        tmp_path / "b",
        runner=fake_bench,
        study="batch",
        log=lambda s: None,
    )
    assert (tmp_path / "b" / "batch.png").stat().st_size > 1000


def test_subprocess_runner_parses_json_and_errors():
    ok, err = sweep.subprocess_runner(
        [sys.executable, "-c", "print('log line'); print('{\\n  \"images_per_s\": 3\\n}')"], 60
    )
    assert ok == {"images_per_s": 3} and err is None
    bad, err = sweep.subprocess_runner(
        [sys.executable, "-c", "import sys; sys.exit('vitscale: error: bad key x')"], 60
    )
    assert bad is None and err == "vitscale: error: bad key x"


def test_one_line_error_from_torchrun_stderr():
    stderr = (
        "vitscale: error: [rank 0] config: model.dim (32) must be divisible by model.heads (3)\n"
        "vitscale: error: [rank 1] config: model.dim (32) must be divisible by model.heads (3)\n"
        "Traceback (most recent call last):\n  File x\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \nvitscale FAILED\n"
    )
    assert sweep.one_line_error(stderr, 1).startswith(
        "vitscale: error: [rank 0] config: model.dim (32)"
    )
    assert (
        sweep.one_line_error("Traceback\n  File y\nRuntimeError: boom\nmore\n", 1)
        == "RuntimeError: boom"
    )
    assert sweep.one_line_error("", 3) == "exit code 3"


def test_sweep_cli_needs_points():
    assert main(["sweep", TINY]) == 2
    assert main(["sweep", TINY, "--grid", "novalues"]) == 2


def test_real_one_point_sweep(tmp_path, capsys):
    assert (
        main(
            [
                "sweep",
                TINY,
                "--set",
                "run.threads=1",
                "--grid",
                "data.batch_size=16",
                "--steps",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    rec = json.loads((tmp_path / "results.jsonl").read_text())
    assert rec["ok"], rec["error"]
    assert rec["bench"]["batch_size"] == 16 and rec["bench"]["images_per_s"] > 0
    assert (tmp_path / "results.md").exists() and (tmp_path / "split.png").exists()


def test_mfu_uses_the_best_peak_of_the_sweep():
    from vitscale.lab.report import common_mfu

    pt = lambda mfu, peak, src="measured bf16 matmul on CPU (1 threads)": {  # noqa: E731
        "ok": True,
        "bench": {"mfu": mfu, "peak_flops": peak, "peak_source": src},
    }
    recs = [
        pt(0.30, 400e9),
        pt(0.50, 200e9),
        pt(0.20, 1e15, "table: H100 dense bf16"),
        {"ok": False, "bench": None},
    ]
    # the point whose peak was measured at half the machine's best: 50% of 200 = 25% of 400
    assert common_mfu(recs) == [pytest.approx(0.30), pytest.approx(0.25), pytest.approx(0.20), None]


def test_the_mesh_study_lists_every_mesh_of_the_processes_with_its_short_form():
    from vitscale.config import load_config
    from vitscale.strategy.mesh import mesh_shape

    points = sweep.study_points("mesh", 16, [4], [])
    shapes = [
        (o["strategy.dp_replicate"], o["strategy.dp_shard"], o["strategy.tp"])
        for o in (p["overrides"] for p in points)
    ]
    # every factorization of 4 into replicate x shard x tp, once
    assert sorted(shapes) == sorted(
        [(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)]
    )
    assert all(p["nproc"] == 4 for p in points)
    for p in points:  # each point's keys are a mesh the config accepts, of that shape
        o = p["overrides"]
        cfg = load_config("configs/tests/tiny.toml", [f"{k}={v}" for k, v in o.items()])
        got = mesh_shape(cfg.strategy, 4).sizes
        assert got == (o["strategy.dp_replicate"], o["strategy.dp_shard"], o["strategy.tp"])
    assert sweep.mesh_points(1) == [{"strategy.name": "single"}]
