"""`vitscale bench`: the recipe's training step timed (its Bench, timing.py), the split, MFU, memory
and communication, and beside it a peer's loop (--peer, peer.py) or the recipe with other settings
(--beside; several, one override each: --each, each.py) in paired rounds (rounds.py). What it reports and its arguments: commands.py."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from ..config import parse_override
from ..errors import UserError
from ..metrics import mfu, peak_flops
from ..precision import tf32_active
from ..run_report import state_bytes
from ..strategy.comm import KINDS
from .each import describe_each, each_rounds
from .machine import hardware_info, max_rss_bytes, versions
from .peer import describe_peer, import_timm, peer_rounds
from .recipes import check_counts, lab_config, with_overrides
from .rounds import gather_max, paired_rounds, rate, rounds_won, side_by_side
from .timing import Bench, kernel_seconds

SPLIT_NOTE = (
    "step_time_s/images_per_s: un-instrumented steps (data fetch included); "
    "split: a separate instrumented pass on one batch with syncs between phases "
    "(max across ranks), data from the timed steps"
)


def measure(
    cfg,
    steps: int,
    warmup: int,
    trials: int,
    synthetic: bool,
    split_steps: int = 0,
    peer: str | None = None,
    rounds: int = 5,
    beside: list | None = None,
    each: list | None = None,
) -> dict:
    """`vitscale bench`'s report (commands.py says what it holds): the timed steps, the split,
    memory, MFU, communication, and the --peer / --beside rounds where asked."""
    rss0 = max_rss_bytes()
    cuda = torch.cuda.is_available() and cfg.run.device != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    b = Bench(cfg, synthetic)
    s = b.s
    try:
        r, comm = timed_steps(b, steps, warmup, trials)
        split = b.split(split_steps or min(steps, 5))
        mem, mem_src = _peak_memory(s, cuda, rss0)
        state = s.gather_objects(state_bytes(s, b.trainer.task))  # what each rank holds, by kind
        split_all = s.gather_objects({k: v for k, v in split.items() if k != "notes"})
        # every rank at once: shared cores
        peak, peak_src = peak_flops(s.device, cfg.train.precision, cfg.train.tf32)
        peak = s.broadcast_object(peak)
        ips = r["images_per_s"]
        world = s.world_size
        out = {
            "images_per_s": ips,
            "images_per_s_per_device": ips / world,
            "mfu": mfu(b.trainer.flops_per_image, ips, peak, world),
            "peak_flops": peak,
            "peak_source": peak_src,
            "tf32": tf32_active(s.device.type, cfg.train.precision, cfg.train.tf32),
            "flops_per_image": b.trainer.flops_per_image,
            "train_flops_per_image": 3 * b.trainer.flops_per_image,
            "step_time_s": r["step_time_s"],
            **{k: r[k] for k in ("first_step_s", "compile_s")},  # the first step: the compile
            "split": _split_max(r, split, split_all),
            "split_notes": [SPLIT_NOTE] + split["notes"],
            "comm": comm,
            "peak_memory_bytes": mem,
            "memory_source": mem_src,
            "state_bytes_per_rank": state,
            "state_bytes": max(sum(r.values()) for r in state),
            **_run_facts(cfg, b, steps=steps, warmup=warmup, trials=trials, synthetic=synthetic),
        }
        out.update(_alongside(b, peer, beside, each, (steps, warmup, rounds), peak))
    finally:
        b.close()
    s.close()  # leave the process group cleanly (multi-process runs)
    return out


def _alongside(b, peer, beside, each, counts: tuple, peak: float) -> dict:
    """What runs beside the recipe's Bench `b` in paired rounds: the peer's loop, the recipe with
    the --beside overrides, each --each candidate; `counts`: (steps, warm-up, rounds)."""
    steps, warmup, rounds = counts
    out = {}
    if peer:
        out["peer"] = peer_rounds(b, peer, steps, warmup, rounds, b.trainer.flops_per_image, peak)
    if beside:
        out["beside"] = beside_rounds(b, beside, steps, warmup, rounds, peak)
    if each:  # issue 51: one candidate per override, all in the same rounds
        out["each"] = each_rounds(b, each, steps, warmup, rounds, peak)
    return out


def _peak_memory(s, cuda: bool, rss0: int) -> tuple[int, str]:
    """(peak memory in bytes, the max across ranks; where it was read): CUDA's allocator peak,
    else this process's RSS growth since `rss0`."""
    if cuda:
        mem, mem_src = (
            torch.cuda.max_memory_allocated(s.device),
            "cuda max_memory_allocated (this process)",
        )
    else:
        mem, mem_src = max_rss_bytes() - rss0, "process max RSS growth (ru_maxrss), CPU"
    return max(s.gather_objects(mem)), mem_src


def _split_max(r: dict, split: dict, split_all: list) -> dict:
    """The step's split: the data time from the timed steps `r`, each instrumented phase the max
    across ranks (`split_all`), the total communication where this rank's `split` has it."""
    out = {
        "data": r["data_s"],
        **{
            k: _max_or_none([d[k] for d in split_all])
            for k in (
                "forward",
                "backward",
                "comm_exposed",
                "comm_overlapped",
                "optimizer",
                "instrumented_step",
            )
        },
    }
    if "comm_total" in split:
        out["comm_total"] = max(d["comm_total"] for d in split_all)
    return out


def _run_facts(cfg, b, *, steps: int, warmup: int, trials: int, synthetic: bool) -> dict:
    """What was measured, and where: the batch, the measurement's settings, the model's size, the
    configuration, versions, hardware and strategy (the report's tail)."""
    s, world = b.s, b.s.world_size
    return {
        "world_size": world,
        "batch_size": cfg.data.batch_size,
        "micro_batch": cfg.data.batch_size // world // cfg.train.accum_steps,
        "steps": steps,
        "warmup": warmup,
        "trials": trials,
        "synthetic": synthetic,
        "params": b.trainer.params,
        "config": b.cfg.to_dict(),
        "versions": versions(),
        "hardware": hardware_info(s.device),
        "strategy": s.name,
        "rank": s.rank,
    }


def beside_rounds(b, overrides: list, steps: int, warmup: int, rounds: int, peak: float) -> dict:
    """The recipe's Bench `b` and the recipe with `overrides` (["section.key=value"]) timed in
    `rounds` interleaved paired rounds, each on its own fixed or loaded batches; each side's img/s,
    MFU and (on a GPU) kernel time per step, and the candidate's speed over the recipe's (the
    median of the per-round ratios)."""
    over = dict(parse_override(o) for o in overrides)
    # the recipe as the Bench was given it (a synthetic Bench swaps the dataset itself)
    other = Bench(with_overrides(b.given, over), b.fixed is not None)
    # each side's own FLOPs per image (a candidate may change them: model.patch_dropout, sizes)
    fpis = (b.trainer.flops_per_image, other.trainer.flops_per_image)
    try:
        times = side_by_side([b, other], steps, rounds, warmup)
        if any(t is None for t in times):
            raise UserError("bench --beside: a side ran out of memory; lower data.batch_size")
        kernels = [kernel_seconds(x, steps) for x in (b, other)]
    finally:
        other.close()
    # the candidate's speed over the recipe's
    speedups = paired_rounds(times, [b.global_batch] * 2)[1]
    sides = [rate(t, steps, b.global_batch) for t in times]
    return {
        "overrides": over,
        "rounds": rounds,
        "steps": steps,
        "warmup": warmup,
        **{
            name: {
                **side,
                "flops_per_image": fpi,
                "mfu": mfu(fpi, side["images_per_s"], peak, 1),
                "kernel_s_per_step": k,
            }
            for name, side, k, fpi in zip(("recipe", "candidate"), sides, kernels, fpis)
        },
        "speedup": statistics.median(speedups),
        "speedup_rounds": speedups,
        "rounds_won": rounds_won(speedups),
    }


def describe_beside(r: dict) -> list[str]:
    ms = lambda v: "n/a" if v is None else f"{1e3 * v:.2f} ms"  # noqa: E731
    cand = " ".join(f"{k}={v}" for k, v in r["overrides"].items())
    rows = [
        f"beside      {r['rounds']} interleaved paired rounds x {r['steps']} steps after {r['warmup']} warm-up",
        "            | candidate | median step | kernel time/step | img/s | MFU |",
        "            |---|---:|---:|---:|---:|",
    ]
    for label, side in (("the recipe", r["recipe"]), (cand, r["candidate"])):
        rows.append(
            f"            | {label} | {ms(side['step_time_s']['median'])} | {ms(side['kernel_s_per_step'])} | "
            f"{side['images_per_s']:.1f} | {100 * side['mfu']:.1f}% |"
        )
    rows.append(
        f"speedup     {cand} / the recipe: {r['speedup']:.3f}x (median of the per-round ratios; faster "
        f"in {r['rounds_won']} of {r['rounds']} rounds)"
    )
    return rows


def timed_steps(b, steps: int, warmup: int, trials: int) -> tuple[dict, dict]:
    """`trials` timings of `steps` steps of Bench `b` after `warmup` (the slowest rank's, per
    trial): (rounds.rate's throughput and step times, the communication counted per step)."""
    s = b.s
    first = b.steps(1)[0] if warmup else None  # torch.compile's compile runs in it
    if warmup > 1:
        b.steps(warmup - 1)
    if s.world_size > 1:
        s.comm_stats(1)
    times = [b.steps(steps) for _ in range(trials)]
    comm = s.comm_stats(steps * trials)
    flat = gather_max(s, [v for t in times for v in t])
    r = rate(list(zip(flat[::2], flat[1::2])), steps, b.global_batch)
    # the first step apart: with train.compile, the compile time is what it took over a step
    r["first_step_s"] = first = gather_max(s, [first])[0] if first is not None else None
    r["compile_s"] = max(0.0, first - r["step_time_s"]["median"]) if first is not None else None
    return r, comm


def _max_or_none(values):
    return None if any(v is None for v in values) else max(values)


def describe(r: dict) -> str:
    ms = lambda v: "n/a" if v is None else f"{1e3 * v:.1f} ms"  # noqa: E731
    st, sp, h = r["step_time_s"], r["split"], r["hardware"]
    c = r["config"]
    lines = [
        f"{h['name']} x {r['world_size']} ({h['device']}, {h['threads']} threads/process), {r['strategy']}, "
        f"{c['train']['precision']}, global batch {r['batch_size']} (micro-batch {r['micro_batch']}), "
        f"{r['trials']} trials x {r['steps']} steps after {r['warmup']} warm-up"
        f"{', one fixed batch' if r['synthetic'] else ''}",
        f"throughput  {r['images_per_s']:.1f} img/s ({r['images_per_s_per_device']:.1f} per device)",
        f"step time   min {ms(st['min'])}, median {ms(st['median'])}, max {ms(st['max'])}; first "
        f"step {ms(r.get('first_step_s'))} (compile: {ms(r.get('compile_s'))} over a step)",
        f"MFU         {100 * r['mfu']:.1f}% of {r['peak_flops'] / 1e9:.0f} GFLOP/s per device "
        f"({r['peak_source']}); {r['train_flops_per_image'] / 1e6:.0f} MFLOP per training image",
        f"memory      {r['peak_memory_bytes'] / 2**20:.0f} MiB ({r['memory_source']}); state held per "
        f"process {r['state_bytes'] / 2**20:.1f} MiB (parameters, master copies, optimizer state)",
        "split/step  "
        + ", ".join(
            f"{k} {ms(sp[k])}"
            for k in ("data", "forward", "backward", "comm_exposed", "comm_overlapped", "optimizer")
        )
        + f" (instrumented step {ms(sp['instrumented_step'])})",
    ]
    c = r["comm"]
    for kind in KINDS:
        if f"comm_{kind}_calls_per_step" in c:
            lines.append(
                f"comm        {kind}: {c[f'comm_{kind}_bytes_per_step'] / 2**20:.2f} MiB in "
                f"{c[f'comm_{kind}_calls_per_step']:.0f} calls per step, "
                f"{ms(c[f'comm_{kind}_s_per_step'])} launch to completion"
            )
    if "peer" in r:
        lines += describe_peer(r["peer"])
    if "beside" in r:
        lines += describe_beside(r["beside"])
    if "each" in r:
        lines += describe_each(r["each"])
    lines += [f"note        {n}" for n in r["split_notes"] + r.get("peer", {}).get("notes", [])]
    return "\n".join(lines)


def run(args) -> int:
    check_counts(
        steps=(args.steps, 1),
        trials=(args.trials, 1),
        warmup=(args.warmup, 0),
        split_steps=(args.split_steps, 0),
        rounds=(args.rounds, 1),
    )
    cfg = lab_config(args.config, args.overrides)
    if args.peer:
        import_timm()  # one line before anything is built where it does not import
    if args.beside:  # the candidate's refusal in one line before anything is timed
        with_overrides(cfg, dict(parse_override(o) for o in args.beside))
    for o in args.each:  # each candidate parses (its refusal is said when it is built)
        parse_override(o)
    r = measure(
        cfg,
        args.steps,
        args.warmup,
        args.trials,
        args.synthetic or bool(args.peer),
        args.split_steps,
        args.peer,
        args.rounds,
        args.beside,
        args.each,
    )
    if r["rank"] != 0:
        return 0
    text = json.dumps(r, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else describe(r))
    return 0


__all__ = ["run", "measure", "describe", "asdict"]
