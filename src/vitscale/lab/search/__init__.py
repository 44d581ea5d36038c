"""`vitscale search`: the best model this machine trains in a time budget, an Optuna search over
recipe keys (docs/search.md). This module is the command: the study in its database, the recipe
every trial trains; space.py reads the space, heldout.py the held-out data sets (--heldout),
score.py scores a trial, trials.py trains the trials and the finish (repeats, the pick, its one
test evaluation), report.py writes the report. The protocol and the command's
arguments: lab/commands.py."""

from __future__ import annotations

import hashlib
import json
import random
import time
import warnings
from pathlib import Path

from ...config import load_config
from ...errors import UserError
from ..recipes import lab_config, log, with_overrides
from .heldout import budget_keys as seconds_keys
from .heldout import load_heldout, prepare_sets, trial_keys
from .report import write_report
from .score import search_score
from .space import load_space
from .trials import (
    fail_dead_trials,
    finalize,
    record_stale_reasons,
    retry_without_reason,
    run_trials,
)


def import_optuna():
    """optuna, imported here only (the rest of vitscale runs without it)."""
    try:
        import optuna
    except ImportError:
        raise UserError(
            "vitscale search needs optuna: pip install 'vitscale[search]' (or: pip install optuna)"
        ) from None
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # one line per trial is ours (trials.py)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # heartbeats
    return optuna


def run(args) -> int:
    if (
        args.budget_s <= 0
        or args.heartbeat_s < 1
        or min(args.trials, args.repeat_top, args.seeds) < 0
    ):
        raise UserError(
            "search: --budget-s must be > 0, --heartbeat-s >= 1; --trials, --repeat-top, --seeds >= 0"
        )
    if not 0 < args.val_fraction <= 0.5:
        raise UserError(f"search: --val-fraction must be in (0, 0.5], got {args.val_fraction}")
    optuna = import_optuna()
    space = load_space(args.space)
    heldout = load_heldout(getattr(args, "heldout", None))
    base = trial_config(args)
    search_score(args, base)  # --score, --target, --combine and --heldout checked together
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sets = prepare_sets(heldout, base, space, args, out, trial_config(args, budget=False))
    score = search_score(args, base, sets.names if sets else ())
    study = open_study(optuna, args, base, space, out, sets)
    log(
        f"search {study.study_name} in {storage_url(args, out)}: {len(space)} keys, "
        f"{args.budget_s:g}s of training per trial, scored on data.val_fraction={base.data.val_fraction} "
        f"of the training set (the test set is not read by trials); {score.line()}"
    )
    if sets:
        log(
            "held-out sets, each trained by every trial on a validation split of its own training "
            "data: "
            + ", ".join(
                f"{h.name} ({sets.classes[h.name]} classes, "
                + (
                    f"the recipe's length, capped at {h.budget_s:g}s)"
                    if h.recipe_length
                    else f"{h.budget_s:g}s)"
                )
                for h in sets.heldout
            )
        )
    if args.report_only:
        # a killed worker's trial is not "running"
        fail_dead_trials(optuna, study, 3 * args.heartbeat_s)
    else:
        run_trials(optuna, study, base, space, args, out, score, sets)
    final = finalize(study, base, args, out, score, sets) if args.repeat_top else None
    report = write_report(study, space, args, out, final, recipe_config(args, final))
    log(f"wrote {report}")
    return 0


def trial_config(args, budget: bool = True):
    """The recipe as every trial trains it: quiet, the time budget, the time-fitted schedule, the
    validation split, no checkpoints but the last, an evaluation every epoch (for the pruner), and
    under --score time-to-target the target among train.targets (its runs' time_to_target). Its
    auto keys and [per_device] tables are answered by each trial's config, after the trial's keys
    (an AdamW trial of a Muon recipe has no Newton-Schulz dtype to resolve). `budget=False`: all
    that but the time budget and its schedule (the recipe's own length: what a held-out set of
    length "recipe" trains)."""
    cfg = lab_config(args.config, args.overrides, resolve=False)
    score = search_score(args, cfg)
    targets = list(dict.fromkeys([*cfg.train.targets, *([score.target] if score.timed else [])]))
    return with_overrides(
        cfg,
        {
            **(budget_keys(args) if budget else {}),
            "data.val_fraction": cfg.data.val_fraction or args.val_fraction,
            "run.checkpoint_every": 2**62,
            "run.keep_last": 1,
            "run.eval_every": cfg.run.eval_every or 1,
            "train.targets": targets,
        },
        resolve=False,
    )


def budget_keys(args) -> dict:
    return seconds_keys(args.budget_s)


def recipe_config(args, final):
    """The pick as a recipe (best.toml): the user's recipe, the budget, the pick's keys (a batch
    the cap of the recipe's data.batch_rule=min_steps, as in the trials), the FULL training set
    (data.val_fraction = 0: evaluation on the test set). None without a pick."""
    if not final or not final.get("pick"):
        return None
    cfg = load_config(args.config, args.overrides)
    return with_overrides(
        cfg,
        {
            **budget_keys(args),
            **trial_keys(cfg, final["pick"]["params"]),
            "data.val_fraction": 0.0,
        },
    )


def storage_url(args, out: Path) -> str:
    return args.storage or f"sqlite:///{(out / 'search.db').resolve()}"


def open_study(optuna, args, base, space, out: Path, sets=None):
    """The study in its database (created, or loaded and checked to be the same search: the
    recipe, space, budget, score and held-out sets; its direction is its score's)."""
    url = storage_url(args, out)
    score = search_score(args, base, sets.names if sets else ())
    engine = {"connect_args": {"timeout": 120}} if url.startswith("sqlite") else {}
    # a killed worker's RUNNING trial: failed once its heartbeat is 3 intervals old (the reason
    # recorded), and retried once
    if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):  # optuna >= 4.9
        retry = {
            "heartbeat_stale_trial_callback": retry_without_reason(
                optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)
            )
        }
    else:
        retry = {
            "failed_trial_callback": retry_without_reason(
                optuna.storages.RetryFailedTrialCallback(max_retry=1)
            )
        }
    for attempt in range(5):  # workers starting together race to create the tables and the study
        try:
            storage = record_stale_reasons(
                optuna,
                optuna.storages.RDBStorage(
                    url,
                    engine_kwargs=engine,
                    heartbeat_interval=args.heartbeat_s,
                    grace_period=3 * args.heartbeat_s,
                    **retry,
                ),
                3 * args.heartbeat_s,
            )
            study = optuna.create_study(
                storage=storage,
                study_name=args.study,
                direction=score.direction,
                load_if_exists=True,
                sampler=sampler(optuna, args),
                pruner=make_pruner(optuna, args),
            )
            break
        except Exception as e:  # noqa: BLE001 - sqlalchemy's errors, whichever the database raises
            if attempt == 4:
                raise UserError(
                    f"search: cannot open {url}: {str(e).splitlines()[0][:300]}"
                ) from None
            time.sleep(0.5 + random.random() * (attempt + 1))
    check_same_search(study, args, base, space, score, url, sets)
    return study


def check_same_search(study, args, base, space, score, url: str, sets=None) -> None:
    """A new study records what it searches (its fingerprint, space, budget, recipe, score and
    held-out sets); a study that exists must be the same search: one line where it is not."""
    what = fingerprint(base, space, args.budget_s, score, sets)
    have = study.user_attrs.get("search")
    if have is None:
        study.set_user_attr("search", what)
        study.set_user_attr("space", [d.as_dict() for d in space])
        study.set_user_attr("budget_s", float(args.budget_s))
        study.set_user_attr("base_config", base.to_dict())
        study.set_user_attr("score", score.as_dict())
        if sets:
            study.set_user_attr("sets", sets.as_dict())
    elif have != what:
        raise UserError(
            f"search: study '{args.study}' in {url} was started with another recipe, space or "
            f"--budget-s, or another --score/--target, or other --heldout sets or --combine; "
            "give the same ones, or another --study / --out"
        )


def sampler(optuna, args):
    """TPE; with constant_liar, workers sharing a study do not all sample next to the same running trials."""
    return optuna.samplers.TPESampler(seed=args.sampler_seed, constant_liar=True)


def make_pruner(optuna, args):
    """Trials report their score so far (their validation accuracy; under time-to-target the
    score its first reach or its accuracy then gives: trials.Pruning) at step = percent of the
    budget trained (0..100), so trials of different speeds meet at the same rungs."""
    if args.pruner == "none":
        return optuna.pruners.NopPruner()
    if args.pruner == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=10, reduction_factor=3)
    return optuna.pruners.HyperbandPruner(min_resource=10, max_resource=100, reduction_factor=3)


def fingerprint(base, space, budget_s: float, score=None, sets=None) -> str:
    """What makes two workers' searches the same one: the recipe (run section left out: folders,
    threads, progress differ between machines; train.targets too: it only adds to what runs
    report), the space, the budget, a score other than accuracy (a study from before --score
    keeps its fingerprint) and the held-out sets (each one's keys, budget, validation share and
    length, with the recipe's own length where a set trains it) with the combine rule (a study
    without them keeps its fingerprint)."""
    cfg = {**{k: v for k, v in base.to_dict().items() if k != "run"}, "seed": base.run.seed}
    cfg["train"] = {k: v for k, v in cfg["train"].items() if k != "targets"}
    what = {"cfg": cfg, "space": [d.as_dict() for d in space], "budget": float(budget_s)}
    if score is not None and score.timed:
        what["score"] = {"name": score.name, "target": score.target}
    if sets:
        what["sets"] = {
            k: v
            for k, v in sets.as_dict().items()
            if k in ("combine", "heldout", "tuning", "recipe_length")
        }
    blob = json.dumps(what, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
