"""The trials of `vitscale search` (lab/search/): each trains in this process under the time
budget with its validation accuracy reported to Optuna at every evaluation (and pruned there), and
a trial that cannot train (a shape the model refuses, out of memory, a NaN loss) is marked failed
with its one-line reason while the search goes on (a killed worker's trial too, by the worker
that finds its heartbeat stale: record_stale_reasons). With held-out sets (heldout.py) a trial then
trains its keys on each of them and is scored by their combined normalised accuracies. Then the
finish: the best trials repeated with other seeds, the pick by the best mean, and the pick's one
evaluation on the test set (on every set's test split, with held-out sets)."""

from __future__ import annotations

import copy
import datetime
import json
import os
import shutil
import socket
import statistics
from pathlib import Path

from ... import evaluate  # evaluate.evaluate_checkpoint looked up when called (tests wrap it)
from ...errors import UserError
from ...loop import train
from ...tasks import task_class, task_kind
from ..recipes import log
from ..timing import free_memory
from .heldout import with_trial
from .score import Score, study_score


class TrialFailed(Exception):
    """A trial that could not train: Optuna marks it failed and the search continues."""


class SetFailed(UserError):
    """A held-out set's run that could not train, its reason prefixed with the set's name."""


def train_run(cfg, run_dir: Path, on_eval=None) -> dict:
    """Train `cfg` into a fresh `run_dir` (what a killed run left there is removed) -> summary, with
    `on_eval(result)` after every evaluation (where the search reports to Optuna and may raise
    TrialPruned). Signals stay the search command's."""
    run_dir = Path(run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    try:
        summary = train(cfg, run_dir, on_eval=on_eval, signals=False)
        return {**summary, "accuracy": summary.get(metric_of(cfg))}
    finally:
        free_memory()  # the next trial starts from empty accelerator memory (also after an OOM)


def took(summary: dict, cfg, length: str = "budget") -> dict:
    """What a run of `cfg` took: its global batch (summary.json's "auto" where data.batch_rule
    changed it, else the config's), steps, epochs and training seconds, its `length` ("budget" or
    "recipe") and whether the cap stopped it (`capped`: a run of length "recipe" that the time limit
    stopped; a budget run ends there by design)."""
    auto = (summary.get("auto") or {}).get("data.batch_size")
    return {
        "length": length,
        "batch": auto["value"] if auto else cfg.data.batch_size,
        "steps": summary.get("steps"),
        "epochs": summary.get("epochs"),
        "train_time_s": summary.get("train_time_s"),
        "capped": length == "recipe" and summary.get("stop_reason") == "time limit",
    }


def metric_of(cfg) -> str:
    """The metric a run of `cfg` keeps the best of (its task's)."""
    return task_class(task_kind(cfg)).metric


class Pruning:
    """`on_eval` of a trial: the score so far at step = percent of the budget trained, 0..LAST-1
    (at most every EVERY percent: each report is a database write), and Optuna's pruner asked there.
    The score so far is the validation accuracy; under --score time-to-target, the training time of
    the first evaluation that reached the target, or (none yet) what the accuracy now would score
    at the end (score.time_score): a trial is pruned beside the others at its rung, the study's
    direction minimize. Never in the last (100 - LAST)% of the budget, the last evaluation
    included: a prune there saves seconds and throws away a nearly finished trial (the default
    job's search pruned one at 99%, 91.10% validation, 4th best of 35)."""

    EVERY = 5
    LAST = 90

    def __init__(self, optuna, trial, budget_s: float, metric: str, score: Score | None = None):
        self.optuna, self.trial, self.budget, self.metric = optuna, trial, budget_s, metric
        self.score = score or Score(budget_s=budget_s)
        self.last = -self.EVERY
        self.reached_s: float | None = None  # when the validation accuracy first reached the target

    def __call__(self, ev: dict) -> None:
        acc, target = ev.get(self.metric), self.score.target
        if acc is not None and target is not None and self.reached_s is None and acc >= target:
            self.reached_s = ev["train_time_s"]
        step = int(100 * ev["train_time_s"] / self.budget)  # < LAST here; 100 is the final value
        if acc is None or step < self.last + self.EVERY or step >= self.LAST:
            return
        self.last = step
        self.trial.report(self.score.value(acc, self.reached_s), step)
        if self.trial.should_prune():
            for k, v in (
                ("train_time_s", ev["train_time_s"]),
                ("steps", ev["step"]),
                ("epochs", ev["epoch"]),
                ("accuracy", acc),
            ):
                self.trial.set_user_attr(k, v)
            raise self.optuna.TrialPruned(
                f"pruned at {step}% of the budget (validation accuracy {acc:.4f})"
            )


def one_line(e: BaseException) -> str:
    text = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
    return (text.strip().splitlines() or [type(e).__name__])[0][:300]


STOPPED = "stopped by Ctrl-C (KeyboardInterrupt) during the trial"


def stale_reason(worker: str | None, grace_s: float) -> str:
    """Why a trial whose heartbeat went stale failed (its worker cannot say: it is gone)."""
    return f"worker {worker + ' ' if worker else ''}stopped: no heartbeat for over {grace_s:g} s (killed or lost)"


def note_failure(optuna, storage, trial_id: int, reason: str) -> None:
    """`reason` as the "error" user attribute of a trial about to be failed (in the database: read
    by every process); nothing where another worker has failed it already (with its reason)."""
    try:
        storage.set_trial_user_attr(trial_id, "error", reason)
    except optuna.exceptions.UpdateFinishedTrialError:
        pass


def record_stale_reasons(optuna, storage, grace_s: float):
    """`storage` whose stale-heartbeat check (run by Optuna before every trial of every worker, and
    by fail_dead_trials) writes each stale trial's reason before Optuna fails it: Optuna's
    fail_stale_trials records none, and a failed trial's attributes can no longer be set."""
    find = storage._get_stale_trial_ids

    def stale_trial_ids(study_id: int) -> list[int]:
        ids = find(study_id)
        for trial_id in ids:
            worker = storage.get_trial(trial_id).user_attrs.get("worker")
            note_failure(optuna, storage, trial_id, stale_reason(worker, grace_s))
        return ids

    storage._get_stale_trial_ids = stale_trial_ids
    return storage


def retry_without_reason(retry):
    """Optuna's retry callback, the failed trial's reason not copied to its retry (which has not
    failed; its own failure, if any, records its own)."""

    def callback(study, trial) -> None:
        trial = copy.copy(trial)  # a cached trial is not changed
        trial.user_attrs = {k: v for k, v in trial.user_attrs.items() if k != "error"}
        retry(study, trial)

    return callback


def run_trials(optuna, study, base, space, args, out: Path, score: Score, sets=None) -> None:
    """This worker's --trials trials (0: until stopped); Ctrl-C stops between or inside one. A
    trial's value is its `score` (its validation accuracy, its time to the target), its final
    validation accuracy the "accuracy" attribute either way. With held-out `sets` the trial's keys
    then train on each of them (only the tuning set's reports can prune: before they start), and
    its value is the sets' combined score; "set_accuracy" and "set_score" keep each set's
    validation accuracy and normalised score, "set_runs" the batch, steps, epochs and seconds each
    set's run took (trials.took)."""

    def train_trial(trial):
        # now, not when the heartbeat thread gets to it
        study._storage.record_heartbeat(trial._trial_id)
        free_memory()  # what an earlier trial's error left referenced (its traceback) is gone now
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        params = {d.key: d.suggest(trial) for d in space}
        run_dir = out / "trials" / f"{trial.number:05d}"
        trial.set_user_attr("run_dir", str(run_dir))
        try:
            cfg = with_trial(base, params)
            pruning = Pruning(optuna, trial, args.budget_s, metric_of(cfg), score)
            r = train_run(cfg, run_dir, pruning)
        finally:
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the metrics stay
        for k in ("train_time_s", "steps", "epochs", "images_per_s", "accuracy"):
            trial.set_user_attr(k, r[k])
        value = score.of_run(r)
        if value is not None:
            trial.report(value, 100)  # the final point of its curve (never pruned there)
        if not sets:
            return value
        return heldout_score(trial, sets, base, params, out, r, cfg)

    def objective(trial):
        """train_trial; any failure recorded as the trial's one-line "error" (a refused shape, out of
        memory, a NaN loss, Ctrl-C) before Optuna marks it failed."""
        try:
            return train_trial(trial)
        except optuna.TrialPruned:
            raise
        except KeyboardInterrupt:
            trial.set_user_attr("error", STOPPED)
            raise
        except Exception as e:  # noqa: BLE001 - any failure of one trial is that trial's
            trial.set_user_attr("error", one_line(e))
            raise TrialFailed(one_line(e)) from None

    fail_dead_trials(optuna, study, 3 * args.heartbeat_s)
    try:
        study.optimize(
            objective,
            n_trials=args.trials or None,
            catch=(TrialFailed,),
            callbacks=[progress_line],
            # (and timing.free_memory: a failed trial's traceback is gone by then)
            gc_after_trial=True,
        )
    except KeyboardInterrupt:
        log("search: stopped; the unfinished trial is marked failed")
    fail_dead_trials(optuna, study, 3 * args.heartbeat_s)


def heldout_score(trial, sets, base, params: dict, out: Path, r: dict, cfg) -> float:
    """A trial's keys `params` trained on every held-out set after its tuning run `r` (of `cfg`):
    each set's accuracy, normalised score and run (set_accuracy, set_score, set_runs) kept in the
    trial's attributes; returns the sets' combined score."""
    accs, runs = {sets.tuning: r["accuracy"]}, {sets.tuning: took(r, cfg)}
    for h in sets.heldout:
        rh = train_set(sets, h, base, params, out / "trials" / f"{trial.number:05d}-{h.name}")
        accs[h.name], runs[h.name] = rh["accuracy"], rh["took"]
        trial.set_user_attr("set_runs", runs)  # so far: a failing set's trial keeps the others'
    trial.set_user_attr("set_accuracy", accs)
    norm, combined = sets.score(accs)
    trial.set_user_attr("set_score", norm)
    return combined


def train_set(sets, h, base, params: dict, run_dir: Path, seed: int | None = None, keep=False):
    """`params` trained on held-out set `h` into `run_dir` (its checkpoints deleted unless `keep`):
    its summary, with "took" (the batch and steps it took: trials.took); a failure (a config the
    set refuses, out of memory, a NaN loss) raises SetFailed naming the set."""
    try:
        cfg = sets.config(h, base, params, seed)
        r = train_run(cfg, run_dir)
        return {**r, "took": took(r, cfg, h.length)}
    except Exception as e:  # noqa: BLE001 - the trial's failure, named by its set
        raise SetFailed(f"held-out set {h.name}: {one_line(e)}") from None
    finally:
        if not keep:
            shutil.rmtree(Path(run_dir) / "checkpoints", ignore_errors=True)


def fail_dead_trials(optuna, study, grace_s: float) -> None:
    """A killed worker's RUNNING trials, failed with their reason and retried once with the same keys:
    those whose heartbeat is older than the grace period (Optuna's check, which it also runs before
    each trial; record_stale_reasons writes the reason) and those killed before their first heartbeat
    (Optuna skips them; a live worker's trial has its heartbeat and its "worker" attribute within
    milliseconds of starting)."""
    optuna.storages.fail_stale_trials(study)
    storage, now = study._storage, datetime.datetime.now()
    retry = (
        storage.get_heartbeat_stale_trial_callback()
        if hasattr(storage, "get_heartbeat_stale_trial_callback")
        else storage.get_failed_trial_callback()
    )
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if (
            "worker" in t.user_attrs
            or not t.datetime_start
            or (now - t.datetime_start).total_seconds() < grace_s
        ):
            continue
        note_failure(
            optuna,
            storage,
            t._trial_id,
            f"worker stopped before the trial's first heartbeat, "
            f"{(now - t.datetime_start).total_seconds():.0f} s after it started (killed or lost)",
        )
        try:
            if (
                storage.set_trial_state_values(t._trial_id, state=optuna.trial.TrialState.FAIL)
                and retry
            ):
                retry(study, storage.get_trial(t._trial_id))
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another worker got there first


def last_value(t):
    """A trial's score: its value, or (pruned, failed) its last reported score."""
    if t.value is not None:
        return t.value
    return t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else None


def accuracy_of(t):
    """A trial's validation accuracy: the one it recorded (at its end, or where it was pruned), or
    (a trial from before that record, scored on accuracy) its score."""
    return t.user_attrs["accuracy"] if "accuracy" in t.user_attrs else last_value(t)


def progress_line(study, t) -> None:
    """One line per finished trial: number, state, validation accuracy (and the time to the
    target under --score time-to-target), training time, params."""
    acc, secs, ep = accuracy_of(t), t.user_attrs.get("train_time_s"), t.user_attrs.get("epochs")
    score = study_score(study)
    acc_text = "-" if acc is None else f"{acc:.4f}"
    if score.timed:
        acc_text += f" ({score.reach_text(last_value(t))})"
    if score.combine and t.user_attrs.get("set_accuracy"):
        accs = t.user_attrs["set_accuracy"]
        acc_text = (
            " ".join(f"{k} {v:.4f}" for k, v in accs.items())
            + f", {score.combine} {'-' if t.value is None else f'{t.value:.4f}'}"
        )
    params = " ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.params.items()
    )
    err = (
        f" | {t.user_attrs['error']}" if t.state.name == "FAIL" and "error" in t.user_attrs else ""
    )
    log(
        f"trial {t.number:4d} {t.state.name.lower():8s} val {acc_text} | "
        f"{'-' if secs is None else f'{secs:.1f}'}s train, {'-' if ep is None else f'{ep:.2f}'} epochs | "
        f"{params}{err}"
    )


def finalize(study, base, args, out: Path, score: Score, sets=None) -> dict:
    """The best --repeat-top complete trials repeated with --seeds other seeds (each repeat's run
    kept in OUT/repeats/, done once); the pick = the best mean score (validation accuracy, or time
    to the target, or with held-out `sets` the combined score: every repeat trains every set); its
    one test evaluation. Unless --no-recipe: the recipe as written trained under the same protocol
    (the same budget, validation split and seeds), tested once on the same seed as the pick, and
    the decision."""
    done = [
        t
        for t in study.get_trials(deepcopy=False)
        if t.state.name == "COMPLETE" and t.value is not None
    ]
    top = sorted(done, key=lambda t: score.sort_key(t.value))[: args.repeat_top]
    if not top:
        log("search: no complete trial yet: nothing to repeat or test")
        return {"candidates": [], "pick": None}
    seeds = [base.run.seed + i for i in range(1, args.seeds + 1)] or [base.run.seed]
    cands = []
    for t in top:
        runs = [
            repeat(
                base,
                t.params,
                seed,
                out / "repeats" / f"trial{t.number:05d}-seed{seed}",
                f"trial {t.number}",
                score,
                sets,
            )
            for seed in seeds
        ]
        cands.append(
            candidate(
                t.number,
                dict(t.params),
                [t.value],
                runs,
                [t.user_attrs.get("epochs")],
                [t.user_attrs.get("set_accuracy")],
            )
        )
        c = cands[-1]
        log(
            f"repeat trial {t.number}: {score.what} {score.fmt(c['mean'])} +- "
            f"{score.fmt(c['std'])} over {len(c['values'])} seeds"
        )
    pick = min(cands, key=lambda c: score.sort_key(c["mean"]))
    final = {
        "candidates": cands,
        "pick": pick,
        "seeds": [base.run.seed, *seeds] if args.seeds else [base.run.seed],
        "test": test_once(pick, out, sets),
    }
    if args.recipe:
        recipe = recipe_runs(base, seeds, out, score, sets)
        final.update(recipe=recipe, recipe_test=test_once(recipe, out, sets))
        final["decision"] = decide(pick, final["test"], recipe, final["recipe_test"], score)
        log(f"decision: {final['decision']['text']}")
    return final


def candidate(
    label, params: dict, first: list, runs: list[dict], first_epochs: list, first_sets=None
) -> dict:
    """Scores over seeds (`first`: the run with run.seed, then the repeats: their "score") and the
    epochs each trained in the budget (the machine's speed moves them from run to run); with
    held-out sets, "set_means": each set's mean validation accuracy over the same runs
    (`first_sets`: the first runs' {set: accuracy})."""
    ok = [r for r in runs if r.get("score") is not None]
    values = first + [r["score"] for r in ok]
    c = {
        "trial": label,
        "params": params,
        "values": values,
        "mean": statistics.fmean(values) if values else 0.0,
        "std": statistics.pstdev(values) if values else 0.0,
        "runs": runs,
        "epochs": first_epochs[: len(first)] + [r.get("epochs") for r in ok],
    }
    per = [a for a in (first_sets or [])[: len(first)] if a] + [
        r["set_accuracy"] for r in ok if r.get("set_accuracy")
    ]
    if per:
        c["set_means"] = {k: statistics.fmean(a[k] for a in per) for k in per[0]}
    return c


def recipe_runs(base, seeds: list[int], out: Path, score: Score, sets=None) -> dict:
    """The recipe as written, none of the space's keys changed, under the trials' protocol: run.seed
    (the trials' seed) and every repeat seed. Its `runs` are the repeat seeds' (in their order), so
    its test evaluation is of the same seed as the pick's."""
    every = list(dict.fromkeys([base.run.seed, *seeds]))
    runs = {
        s: repeat(base, {}, s, out / "repeats" / f"recipe-seed{s}", "the recipe", score, sets)
        for s in every
    }
    first = (
        [runs[base.run.seed]]
        if base.run.seed not in seeds and runs[base.run.seed].get("score") is not None
        else []
    )
    rec = candidate(
        "recipe",
        {},
        [r["score"] for r in first],
        [runs[s] for s in seeds],
        [r.get("epochs") for r in first],
        [r.get("set_accuracy") for r in first],
    )
    log(
        f"the recipe as written: {score.what} {score.fmt(rec['mean'])} +- "
        f"{score.fmt(rec['std'])} over {len(rec['values'])} seeds"
    )
    return rec


def decide(
    pick: dict,
    pick_test: dict | None,
    recipe: dict,
    recipe_test: dict | None,
    score: Score | None = None,
) -> dict:
    """Whether the pick should replace the recipe: a better mean score over the same seeds AND, on
    the same seed, a better test accuracy (under time-to-target: a test accuracy at the end of the
    budget that reaches the target; with held-out sets: a better combined score of the sets' test
    accuracies); the gap is also set against the seeds' spread."""
    score = score or Score()
    if not recipe["values"]:
        return {
            "adopt": False,
            "val_gap": None,
            "seed_spread": None,
            "test_gap": None,
            "within_noise": None,
            "text": "the recipe as written did not train (its runs failed: see the log); no comparison",
        }
    gap = score.gain(pick["mean"], recipe["mean"])
    noise = max(pick["std"], recipe["std"])
    tested = "test_score" if score.combine else "test_accuracy"
    tests = (pick_test or {}).get(tested), (recipe_test or {}).get(tested)
    test_gap = None if None in tests else tests[0] - tests[1]
    test_ok = test_gap is not None and (
        tests[0] >= (score.target or 0) if score.timed else test_gap > 0
    )
    adopt = gap > 0 and test_ok
    what = score.what if score.timed or score.combine else "validation"
    text = (
        f"the pick (trial {pick['trial']}) {'beats' if adopt else 'does not beat'} the recipe as written: "
        f"{what} {score.fmt(pick['mean'])} vs {score.fmt(recipe['mean'])} (mean over the same "
        f"seeds, gap {gap:+.4f}, seed spread up to {noise:.4f}{', within it' if abs(gap) <= noise else ''})"
        + (
            f", test{' score' if score.combine else ''} {tests[0]:.4f} vs {tests[1]:.4f}"
            if test_gap is not None
            else ", no test accuracy for both"
        )
    )
    return {
        "adopt": adopt,
        "val_gap": gap,
        "seed_spread": noise,
        "test_gap": test_gap,
        "within_noise": abs(gap) <= noise,
        "text": text,
    }


def repeat(
    base, params: dict, seed: int, run_dir: Path, what: str, score: Score, sets=None
) -> dict:
    """`params` with run.seed = `seed`, trained once into `run_dir` (a finished run's summary is
    reused: a killed finish continues); its validation accuracy and its `score`. With held-out
    `sets`, each set trained too (into RUN_DIR-NAME, its checkpoint kept for the test evaluation):
    "set_accuracy", "set_score", "set_checkpoints", "set_runs" (what each run took: trials.took),
    and the combined score."""

    def trained(run_dir: Path, make):
        summary = run_dir / "summary.json"
        if summary.is_file():
            r = json.loads(summary.read_text())
            # the run's evaluation split: validation (data.val_fraction, or a folder's carved view)
            return {**r, "accuracy": r.get("test_accuracy")}
        return make()

    try:
        cfg = with_trial(base, params, {"run.seed": seed})
        r = trained(run_dir, lambda: train_run(cfg, run_dir))
        out = {
            "seed": seed,
            "accuracy": r["accuracy"],
            "score": score.of_run(r),
            "train_time_s": r["train_time_s"],
            "epochs": r.get("epochs"),
            "checkpoint": r["checkpoint"],
            "run_dir": str(run_dir),
        }
        if sets:
            accs, ckpts = {sets.tuning: r["accuracy"]}, {sets.tuning: r["checkpoint"]}
            runs = {sets.tuning: took(r, cfg)}
            for h in sets.heldout:
                hdir = run_dir.with_name(f"{run_dir.name}-{h.name}")
                rh = trained(
                    hdir, lambda h=h, d=hdir: train_set(sets, h, base, params, d, seed, True)
                )
                accs[h.name], ckpts[h.name] = rh["accuracy"], rh["checkpoint"]
                # a reused summary: the batch from its "auto", else its config's (the same one)
                runs[h.name] = rh.get("took") or took(
                    rh, sets.config(h, base, params, seed), h.length
                )
            norm, out["score"] = sets.score(accs)
            out.update(set_accuracy=accs, set_score=norm, set_checkpoints=ckpts, set_runs=runs)
    except Exception as e:  # noqa: BLE001
        log(f"repeat of {what} with seed {seed} failed: {one_line(e)}")
        return {"seed": seed, "error": one_line(e), "run_dir": str(run_dir)}
    return out


def test_once(pick: dict, out: Path, sets=None) -> dict | None:
    """The pick's ONE evaluation on the test set: its first repeat's model (trained on the training
    set minus the validation split), evaluated with data.val_fraction = 0; with held-out `sets`,
    that seed's model of each set on the set's test split too ("set_test", and "test_score": their
    combined normalised accuracies). Kept in OUT/test.json with every earlier pick's, so the report
    can say how often this folder's search looked at the test set."""
    path = out / "test.json"
    history = json.loads(path.read_text()) if path.is_file() else []
    # the recipe's evaluation is the comparison's
    picks = sum(h["trial"] != "recipe" for h in history)
    for h in history:
        if h["trial"] == pick["trial"]:
            return {**h, "evaluations": picks}
    run = next((r for r in pick["runs"] if r.get("checkpoint")), None)
    if run is None:
        return None
    r = evaluate.evaluate_checkpoint(run["checkpoint"], ["data.val_fraction=0"])
    h = {
        "trial": pick["trial"],
        "seed": run["seed"],
        "run_dir": run["run_dir"],
        "checkpoint": run["checkpoint"],
        "test_accuracy": r["test_accuracy"],
        "test_loss": r["test_loss"],
        "test_count": r["test_count"],
    }
    if sets and run.get("set_checkpoints"):
        tests = {sets.tuning: r["test_accuracy"]}
        for s in sets.heldout:
            tests[s.name] = evaluate.evaluate_checkpoint(
                run["set_checkpoints"][s.name], sets.test_overrides(s)
            )["test_accuracy"]
        h["set_test"], h["test_score"] = tests, sets.score(tests)[1]
    path.write_text(json.dumps(history + [h], indent=2))
    what = (
        "the recipe as written" if pick["trial"] == "recipe" else f"the pick, trial {pick['trial']}"
    )
    log(
        f"{what}: test accuracy {h['test_accuracy']:.4f} on {h['test_count']} images (seed {h['seed']}; "
        f"its one evaluation on the test set)"
        + (
            "; on every set: " + " ".join(f"{k} {v:.4f}" for k, v in h["set_test"].items())
            if "set_test" in h
            else ""
        )
    )
    return {**h, "evaluations": picks + (pick["trial"] != "recipe")}
