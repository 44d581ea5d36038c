"""`vitscale sweep`: `vitscale bench` run over a grid of overrides and process counts, one subprocess
per point (resumable: OUT/results.jsonl), and the report (report.py). The studies and the
command's arguments: commands.py."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..config import load_config
from ..errors import UserError
from ..strategy import default_for
from ..strategy.dist import free_port
from ..tasks import check_config
from .report import write_report

MEMORY_POINTS = (
    [{"strategy.name": "ddp"}]
    + [{"strategy.name": "deepspeed", "strategy.zero_stage": z} for z in range(4)]
    + [{"strategy.name": "fsdp"}]
)


def parse_grid(text: str) -> tuple[str, list[str]]:
    key, sep, values = text.partition("=")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not vals:
        raise UserError(f"--grid {text!r}: expected KEY=V1,V2,...")
    return key.strip(), vals


def _num(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return v


def expand(grids: list[tuple[str, list]], nprocs: list[int]) -> list[dict]:
    """Cartesian product of grids and process counts -> [{'nproc': K, 'overrides': {key: value}}]."""
    keys = [k for k, _ in grids if k != "nproc"]
    grid_n = [vals for k, vals in grids if k == "nproc"]
    ns = [int(v) for v in grid_n[0]] if grid_n else nprocs
    points = []
    for n in ns:
        for combo in itertools.product(*[vals for k, vals in grids if k != "nproc"]):
            points.append({"nproc": int(n), "overrides": dict(zip(keys, combo))})
    return points


def study_points(study: str, batch: int, nprocs: list[int], grids: list) -> list[dict]:
    """The points of a built-in study for a config whose data.batch_size is `batch`."""
    if study == "strong":
        return expand(grids, nprocs if len(nprocs) > 1 else [1, 2])
    if study == "weak":
        points = expand(grids, nprocs if len(nprocs) > 1 else [1, 2])
        for p in points:
            per_device = int(p["overrides"].get("data.batch_size", batch))
            p["overrides"]["data.batch_size"] = per_device * p["nproc"]
            p["per_device_batch"] = per_device
        return points
    if study == "batch":
        if not any(k == "data.batch_size" for k, _ in grids):
            grids = grids + [
                (
                    "data.batch_size",
                    sorted({max(1, batch // 4), max(1, batch // 2), batch, 2 * batch}),
                )
            ]
        return expand(grids, nprocs)
    if study == "accum":
        if not any(k == "train.accum_steps" for k, _ in grids):
            grids = grids + [("train.accum_steps", [a for a in (1, 2, 4, 8) if batch % a == 0])]
        return expand(grids, nprocs)
    if study == "memory":
        points = []
        for base in expand(grids, nprocs if nprocs != [1] else [2]):
            points += [
                {"nproc": base["nproc"], "overrides": {**base["overrides"], **m}}
                for m in MEMORY_POINTS
            ]
        return points
    if study == "mesh":
        points = []
        for base in expand(grids, nprocs if nprocs != [1] else [4]):
            points += [
                {"nproc": base["nproc"], "overrides": {**base["overrides"], **m}}
                for m in mesh_points(base["nproc"])
            ]
        return points
    raise UserError(f"unknown study {study!r}")


def mesh_points(n: int) -> list[dict]:
    """Every device mesh of `n` processes (strategy/mesh.py): each dp_replicate x dp_shard x tp
    whose product is n, with the strategy.name that is its short form (a point whose tp the model
    refuses is recorded with the refusal's line, as any failing point)."""
    if n == 1:
        return [{"strategy.name": "single"}]
    points = []
    for tp in (d for d in range(1, n + 1) if n % d == 0):
        for shard in (d for d in range(1, n // tp + 1) if (n // tp) % d == 0):
            replicate = n // tp // shard
            name = "hsdp" if replicate > 1 and shard > 1 else "ddp" if replicate > 1 else "fsdp"
            points.append(
                {
                    "strategy.name": name,
                    "strategy.dp_replicate": replicate,
                    "strategy.dp_shard": shard,
                    "strategy.tp": tp,
                }
            )
    return points


def point_key(point: dict) -> str:
    return json.dumps(
        {"nproc": point["nproc"], "overrides": {k: str(v) for k, v in point["overrides"].items()}},
        sort_keys=True,
    )


def bench_argv(
    config: str | None, point: dict, base_sets: list[str], bench_flags: list[str]
) -> list[str]:
    """The command line that benchmarks one point."""
    over = dict(point["overrides"])
    base_keys = {b.partition("=")[0].strip() for b in base_sets}
    if point["nproc"] > 1 and "strategy.name" not in over and "strategy.name" not in base_keys:
        over["strategy.name"] = default_for(point["nproc"])
    sets = [a for s in [*base_sets, *(f"{k}={v}" for k, v in over.items())] for a in ("--set", s)]
    tail = ["bench", *([config] if config else []), *sets, "--json", *bench_flags]
    if point["nproc"] <= 1:
        return [sys.executable, "-m", "vitscale", *tail]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(point["nproc"]),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "vitscale",
        *tail,
    ]


def one_line_error(stderr: str, rc: int) -> str:
    """vitscale's own one-line error (rank 0's first), else the last Python exception line, else the
    last line that says 'error', else the last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("vitscale: error:"):
            return ln[:400]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if (
            ":" in ln
            and head.replace(".", "").isidentifier()
            and head.endswith(("Error", "Exception"))
            and ln.split(":", 1)[1].strip()
        ):
            return ln[:400]
    for ln in reversed(lines):
        if "error" in ln.lower():
            return ln[:400]
    return lines[-1][:400] if lines else f"exit code {rc}"


def subprocess_runner(argv: list[str], timeout: float) -> tuple[dict | None, str | None]:
    """Run one bench command; (bench JSON, None) or (None, one-line error)."""
    env = dict(os.environ)
    if argv[2:3] == ["torch.distributed.run"]:
        env.setdefault("OMP_NUM_THREADS", "1")
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f}s"
    bench = parse_bench_stdout(p.stdout) if p.returncode == 0 else None
    if bench is not None:
        return bench, None
    return None, one_line_error(p.stderr, p.returncode)


def parse_bench_stdout(text: str) -> dict | None:
    """The last JSON object in stdout (bench prints it indented, possibly after log lines)."""
    decoder, lines, pos, starts = json.JSONDecoder(), text.splitlines(keepends=True), 0, []
    for ln in lines:
        if ln.startswith("{"):
            starts.append(pos)
        pos += len(ln)
    for start in reversed(starts):
        try:
            obj, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def load_done(path: Path) -> dict:
    done = {}
    if path.exists():
        for ln in path.read_text().splitlines():
            try:
                rec = json.loads(ln)
                done[point_key(rec)] = rec
            except (json.JSONDecodeError, KeyError):
                continue
    return done


def run_sweep(
    config: str | None,
    points: list[dict],
    out: Path,
    *,
    base_sets=(),
    bench_flags=(),
    study=None,
    runner=subprocess_runner,
    timeout: float = 900.0,
    retry_failed: bool = False,
    log=print,
) -> list[dict]:
    """Bench each point not already in out/results.jsonl; write results.md and plots; return all records."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    done = load_done(path)
    for i, point in enumerate(points, 1):
        key = point_key(point)
        desc = f"nproc={point['nproc']} " + " ".join(
            f"{k}={v}" for k, v in point["overrides"].items()
        )
        if key in done and (done[key].get("ok") or not retry_failed):
            log(f"[{i}/{len(points)}] {desc}: already done, skipped")
            continue
        t0 = time.perf_counter()
        bench, error = runner(
            bench_argv(config, point, list(base_sets), list(bench_flags)), timeout
        )
        rec = {
            "nproc": point["nproc"],
            "overrides": point["overrides"],
            "study": study,
            "ok": bench is not None,
            "error": error,
            "wall_s": round(time.perf_counter() - t0, 2),
            "bench": bench,
        }
        if "per_device_batch" in point:
            rec["per_device_batch"] = point["per_device_batch"]
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        done[key] = rec
        what = (
            f"{bench['images_per_s']:.1f} img/s, step {1e3 * bench['step_time_s']['median']:.1f} ms"
            if bench
            else f"FAILED: {error}"
        )
        log(f"[{i}/{len(points)}] {desc}: {what} ({rec['wall_s']:.0f}s)")
    records = [done[point_key(p)] for p in points if point_key(p) in done]
    write_report(records, out, study)
    return records


def run(args) -> int:
    # validates the base config once, up front
    cfg = check_config(load_config(args.config, args.overrides))
    grids = [parse_grid(g) for g in args.grid]
    try:
        nprocs = [int(n) for n in (args.nproc or "1").split(",") if n.strip()]
    except ValueError:
        raise UserError(f"--nproc: expected integers, got {args.nproc!r}") from None
    if args.study:
        points = study_points(args.study, cfg.data.batch_size, nprocs, grids)
    elif grids or args.nproc:
        points = expand(grids, nprocs)
    else:
        raise UserError("sweep: give --grid KEY=V1,V2, --nproc LIST or --study NAME")
    flags = [
        *(["--steps", str(args.steps)] if args.steps else []),
        *(["--warmup", str(args.warmup)] if args.warmup is not None else []),
        *(["--trials", str(args.trials)] if args.trials else []),
        *(["--synthetic"] if args.synthetic else []),
    ]
    out = Path(args.out or f"runs/sweep-{args.study or 'grid'}")
    print(f"sweep: {len(points)} points -> {out}", flush=True)
    records = run_sweep(
        args.config,
        points,
        out,
        base_sets=args.overrides,
        bench_flags=flags,
        study=args.study,
        timeout=args.timeout,
        log=lambda s: print(s, flush=True),
    )
    failed = sum(not r["ok"] for r in records)
    print(
        f"sweep: {len(records) - failed} ok, {failed} failed; wrote {out}/results.jsonl, results.md and plots"
    )
    return 0 if failed < len(records) else 1
