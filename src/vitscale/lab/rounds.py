"""Side-by-side measurement and its statistics (bench, ladder, tune share them).

`side_by_side()` times several Benches in interleaved rounds so that machine noise hits every
configuration alike; each Bench's steps run under its own process-wide settings (TF32 / cuDNN
flags, torch threads), which building a later Bench would otherwise overwrite. `paired_rounds()`
compares them round by round (a drift of the machine's speed between rounds cancels in each ratio).
`measure_configs()` (tune) builds a few Benches and times them together; `measure_against_first()`
(the ladder) keeps only the first (the baseline) resident and builds, times and frees every other
configuration one at a time, each paired with the baseline.
"""

from __future__ import annotations

import statistics

from ..strategy.dist import gather_objects
from .recipes import log
from .timing import Bench, build_bench, free_memory, perf, run_steps, settings_kept


def side_by_side(
    benches: list[Bench], steps: int | list, rounds: int, warmup: int | list, label=None
) -> list:
    """Interleaved rounds: round r runs `steps` steps of bench 0, 1, ..., n-1, each bench (its
    warm-up too) under its own process-wide settings; `steps` and `warmup` either for all or one
    per bench. Returns per bench the per-round (wall s, data s) (max across ranks), or None where
    a bench ran out of memory (that bench is closed)."""
    out: list = [[] for _ in benches]
    steps = steps if isinstance(steps, list) else [steps] * len(benches)
    warmup = warmup if isinstance(warmup, list) else [warmup] * len(benches)
    for i, b in enumerate(benches):
        if warmup[i] and b is not None:
            t0 = perf()
            if run_steps(b, warmup[i]) is None:
                out[i] = None
            if label:
                log(f"  warm-up {label(i)}: {warmup[i]} steps in {perf() - t0:.1f}s")
    for _r in range(rounds):
        for i, b in enumerate(benches):
            if b is None or out[i] is None:
                continue
            t = run_steps(b, steps[i])
            if t is None:
                out[i] = None
            else:
                out[i].append(t)
    flat = [x for o in out if o for x in o]
    # max across ranks through the process group itself: a strategy held here would keep the model
    # of a bench closed for running out of memory alive
    flat = [max(vals) for vals in zip(*gather_objects([v for x in flat for v in x]))]
    it = iter(zip(flat[::2], flat[1::2]))
    return [None if o is None else [next(it) for _ in o] for o in out]


def rate(bench_times: list, steps: int, batch: int) -> dict:
    """images/s from the median round; step time spread over rounds."""
    per_step = sorted(w / steps for w, _ in bench_times)
    med = statistics.median(per_step)
    return {
        "images_per_s": batch / med,
        "step_time_s": {"min": per_step[0], "median": med, "max": per_step[-1]},
        "data_s": statistics.median(d / steps for _, d in bench_times),
    }


def paired_rounds(times: list, batches: list) -> list:
    """Per bench, its speed relative to bench 0 in each round: (bench 0's seconds per image in
    round r) / (this bench's seconds per image in round r), a list over rounds. A drift of the
    machine's speed between rounds cancels in each ratio. `times`: side_by_side's per-bench
    [(wall s, data s) per round] or None; None where a bench or bench 0 has no times."""
    if not times or times[0] is None:
        return [None] * len(times)
    first = [w / batches[0] for w, _ in times[0]]
    return [
        None if t is None else [f / (w / b) for f, (w, _) in zip(first, t)]
        for t, b in zip(times, batches)
    ]


def paired_speedups(times: list, batches: list) -> list:
    """Per bench, its speed relative to bench 0 round by round: the median over rounds of
    `paired_rounds`, where the ratio of two median rounds would keep the drift between rounds."""
    return [None if r is None else statistics.median(r) for r in paired_rounds(times, batches)]


def rounds_won(ratios: list) -> int:
    """In how many rounds a configuration was faster than the first one (`paired_rounds` > 1)."""
    return sum(r > 1 for r in ratios)


def faster_in_most_rounds(ratios: list | None, share: float = 2 / 3) -> bool:
    """Whether a configuration beat the first one in more than `share` of the rounds (all 3 of 3,
    4 of 5, 7 of 10): a median ratio above 1 from one or two lucky rounds is noise, not a gain."""
    return bool(ratios) and rounds_won(ratios) > share * len(ratios)


@settings_kept()
def measure_configs(
    cfgs: list,
    steps: int,
    rounds: int,
    warmup: int,
    synthetic: bool = False,
    names: list | None = None,
) -> list:
    """Build one Bench per config, time them side by side, free them. Per config a dict
    (images_per_s, step_time_s, paired_vs_first, paired_rounds, flops_per_image, ...) or {'error': reason}."""
    names = names or [str(i) for i in range(len(cfgs))]
    benches, results = [], []
    for cfg in cfgs:
        b, why = build_bench(cfg, synthetic)
        benches.append(b)
        results.append({} if b is not None else {"error": why})
    if not any(benches):
        return results
    times = side_by_side(benches, steps, rounds, warmup, label=lambda i: names[i])
    batches = [b.global_batch if b is not None else 1 for b in benches]
    per_round = paired_rounds(times, batches)
    for i, (b, t) in enumerate(zip(benches, times)):
        if b is None:
            continue
        if t is None:
            results[i] = {"error": "out of memory"}
        else:
            results[i] = result_of(b, t, steps, per_round[i])
        b.close()
    del benches, b
    free_memory()
    return results


def result_of(b: Bench, times: list, steps: int, ratios: list | None) -> dict:
    """A measured configuration: its rate over its rounds and its round-by-round ratios to the first."""
    return {
        **rate(times, steps, b.global_batch),
        "paired_rounds": ratios,
        "paired_vs_first": statistics.median(ratios) if ratios else None,
        "flops_per_image": b.trainer.flops_per_image,
        "world_size": b.s.world_size,
        "device": b.s.device,
    }


@settings_kept()
def measure_against_first(
    cfgs: list,
    steps: int,
    rounds: int,
    warmup: int,
    synthetic: bool = False,
    names: list | None = None,
    on_result=None,
    reference_steps: int | None = None,
) -> list:
    """`measure_configs` for a long list compared with its first (the ladder: every rung against
    the baseline), with at most two configurations resident: the first (the reference) is built
    once and stays; every other one is built, warmed up and timed in interleaved rounds with the
    reference (round r: the reference's steps, then its steps, each under its own settings), then
    freed before the next is built. Why pairs rather than one configuration at a time: each ratio
    to the reference stays round by round (the reference and the configuration ran back to back,
    so a drift of the machine's speed cancels), as when all were timed together; what changes is
    that configurations k and k+1 were no longer timed in the same rounds, so a comparison between
    them goes through the reference (the ladder's "vs previous, round by round" is the ratio of
    their per-round ratios to it). The cost: the reference runs in every pair; to keep that small
    (the ladder's baseline, fp32 IEEE, is its slowest rung), once the reference was measured in
    full (`steps` per round, its own result) it runs `reference_steps` per round (default `steps`)
    after a 1-step warm-up in the later pairs: enough to carry the round's drift, the ratios taken
    per image.

    Returns per config the dict of `measure_configs` (for the reference: from its first pair);
    the others also carry `reference_images_per_s`, the reference's rate in their own pair.
    `on_result(i, result)` is called as soon as config i's result is known (after its bench was
    freed), the reference's before the first other's."""
    names = names or [str(i) for i in range(len(cfgs))]
    results: list = [None] * len(cfgs)

    def emit(i: int, r: dict) -> None:
        if results[i] is None:
            results[i] = r
            if on_result is not None:
                on_result(i, r)

    ref, ref_i = first_bench(cfgs, synthetic, emit)
    if ref is None:
        return results
    if ref_i == len(cfgs) - 1:  # nothing to pair it with: timed alone
        t = side_by_side([ref], steps, rounds, warmup, label=lambda k: names[ref_i])[0]
        emit(
            ref_i,
            {"error": "out of memory"} if t is None else result_of(ref, t, steps, [1.0] * len(t)),
        )
    ref = _pairs_with_reference(
        ref, ref_i, results, emit, cfgs, steps, rounds, warmup, synthetic, names, reference_steps
    )
    emit(ref_i, {"error": "out of memory"})  # where it never completed a pair
    if ref is not None:
        ref.close()
    del ref
    free_memory()
    return results


def _pairs_with_reference(
    ref,
    ref_i: int,
    results: list,
    emit,
    cfgs,
    steps,
    rounds,
    warmup,
    synthetic,
    names,
    reference_steps,
):
    """measure_against_first's pairs: every config after the reference `ref` (config `ref_i`)
    built, timed beside it and freed, one at a time; `emit(i, result)` for each, and for the
    reference from its first completed pair while its entry in `results` is still None. Returns
    the reference's Bench as it stands (rebuilt where it ran out of memory; None where that
    failed), for the caller to close."""
    fresh = True  # the reference has not run a pair since it was built
    for j in range(ref_i + 1, len(cfgs)):
        # it ran out of memory next to an earlier configuration: again
        if ref is None or ref.closed:
            ref, _ = build_bench(cfgs[ref_i], synthetic)
            fresh = True
        full = results[ref_i] is None  # the reference's own result is still to be measured
        ref_steps = steps if full else (reference_steps or steps)
        ref_r, r, ran = beside(
            ref,
            cfgs[j],
            synthetic,
            [ref_steps, steps],
            rounds,
            [warmup if fresh else min(warmup, 1), warmup],
            (names[ref_i], names[j]),
        )
        fresh = fresh and not ran
        if ref_r is not None and full:
            emit(ref_i, ref_r)
        emit(j, r)
    return ref


def first_bench(cfgs: list, synthetic: bool, emit) -> tuple:
    """(the first of `cfgs` that builds, its index), or (None, None); `emit(i, error)` for each
    one before it that did not."""
    for i, cfg in enumerate(cfgs):
        ref, why = build_bench(cfg, synthetic)
        if ref is not None:
            return ref, i
        emit(i, {"error": why})
    return None, None


def beside(
    ref, cfg, synthetic: bool, steps: list, rounds: int, warmups: list, names: tuple
) -> tuple:
    """`cfg` built and timed in interleaved rounds beside the resident reference `ref` (None: alone),
    then freed (and its compiled graphs where nothing alive uses them): (the reference's result or
    None, cfg's result, whether it ran). `steps`, `warmups`, `names`: (reference's, cfg's)."""
    b, why = build_bench(cfg, synthetic)
    if b is None:
        return None, {"error": why}, False
    (ref_steps, b_steps), pair = steps, [b] if ref is None else [ref, b]
    times = side_by_side(
        pair,
        steps[-len(pair) :],
        rounds,
        warmups[-len(pair) :],
        label=lambda k: names[1] if pair[k] is b else names[0],  # noqa: F821 (del later)
    )
    t_ref, t_b = (None, *times) if ref is None else times
    ref_r = None if t_ref is None else result_of(ref, t_ref, ref_steps, [1.0] * len(t_ref))
    if t_b is None:
        r = {"error": "out of memory"}
    else:  # per image: the two may run different numbers of steps per round
        ratios = (
            None
            if t_ref is None
            else paired_rounds(
                [t_ref, t_b], [ref.global_batch * ref_steps, b.global_batch * b_steps]
            )[1]
        )
        r = {
            **result_of(b, t_b, b_steps, ratios),
            "reference_images_per_s": ref_r and ref_r["images_per_s"],
        }
    # freed before anything else runs (the caller may train a model next)
    compiled = b.cfg.train.compile
    b.close()
    del b, pair
    if compiled and (ref is None or ref.closed or not ref.cfg.train.compile):
        import torch._dynamo  # here: seconds to import, and only a compiled configuration needs it

        torch._dynamo.reset()  # its compiled graphs and CUDA-graph pools (nothing else alive uses them)
    free_memory()
    return ref_r, r, True


def gather_max(s, times: list) -> list:
    """Per entry, the max across ranks (the slowest rank sets the pace)."""
    per_rank = s.gather_objects(times)
    return [max(vals) for vals in zip(*per_rank)]
