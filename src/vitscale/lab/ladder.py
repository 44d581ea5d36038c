"""`vitscale ladder`: the rungs (cumulative speed-ups from an fp32 baseline), each timed beside the
baseline (rounds.measure_against_first), its row written as soon as it is known; numerics-changing
rungs trained and tested. What it measures and its arguments: commands.py."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from ..launch import is_main_process, this_process
from ..loop import Trainer
from ..optim import build_optimizer
from ..strategy import IN_PROCESS, needs_processes
from ..strategy.dist import env_world
from .commands import LADDER_RUNGS
from .machine import hardware_info, versions
from .recipes import check_counts, lab_config, log, with_overrides
from .rounds import measure_against_first

BASELINE = {
    "train.precision": "fp32",
    "train.tf32": False,
    "model.head": "token",
    "optim.impl": "forloop",
    "model.attention": "explicit",
    "train.compile": False,
    "train.compile_mode": "default",
    # the capture is a rung of its own (train.capture=auto takes it on a GPU)
    "train.capture": "none",
}


@dataclass
class Rung:
    key: str  # short name for --skip
    name: str
    delta: dict  # what this rung adds
    numerics: bool  # changes what is computed (then it is trained and tested)
    overrides: dict = field(default_factory=dict)  # cumulative: baseline + every delta so far
    skip: str | None = None  # why it was not measured
    note: str = ""


# rungs that change nothing on a CPU, or cannot run there
CUDA_ONLY = ("tf32", "sdpa_backend", "autotune", "cudagraphs", "capture")


def build_rungs(cfg, world_size: int, skip: tuple = ()) -> list[Rung]:
    """The cumulative rungs for this config and process count; a rung whose config does not
    validate (e.g. fused optimizer for LAMB) or named in `skip` is skipped with the reason and
    adds nothing."""
    device_type = "cuda" if torch.cuda.is_available() and cfg.run.device != "cpu" else "cpu"
    rungs = _all_rungs(cfg, world_size, device_type)
    _accumulate(rungs, cfg, world_size, device_type, skip)
    return rungs


def _all_rungs(cfg, world_size: int, device_type: str) -> list[Rung]:
    """Every rung in ladder order, each with its own delta (not yet accumulated or checked)."""
    per_device = cfg.data.batch_size // world_size
    half = "bf16"  # bf16 autocast: the fast path on CPUs with AVX-512 bf16 and on Ampere+ GPUs
    fp32 = "fp32 IEEE, TF32 off" if device_type == "cuda" else "fp32"
    return [
        Rung(
            "baseline",
            f"baseline ({fp32}, class token, for-loop AdamW, explicit attention)",
            dict(BASELINE),
            True,
        ),
        Rung("tf32", "+ TF32 matmuls and convolutions", {"train.tf32": True}, True),
        Rung("precision", f"+ mixed precision ({half})", {"train.precision": half}, True),
        Rung("foreach", "+ multi-tensor optimizer (foreach)", {"optim.impl": "foreach"}, False),
        Rung("fused", "+ fused optimizer", {"optim.impl": "fused"}, False),
        Rung("pool", "+ pooled head", {"model.head": "pool"}, True),
        Rung("sdpa", "+ fused attention (sdpa)", {"model.attention": "sdpa"}, True),
        Rung(
            "sdpa_backend",
            "+ cuDNN attention (train.sdpa_backend=cudnn)",
            {"train.sdpa_backend": "cudnn"},
            True,
        ),
        Rung("compile", "+ compile", {"train.compile": True}, False),
        Rung(
            "autotune",
            "+ autotuned kernels (compile mode max-autotune-no-cudagraphs: bias + GELU in the "
            "matmul's epilogue)",
            {"train.compile_mode": "max-autotune-no-cudagraphs"},
            False,
        ),
        Rung(
            "cudagraphs",
            "+ CUDA graphs (compile mode reduce-overhead, or max-autotune after autotune)",
            {"train.compile_mode": "reduce-overhead"},
            False,
        ),
        Rung(
            "capture",
            "+ the whole step captured (train.capture=step; compile inside it without graphs of its own)",
            {"train.capture": "step", "train.compile_mode": "default"},
            False,
        ),
        Rung(
            "batch",
            f"+ larger batch ({per_device} -> {2 * per_device} per device)",
            {"data.batch_size": 2 * cfg.data.batch_size},
            True,
        ),
        Rung("sharding", "+ sharding (fsdp)", {"strategy.name": "fsdp"}, False),
    ]


def _accumulate(rungs: list[Rung], cfg, world_size: int, device_type: str, skip: tuple) -> None:
    """Each rung's skip reason (--skip, a CUDA feature on the CPU, one process for sharding, a
    config that does not validate) or, when taken, its cumulative overrides."""
    acc: dict = {}
    autotuned = False
    for r in rungs:
        # the graph rungs keep the autotune rung's kernels where it was taken
        if r.key == "cudagraphs" and autotuned:
            r.delta = {"train.compile_mode": "max-autotune"}
        if r.key == "capture" and autotuned:
            r.delta = {"train.capture": "step", "train.compile_mode": "max-autotune-no-cudagraphs"}
        if r.key in skip:
            r.skip = "left out (--skip)"
        elif r.key in CUDA_ONLY and device_type != "cuda":
            r.skip = "a CUDA feature (this ladder runs on the CPU)"
        elif needs_processes(r.delta.get("strategy.name", IN_PROCESS)) and world_size < 2:
            r.skip = (
                "sharding needs more than one process (launch with torchrun --nproc-per-node N)"
            )
        else:
            try:
                c = with_overrides(cfg, {**acc, **r.delta})
                if "optim.impl" in r.delta:  # e.g. LAMB has no foreach/fused implementation
                    build_optimizer(torch.nn.Linear(1, 1), c.optim)
            except UserError as e:
                r.skip = str(e)
        if r.skip is None:
            acc = {**acc, **r.delta}
            autotuned = autotuned or r.key == "autotune"
        r.overrides = dict(acc)


def accuracy(cfg, steps: int) -> dict:
    """Train `steps` steps from the config's seed (a temp run folder) and test."""
    cfg = with_overrides(
        cfg, {"run.max_steps": steps, "run.eval_every": 0, "run.checkpoint_every": steps + 1}
    )
    with tempfile.TemporaryDirectory(prefix="vitscale-ladder-") as tmp:
        t = Trainer(cfg, Path(tmp) / "run", signals=False)  # Ctrl-C ends the ladder
        try:
            s = t.fit()
        finally:
            t.close()
    return {k: s[k] for k in (t.task.metric, "steps", "images_seen") if k in s}


def vs_previous_paired(rounds: list | None, prev_rounds: list | None) -> float | None:
    """A rung against the measured rung before it, round by round: the median over rounds of the
    ratio of their per-round speedups over the baseline (1.0 for the first measured rung)."""
    if prev_rounds is None:
        return 1.0
    if not rounds:
        return None
    return statistics.median(a / b for a, b in zip(rounds, prev_rounds))


def skipped_row(r: Rung, why: str | None = None) -> dict:
    return {"rung": r.name, "overrides": r.delta, "skipped": why or r.skip, "note": r.note}


def measured_row(r: Rung, m: dict, prev: float | None, prev_rounds: list | None) -> dict:
    """A measured rung's row (`m`: its result from rounds.measure_against_first); `prev`,
    `prev_rounds`: the last measured rung's speedup over the baseline and its per-round ratios
    (None for the first measured rung)."""
    row = skipped_row(r)
    if "error" in m:
        row["skipped"] = m["error"]
        return row
    ips = m["images_per_s"]
    # vs the baseline's median round in this rung's own rounds (the rung was timed beside it),
    # as when all rungs ran in the same rounds; the baseline's own row: 1.0
    base = m["reference_images_per_s"] if "reference_images_per_s" in m else ips
    vs_base = ips / base if base else None
    first = prev is None
    row.update(
        images_per_s=ips,
        step_time_s=m["step_time_s"],
        baseline_images_per_s=base,
        speedup_vs_baseline=vs_base,
        # each rung against the baseline of its own rounds, so the two ratios share no drift
        speedup_vs_previous=1.0 if first else (vs_base / prev if vs_base and prev else None),
        # the median over rounds of the per-round ratio to the baseline, timed in the
        # same rounds (drift between rounds cancels)
        speedup_vs_baseline_paired=m.get("paired_vs_first"),
        speedup_vs_previous_paired=1.0
        if first
        else vs_previous_paired(m.get("paired_rounds"), prev_rounds)
        if prev_rounds
        else None,
    )
    return row


class LadderRows:
    """The ladder's rows as the rungs are measured: `out["rungs"]` holds them in rung order up to
    the first rung not yet known, and `on_update(out)` sees each new state."""

    def __init__(self, cfg, rungs: list[Rung], out: dict, train_steps: int, on_update=None):
        self.cfg, self.rungs, self.out, self.train_steps, self.on_update = (
            cfg,
            rungs,
            out,
            train_steps,
            on_update,
        )
        self.live = [r for r in rungs if r.skip is None]
        self.index = {id(r): i for i, r in enumerate(rungs)}
        self.rows: dict = {}  # rung index -> row, filled as rungs are measured
        # the last measured rung's speedups over the baseline
        self.prev, self.prev_rounds = None, None
        self.skipped_after(-1)  # the skipped ones before the first measured rung

    def update(self) -> None:
        self.out["rungs"] = []
        for i in range(len(self.rungs)):
            if i not in self.rows:
                break
            self.out["rungs"].append(self.rows[i])
        if self.on_update is not None:
            self.on_update(self.out)

    def skipped_after(self, i: int) -> None:
        """The skipped rungs after rung i up to the next measured one."""
        for later in self.rungs[i + 1 :]:
            if later.skip is None:
                break
            self.rows[self.index[id(later)]] = skipped_row(later)

    def measured(self, k: int, m: dict) -> None:
        """rounds.measure_against_first's `on_result`: live rung k's result `m`."""
        r = self.live[k]
        i = self.index[id(r)]
        self.rows[i] = row = measured_row(r, m, self.prev, self.prev_rounds)
        if "error" not in m:
            self.prev, self.prev_rounds = row["speedup_vs_baseline"] or 0.0, m.get("paired_rounds")
        self.skipped_after(i)
        self.update()
        if self.train_steps and r.numerics and "error" not in m:
            log(f"training {r.name} for {self.train_steps} steps")
            row["accuracy"] = accuracy(with_overrides(self.cfg, r.overrides), self.train_steps)
            self.update()

    def finish(self) -> dict:
        for i, r in enumerate(self.rungs):  # where nothing was measured at all
            self.rows.setdefault(i, skipped_row(r, r.skip or "not measured"))
        self.out["complete"] = True
        self.update()
        return self.out


def ladder(
    cfg,
    steps: int,
    rounds: int,
    warmup: int,
    train_steps: int,
    synthetic: bool = False,
    skip: tuple = (),
    on_update=None,
) -> dict:
    """Measure the rungs (`rounds.measure_against_first`: the baseline resident, one rung at a
    time beside it) and return the result; `on_update(result so far)` is called after every row
    (a rung measured, skipped or failed, or its accuracy added), rows in rung order, the result
    marked "complete": false until the last one."""
    world = env_world()[1]
    rungs = build_rungs(cfg, world, skip)
    _log_rungs(rungs)
    # the baseline (fp32 IEEE: the slowest rung) runs a third of the steps per round as the drift
    # reference beside the rungs after the first (rounds.measure_against_first)
    reference_steps = max(1, steps // 3)
    out = _result_header(
        cfg,
        steps=steps,
        rounds=rounds,
        warmup=warmup,
        reference_steps=reference_steps,
        train_steps=train_steps,
        synthetic=synthetic,
        world=world,
    )
    rows = LadderRows(cfg, rungs, out, train_steps, on_update)
    t0 = time.perf_counter()
    rows.update()
    measure_against_first(
        [with_overrides(cfg, r.overrides) for r in rows.live],
        steps,
        rounds,
        warmup,
        synthetic,
        names=[r.name for r in rows.live],
        on_result=rows.measured,
        reference_steps=reference_steps,
    )
    log(
        f"timed {len(rows.live)} rungs, each beside the baseline: {rounds} rounds x {steps} steps in "
        f"{time.perf_counter() - t0:.0f}s"
    )
    return rows.finish()


def _log_rungs(rungs: list[Rung]) -> None:
    """One line per rung: its cumulative overrides, or why it is skipped."""
    for r in rungs:
        log(
            f"rung {r.name}: "
            + (
                f"skipped ({r.skip})"
                if r.skip
                else " ".join(f"{k}={v}" for k, v in r.overrides.items())
            )
        )


def _result_header(
    cfg, *, steps, rounds, warmup, reference_steps, train_steps, synthetic, world
) -> dict:
    """The result before any row: the measurement's settings, hardware, versions and config,
    marked incomplete."""
    device = torch.device(
        "cuda" if torch.cuda.is_available() and cfg.run.device != "cpu" else "cpu"
    )
    return {
        "rungs": [],
        "steps": steps,
        "rounds": rounds,
        "warmup": warmup,
        "reference_steps": reference_steps,
        "train_steps": train_steps,
        "synthetic": synthetic,
        "world_size": world,
        "batch_size": cfg.data.batch_size,
        # the threads the rungs run with (their Trainers set run.threads; the process's are restored after)
        "hardware": {
            **hardware_info(device),
            "threads": cfg.run.threads or torch.get_num_threads(),
        },
        "versions": versions(),
        "config": cfg.to_dict(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "complete": False,
    }


def slower_than_previous(row: dict) -> bool:
    """By the round-by-round ratio where there is one (older results: the ratio of median rounds)."""
    v = row.get("speedup_vs_previous_paired") or row["speedup_vs_previous"]
    return v is not None and v < 0.98


def ratio(v: float | None) -> str:
    return f"{v:.2f}x" if v else ""


def table(r: dict) -> str:
    metric = None
    lines = [
        "| rung | img/s | step (median, ms) | vs baseline | vs baseline, round by round | vs previous "
        "| vs previous, round by round | test accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["rungs"]:
        if row.get("skipped"):
            lines.append(f"| {row['rung']} | skipped: {row['skipped']} | | | | | | |")
            continue
        paired, paired_prev = (
            row.get("speedup_vs_baseline_paired"),
            row.get("speedup_vs_previous_paired"),
        )
        acc = row.get("accuracy")
        if acc:
            metric = next(k for k in acc if k not in ("steps", "images_seen"))
        acc_s = (
            f"{100 * acc[metric]:.2f}%" if acc else "(same numerics)" if r["train_steps"] else ""
        )
        slower = " (slower)" if slower_than_previous(row) else ""
        lines.append(
            f"| {row['rung']}{' — ' + row['note'] if row['note'] else ''} | {row['images_per_s']:.1f} | "
            f"{1e3 * row['step_time_s']['median']:.1f} | {ratio(row['speedup_vs_baseline'])} | "
            f"{ratio(paired)} | {ratio(row['speedup_vs_previous'])}{slower} | "
            f"{ratio(paired_prev)} | {acc_s} |"
        )
    if not r.get("complete", True):
        lines.append("\n(incomplete: the rungs below the last row were not measured yet)")
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib  # here: optional, and the plot alone needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [x for x in r["rungs"] if not x.get("skipped")]
    names = [
        x["rung"].split(" (")[0] if x["rung"].startswith("baseline") else x["rung"] for x in rows
    ]
    sp = [x["speedup_vs_baseline"] or 0.0 for x in rows]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    colors = [
        "tab:red" if i and slower_than_previous(x) else "tab:blue" for i, x in enumerate(rows)
    ]
    ax.barh(range(len(rows)), sp, color=colors)
    for i, v in enumerate(sp):
        ax.text(v, i, f" {v:.2f}x ({rows[i]['images_per_s']:.0f} img/s)", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xlim(0, max(sp) * 1.35)
    ax.set_xlabel("images/s relative to the baseline (red: slower than the rung above)")
    h = r["hardware"]
    ax.set_title(
        f"ablation ladder, {h['name']} x {r['world_size']} ({h['device']}), batch {r['batch_size']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(r: dict, command: str) -> str:
    h = r["hardware"]
    return (
        f"# Ablation ladder\n\n`{command}`\n\n{r['date']}; {h['name']} ({h['cores']} cores, {h['threads']} "
        f"torch threads), {h['device']}, {r['world_size']} process(es), torch {r['versions']['torch']}; "
        f"global batch {r['batch_size']}; each rung built, timed beside the baseline and freed, one at a "
        f"time: {r['rounds']} interleaved rounds x {r['steps']} steps per rung after {r['warmup']} warm-up "
        f"steps (the baseline: in full beside the first rung, then {r.get('reference_steps', r['steps'])} "
        f'step(s) per round as the reference); images/s from the median round; "vs baseline": against '
        f"the baseline's median round in the rung's own rounds; the round-by-round columns: per-round "
        f"ratios to the baseline, per image"
        f"{'; one fixed batch' if r['synthetic'] else ''}."
        + (
            f" Test accuracy after {r['train_steps']} training steps from the same seed (rungs that change "
            "numerics; the lr schedule of a run that long: the recipe's warm-up, then its decay over the "
            "remaining steps)."
            if r["train_steps"]
            else ""
        )
        + f"\n\n{table(r)}\n\n![ladder](ladder.png)\n"
    )


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` in one rename: a run stopped mid-write leaves the previous version."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_rows(out: Path, r: dict, command: str) -> None:
    """ladder.json and ladder.md with the rows measured so far (called after every row)."""
    write_atomic(out / "ladder.json", json.dumps(r, indent=2, default=str) + "\n")
    write_atomic(out / "ladder.md", markdown(r, command))


def run(args) -> int:
    check_counts(
        steps=(args.steps, 1),
        trials=(args.trials, 1),
        warmup=(args.warmup, 0),
        train_steps=(args.train_steps, 0),
    )
    skip = tuple(k.strip() for k in args.skip.split(",") if k.strip())
    bad = [k for k in skip if k not in LADDER_RUNGS]
    if bad:
        raise UserError(f"--skip: unknown rung {', '.join(bad)} (rungs: {', '.join(LADDER_RUNGS)})")
    cfg = lab_config(args.config, args.overrides)
    main = is_main_process()
    out = Path(args.out)
    command = " ".join(
        [
            "vitscale ladder",
            *([args.config] if args.config else []),
            *(f"--set {shlex.quote(o)}" for o in args.overrides),
            f"--steps {args.steps} --trials {args.trials} --warmup {args.warmup} "
            f"--train-steps {args.train_steps}",
            *(["--synthetic"] if args.synthetic else []),
            *([f"--skip {args.skip}"] if args.skip else []),
            f"--out {shlex.quote(args.out)}",
        ]
    )
    if this_process().world_size != 1:
        command = f"torchrun --nproc-per-node {this_process().world_size} -m {command}"
    if main:
        out.mkdir(parents=True, exist_ok=True)
    r = ladder(
        cfg,
        args.steps,
        args.trials,
        args.warmup,
        args.train_steps,
        args.synthetic,
        skip,
        on_update=(lambda partial: write_rows(out, partial, command)) if main else None,
    )
    if not main:
        return 0
    plot(r, out / "ladder.png")
    print(
        json.dumps(r, indent=2, default=str)
        if args.json
        else f"{table(r)}\nwrote {out}/ladder.md, ladder.png, ladder.json"
    )
    return 0
