"""Memory each rank really holds, per engine and model size, against the 16-bytes-per-parameter formula.

For every (model, engine) point this launches 2 processes with torchrun (gloo, CPU) on synthetic data,
runs a few training steps (the loop's own `Trainer.train_step`, through `lab.timing.Bench`), then one
more step taken apart so that it can look between backward and the optimizer step. Per rank it records:

- `state`: the trainer's `state_bytes()` after the step, as `summary.json`'s `state_bytes_per_rank`
  (local parameter shards, fp32 master copies, optimizer state; gradients are NOT in it)
- `grads`: bytes of the module parameters' `.grad` after backward (local shards for FSDP2); DeepSpeed
  keeps ZeRO-1/2/3 gradients in buffers of its own, so this reads 0 or the full size there: see
  `live_after_backward`
- `live_after_backward` / `live_after_step`: every tensor storage the Python side can reach (gc
  objects, their `.grad`, DTensor local shards), deduplicated by storage: what the process holds in
  tensors at the step's two high points, activations freed or not yet made
- `peak_rss_growth`: peak RSS growth of the process over set-up and steps (`ru_maxrss`), what
  `vitscale bench` reports on CPUs (activations, allocator and library overheads included)
- `saved_activations`: bytes of the tensors the measured step's forward saves for backward
  (`torch.autograd.graph.saved_tensors_hooks`, local shards of DTensors, each storage once) that
  carry the micro-batch in their first dimension, parameters left out: the activation memory, which
  tensor parallelism (`--engines fsdp_tp2`) splits and data parallelism does not

  flock /tmp/vitscale-bench.lock .venv/bin/python benchmarks/memory_per_rank.py --out runs/memory-per-rank
  python benchmarks/memory_per_rank.py --models default --engines ddp,fsdp --steps 2   # quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# The default recipe on synthetic 1-channel 32 px data; larger registry models replace its model.
BASE = [
    "data.name=synthetic",
    "data.channels=1",
    "data.num_classes=10",
    "data.train_size=256",
    "data.test_size=64",
    "run.threads=1",
    "train.precision=fp32",
    "optim.impl=foreach",
]
PLAIN_VIT = [
    "model.dim=0",
    "model.depth=0",
    "model.heads=0",
    "model.mlp_ratio=0",
    "model.patch_size=0",
    "model.stem=patch",
    "model.head=token",
    "model.attention=sdpa",
]
MODELS = {
    "default": [],  # vit_nano_patch8, conv stem
    "default-bf16": ["train.precision=bf16", "optim.impl=fused"],  # the recipe as it is
    "small": ["model.arch=vit_small_patch4", *PLAIN_VIT],  # ViT-S/4 at 32 px
    "base": ["model.arch=vit_base_patch16", *PLAIN_VIT],  # ViT-B/16 at 32 px
}
ENGINES = {
    "ddp": ["strategy.name=ddp"],
    "z0": ["strategy.name=deepspeed", "strategy.zero_stage=0"],
    "z1": ["strategy.name=deepspeed", "strategy.zero_stage=1"],
    "z2": ["strategy.name=deepspeed", "strategy.zero_stage=2"],
    "z3": ["strategy.name=deepspeed", "strategy.zero_stage=3"],
    "fsdp": ["strategy.name=fsdp"],
    "fsdp_tp2": ["strategy.name=fsdp", "strategy.tp=2"],  # tensor parallel over 2 (issue 49)
    "fsdp_tp2_sp": ["strategy.name=fsdp", "strategy.tp=2", "strategy.sequence_parallel=true"],
}
# formula (docs/distributed.md): bytes per parameter per rank at N processes, fp32 weights + grads + AdamW
FORMULA = {
    "ddp": lambda n: 16,
    "z0": lambda n: 16,
    "z1": lambda n: 8 + 8 / n,
    "z2": lambda n: 4 + 12 / n,
    "z3": lambda n: 16 / n,
    "fsdp": lambda n: 16 / n,
    # the blocks' weights split over tp (embeddings, norms and the head replicated: a little more)
    "fsdp_tp2": lambda n: 16 / n,
    "fsdp_tp2_sp": lambda n: 16 / n,
}
# the same without the gradients (what state_bytes counts)
FORMULA_NO_GRAD = {
    "ddp": lambda n: 12,
    "z0": lambda n: 12,
    "z1": lambda n: 4 + 8 / n,
    "z2": lambda n: 4 + 8 / n,
    "z3": lambda n: 12 / n,
    "fsdp": lambda n: 12 / n,
    "fsdp_tp2": lambda n: 12 / n,
    "fsdp_tp2_sp": lambda n: 12 / n,
}


def saved_activation_bytes(step, batch: int, params) -> int:
    """Run `step()` (a forward and backward) and return the bytes of the tensors its forward saves
    for backward that carry `batch` in their first dimension (activations), each local storage once,
    the parameters' own storages left out."""
    import torch

    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    skip = {local(p).untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        x = local(t)
        if x.dim() and x.shape[0] == batch:
            ptr = x.untyped_storage().data_ptr()
            if ptr not in skip:
                seen[ptr] = x.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def live_tensor_bytes(top: int = 0):
    """Bytes of every distinct tensor storage reachable from Python objects (and their .grad); with
    top > 0 also the `top` largest storages as (MiB, dtype, shape of one tensor on it)."""
    import torch

    seen, total, big = set(), 0, []

    def add(t):
        nonlocal total
        if t is None:
            return
        if hasattr(t, "to_local"):
            t = t.to_local()
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = st.data_ptr()
        if key == 0 or key in seen or t.device.type == "meta":
            return
        seen.add(key)
        total += st.nbytes()
        if top:
            big.append((round(st.nbytes() / 2**20, 1), str(t.dtype), list(t.shape)))

    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                add(obj)
                add(obj.grad)
        except Exception:  # noqa: BLE001 - some tensor subclasses refuse introspection
            continue
    return (total, sorted(big, reverse=True)[:top]) if top else total


def rss_bytes() -> int:
    """The process's resident set now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(config: str, sets: list[str], warmup: int) -> None:

    import torch

    from vitscale.lab.machine import max_rss_bytes
    from vitscale.lab.recipes import lab_config
    from vitscale.lab.timing import Bench
    from vitscale.run_report import state_bytes

    cfg = lab_config(config, sets)
    rss0, rss_start = max_rss_bytes(), rss_bytes()
    b = Bench(cfg, synthetic=True)
    s, tr = b.s, b.trainer
    if warmup:
        b.steps(warmup)
    # one step taken apart (the step function's own parts): backward, look, optimizer step, look
    micro = b.fixed[0].shape[0] // cfg.train.accum_steps
    params = list(s.module.parameters())
    acts = saved_activation_bytes(lambda: tr.step_fn.forward_backward(b.fixed), micro, params)
    gc.collect()

    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    grads = sum(local(p.grad) for p in s.module.parameters() if p.grad is not None)
    live_bwd, top_bwd = live_tensor_bytes(top=4)
    rss_bwd = rss_bytes()
    s.step()
    tr.task.after_step()
    gc.collect()
    live_step = live_tensor_bytes()
    # ZeRO-3 keeps each rank's parameter partition in p.ds_tensor (p.data is an empty placeholder,
    # or the whole tensor for the small "persistent" ones): state_bytes' "params" misses it
    ds_part = sum(
        local(p.ds_tensor)
        for p in s.module.parameters()
        if getattr(p, "ds_tensor", None) is not None
    )
    rec = {
        "rank": s.rank,
        "params": tr.params,
        "state": state_bytes(s, tr.task),
        "grads": grads,
        "saved_activations": acts,
        "zero3_partitions": ds_part,
        "live_after_backward": live_bwd,
        "live_after_step": live_step,
        "largest_storages_after_backward": top_bwd,
        "rss_after_backward": rss_bwd,
        "rss_before_setup": rss_start,
        "peak_rss_growth": max_rss_bytes() - rss0,
        "world_size": s.world_size,
        "strategy": s.name,
        "precision": cfg.train.precision,
        "torch": torch.__version__,
    }
    per_rank = s.gather_objects(rec)
    if s.rank == 0:
        print("RESULT " + json.dumps(per_rank), flush=True)
    b.close()
    s.close()
    sys.stdout.flush()
    os._exit(0)  # as the CLI does after a multi-process run: no teardown aborts from the engines


def run_point(config, sets, nproc, warmup, port, timeout):
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        str(Path(__file__).resolve()),
        "--worker",
        "--config",
        config,
        "--warmup",
        str(warmup),
        *[a for x in sets for a in ("--set", x)],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    for ln in p.stdout.splitlines():
        if ln.startswith("RESULT "):
            return json.loads(ln[7:]), None
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    return None, (err[-1] if err else f"exit {p.returncode}")[:300]


def mib(x) -> str:
    return f"{x / 2**20:.1f}"


def table(records: list[dict]) -> str:
    """Rank 0's numbers (the ranks agree to 0.1 MiB; FSDP2's uneven shards by less than 1%)."""
    head = (
        "| model | params P | engine | precision | state_bytes_per_rank MiB (params + master + optimizer) "
        "| ZeRO-3 partitions not in it MiB | tensors held after backward MiB (bytes/P) | formula MiB "
        "(bytes/P) | activations saved for backward MiB | RSS after backward MiB | peak RSS growth MiB |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        if not r.get("ok"):
            lines.append(f"| {r['model']} | | {r['engine']} | | failed: {r['error']} | | | | | | |")
            continue
        x, n = r["ranks"][0], r["nproc"]
        P, st, f = x["params"], x["state"], FORMULA[r["engine"]](n)
        state = st["params"] + st["master_params"] + st["optimizer_state"]
        held = x["live_after_backward"]
        lines.append(
            f"| {r['model']} | {P / 1e6:.2f}M | {r['engine']} | {x['precision']} | {mib(state)} "
            f"({mib(st['params'])} + {mib(st['master_params'])} + {mib(st['optimizer_state'])}) | "
            f"{mib(x.get('zero3_partitions', 0)) if x.get('zero3_partitions') else '-'} | "
            f"{mib(held)} ({held / P:.1f}) | {mib(f * P)} ({f:g}) | "
            f"{mib(x['saved_activations']) if 'saved_activations' in x else '-'} | "
            f"{mib(x['rss_after_backward'] - x['rss_before_setup']) if 'rss_after_backward' in x else '-'} | "
            f"{mib(x['peak_rss_growth'])} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default=str(ROOT / "configs" / "fashion_mnist.toml"))
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--models", default="default,small,base", help=f"of {', '.join(MODELS)}")
    ap.add_argument("--engines", default="ddp,z0,z1,z2,z3,fsdp", help=f"of {', '.join(ENGINES)}")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument(
        "--batch", type=int, default=16, help="global batch (small: memory is the point)"
    )
    ap.add_argument("--warmup", type=int, default=2, help="training steps before the measured one")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default="runs/memory-per-rank")
    args = ap.parse_args()
    if args.worker:
        worker(args.config, args.set, args.warmup)
        return 0
    from vitscale.strategy.dist import free_port

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for m in args.models.split(","):
        for e in args.engines.split(","):
            sets = [*BASE, f"data.batch_size={args.batch}", *MODELS[m], *ENGINES[e], *args.set]
            t0 = time.perf_counter()
            ranks, err = run_point(
                args.config, sets, args.nproc, args.warmup, free_port(), args.timeout
            )
            rec = {
                "model": m,
                "engine": e,
                "nproc": args.nproc,
                "sets": sets,
                "ok": ranks is not None,
                "error": err,
                "ranks": ranks,
                "wall_s": round(time.perf_counter() - t0, 1),
            }
            records.append(rec)
            with (out / "results.jsonl").open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(
                f"{m} {e}: {'ok' if ranks else 'FAILED ' + str(err)} ({rec['wall_s']}s)", flush=True
            )
    md = table(records)
    (out / "results.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
