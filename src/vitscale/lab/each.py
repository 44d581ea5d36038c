"""`vitscale bench --each KEY=VALUE ...` (issue 51): several candidates, each the recipe with one
override, timed with the recipe in the same interleaved paired rounds, so that a matrix of knobs
(inductor's options, precision modes, attention kernels) costs one compile per candidate and one for
the recipe. Each candidate is built and warmed alone first: one that does not validate, compile or
fit is recorded with its one-line error and left out of the rounds, and the others still run."""

from __future__ import annotations

import statistics
import time

from ..config import parse_override
from ..errors import UserError
from ..metrics import mfu
from .recipes import log, with_overrides
from .rounds import paired_rounds, rate, rounds_won, side_by_side
from .timing import Bench, free_memory, kernel_seconds


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def _built(b: Bench, text: str, warmup: int):
    """(overrides, the candidate's warmed Bench and its warm-up seconds) or (overrides, error)."""
    over = dict([parse_override(text)])
    other = None
    try:
        other = Bench(with_overrides(b.given, over), b.fixed is not None)
        t0 = time.perf_counter()
        other.steps(max(warmup, 1))  # the compile, where the candidate compiles
        return over, (other, time.perf_counter() - t0)
    except (UserError, RuntimeError, ValueError, NotImplementedError, AssertionError) as e:
        # a knob this machine refuses or cannot compile (a missing CUTLASS, a kernel without this
        # shape): said in one line, not timed
        if other is not None:
            other.close()
        free_memory()
        log(f"  each {text}: not timed ({_first_line(e)})")
        return over, _first_line(e)


def each_rounds(b: Bench, candidates: list[str], steps: int, warmup: int, rounds: int, peak: float):
    """The recipe's (warmed) Bench `b` and each candidate ("section.key=value") side by side:
    {"rounds", "steps", "recipe": its side, "candidates": [per candidate: overrides, its side (img/s,
    MFU, kernel time per step, warm-up seconds: the compile), speedup over the recipe (median of
    the per-round ratios), or its error]}."""
    built = [_built(b, text, warmup) for text in candidates]
    ok = [(i, got) for i, (_, got) in enumerate(built) if not isinstance(got, str)]
    benches = [b] + [got[0] for _, got in ok]
    fpis = [x.trainer.flops_per_image for x in benches]  # each side's own (before closing them)
    try:
        times = side_by_side(benches, steps, rounds, 1)
        kernels = [kernel_seconds(x, steps) if t else None for x, t in zip(benches, times)]
    finally:
        for _, (other, _) in ok:
            other.close()
    if times[0] is None:
        raise UserError("bench --each: the recipe ran out of memory; lower data.batch_size")
    speed = paired_rounds(times, [b.global_batch] * len(benches))

    def side(k: int, fpi: float) -> dict:
        got = rate(times[k], steps, b.global_batch)
        return {
            **got,
            "mfu": mfu(fpi, got["images_per_s"], peak, 1),
            "kernel_s_per_step": kernels[k],
        }

    out = [{"overrides": over, "error": got} for over, got in built]
    for k, (i, (_, warm)) in enumerate(ok, 1):
        if times[k] is None:
            out[i]["error"] = "out of memory"
            continue
        out[i] = {
            "overrides": built[i][0],
            "candidate": {**side(k, fpis[k]), "warmup_s": warm},
            "speedup": statistics.median(speed[k]),
            "speedup_rounds": speed[k],
            "rounds_won": rounds_won(speed[k]),
        }
    recipe = side(0, fpis[0])
    return {"rounds": rounds, "steps": steps, "recipe": recipe, "candidates": out}


def describe_each(r: dict) -> list[str]:
    rows = [
        f"each        {r['rounds']} interleaved paired rounds x {r['steps']} steps, one candidate each"
    ]
    for c in r["candidates"]:
        name = " ".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in c["overrides"].items()
        )
        if "error" in c:
            rows.append(f"            {name}: not timed ({c['error']})")
        else:
            s = c["candidate"]
            rows.append(
                f"            {name}: {c['speedup']:.3f}x the recipe ({c['rounds_won']} rounds won), "
                f"{s['images_per_s']:.1f} img/s, MFU {100 * s['mfu']:.1f}%, warm-up {s['warmup_s']:.1f} s"
            )
    return rows
