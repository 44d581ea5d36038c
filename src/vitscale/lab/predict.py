"""`vitscale predict`: data-parallel scaling predicted from one step (a bench result or an estimate)
with the ring / hierarchical communication model of comm_model.py; the table, JSON and plot. The
model's formulas and the command's arguments: commands.py."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import load_config
from ..errors import UserError
from ..metrics import gpu_peak
from ..precision import compute_dtype_name
from ..tasks import check_config, model_info
from . import comm_model as cm
from .comm_model import StepCost
from .linkbench import measure_gloo
from .report import plot_predicted_speedup

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
STRATEGY_NAMES = {
    "ddp": "DDP",
    "zero12": "ZeRO-1/2",
    "zero3": "ZeRO-3 / FSDP2",
    "hsdp": "HSDP (FSDP2 in a node, replicas across)",
}


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--gpus: expected a comma list of integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise UserError("--gpus: GPU counts must be >= 1")
    return out


def step_cost_from_bench(bench: dict, accum: int = 1):
    """StepCost from a bench JSON whose total is its median step: the split's phases (scaled down when
    the instrumented pass took longer than the median step, the remainder added to backward when it
    took less), else the median step with fwd:bwd = 1:2."""
    if int(bench.get("world_size", 1)) != 1:
        raise UserError("--bench: give a single-device bench result (world_size 1)")
    step = float(bench["step_time_s"]["median"])
    split = bench.get("split") or {}
    fwd, bwd = split.get("forward"), split.get("backward")
    if fwd is None or bwd is None:
        fwd, bwd = step / 3, 2 * step / 3
        return StepCost(
            int(bench["batch_size"]), fwd, bwd, 0.0, 0.0, accum
        ), "bench median step (no split: fwd:bwd 1:2)"
    opt, data = split.get("optimizer") or 0.0, split.get("data") or 0.0
    total = fwd + bwd + opt + data
    # the instrumented pass (syncs between phases) ran slower: scale it to the median step
    if total > step:
        k = step / total
        return (
            StepCost(int(bench["batch_size"]), fwd * k, bwd * k, opt * k, data * k, accum),
            f"bench split scaled by {k:.3f} to the median step",
        )
    # untimed remainder (zero_grad, syncs): counted as backward
    return (
        StepCost(int(bench["batch_size"]), fwd, bwd + step - total, opt, data, accum),
        "bench split (forward, backward, optimizer, data)",
    )


def step_cost_estimate(
    train_flops_per_image: float, batch: int, peak: float, mfu: float, accum: int = 1
):
    """compute = train FLOPs per image x batch / (peak x MFU), split 1/3 forward, 2/3 backward."""
    t = train_flops_per_image * batch / (peak * mfu)
    return StepCost(batch, t / 3, 2 * t / 3, 0.0, 0.0, accum)


def predict(
    cfg,
    *,
    bench: dict | None = None,
    links: str | None = None,
    gpus=(2, 4, 8),
    per_node: int = 8,
    bucket_mb: float = 25.0,
    overlap: float = 0.7,
    strategies=("ddp",),
    reduce_dtype: str | None = None,
    gpu: str = "H100",
    mfu: float = 0.4,
    tp: int = 1,
) -> dict:
    """`vitscale predict`'s result: the step's cost on one GPU (from a bench result, else
    estimated from the FLOPs, a GPU's peak and an MFU) and its scaling curves over each link and
    strategy for `gpus` GPUs."""
    info = model_info(cfg)
    reduce_dtype = reduce_dtype or _default_reduce_dtype(cfg.strategy)
    grad_bytes = info["params"] * DTYPE_BYTES[reduce_dtype]
    cost, source = _step_cost(cfg, info, bench, gpu, mfu)
    try:
        link_list = cm.parse_links(links or cm.DEFAULT_LINKS)
    except ValueError as e:
        raise UserError(f"--link: {e}") from None
    for st in strategies:
        if st not in cm.STRATEGIES:
            raise UserError(f"--strategy: unknown {st!r} (one of {', '.join(cm.STRATEGIES)})")
    split = tensor_parallel(cfg, info, tp)
    curves = _curves(
        cost,
        link_list,
        strategies,
        grad_bytes,
        sorted(set([1, *gpus])),
        per_node,
        bucket_mb,
        overlap,
        split,
    )
    return {
        "arch": info["arch"],
        "params": info["params"],
        "grad_bytes": grad_bytes,
        "reduce_dtype": reduce_dtype,
        "batch": cost.batch,
        "step_1gpu_s": cost.forward + cost.backward + cost.optimizer + cost.data,
        "cost": cost.__dict__,
        "source": source,
        "per_node": per_node,
        "tp": tp,
        "bucket_mb": bucket_mb,
        "overlap": overlap,
        "curves": curves,
        "links": {
            label: {"intra": intra.__dict__, "inter": inter.__dict__}
            for label, intra, inter in link_list
        },
    }


def tensor_parallel(cfg, info: dict, tp: int) -> cm.TensorParallel | None:
    """What tensor parallelism of size `tp` splits in the recipe's ViT (its depth and the bytes of
    one sample's activations between blocks, in the compute dtype); None for tp = 1. Refused in
    one line where tp does not fit: a CLIP (two towers, not modelled yet), heads or widths tp
    does not divide."""
    if tp <= 1:
        return None
    if "depth" not in info or "tokens" not in info:
        raise UserError(f"--tp: modelled for ViT classifiers, not {info['kind']} models yet")
    if info["heads"] % tp or info["dim"] % tp:
        raise UserError(f"--tp {tp} does not divide the model's heads ({info['heads']}) or width")
    tokens = info["tokens"]
    width = (
        2
        if cfg.train.precision in ("bf16", "bf16_act", "fp16", "pure_bf16", "pure_fp16", "auto")
        else 4
    )
    return cm.TensorParallel(tp, info["depth"], tokens * info["dim"] * width)


def _curves(cost, link_list, strategies, grad_bytes, ks, per_node, bucket_mb, overlap, tp) -> list:
    """One scaling table (comm_model.scaling_table over `ks` GPUs) per link and strategy."""
    curves = []
    for label, intra, inter in link_list:
        for st in strategies:
            rows = cm.scaling_table(
                cost, st, grad_bytes, ks, intra, inter, per_node, bucket_mb * 1e6, overlap, tp
            )
            curves.append(
                {
                    "link": label,
                    "intra": intra.name,
                    "inter": inter.name,
                    "strategy": st,
                    "rows": rows,
                }
            )
    return curves


def _default_reduce_dtype(s) -> str:
    """The gradients' dtype the strategy config `s` reduces in: bf16 or fp16 when it compresses
    them, else fp32."""
    return (
        "bf16"
        if "bf16" in (s.grad_compression, s.reduce_dtype)
        else "fp16"
        if s.grad_compression == "fp16"
        else "fp32"
    )


def _step_cost(cfg, info: dict, bench: dict | None, gpu: str, mfu: float):
    """(StepCost on one GPU, where it comes from): the bench result's split, else estimated from
    the train FLOPs per image, `gpu`'s peak for the run's precision and `mfu`."""
    if bench is not None:
        return step_cost_from_bench(bench, cfg.train.accum_steps)
    precision = cfg.train.precision
    if precision == "auto":  # bf16 on a GPU that has bf16 tensor cores (a bf16 peak), else fp32
        precision = "bf16" if gpu_peak(gpu, "bf16") else "fp32"
    dtype = compute_dtype_name(precision, cfg.train.tf32)  # a GPU: TF32 when on
    peak = gpu_peak(gpu, dtype)
    if not peak:
        raise UserError(f"--gpu {gpu}: no {dtype} peak in hardware.GPU_PEAKS")
    cost = step_cost_estimate(
        info["train_flops_per_image"], cfg.data.batch_size, peak, mfu, cfg.train.accum_steps
    )
    source = (
        f"estimated: {info['train_flops_per_image'] / 1e9:.3g} GFLOP/image x {cfg.data.batch_size} "
        f"/ ({gpu} {dtype} peak {peak / 1e12:.3g} TFLOP/s x MFU {mfu:g}); optimizer and data time not modelled"
    )
    return cost, source


def markdown(result: dict) -> str:
    r = result
    lines = [
        f"{r['arch']}: {r['params'] / 1e6:.2f}M params, gradients {r['grad_bytes'] / 1e6:.1f} MB "
        f"({r['reduce_dtype']}), batch {r['batch']:g} per device at 1 GPU, step {1e3 * r['step_1gpu_s']:.1f} ms "
        f"({r['source']}); {r['per_node']} GPUs/node, buckets {r['bucket_mb']:g} MB, overlap {r['overlap']:g}",
        "",
    ]
    for c in r["curves"]:
        tp = f" x tensor parallel {r['tp']}" if r.get("tp", 1) > 1 else ""
        lines += [
            f"### {STRATEGY_NAMES[c['strategy']]}{tp} over {c['link']} ({c['intra']} / {c['inter']})",
            "",
            "| GPUs | strong speedup | strong eff. | weak eff. | weak img/s | comm/step ms | TP comm/step ms | exposed share (weak) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in c["rows"]:
            lines.append(
                f"| {row['gpus']} | {row['strong_speedup']:.2f} | {100 * row['strong_efficiency']:.1f}% | "
                f"{100 * row['weak_efficiency']:.1f}% | {row['weak_images_per_s']:.0f} | "
                f"{1e3 * row['comm_s']:.2f} | {1e3 * row.get('tp_comm_s', 0.0):.2f} | "
                f"{100 * row['weak_comm_share']:.1f}% |"
            )
        lines.append("")
    return "\n".join(lines)


def run(args) -> int:
    cfg = check_config(load_config(args.config, args.overrides))
    bench = None
    if args.bench:
        try:
            bench = json.loads(Path(args.bench).read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"--bench {args.bench}: not JSON ({e})") from None
    links, measured = args.link, None
    if links and "loopback" in links:  # measure this machine's gloo all-reduce and use it as a link
        m = measure_gloo(2)
        measured = m
        cm.LINKS["loopback"] = cm.Link(
            f"gloo loopback, measured {m['bw'] / 1e9:.2f} GB/s, {1e6 * m['latency']:.0f} us",
            m["bw"],
            m["latency"],
        )
        print(
            f"measured gloo all-reduce between 2 local processes: bandwidth {m['bw'] / 1e9:.3f} GB/s, latency "
            f"{1e6 * m['latency']:.1f} us per ring step; "
            + ", ".join(f"{b / 2**20:g} MiB {1e3 * t:.2f} ms" for b, t in m["rows"])
        )
    result = predict(
        cfg,
        bench=bench,
        links=links,
        gpus=_ints(args.gpus),
        per_node=args.per_node,
        bucket_mb=args.bucket_mb,
        overlap=args.overlap,
        strategies=[s.strip() for s in args.strategy.split(",") if s.strip()],
        reduce_dtype=args.reduce_dtype,
        gpu=args.gpu,
        mfu=args.mfu,
        tp=args.tp,
    )
    if measured:
        result["loopback_measurement"] = measured
    text = markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "predict.md").write_text(text + "\n")
        (out / "predict.json").write_text(json.dumps(result, indent=1) + "\n")
        plot_predicted_speedup(result, out / "predict_speedup.png")
        print(f"wrote {out}/predict.md, predict.json, predict_speedup.png")
    return 0
