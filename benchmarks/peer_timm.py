"""vitscale's training step vs timm's VisionTransformer of the same dimensions, in one process.

Three candidates train on one fixed random batch, timed in interleaved rounds (machine noise hits
all of them alike):
  vitscale step   vitscale's Trainer.train_step (the loop's exact step: its optimizer with weight-
                  decay groups, schedule, label smoothing, autocast) on a synthetic-data config
  vitscale model  vitscale's VisionTransformer in the plain loop below
  timm model      timm.models.vision_transformer.VisionTransformer in the same plain loop, its
                  attention kind set to vitscale's (explicit, or fused: timm then calls torch's
                  SDPA, vitscale its attention_kernel, whose CPU bf16 backward is its own)
  timm as shipped the same timm model with timm's own attention default (`fused_attn`: SDPA unless
                  TIMM_FUSED_ATTN says otherwise), when that differs: what a timm user gets at
                  the same dimensions, batch and precision (the frameworks compared)
Plain loop: torch.optim.AdamW(fused=True, lr 1e-3, wd 0.05), cross-entropy, bf16 autocast when the
recipe's precision is bf16, zero_grad(set_to_none). Same patch / dim / depth / heads / MLP ratio /
head (class token or average pool; timm's fc_norm off so that the final norm precedes pooling as in
vitscale) / attention kind (explicit or SDPA; timm's `fused_attn` set to match). timm has no conv
stem, so both sides use stem=patch (the default recipe itself uses stem=conv).

Run it in a virtualenv where timm imports (on CPU-only torch see /work/shared/tools/tv_cpu_stub):
  /tmp/ocvenv/bin/python benchmarks/peer_timm.py --rounds 5 --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

CASES = {
    # the default recipe's model (configs/fashion_mnist.toml) with a patch stem: 32 px, 1 channel, patch 8
    "fashion_mnist (stem=patch)": ("configs/fashion_mnist.toml", ["model.stem=patch"], 1, 10),
    # ViT-Ti/S-like at 224 px would take minutes per step on 2 cores: ViT-Ti dims at 64 px, patch 8
    "vit_tiny_patch8 @64px": (
        "configs/fashion_mnist.toml",
        [
            "model.arch=vit_tiny_patch8",
            "model.dim=0",
            "model.depth=0",
            "model.heads=0",
            "model.mlp_ratio=0",
            "model.head=token",
            "model.attention=sdpa",
            "model.stem=patch",
            "data.image_size=64",
            "data.batch_size=64",
        ],
        3,
        100,
    ),
}


def build(case, precision):
    import torch
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    from vitscale.config import load_config
    from vitscale.lab.timing import Bench
    from vitscale.models.vit import VisionTransformer, ViTSpec
    from vitscale.tasks import model_info

    path, sets, chans, classes = case
    sets = sets + [
        f"train.precision={precision}",
        "data.name=synthetic",
        f"data.channels={chans}",
        f"data.num_classes={classes}",
        "run.progress=off",
        "run.tensorboard=false",
        "train.eval_hflip_tta=false",
        "optim.warmup_epochs=0",
    ]
    cfg = load_config(str(ROOT / path), sets)
    from vitscale.config import set_value

    set_value(cfg, "data.train_size", cfg.data.batch_size * 2)
    info = model_info(cfg)
    spec = ViTSpec(**{k: info[k] for k in ViTSpec.__dataclass_fields__ if k in info})

    def timm_vit():
        return TimmViT(
            img_size=spec.image_size,
            patch_size=spec.patch_size,
            in_chans=spec.in_chans,
            num_classes=spec.num_classes,
            embed_dim=spec.dim,
            depth=spec.depth,
            num_heads=spec.heads,
            mlp_ratio=spec.mlp_ratio,
            qkv_bias=True,
            class_token=spec.head == "token",
            global_pool="token" if spec.head == "token" else "avg",
            fc_norm=False,
        )

    timm, shipped = timm_vit(), timm_vit()
    shipped.load_state_dict(timm.state_dict())
    fused = {
        m.fused_attn for m in shipped.modules() if hasattr(m, "fused_attn")
    }  # timm's own default
    for m in timm.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = spec.attention == "sdpa"
    models = {"timm model": timm}
    if fused != {
        spec.attention == "sdpa"
    }:  # timm as a user gets it picks the other attention kernel
        models[f"timm model, as shipped (fused_attn={fused.pop()})"] = shipped
    ours = VisionTransformer(spec)
    n_ours, n_timm = (sum(p.numel() for p in m.parameters()) for m in (ours, timm))
    b = cfg.data.batch_size
    x = torch.randn(b, spec.in_chans, spec.image_size, spec.image_size)
    y = torch.randint(0, spec.num_classes, (b,))
    bench = Bench(cfg, synthetic=True)
    return cfg, spec, bench, {"vitscale model": ours, **models}, (x, y), (n_ours, n_timm)


def plain_step_fn(model, batch, bf16):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, fused=True)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = batch

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def run_case(name, case, precision, rounds, steps, warmup):
    import torch

    cfg, spec, bench, models, batch, (n_ours, n_timm) = build(case, precision)
    bf16 = precision == "bf16"
    fns = {"vitscale step": lambda: bench.trainer.train_step(bench.fixed)}
    fns.update({k: plain_step_fn(m.train(), batch, bf16) for k, m in models.items()})
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))  # alternate who goes first
        for k in order:
            t0 = time.perf_counter()
            for _ in range(steps):
                fns[k]()
            if torch.cuda.is_available():  # the step leaves its work queued on the GPU
                torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t0) / steps)
    bench.close()
    b = cfg.data.batch_size
    ips = {k: b / statistics.median(v) for k, v in times.items()}
    print(
        f"\n## {name}: {spec.image_size}px, patch {spec.patch_size}, dim {spec.dim}, depth {spec.depth}, heads "
        f"{spec.heads}, mlp {spec.mlp_ratio}, head={spec.head}, attention={spec.attention}, {precision}, batch {b}; "
        f"params vitscale {n_ours:,} / timm {n_timm:,}\n"
    )
    shipped = next((k for k in ips if k.startswith("timm model, as shipped")), None)
    print(
        "| candidate | median step ms (min-max over rounds) | img/s | vs timm model (same attention) |"
        + (
            " vs timm as shipped |\n|---|---:|---:|---:|---:|"
            if shipped
            else "\n|---|---:|---:|---:|"
        )
    )
    for k, v in times.items():
        print(
            f"| {k} | {1e3 * statistics.median(v):.1f} ({1e3 * min(v):.1f}-{1e3 * max(v):.1f}) | {ips[k]:.1f} | "
            f"{ips[k] / ips['timm model']:.3f} |"
            + (f" {ips[k] / ips[shipped]:.3f} |" if shipped else "")
        )
    return ips


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="steps per candidate per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--case", action="append", choices=sorted(CASES), help="default: all")
    args = p.parse_args()
    try:
        import timm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - torchvision's CUDA-only wheel fails with odd errors
        print(
            f"peer_timm: timm cannot be imported here ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            "run this script with a virtualenv that has timm (see the docstring)",
            file=sys.stderr,
        )
        return 2
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from vitscale.lab.machine import machine_line

    print(
        f"# vitscale vs timm {timm.__version__}, torch {torch.__version__}, {machine_line(torch.device('cpu'))}, "
        f"{torch.get_num_threads()} threads; {args.rounds} interleaved rounds x {args.steps} steps after "
        f"{args.warmup} warm-up; command: {' '.join([os.path.basename(sys.executable), *sys.argv])}"
    )
    for name in args.case or list(CASES):
        run_case(name, CASES[name], args.precision, args.rounds, args.steps, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
