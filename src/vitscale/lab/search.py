"""The best model this machine trains in a time budget: an Optuna search over recipe keys
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

examples:
  vitscale search --budget-s 300 --trials 40 --out search/fmnist      # the default recipe and space
  vitscale search configs/cifar10.toml --space my_space.toml --budget-s 600 --trials 0   # until Ctrl-C
  vitscale search --budget-s 300 --storage postgresql://host/db --study fm --repeat-top 0   # a worker
  vitscale search --budget-s 300 --storage postgresql://host/db --study fm --report-only    # finish
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

HELP = "search recipe keys for the best accuracy in a fixed training-time budget (Optuna, resumable, multi-worker)"

BIG_EPOCHS = 100_000.0  # trials end on the time budget, never on epochs


def add_arguments(p) -> None:
    from ..config import add_recipe_arguments
    add_recipe_arguments(p)
    p.add_argument("--space", help="the space: a TOML file of ranges and choices, or the name of a shipped one "
                   "(default: configs/search/vit_default.toml)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="training seconds of every trial (train.time_limit_s; evaluation not counted; default 300)")
    p.add_argument("--trials", type=int, default=20, help="trials this worker runs (0 = until stopped; default 20)")
    p.add_argument("--out", default="search", help="the search folder: trial runs, report, best.toml (default: search)")
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite:///OUT/search.db); a server database "
                   "(postgresql://, mysql://) for workers on several machines")
    p.add_argument("--study", default="search", help="study name in the storage (default: search)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="share of the training set held out to score trials, when the recipe's "
                        "data.val_fraction is 0 (default 0.1)")
    p.add_argument("--pruner", choices=("hyperband", "halving", "none"), default="hyperband",
                   help="stops poor trials early on their validation accuracy at each epoch (default hyperband)")
    p.add_argument("--repeat-top", type=int, default=3, help="retrain the best K trials with other seeds, pick the "
                   "best mean, evaluate it once on the test set (0 = no repeats, no test evaluation: a worker)")
    p.add_argument("--seeds", type=int, default=2, help="other seeds per repeated trial (default 2)")
    p.add_argument("--no-recipe", dest="recipe", action="store_false",
                   help="do not train the recipe as written beside the pick (by default it is trained under the "
                        "same budget, validation split and seeds, tested once on the pick's seed, and the report "
                        "says whether the pick beats it)")
    p.add_argument("--report-only", action="store_true",
                   help="no new trials: the repeats still missing, the test evaluation and the report")
    p.add_argument("--heartbeat-s", type=int, default=10, help="a worker's heartbeat; a RUNNING trial "
                   "silent for 3 heartbeats (a killed worker's) is marked failed and retried once (default 10)")
    p.add_argument("--sampler-seed", type=int, default=None, help="seed of the TPE sampler (default: random; "
                   "give workers different seeds)")


def import_optuna():
    """optuna, imported here only (the rest of vitscale runs without it)."""
    from ..errors import UserError
    try:
        import optuna
    except ImportError:
        raise UserError("vitscale search needs optuna: pip install 'vitscale[search]' (or: pip install optuna)") \
            from None
    import warnings
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # one line per trial is ours (search_trials.py)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # heartbeats
    return optuna


def run(args) -> int:
    from ..errors import UserError
    from .harness import log
    from .search_space import load_space
    from .search_report import write_report
    from .search_trials import fail_dead_trials, finalize, run_trials
    if args.budget_s <= 0 or args.heartbeat_s < 1 or min(args.trials, args.repeat_top, args.seeds) < 0:
        raise UserError("search: --budget-s must be > 0, --heartbeat-s >= 1; --trials, --repeat-top, --seeds >= 0")
    if not 0 < args.val_fraction <= 0.5:
        raise UserError(f"search: --val-fraction must be in (0, 0.5], got {args.val_fraction}")
    optuna = import_optuna()
    space = load_space(args.space)
    base = trial_config(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    study = open_study(optuna, args, base, space, out)
    log(f"search {study.study_name} in {storage_url(args, out)}: {len(space)} keys, "
        f"{args.budget_s:g}s of training per trial, scored on data.val_fraction={base.data.val_fraction} "
        f"of the training set (the test set is not read by trials)")
    if args.report_only:
        fail_dead_trials(optuna, study, 3 * args.heartbeat_s)  # a killed worker's trial is not "running"
    else:
        run_trials(optuna, study, base, space, args, out)
    final = finalize(study, base, args, out) if args.repeat_top else None
    report = write_report(study, space, args, out, final, recipe_config(args, final))
    log(f"wrote {report}")
    return 0


def trial_config(args):
    """The recipe as every trial trains it: quiet, the time budget, the time-fitted schedule, the
    validation split, no checkpoints but the last, an evaluation every epoch (for the pruner)."""
    from .harness import lab_config, with_overrides
    cfg = lab_config(args.config, args.overrides)
    return with_overrides(cfg, {**budget_keys(args), "data.val_fraction": cfg.data.val_fraction or args.val_fraction,
                                "run.checkpoint_every": 2 ** 62, "run.keep_last": 1,
                                "run.eval_every": cfg.run.eval_every or 1})


def budget_keys(args) -> dict:
    return {"train.time_limit_s": float(args.budget_s), "optim.schedule_clock": "time", "train.epochs": BIG_EPOCHS}


def recipe_config(args, final):
    """The pick as a recipe (best.toml): the user's recipe, the budget, the pick's keys, the FULL
    training set (data.val_fraction = 0: evaluation on the test set). None without a pick."""
    from ..config import load_config
    from .harness import with_overrides
    if not final or not final.get("pick"):
        return None
    return with_overrides(load_config(args.config, args.overrides),
                          {**budget_keys(args), **final["pick"]["params"], "data.val_fraction": 0.0})


def storage_url(args, out: Path) -> str:
    return args.storage or f"sqlite:///{(out / 'search.db').resolve()}"


def open_study(optuna, args, base, space, out: Path):
    """The study in its database (created, or loaded and checked to be the same search)."""
    from ..errors import UserError
    from .search_trials import record_stale_reasons, retry_without_reason
    url = storage_url(args, out)
    engine = {"connect_args": {"timeout": 120}} if url.startswith("sqlite") else {}
    # a killed worker's RUNNING trial: failed once its heartbeat is 3 intervals old (the reason
    # recorded), and retried once
    if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):  # optuna >= 4.9
        retry = {"heartbeat_stale_trial_callback": retry_without_reason(
            optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))}
    else:
        retry = {"failed_trial_callback": retry_without_reason(optuna.storages.RetryFailedTrialCallback(max_retry=1))}
    for attempt in range(5):  # workers starting together race to create the tables and the study
        try:
            storage = record_stale_reasons(optuna, optuna.storages.RDBStorage(
                url, engine_kwargs=engine, heartbeat_interval=args.heartbeat_s, grace_period=3 * args.heartbeat_s,
                **retry), 3 * args.heartbeat_s)
            study = optuna.create_study(storage=storage, study_name=args.study, direction="maximize",
                                        load_if_exists=True, sampler=sampler(optuna, args),
                                        pruner=make_pruner(optuna, args))
            break
        except Exception as e:  # noqa: BLE001 - sqlalchemy's errors, whichever the database raises
            if attempt == 4:
                raise UserError(f"search: cannot open {url}: {str(e).splitlines()[0][:300]}") from None
            time.sleep(0.5 + random.random() * (attempt + 1))
    what = fingerprint(base, space, args.budget_s)
    have = study.user_attrs.get("search")
    if have is None:
        study.set_user_attr("search", what)
        study.set_user_attr("space", [d.as_dict() for d in space])
        study.set_user_attr("budget_s", float(args.budget_s))
        study.set_user_attr("base_config", base.to_dict())
    elif have != what:
        raise UserError(f"search: study '{args.study}' in {url} was started with another recipe, space or "
                        f"--budget-s; give the same ones, or another --study / --out")
    return study


def sampler(optuna, args):
    """TPE; with constant_liar, workers sharing a study do not all sample next to the same running trials."""
    return optuna.samplers.TPESampler(seed=args.sampler_seed, constant_liar=True)


def make_pruner(optuna, args):
    """Trials report their validation accuracy at step = percent of the budget trained (0..100),
    so trials of different speeds meet at the same rungs."""
    if args.pruner == "none":
        return optuna.pruners.NopPruner()
    if args.pruner == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=10, reduction_factor=3)
    return optuna.pruners.HyperbandPruner(min_resource=10, max_resource=100, reduction_factor=3)


def fingerprint(base, space, budget_s: float) -> str:
    """What makes two workers' searches the same one: the recipe (run section left out: folders,
    threads, progress differ between machines), the space and the budget."""
    cfg = {**{k: v for k, v in base.to_dict().items() if k != "run"}, "seed": base.run.seed}
    blob = json.dumps({"cfg": cfg, "space": [d.as_dict() for d in space], "budget": float(budget_s)},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
