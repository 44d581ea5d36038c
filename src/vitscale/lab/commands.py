"""The lab's commands on the command line: for each (bench, sweep, ladder, tune, predict, search)
its one-line help, its description (`vitscale COMMAND --help`) and its arguments.

Light on purpose: the CLI builds its parser from this module alone, so `vitscale --help` and the
commands that measure nothing (config, info) import no torch. A command's implementation,
lab/COMMAND.py (lab/search/ for search) with its `run(args)`, is imported when the command runs, and
imports what it needs at its top."""

from __future__ import annotations

import argparse

from ..config import add_recipe_arguments

# the --skip names of the ladder's rungs, in rung order (ladder.build_rungs builds them)
LADDER_RUNGS = (
    "tf32",
    "precision",
    "foreach",
    "fused",
    "pool",
    "sdpa",
    "sdpa_backend",
    "compile",
    "autotune",
    "cudagraphs",
    "capture",
    "batch",
    "sharding",
)
SWEEP_STUDIES = ("strong", "weak", "batch", "accum", "memory", "mesh")
REDUCE_DTYPES = ("bf16", "fp16", "fp32")  # predict --reduce-dtype (predict.DTYPE_BYTES's keys)


def add_synthetic_argument(p) -> None:
    """`--synthetic`, one definition for bench, ladder, tune and sweep (which passes it to bench)."""
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="synthetic images of the dataset's shape, one batch reused: no dataset needed, no data cost",
    )


# -- bench ----------------------------------------------------------------------------------------
BENCH_HELP = "time the training step: img/s, MFU, memory, forward/backward/comm/optimizer split"
BENCH_DESCRIPTION = """Time the training step of a recipe: images/s, step time over trials, MFU, peak memory and the
step split (data / forward / backward / communication / optimizer).

The headline numbers come from un-instrumented steps (`Trainer.train_step`, exactly what training
runs; warm-up excluded; synchronized timers). The split comes from a separate instrumented pass on
one batch, with a sync between phases.

examples:
  vitscale bench                                   # the default recipe
  vitscale bench configs/vit_b16_imagenet.toml --synthetic --set train.precision=bf16
  torchrun --nproc-per-node 2 -m vitscale bench configs/tests/tiny.toml --set strategy.name=ddp --json
  vitscale bench configs/vit_b16_imagenet.toml --peer timm --set train.precision=bf16   # beside timm's ViT
"""


def bench_arguments(p) -> None:
    add_recipe_arguments(p)
    p.add_argument("--steps", type=int, default=20, help="timed steps per trial (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps (default 5)")
    p.add_argument("--trials", type=int, default=3, help="trials of --steps steps (default 3)")
    p.add_argument(
        "--split-steps",
        type=int,
        default=0,
        help="steps of the instrumented split pass (default: min(steps, 5))",
    )
    add_synthetic_argument(p)
    p.add_argument(
        "--peer",
        choices=("timm",),
        help="also time timm's VisionTransformer of the same function "
        "(same weights, batch, precision, compile) in a skilled user's plain loop, in interleaved "
        "paired rounds beside the recipe's step (implies --synthetic)",
    )
    p.add_argument(
        "--beside",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="also time the recipe with this override (repeatable: one candidate with all of "
        "them) in interleaved paired rounds beside the recipe's own step, e.g. "
        "--beside train.capture=step",
    )
    p.add_argument(
        "--each",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="also time the recipe with this one override as a candidate of its own (repeatable: "
        "one candidate each), all in the same interleaved paired rounds beside the recipe; a "
        "candidate that does not validate or compile is reported with its error, not timed",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="paired rounds with --peer, --beside or --each (default 5)",
    )
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--out", help="also write the JSON result to this file")


# -- sweep ----------------------------------------------------------------------------------------
SWEEP_HELP = "benchmark a grid of configs / process counts (strong, weak, batch, accum, memory, mesh studies)"
SWEEP_DESCRIPTION = """Run `vitscale bench` over a grid of config overrides and process counts; tables and plots.

Each point is a subprocess `vitscale bench CONFIG --json` (through torchrun when nproc > 1, with
strategy.name=ddp unless the point sets a strategy). A failing point is recorded with its one-line
error and the sweep goes on. Results go to OUT/results.jsonl (one line per point), results.md and
PNG plots; points already in results.jsonl are skipped, so an interrupted sweep resumes.

studies (presets; --grid/--nproc refine them):
  strong  fixed global batch (the config's), nproc 1..N             speedup and efficiency vs ideal
  weak    fixed per-device batch b: data.batch_size = b x nproc      efficiency vs ideal
  batch   data.batch_size in b/4, b/2, b, 2b                          images/s vs batch
  accum   train.accum_steps in 1, 2, 4, 8 at the same global batch   gradient bytes sent per sample
  memory  nproc 2: ddp, deepspeed ZeRO 0/1/2/3, fsdp                   peak memory and images/s
  mesh    nproc 4: every dp_replicate x dp_shard x tp that makes it      images/s, memory, comm per dim

examples:
  vitscale sweep configs/tests/tiny.toml --grid data.batch_size=16,32 --steps 5
  vitscale sweep configs/fashion_mnist.toml --study strong --nproc 1,2 --set run.threads=1 --out runs/strong
"""


def sweep_arguments(p) -> None:
    add_recipe_arguments(p, set_help="override one config value for every point (repeatable)")
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a swept config key (or nproc); repeatable: the cartesian product is run",
    )
    p.add_argument(
        "--nproc", default=None, metavar="LIST", help="process counts, e.g. 1,2 (default 1)"
    )
    p.add_argument("--study", choices=SWEEP_STUDIES, help="a built-in study (see above)")
    p.add_argument(
        "--steps", type=int, default=None, help="timed steps per point (bench's default if absent)"
    )
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per point")
    p.add_argument("--trials", type=int, default=None, help="bench trials per point")
    add_synthetic_argument(p)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a point is killed")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="results folder (default runs/sweep-<study|grid>)",
    )


# -- ladder ---------------------------------------------------------------------------------------
LADDER_HELP = (
    "ablation ladder: cumulative speed-ups measured side by side, speedups + accuracy, table + PNG"
)
LADDER_DESCRIPTION = """Ablation ladder: from a plain fp32 baseline, add one speed-up at a time (cumulative) and measure
every rung against the baseline in one run: the baseline's Trainer stays in this process, and each
rung's Trainer is built, timed in interleaved rounds with it (round r runs N steps of the
baseline, then N of the rung, each under its own TF32 / cuDNN flags), and freed before the next
rung is built, so at most two rungs are resident (ViT-B/16 rungs with their optimizer state and
CUDA-graph pools would not all fit) and machine noise hits the rung and the baseline alike. Each
rung's row is written (ladder.json, ladder.md) as soon as it is measured, so a time limit loses
nothing. Rungs that change numerics (precision, head, attention kernel, batch) can also be trained
for the same number of steps from the same seed and tested (--train-steps). A rung may be slower
than the one before it: the ladder reports what it measures.

examples:
  vitscale ladder --out runs/ladder                # the default recipe
  vitscale ladder configs/vit_b16_imagenet.toml --synthetic --train-steps 0
  torchrun --nproc-per-node 2 -m vitscale ladder configs/tests/tiny.toml   # + the sharding rung
"""


def ladder_arguments(p) -> None:
    add_recipe_arguments(p)
    p.add_argument(
        "--steps", type=int, default=3, help="timed steps per rung per round (default 3)"
    )
    p.add_argument(
        "--trials",
        type=int,
        default=10,
        help="interleaved rounds (default 10: short rounds pair well for the round-by-round columns)",
    )
    p.add_argument(
        "--warmup", type=int, default=3, help="warm-up steps per rung (compile happens here)"
    )
    p.add_argument(
        "--train-steps",
        type=int,
        default=100,
        help="train numerics-changing rungs this many steps and test them (0 = off; default 100)",
    )
    add_synthetic_argument(p)
    p.add_argument(
        "--skip",
        default="",
        metavar="RUNG,...",
        help=f"leave rungs out (the later ones stay cumulative): {','.join(LADDER_RUNGS)}",
    )
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument(
        "--out", default="runs/ladder", help="folder for ladder.md, ladder.png, ladder.json"
    )


# -- tune -----------------------------------------------------------------------------------------
TUNE_HELP = "search the fastest attention/compile/optimizer/precision/micro-batch for a recipe on this machine"
TUNE_DESCRIPTION = """Find the fastest settings of a recipe on this machine that keep the numerics it allows:
precision (within --allow-precision), attention kernel, optimizer implementation, micro-batch
(the global batch is kept through train.accum_steps; not searched when the model has BatchNorm
layers, as the default recipe's conv stem does, whose batch statistics would then come from smaller
micro-batches, unless --allow-bn-micro-batch) and torch.compile; on a GPU also the SDPA kernel (only
those that pass a gradient check against float64 math at the recipe's attention shape), the compile
mode, inductor's knobs (train.inductor_*: each off unless measured faster) and the whole step
captured. --allow-precision bf16,bf16_act lets it try the bf16 residual stream. Candidates are measured
side by side (interleaved rounds, the ladder's harness), one knob at a time, starting from the
recipe's own values; a candidate replaces the incumbent only if it was faster in more than 2/3 of
the rounds (round by round) and by more than 1% in their median; the micro-batch doubles from a
small one until images/s improves by less than 3% (CPU) or memory runs out (GPU). Writes the tuned
TOML with the measured gain in its header.

examples:
  vitscale tune                                    # the default recipe, its own precision only
  vitscale tune configs/cifar10.toml --allow-precision bf16,fp32 --budget-s 600 --out tuned.toml
"""


def tune_arguments(p) -> None:
    add_recipe_arguments(p)
    p.add_argument(
        "--allow-precision",
        default="",
        metavar="P1,P2",
        help="precisions the search may use (default: the recipe's own only)",
    )
    p.add_argument(
        "--budget-s", type=float, default=300.0, help="stop searching after this many seconds"
    )
    p.add_argument(
        "--steps", type=int, default=2, help="timed steps per candidate per round (default 2)"
    )
    p.add_argument(
        "--trials",
        type=int,
        default=9,
        help="interleaved rounds (default 9: short rounds pair well; a candidate must win more "
        "than 2/3 of them)",
    )
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per candidate (default 2)")
    p.add_argument(
        "--no-compile", action="store_true", help="leave torch.compile out of the search"
    )
    p.add_argument(
        "--allow-bn-micro-batch",
        action="store_true",
        help="search the micro-batch even when the model has BatchNorm layers (their batch "
        "statistics then come from the smaller micro-batch: not the recipe's numerics)",
    )
    add_synthetic_argument(p)
    p.add_argument("--out", default="tuned.toml", help="where to write the tuned recipe")


# -- parity -------------------------------------------------------------------------------------
PARITY_HELP = (
    "does a candidate setting (a precision mode, a kernel, a compile knob) train like the recipe?"
)
PARITY_DESCRIPTION = """Train the recipe N steps with seed A, again with seed B, and the recipe with the candidate's
settings (--candidate KEY=VALUE, repeatable) with seed A, each on its seed's data stream (the seed
decides the initial weights and the data order); average each run's losses over windows of
--window steps. The candidate passes where its largest window difference from the recipe at seed A
is no larger than the recipe's own largest window difference between seeds A and B (the spread:
what a change of seed alone does). Prints one line "parity: PASS|FAIL (...)"; exit status 0 on
PASS, 1 on FAIL; --out writes every loss and window mean as JSON.

examples:
  vitscale parity --candidate train.precision=bf16_act --set train.precision=bf16 --steps 200
  vitscale parity vit_b16_imagenet --synthetic --set data.batch_size=256 --set train.precision=bf16 \
      --set train.compile=true --candidate train.precision=bf16_act --steps 60 --out parity.json
"""


def parity_arguments(p) -> None:
    add_recipe_arguments(p)
    p.add_argument(
        "--candidate",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the candidate's settings over the recipe (repeatable)",
    )
    p.add_argument("--steps", type=int, default=100, help="training steps per run (default 100)")
    p.add_argument(
        "--window", type=int, default=10, help="steps per averaged window of losses (default 10)"
    )
    p.add_argument(
        "--seeds", default="0,1", metavar="A,B", help="the two seeds (default 0,1; A for both)"
    )
    add_synthetic_argument(p)
    p.add_argument("--out", default="", help="write the losses and the verdict as JSON here")


# -- predict --------------------------------------------------------------------------------------
PREDICT_HELP = "predict DDP / ZeRO / FSDP scaling to 512 GPUs from one measured or estimated step"
PREDICT_DESCRIPTION = """Predict data-parallel scaling (2 to 512 GPUs) from one single-device step.

The step's compute comes from a `vitscale bench --json` result (--bench FILE) or, without one, is
estimated as train FLOPs per image x batch / (GPU peak x MFU) with forward:backward = 1:2 and no
optimizer or data time. Gradient bytes = parameters x bytes of the reduce dtype. Collectives follow
the ring / hierarchical model of vitscale.lab.comm_model (formulas in its docstrings):

  DDP        all-reduce 2(K-1)/K x B, overlapped with backward: exposed = max(0, comm - overlap x bwd)
  ZeRO-1/2   reduce-scatter (overlapped) + all-gather after the step: the same 2(K-1)/K x B
  ZeRO-3     all-gather in forward and backward + reduce-scatter: 3(K-1)/K x B

examples:
  vitscale predict configs/vit_b16_imagenet.toml --gpu H100 --mfu 0.4 --link nvlink+infiniband,pcie
  vitscale bench configs/fashion_mnist.toml --json --out b.json && vitscale predict configs/fashion_mnist.toml --bench b.json
"""


def predict_arguments(p) -> None:
    add_recipe_arguments(p, help="TOML recipe (its model, batch and precision)")
    p.add_argument(
        "--bench", metavar="FILE.json", help="a single-device `vitscale bench --json` result"
    )
    p.add_argument(
        "--link",
        default=None,
        metavar="LIST",
        help="comma list of links, each NAME or INTRA+INTER (names: nvlink, pcie, pcie3, infiniband, "
        "infiniband_ndr, ethernet, ethernet10, loopback = a gloo all-reduce measured here between 2 local processes, or GBPS[:LATENCY_US]); default "
        "nvlink+infiniband,pcie+infiniband,pcie+ethernet,ethernet10",
    )
    p.add_argument("--gpus", default="2,4,8,16,32,64,128,256,512", metavar="LIST")
    p.add_argument(
        "--per-node", type=int, default=8, help="GPUs per node (intra-node link up to this many)"
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=25.0,
        help="gradient bucket size (latency term per bucket)",
    )
    p.add_argument(
        "--overlap", type=float, default=0.7, help="share of backward time that hides communication"
    )
    p.add_argument(
        "--strategy", default="ddp", metavar="LIST", help="comma list of ddp, zero12, zero3, hsdp"
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size inside a node (strategy.tp): each block's 4 all-reduces of "
        "activations per micro-batch on the intra-node link, the data-parallel size K / tp",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=REDUCE_DTYPES,
        help="default: fp32, or bf16 when the "
        "config compresses gradients (strategy.grad_compression / reduce_dtype)",
    )
    p.add_argument(
        "--gpu", default="H100", help="without --bench: GPU whose peak (metrics.GPU_PEAKS) is used"
    )
    p.add_argument(
        "--mfu", type=float, default=0.4, help="without --bench: assumed model FLOPs utilization"
    )
    p.add_argument(
        "--out", metavar="DIR", help="write predict.md, predict.json and predict_speedup.png here"
    )


# -- search ---------------------------------------------------------------------------------------
SEARCH_HELP = "search recipe keys for the best accuracy in a fixed training-time budget (Optuna, resumable, multi-worker)"
SEARCH_DESCRIPTION = """The best model this machine trains in a time budget: an Optuna search over recipe keys
(docs/search.md).

Every trial trains the recipe with the trial's keys under the same training-time budget
(train.time_limit_s = --budget-s) with its lr schedule fitted to that budget
(optim.schedule_clock = time: the decay ends when the budget ends), scored on a seeded, stratified
validation split of the TRAINING set (data.val_fraction); the test set is never read by a trial.
The validation accuracy of each epoch goes to Optuna's pruner (Hyperband by default). The study
lives in a database (SQLite in OUT by default; any SQLAlchemy URL), so a killed search continues
where it stopped (its unfinished trial is marked failed by the heartbeat, that reason recorded,
and retried once) and several workers, on one machine or many, share one search. At the end the
best --repeat-top trials are retrained with --seeds other seeds, the best mean is the pick, and the
pick alone is evaluated once on the test set; the recipe as written is trained under the same protocol and seeds
and tested once too, and the report says whether the pick beats it. Writes OUT/search.md, search.json, pareto.png, importance.png and
best.toml (`vitscale train OUT/best.toml` reproduces the pick on the full training set).
With --heldout FILE, every trial also trains its keys on each held-out data set of FILE (its own
data keys and training seconds, or length = "recipe": the recipe's own length, capped), on a
validation split of that set's training data, and is scored by the worst (or --combine mean) of the
sets' validation accuracies normalised to chance.

examples:
  vitscale search --budget-s 300 --trials 40 --out search/fmnist      # the default recipe and space
  vitscale search configs/cifar10.toml --space my_space.toml --budget-s 600 --trials 0   # until Ctrl-C
  vitscale search --budget-s 300 --score time-to-target --target 0.9   # the fastest to 90% validation
  vitscale search --budget-s 300 --heldout heldout_grey_small          # robust: scored on 4 sets
  vitscale search --budget-s 300 --storage postgresql://host/db --study fm --repeat-top 0   # a worker
  vitscale search --budget-s 300 --storage postgresql://host/db --study fm --report-only    # finish
"""


def search_arguments(p) -> None:
    add_recipe_arguments(p)
    _search_study_arguments(p)
    _search_protocol_arguments(p)
    _search_pick_arguments(p)
    _search_worker_arguments(p)


def _search_study_arguments(p) -> None:
    """The space, the budget, the number of trials and where the study and its runs live."""
    p.add_argument(
        "--space",
        help="the space: a TOML file of ranges and choices, or the name of a shipped one "
        "(default: configs/search/vit_default.toml)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="training seconds of every trial (train.time_limit_s; evaluation not counted; default 300)",
    )
    p.add_argument(
        "--trials",
        type=int,
        default=20,
        help="trials this worker runs (0 = until stopped; default 20)",
    )
    p.add_argument(
        "--out",
        default="search",
        help="the search folder: trial runs, report, best.toml (default: search)",
    )
    p.add_argument(
        "--storage",
        help="Optuna storage URL (default: sqlite:///OUT/search.db); a server database "
        "(postgresql://, mysql://) for workers on several machines",
    )
    p.add_argument("--study", default="search", help="study name in the storage (default: search)")


def _search_protocol_arguments(p) -> None:
    """How trials are scored and pruned, and how the pick is confirmed (repeats, recipe, test)."""
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="share of the training set held out to score trials, when the recipe's "
        "data.val_fraction is 0 (default 0.1)",
    )
    p.add_argument(
        "--score",
        choices=("accuracy", "time-to-target"),
        default="accuracy",
        help="what ranks trials: the validation accuracy at the end of the budget (default), or the "
        "training time at which the validation accuracy first reached --target (lower is better; "
        "a trial that never reached it ranks after all that did, by its accuracy: docs/search.md)",
    )
    p.add_argument(
        "--target",
        type=float,
        help="the validation accuracy of --score time-to-target, in (0, 1] (default: the "
        "recipe's first train.targets entry)",
    )
    _search_heldout_arguments(p)


def _search_heldout_arguments(p) -> None:
    """Held-out data sets every trial also trains on, and how their scores combine."""
    p.add_argument(
        "--heldout",
        action="append",
        default=[],
        metavar="FILE",
        help="held-out data sets every trial also trains on (repeatable): a TOML file of [NAME] "
        "tables, each with budget_s, its data keys (data.name, data.root, ...) and optionally "
        'length = "recipe" (the recipe\'s own epochs, as `vitscale train` on that set, budget_s '
        "a cap), or the name of a shipped one (configs/search/NAME.toml); docs/search.md",
    )
    p.add_argument(
        "--combine",
        choices=("worst", "mean"),
        help="with --heldout: a trial's score is the worst (minimum, the default) or the mean of "
        "every set's validation accuracy normalised to chance, (acc - 1/classes) / (1 - 1/classes)",
    )


def _search_pick_arguments(p) -> None:
    """Pruning, and how the pick is confirmed (repeats, the recipe as written, the test set)."""
    p.add_argument(
        "--pruner",
        choices=("hyperband", "halving", "none"),
        default="hyperband",
        help="stops poor trials early on their score so far at each epoch (default hyperband; "
        "with --heldout, on the tuning set's, before the held-out sets train)",
    )
    p.add_argument(
        "--repeat-top",
        type=int,
        default=3,
        help="retrain the best K trials with other seeds, pick the "
        "best mean, evaluate it once on the test set (0 = no repeats, no test evaluation: a worker)",
    )
    p.add_argument(
        "--seeds", type=int, default=2, help="other seeds per repeated trial (default 2)"
    )
    p.add_argument(
        "--no-recipe",
        dest="recipe",
        action="store_false",
        help="do not train the recipe as written beside the pick (by default it is trained under the "
        "same budget, validation split and seeds, tested once on the pick's seed, and the report "
        "says whether the pick beats it)",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="no new trials: the repeats still missing, the test evaluation and the report",
    )


def _search_worker_arguments(p) -> None:
    """A worker's heartbeat and sampler seed (several workers share one study)."""
    p.add_argument(
        "--heartbeat-s",
        type=int,
        default=10,
        help="a worker's heartbeat; a RUNNING trial "
        "silent for 3 heartbeats (a killed worker's) is marked failed and retried once (default 10)",
    )
    p.add_argument(
        "--sampler-seed",
        type=int,
        default=None,
        help="seed of the TPE sampler (default: random; give workers different seeds)",
    )


# name: (help, description, arguments); the implementation, vitscale.lab.NAME, has the command's `run(args)`
COMMANDS = {
    "bench": (BENCH_HELP, BENCH_DESCRIPTION, bench_arguments),
    "sweep": (SWEEP_HELP, SWEEP_DESCRIPTION, sweep_arguments),
    "ladder": (LADDER_HELP, LADDER_DESCRIPTION, ladder_arguments),
    "tune": (TUNE_HELP, TUNE_DESCRIPTION, tune_arguments),
    "parity": (PARITY_HELP, PARITY_DESCRIPTION, parity_arguments),
    "predict": (PREDICT_HELP, PREDICT_DESCRIPTION, predict_arguments),
    "search": (SEARCH_HELP, SEARCH_DESCRIPTION, search_arguments),
}


def add_parsers(sub) -> None:
    """Each lab command's parser, in COMMANDS' order, on the CLI's subparsers `sub`."""
    for name, (short, description, arguments) in COMMANDS.items():
        arguments(
            sub.add_parser(
                name,
                help=short,
                description=description,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
