"""Command line: vitscale {train,eval,info,export,config,data,bench,sweep,ladder,tune,predict} ...
(hyperparameters live in configs)."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path

from .config import add_overrides, add_recipe_arguments
from .errors import ConfigError, SaveError, UserError
from .lab import commands as lab_commands
from .launch import this_process

EPILOG = """examples:
  vitscale train                                   # default recipe: ViT on Fashion-MNIST
  vitscale train configs/cifar10.toml --set optim.lr=1e-3 --set train.epochs=30
  vitscale train --set train.precision=fp32 --out runs/fp32
  vitscale train --resume runs/fp32                # continue where it stopped
  vitscale eval runs/fp32                          # test accuracy of the latest checkpoint
  vitscale export runs/fp32 --out vit.safetensors
  vitscale info configs/vit_b16_imagenet.toml --json
  vitscale data download cifar10
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vitscale",
        description="Train Vision Transformers fast.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_commands(sub)
    _add_data_commands(sub)
    _add_lab_commands(sub)
    return p


def add_launcher_arguments(parser) -> None:
    """train's launcher options (torchrun's names; strategy/elastic.py starts the ranks)."""
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=0,
        metavar="N",
        help="start N processes on this machine through torch's elastic launcher (torchrun's "
        "engine): one command owns their output and exit status (docs/distributed.md)",
    )
    parser.add_argument("--nnodes", default="1", help="with --nproc-per-node: nodes (or MIN:MAX)")
    parser.add_argument(
        "--rdzv-endpoint", default="", help="with --nnodes > 1: HOST:PORT of the rendezvous"
    )
    parser.add_argument("--rdzv-id", default="", help="with --nnodes > 1: the job's id")


def _add_run_commands(sub) -> None:
    """train, eval, info, config and export: the commands on a recipe or a checkpoint."""
    t = sub.add_parser(
        "train",
        help="train a model (no CONFIG = the default Fashion-MNIST recipe)",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe_arguments(t)
    t.add_argument("--out", help="run folder (default: run.out_dir/run.name-TIMESTAMP)")
    t.add_argument(
        "--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint"
    )
    add_launcher_arguments(t)

    e = sub.add_parser("eval", help="evaluate a checkpoint (file or run folder) on its test set")
    e.add_argument("checkpoint")
    add_overrides(e)
    e.add_argument("--json", action="store_true", help="print JSON only")

    i = sub.add_parser("info", help="print parameters and FLOPs per image of a recipe's model")
    add_recipe_arguments(i)
    i.add_argument("--json", action="store_true")

    c = sub.add_parser("config", help="print the resolved config (recipe + overrides) as TOML")
    add_recipe_arguments(c)

    x = sub.add_parser("export", help="export a checkpoint's model weights to safetensors")
    x.add_argument("checkpoint")
    x.add_argument(
        "--out",
        help="output file (default: RUN/model.safetensors); --format timm: a file, with "
        "config.json beside it, or a folder (default: RUN/timm)",
    )
    x.add_argument(
        "--no-ema", action="store_true", help="export the raw weights even when EMA is on"
    )
    x.add_argument(
        "--format",
        choices=("vitscale", "timm", "open_clip"),
        default="vitscale",
        help="key layout: vitscale's (default), timm's VisionTransformer (a hub folder: "
        "model.safetensors and config.json, with the timm.create_model call printed) or "
        "OpenCLIP's CLIP (a model with OpenCLIP's layout: one started from an OpenCLIP file)",
    )


def _add_data_commands(sub) -> None:
    """data download and data prepare."""
    d = sub.add_parser("data", help="dataset utilities")
    dsub = d.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    dl = dsub.add_parser("download", help="fetch an official archive and check its md5")
    dl.add_argument("name", choices=["cifar10", "cifar100", "fashion-mnist"])
    dl.add_argument("--root", help="target folder (default: the dataset's default location)")
    pr = dsub.add_parser(
        "prepare",
        help="an image folder or a CSV of images and captions -> shards of "
        "pre-resized JPEGs (parallel, resumable, with a manifest)",
        description="Write webdataset shards of pre-resized JPEGs with their labels or "
        "captions and sample indices, plus DIR/manifest.json. Rerun the same "
        "command to resume: finished shards are kept.",
    )
    pr.add_argument(
        "src",
        metavar="SRC",
        help="ImageNet-style folder (SRC/train/<class>/*.jpg and "
        "SRC/val/<class>/...) or a .csv/.tsv of image paths and captions",
    )
    pr.add_argument("--out", required=True, metavar="DIR", help="output folder")
    pr.add_argument(
        "--size",
        type=int,
        default=256,
        help="shorter side of the stored images; smaller images are not upscaled (default: 256)",
    )
    pr.add_argument("--quality", type=int, default=90, help="JPEG quality 1..100 (default: 90)")
    pr.add_argument(
        "--shard-size", type=int, default=1000, help="samples per shard (default: 1000)"
    )
    pr.add_argument(
        "--workers", type=int, default=None, help="processes (default: the number of CPUs)"
    )
    pr.add_argument("--seed", type=int, default=0, help="shuffle of the train split (default: 0)")
    pr.add_argument(
        "--image-key", default="filepath", help="CSV column of the image paths (default: filepath)"
    )
    pr.add_argument(
        "--caption-key", default="title", help="CSV column of the captions (default: title)"
    )
    pr.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="CSV: fraction held out as the val split, by crc32 of the image path as written "
        "(data.test_fraction's split); 0 = no val split (default: 0.1)",
    )


def _add_lab_commands(sub) -> None:
    """The performance lab: lab/commands.py declares each command's help and arguments (light: no
    torch); the command's module, with its `run(args)`, is imported only when the command runs."""
    lab_commands.add_parsers(sub)


def cmd_train(args) -> int:
    from .loop import train
    from .run_state import train_request
    from .stop import PREEMPTED, exit_status
    from .tasks import describe_result

    if args.nproc_per_node:
        return launch_ranks(args)
    # a new run, a --resume, or torchrun --max-restarts bringing a run back (run_state decides)
    cfg, run_dir, resume = train_request(args.config, args.resume, args.overrides, args.out)
    summary = train(cfg, run_dir, resume=resume)
    # saved where it stopped: a status the scheduler acts on
    if summary["stop_reason"] in PREEMPTED:
        if summary["rank"] == 0:
            print(
                f"vitscale: stopped by {summary['stop_reason']} at step {summary['step']} of "
                f"{summary['total_steps']} (epoch {summary['epoch']:.2f}); checkpoint {summary['checkpoint']}; "
                f"continue with: vitscale train --resume {summary['run_dir']}",
                file=sys.stderr,
            )
        return exit_status(summary["stop_reason"])
    if summary["rank"] != 0:
        return 0
    if summary["stop_reason"] == "finished":  # resumed at its end: nothing trained or written
        done = json.loads((Path(summary["run_dir"]) / "summary.json").read_text())
        more = "run.max_steps=M" if summary["capped"] else "train.epochs=N"
        print(
            f"vitscale: {summary['run_dir']} is finished at step {summary['step']} of "
            f"{summary['total_steps']}: {describe_result(done)}{targets_text(done)}; nothing to "
            f"train (for more steps: --resume {summary['run_dir']} --set {more})"
        )
        return 0
    print(
        f"{describe_result(summary)} after {summary['epochs']:.2f} epochs, {summary['train_time_s']:.0f}s "
        f"training, {summary['images_per_s']:.0f} img/s, MFU {100 * summary['mfu']:.1f}%"
        f"{targets_text(summary)}; run folder {summary['run_dir']}"
    )
    return 0


def launch_ranks(args) -> int:
    """--nproc-per-node: a new run's config checked here, once, for the world it asks for (one
    line, exit 2, before any rank starts), its folder named here so that every rank and this
    command agree on it; then the ranks (elastic.launch)."""
    import time

    from .checks import check_run
    from .run_state import train_request

    if this_process().world_size > 1:
        raise UserError("train: --nproc-per-node starts the ranks itself; not under torchrun")
    if args.nproc_per_node < 1:
        raise UserError(f"train: --nproc-per-node {args.nproc_per_node}: at least 1")
    argv = list(args.argv)
    run_dir = Path(args.resume or args.out) if (args.resume or args.out) else None
    if not args.resume:
        cfg, _, _ = train_request(args.config, None, args.overrides, args.out)
        nodes = int(str(args.nnodes).split(":")[-1])
        check_run(cfg, world_size=args.nproc_per_node * nodes)
        if run_dir is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            run_dir = Path(cfg.run.out_dir) / f"{cfg.run.name}-{stamp}"
            argv += ["--out", str(run_dir)]
    from .strategy import elastic

    return elastic.launch(args, argv, run_dir)


def targets_text(summary: dict) -> str:
    """The closing line's "; 90% at 41.2s (epoch 2), 91% not reached" (train.targets), or ""."""
    from .run_report import describe_targets

    times = summary.get("time_to_target")
    return f"; {describe_targets(times)}" if times else ""


def cmd_eval(args) -> int:
    from .evaluate import evaluate_checkpoint
    from .tasks import describe_result

    result = evaluate_checkpoint(args.checkpoint, args.overrides)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{describe_result(result)} from {result['checkpoint']}")
    return 0


def cmd_info(args) -> int:
    from .checks import check_run
    from .config import load_config
    from .optim import split_line
    from .tasks import model_info, task_class

    info = model_info(check_run(load_config(args.config, args.overrides)))
    print(json.dumps(info) if args.json else task_class(info["kind"]).info_line(info))
    if "optimizer_split" in info and not args.json:
        print(split_line(info["optimizer_split"]))
    return 0


def cmd_config(args) -> int:
    from .checks import check_run
    from .config import load_config

    print(check_run(load_config(args.config, args.overrides)).to_toml(), end="")
    return 0


def cmd_export(args) -> int:
    from .evaluate import export_checkpoint

    path = export_checkpoint(args.checkpoint, args.out, use_ema=not args.no_ema, fmt=args.format)
    print(f"wrote {path}")
    if args.format == "open_clip":
        from .interop.open_clip.convert import CONFIG_FILE, load_call

        print(f"wrote {path.parent / CONFIG_FILE}")
        print(load_call(path))
    # the call that builds the trained function, with its preprocessing config
    if args.format == "timm":
        from .interop.timm.vision_transformer import (
            hub_config_path,
            read_hub_config,
            timm_load_call,
        )

        print(f"wrote {hub_config_path(path)}")
        print(f"load it: {timm_load_call(read_hub_config(path), path)}")
    return 0


def cmd_data(args) -> int:
    if args.data_command == "prepare":
        from .data.offline.prepare import prepare_shards

        try:
            done = prepare_shards(
                args.src,
                args.out,
                size=args.size,
                quality=args.quality,
                shard_size=args.shard_size,
                workers=args.workers,
                seed=args.seed,
                image_key=args.image_key,
                caption_key=args.caption_key,
                val_fraction=args.val_fraction,
            )
        except KeyboardInterrupt:
            print(
                "vitscale: interrupted; finished shards are kept: rerun the same command to resume",
                file=sys.stderr,
            )
            return 130
        print(f"prepared {done.summary()}")
        return 0
    from .data.offline.fetch import download

    path = download(args.name, args.root)
    print(f"{args.name} ready in {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="vitscale: warning: %(message)s")
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    handler = {
        "train": cmd_train,
        "eval": cmd_eval,
        "info": cmd_info,
        "export": cmd_export,
        "config": cmd_config,
        "data": cmd_data,
    }.get(args.command)
    if handler is None:  # a performance-lab command (lab/commands.py): its module, imported now
        handler = importlib.import_module(f".lab.{args.command}", __package__).run
    launch = this_process()
    where = f"[rank {launch.rank}] " if launch.world_size > 1 else ""
    try:
        rc = handler(args)
    except UserError as e:
        return refused(e, launch.rank, where)
    except OSError as e:  # unreadable/unwritable paths, full disk: one line, nothing half-written
        print(
            f"vitscale: error: {where}{e.strerror or e}: {e.filename or ''}".rstrip(": "),
            file=sys.stderr,
        )
        return 2
    except Exception as e:
        from .strategy.dist import is_comm_failure

        if not (where and is_comm_failure(e)):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"vitscale: error: {where}lost contact with another process ({first[:300]}); stopping. "
            "The last complete checkpoint is kept: resume with `vitscale train --resume RUN`, or launch "
            "with `torchrun --max-restarts N ... --out RUN` to restart and resume automatically",
            file=sys.stderr,
        )
        # leave now: the broken process group's C++ destructors can abort (SIGABRT) at interpreter
        # exit when a peer is gone, which would turn this clean exit 1 into a crash
        _exit_now(1)
    except KeyboardInterrupt:
        print(
            "vitscale: interrupted; the last complete checkpoint is kept (resume with --resume RUN)",
            file=sys.stderr,
        )
        return 130
    if where:
        # a finished multi-process run: leave without the interpreter's teardown, where the threads
        # of gloo / DeepSpeed's communication backend can abort the process (SIGABRT, "terminate
        # called without an active exception") after all work is written
        _exit_now(rc)
    return rc


def refused(e: UserError, rank: int, where: str) -> int:
    """The one line of an input error, and status 2. A config refusal or a refused save is every
    rank's: rank 0 says it, the others exit with the same status; a process with a process group
    leaves without the teardown that can abort (gloo's threads: _exit_now)."""
    from .strategy.dist import group_started

    if not (isinstance(e, (ConfigError, SaveError)) and rank != 0):
        print(f"vitscale: error: {where}{one_line(e)}", file=sys.stderr)
    if group_started():
        _exit_now(2)
    return 2


def one_line(e: UserError) -> str:
    """The error's own message. One re-raised from a DataLoader worker carries torch's "Caught X in
    DataLoader worker process N. Original Traceback ..." wrapper: its last line is the message."""
    text = str(e)
    if "Original Traceback" not in text:
        return text
    last = [x for x in text.strip().splitlines() if x.strip()][-1]
    prefix = f"{type(e).__module__}.{type(e).__qualname__}: "
    return (
        last[len(prefix) :] if last.startswith(prefix) else last.split(": ", 1)[-1]
    ) + " (in a data-loading worker)"


def _exit_now(rc: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
