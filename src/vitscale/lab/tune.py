"""`vitscale tune`: a coordinate search over a recipe's speed settings, each group of candidates
timed side by side (rounds.measure_configs), then the recipe and the winner compared once more and
the tuned recipe written. What it searches and its arguments: commands.py."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from ..config import TrainConfig
from ..errors import UserError
from ..launch import is_main_process
from ..metrics import mfu, peak_flops
from ..precision import half_dtype
from ..strategy.dist import broadcast_object, env_world
from ..tasks import build_task
from . import (
    rounds as lab_rounds,  # rounds.measure_configs looked up when called (tests replace it)
)
from . import sdpa_check
from .machine import machine_line
from .recipes import check_counts, lab_config, log, synthetic_data, with_overrides
from .rounds import faster_in_most_rounds, rounds_won

THRESHOLD = 0.03  # a larger micro-batch must be this much faster (CPU)
MARGIN = 0.01  # a candidate's median round-by-round ratio must exceed 1 + MARGIN
MIN_MICRO = 16


def accum_choices(per_device: int, accum: int, min_micro: int = MIN_MICRO) -> list[int]:
    """accum_steps values, smallest micro-batch first: per_device / 2^k down to 1 accumulation
    step, never below min(min_micro, the recipe's micro-batch); the global batch never changes."""
    lo = min(per_device // accum, min_micro)
    out, a = [], 1
    while per_device % a == 0 and per_device // a >= lo:
        out.append(a)
        a *= 2
    if accum not in out:
        out.append(accum)
    return sorted(out, key=lambda a: per_device // a)


def search(
    choices: list,
    accums: list[int],
    measure,
    *,
    gpu: bool = False,
    threshold: float = THRESHOLD,
    out_of_time=lambda: False,
    say=lambda msg: None,
    start_accum: int = 1,
    margin: float = MARGIN,
) -> tuple[dict, list]:
    """Coordinate search from the recipe ({} = its own values). `choices`: [(key, [values])] (a
    knob's first value is the incumbent) and the string "micro" where the micro-batch walk goes;
    `measure(list of override dicts)` times them side by side -> images/s or None (invalid / out
    of memory). Returns (best, history)."""
    best: dict = {}
    history: list = []

    def group(cands):
        ips = measure(cands)
        history.extend(zip(cands, ips))
        return ips

    def fastest(cands, ips):
        """The fastest; the first candidate (the incumbent) keeps its place unless another beats
        it by more than `margin` (noise must not flip settings)."""
        ok = [(v, i) for i, v in enumerate(ips) if v is not None]
        if not ok:
            return best
        v, i = max(ok)
        return cands[0] if ips[0] is not None and v <= ips[0] * (1 + margin) else cands[i]

    for step in choices:
        if out_of_time():
            say("budget reached: keeping the best settings so far")
            break
        if step == "micro":
            if len(accums) < 2:
                continue
            start = best.get("train.accum_steps", start_accum)
            cur = _micro_walk(best, accums, group, gpu, threshold, out_of_time)
            if cur.get("train.accum_steps") != start:  # the walk's pick against the recipe's own
                orig = dict(best)
                best = fastest([orig, cur], group([orig, cur]))
            continue
        key, values = step
        if len(values) < 2:
            continue
        cands = [{**best, key: v} for v in values]
        best = fastest(cands, group(cands))
    return best, history


def _micro_walk(best: dict, accums: list[int], group, gpu: bool, threshold: float, out_of_time):
    """search's micro-batch walk from `best`: from the smallest micro-batch up (`accums`, smallest
    micro-batch first), each next one timed beside the current pick (`group`) and taken while it is
    more than `threshold` faster (on a GPU: while no more than `threshold` slower); it stops at a
    failure (the larger micro-batch taken only where the smaller one failed), a slower one or
    `out_of_time()`. Returns the pick: `best` with its train.accum_steps."""
    cur = {**best, "train.accum_steps": accums[0]}
    for a in accums[1:]:
        nxt = {**best, "train.accum_steps": a}
        ips = group([cur, nxt])
        if ips[1] is None or ips[0] is None:
            cur = nxt if ips[0] is None else cur
            break
        if (gpu and ips[1] >= ips[0] * (1 - threshold)) or ips[1] > ips[0] * (1 + threshold):
            cur = nxt
        else:
            break
        if out_of_time():
            break
    return cur


def beats_first(paired: float | None, per_round: list | None, margin: float = MARGIN) -> bool:
    """tune's rule for one candidate against its group's first (the incumbent), as `run`'s measure
    and `search` apply it together: faster in more than 2/3 of the rounds and a median
    round-by-round ratio above 1 + margin (benchmarks/harness_noise.py asks it of identical copies)."""
    return (
        bool(paired) and paired > 1 + margin and (not per_round or faster_in_most_rounds(per_round))
    )


def batch_norm_layers(cfg) -> list[str]:
    """The recipe model's layers that normalize with batch statistics (BatchNorm, e.g. the conv
    stem's): with them, a smaller micro-batch changes what a training step computes, so
    accumulation does not keep the recipe's numerics. Built on the meta device (no memory)."""
    return [
        n
        for n, m in build_task(cfg).meta_model()[1].named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]


def describe(over: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in over.items()) or "(the recipe as written)"


def run(args) -> int:
    check_counts(steps=(args.steps, 1), trials=(args.trials, 1), warmup=(args.warmup, 0))
    if args.budget_s <= 0:
        raise UserError(f"--budget-s must be > 0, got {args.budget_s}")
    cfg = lab_config(args.config, args.overrides)
    space = search_space(cfg, args)
    t0 = time.perf_counter()
    out_of_time = lambda: broadcast_object(time.perf_counter() - t0 > args.budget_s)  # noqa: E731
    measure = Measurer(cfg, args)
    log(
        f"tuning on {machine_line(torch.device('cuda' if space['gpu'] else 'cpu'))}: precisions "
        f"{space['allowed']}, micro-batches {[space['per_device'] // a for a in space['accums']]} (global batch "
        f"{cfg.data.batch_size}), budget {args.budget_s:.0f}s"
    )
    if space["micro_note"]:
        log(space["micro_note"])
    best, history = search(
        space["choices"],
        space["accums"],
        measure,
        gpu=space["gpu"],
        out_of_time=out_of_time,
        say=log,
        start_accum=cfg.train.accum_steps,
    )
    chosen = {k: v for k, v in best.items() if _value(cfg, k) != v}
    return final_comparison(cfg, args, measure, chosen, space, len(history))


def allowed_precisions(cfg, allow: str) -> list[str]:
    """--allow-precision's list (default: the recipe's own), each a train.precision value."""
    valid = TrainConfig.__dataclass_fields__["precision"].metadata["choices"]
    allowed = [p.strip() for p in allow.split(",") if p.strip()] or [cfg.train.precision]
    bad = [p for p in allowed if p not in valid]
    if bad:
        raise UserError(
            f"--allow-precision: unknown precision {', '.join(bad)} (choose from {', '.join(valid)})"
        )
    return allowed


def search_space(cfg, args) -> dict:
    """What the search may change: the allowed precisions, attention, optimizer implementation,
    the micro-batch (accumulation steps; kept where BatchNorm would change the numerics), compile;
    on a GPU the attention kernels that pass their gradient check, inductor's knobs, the capture."""
    allowed = allowed_precisions(cfg, args.allow_precision)
    world = env_world()[1]
    per_device = cfg.data.batch_size // world

    def first(key, values):  # the recipe's own value first: it is the incumbent
        cur = _value(cfg, key)
        return (key, [cur] + [v for v in values if v != cur] if cur in values else values)

    choices = [
        first("train.precision", allowed),
        first("model.attention", ["explicit", "sdpa"]),
        first("optim.impl", ["forloop", "foreach", "fused"]),
        "micro",
    ]
    if not args.no_compile:
        choices.append(first("train.compile", [False, True]))
    gpu = torch.cuda.is_available() and cfg.run.device != "cpu"
    shaped = synthetic_data(cfg) if args.synthetic else cfg  # --synthetic: no dataset read
    if gpu:  # GPU-only switches (a candidate that does not validate is measured as None)
        # the attention kernel (issue 32: cuDNN vs flash on Hopper), where attention is fused; only
        # the kernels that passed their gradient check at the recipe's shape (issue 51)
        kernels = checked_kernels(shaped, allowed, torch.device("cuda"))
        choices.insert(2, first("train.sdpa_backend", kernels))
        # inductor's autotuned templates: bias + GELU in the matmul's epilogue; inductor's own knobs
        # (issue 51: all off unless measured faster here; refused without compile: measured as None)
        if not args.no_compile:
            choices.append(first("train.compile_mode", ["default", "max-autotune-no-cudagraphs"]))
            choices.extend(first(k, v) for k, v in INDUCTOR_SPACE)
        choices.append(first("train.capture", ["none", "step"]))  # the whole step as one CUDA graph
        # float8 matmuls in the blocks (torchao): refused where measured slower, so measured as None there
        choices.append(first("train.fp8", ["none", "rowwise", "tensorwise"]))
    accums = accum_choices(per_device, cfg.train.accum_steps)
    bn = batch_norm_layers(shaped)
    micro_note = ""
    if bn and not args.allow_bn_micro_batch:
        accums = [cfg.train.accum_steps]  # the recipe's micro-batch only: no walk
        micro_note = (
            f"micro-batch kept at {per_device // cfg.train.accum_steps}: {len(bn)} BatchNorm "
            f"layer(s) ({', '.join(bn[:3])}{', ...' if len(bn) > 3 else ''}) normalize with "
            f"batch statistics, so a smaller micro-batch would change the numerics "
            f"(--allow-bn-micro-batch searches it anyway)"
        )
    return {
        "allowed": allowed,
        "choices": choices,
        "accums": accums,
        "micro_note": micro_note,
        "world": world,
        "per_device": per_device,
        "gpu": gpu,
    }


# inductor's knobs as tune searches them (config.py's train.inductor_*), off first
INDUCTOR_SPACE = [
    ("train.inductor_coordinate_descent", [False, True]),
    ("train.inductor_combo_kernels", [False, True]),
    ("train.inductor_mix_order", ["default", "on", "off"]),
    ("train.inductor_gemm", ["default", "cutlass"]),  # with max-autotune only (else not valid)
]


def attention_shape(cfg) -> dict:
    """The recipe's attention shape for the kernels' gradient check: its first attention layer's
    heads and head width, its image tower's tokens (ViT-B/16's where the model does not say)."""
    spec, model = build_task(cfg).meta_model()
    shape = dict(sdpa_check.VIT_B16)
    attn = next(
        (m for m in model.modules() if hasattr(m, "heads") and hasattr(m, "head_dim")), None
    )
    if attn is not None:
        shape.update(heads=attn.heads, head_dim=attn.head_dim)
    tokens = getattr(getattr(spec, "vision", spec), "num_tokens", None)
    if isinstance(tokens, int):
        shape["tokens"] = tokens
    return shape


def checked_kernels(cfg, allowed: list[str], device) -> list[str]:
    """train.sdpa_backend's candidates: auto, and each kernel that passed its gradient check against
    float64 math (lab/sdpa_check.py) at the recipe's attention shape in every allowed precision's
    dtype; the others are said in one line each and not timed."""
    dtypes = {half_dtype(p if p != "auto" else "bf16") or torch.float32 for p in allowed}
    shape, out = attention_shape(cfg), ["auto"]
    for kernel in ("flash", "cudnn", "efficient"):
        results = [
            sdpa_check.grad_check(kernel, device, d, **shape) for d in sorted(dtypes, key=str)
        ]
        bad = next((r for r in results if r["status"] != "PASS"), None)
        if bad is None:
            out.append(kernel)
        else:
            log(f"  train.sdpa_backend={kernel}: not timed ({sdpa_check.describe(bad)})")
    return out


class Measurer:
    """`measure(candidates, rounds)` for `search`: images/s per candidate (overrides of the
    recipe), compared round by round with the group's first; `last` keeps the raw results."""

    def __init__(self, cfg, args):
        self.cfg, self.args, self.last = cfg, args, {}

    def __call__(self, cands: list[dict], rounds: int | None = None) -> list:
        args, rounds = self.args, rounds or self.args.trials
        cfgs, idx, out = [], [], [None] * len(cands)
        for i, c in enumerate(cands):
            try:
                cfgs.append(with_overrides(self.cfg, c))
                idx.append(i)
            except UserError as e:
                log(f"  {describe(c)}: not valid here ({e})")
        results = lab_rounds.measure_configs(
            cfgs,
            args.steps,
            rounds,
            args.warmup,
            args.synthetic,
            names=[describe(cands[i]) for i in idx],
        )
        ref = results[0].get("images_per_s") if results else None
        for k, (i, r) in enumerate(zip(idx, results)):
            own, paired, per_round = (
                r.get("images_per_s"),
                r.get("paired_vs_first"),
                r.get("paired_rounds"),
            )
            # compared by the round-by-round ratio to the group's first (drift cancels), on its scale
            out[i] = ref * paired if own and ref and paired else own
            note = f" ({paired:.3f}x the first, round by round)" if own and paired and k else ""
            if (
                k
                and own
                and ref
                and paired
                and paired > 1
                and per_round
                and not faster_in_most_rounds(per_round)
            ):
                out[i] = ref  # a median above 1 from a lucky round or two: no faster than the first
                note = (
                    f" ({paired:.3f}x the first, round by round, but faster in only {rounds_won(per_round)} of "
                    f"{len(per_round)} rounds: counted as no faster)"
                )
            self.last[i] = r
            log(
                f"  {describe(cands[i])}: "
                + (f"{own:.1f} img/s{note}" if own else r.get("error", "failed"))
            )
        return out


def final_comparison(
    cfg, args, measure: Measurer, chosen: dict, space: dict, candidates: int
) -> int:
    """The recipe and the search's winner side by side; the tuned recipe written (main process)."""
    log(f"final side-by-side: the recipe vs {describe(chosen)}")
    measure.last = {}
    ips = measure([{}, chosen] if chosen else [{}], rounds=max(args.trials, 3))
    gain = ips[-1] / ips[0] if ips[0] and ips[-1] else None  # round by round (see Measurer)
    tuned = measure.last[len(ips) - 1]
    rejected = {}
    # nothing ran (the recipe alone, or the recipe and the tuned settings both failed)
    if not ips[-1]:
        raise UserError(
            f"tune: the final comparison failed: {tuned.get('error', 'no measurement')}"
        )
    if chosen and ips[0] and not (gain and gain > 1):
        # the search's winner lost to the recipe side by side (noise picked it): keep the recipe
        log(f"  {describe(chosen)} did not beat the recipe side by side: keeping the recipe")
        rejected, chosen, gain, tuned = chosen, {}, 1.0, measure.last[0]
    # their median rounds
    base_ips, tuned_ips = measure.last[0].get("images_per_s"), tuned["images_per_s"]
    vs = f"{base_ips:.1f} img/s" if base_ips else f"failed ({measure.last[0].get('error', '?')})"
    ratio = f"{gain:.2f}x round by round" if gain else "the recipe itself did not run"
    device = tuned["device"]
    peak, src = peak_flops(device, "bf16")
    peak = broadcast_object(peak)
    tuned_mfu = mfu(tuned["flops_per_image"], tuned_ips, peak, tuned["world_size"])
    if not is_main_process():
        return 0
    machine = machine_line(device)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = [
        f"# tuned by `vitscale tune` on {date}",
        f"# machine: {machine}, {space['world']} process(es)",
        f"# measured side by side ({max(args.trials, 3)} rounds x {args.steps} steps): recipe "
        f"{vs}, tuned {tuned_ips:.1f} img/s (median rounds); tuned / recipe: {ratio}",
        f"# tuned MFU {100 * tuned_mfu:.1f}% of the bf16 matmul peak {peak / 1e9:.0f} GFLOP/s ({src})",
        f"# allowed precisions: {','.join(space['allowed'])}; {candidates} candidate measurements",
        "# chosen overrides: " + (" ".join(f"--set {k}={v}" for k, v in chosen.items()) or "none"),
    ]
    if space["micro_note"]:
        header.append(f"# {space['micro_note']}")
    if rejected:
        header.append(
            "# rejected (slower than the recipe in the final side-by-side): "
            + " ".join(f"--set {k}={v}" for k, v in rejected.items())
        )
    Path(args.out).write_text("\n".join(header) + "\n\n" + with_overrides(cfg, chosen).to_toml())
    print(
        f"tuned: {describe(chosen)}\nrecipe {vs} -> tuned {tuned_ips:.1f} img/s "
        f"({ratio}) on {machine}\ntuned MFU {100 * tuned_mfu:.1f}% of the bf16 matmul "
        f"peak ({peak / 1e9:.0f} GFLOP/s per device; {src})\nwrote {args.out}"
    )
    return 0


def _value(cfg, dotted: str):
    sec, key = dotted.split(".")
    return getattr(getattr(cfg, sec), key)
