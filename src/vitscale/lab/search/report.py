"""The report of `vitscale search`: OUT/search.json (every trial, the Pareto front, key importances,
the repeats, the pick and its one test evaluation), OUT/search.md (the same for people),
OUT/pareto.png (validation accuracy against training time, every trial, the front drawn),
OUT/importance.png and OUT/best.toml (the pick as a recipe, with the command that trains it)."""

from __future__ import annotations

import itertools
import json
import shlex
import time
import warnings
from pathlib import Path

from .score import Score, study_score
from .trials import accuracy_of, last_value

UNRECORDED = "worker stopped: no reason recorded (killed or lost)"


def trial_row(t, score: Score | None = None) -> dict:
    """A trial as the report lists it; a failed one's "error" is its one-line reason (a failure
    without one was failed by another process: its worker is gone, UNRECORDED). Its "score" is
    the study's (= val_accuracy under --score accuracy; with held-out sets the combined score of a
    complete trial, none for others: their reports are the tuning set's accuracies); its "curve"
    the validation accuracy it reported (none under time-to-target, whose reports are scores).
    With held-out sets, "set_accuracy" and "set_score": each set's validation accuracy and its
    normalised score, and "set_runs": what each set's run took (batch, steps, epochs, seconds,
    length, capped: trials.took)."""
    u, timed = t.user_attrs, score is not None and score.timed
    combined = score is not None and score.combine
    curve = [] if timed else sorted([int(k), float(v)] for k, v in t.intermediate_values.items())
    return {
        "number": t.number,
        "state": t.state.name.lower(),
        "val_accuracy": accuracy_of(t),
        "score": (t.value if t.state.name == "COMPLETE" else None) if combined else last_value(t),
        "set_accuracy": u.get("set_accuracy"),
        "set_score": u.get("set_score"),
        "set_runs": u.get("set_runs"),
        "train_time_s": u.get("train_time_s"),
        "epochs": u.get("epochs"),
        "steps": u.get("steps"),
        "params": dict(t.params),
        "error": (u.get("error") or UNRECORDED) if t.state.name == "FAIL" else None,
        "worker": u.get("worker"),
        "retry_of": t.system_attrs.get("failed_trial"),
        "curve": curve,
    }


def pareto(rows: list[dict]) -> list[int]:
    """Trial numbers on the front of (higher validation accuracy, less training time)."""
    pts = [
        (r["train_time_s"], r["val_accuracy"], r["number"])
        for r in rows
        if r["val_accuracy"] is not None and r["train_time_s"] is not None
    ]
    front, best = [], -1.0
    for _secs, acc, n in sorted(pts, key=lambda p: (p[0], -p[1])):
        if acc > best:
            front.append(n)
            best = acc
    return front


def importances(study) -> dict:
    """optuna.importance over the complete trials, with PED-ANOVA (no scikit-learn needed; optuna
    5's default); {"error": why} where it cannot say (fewer than two complete trials, ...)."""
    import optuna  # here: optional (vitscale[search]); this runs only where the search did

    make = getattr(optuna.importance, "PedAnovaImportanceEvaluator", None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            imp = optuna.importance.get_param_importances(study, evaluator=make() if make else None)
        return {k: float(v) for k, v in imp.items()}
    except (ValueError, RuntimeError, ImportError) as e:
        return {"error": str(e).splitlines()[0] if str(e) else type(e).__name__}


def command_line(args) -> str:
    """The search command, as given (to rerun or extend it)."""
    parts = ["vitscale", "search"] + ([args.config] if args.config else [])
    parts += [x for o in args.overrides for x in ("--set", o)]
    parts += ["--budget-s", f"{args.budget_s:g}", "--out", args.out, "--study", args.study]
    parts += ["--space", args.space] if args.space else []
    if getattr(args, "score", "accuracy") != "accuracy":
        parts += ["--score", args.score]
    parts += ["--target", f"{args.target:g}"] if getattr(args, "target", None) else []
    parts += [x for f in getattr(args, "heldout", None) or [] for x in ("--heldout", str(f))]
    parts += ["--combine", args.combine] if getattr(args, "combine", None) else []
    parts += ["--storage", args.storage] if args.storage else []
    return shlex.join(parts)


def write_report(study, space, args, out: Path, final: dict | None, best_cfg) -> Path:
    score = study_score(study)
    rows = [trial_row(t, score) for t in study.get_trials(deepcopy=False)]
    front = pareto(rows)
    imp = importances(study)
    best_toml = write_best(out, best_cfg, final, args, score) if best_cfg is not None else None
    report = {
        "study": study.study_name,
        "budget_s": args.budget_s,
        "score": {**score.as_dict(), "direction": score.direction, "text": score.line()},
        "sets": study.user_attrs.get("sets"),
        "command": command_line(args),
        "space": [d.as_dict() for d in space],
        "trials": rows,
        "pareto": front,
        "importance": imp,
        "selection": "trials scored on data.val_fraction of the training set; the test set evaluated "
        "once, for the pick (and once for the recipe as written, the comparison)",
        "finish": final,
        "best_toml": str(best_toml) if best_toml else None,
        "reproduce": f"vitscale train {best_toml}" if best_toml else None,
    }
    (out / "search.json").write_text(json.dumps(report, indent=2, default=str))
    # the repeats' means drawn on the accuracy axis only where they are accuracies
    plots = draw(
        rows, front, imp, out, args.budget_s, None if score.timed or score.combine else final
    )
    path = out / "search.md"
    path.write_text("\n".join(markdown(report, rows, plots, score)) + "\n")
    return path


def write_best(out: Path, cfg, final: dict, args, score: Score) -> Path:
    pick, test = final["pick"], final.get("test") or {}
    head = [
        f"# `vitscale search` pick, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: trial {pick['trial']} "
        f"of study {args.study}",
        f"# {score.what} {score.fmt(pick['mean'])} +- {score.fmt(pick['std'])} over "
        f"{len(pick['values'])} seeds (data.val_fraction of the training set), {args.budget_s:g}s "
        "of training each",
        (
            "# test accuracy {:.4f} on {} images: the test set's one evaluation, of the seed-{} model".format(
                test["test_accuracy"], test["test_count"], test["seed"]
            )
            if test
            else "# not evaluated on the test set"
        ),
        "# this recipe trains on the FULL training set (data.val_fraction = 0) for the same time budget,",
        "# the lr schedule fitted to it (optim.schedule_clock = time); train.epochs is only an upper bound",
        f"# reproduce: vitscale train {out / 'best.toml'}",
        "# keys chosen: " + " ".join(f"--set {k}={v}" for k, v in pick["params"].items()),
    ]
    if pick.get("set_means"):
        head.insert(
            2,
            "# mean validation accuracy per set: "
            + ", ".join(f"{k} {v:.4f}" for k, v in pick["set_means"].items())
            + f" (the score: {score.combine} of their normalised accuracies)",
        )
    path = out / "best.toml"
    path.write_text("\n".join(head) + "\n\n" + cfg.to_toml())
    return path


def draw(
    rows: list[dict], front: list[int], imp: dict, out: Path, budget_s: float, final: dict | None
) -> list[str]:
    """pareto.png and importance.png (nothing where matplotlib is missing)."""
    try:
        import matplotlib  # here: optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.8))
    pareto_panel(ax, rows, front, budget_s)
    zoom_panel(zoom, rows, budget_s, final or {})
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=110)
    made.append("pareto.png")
    plt.close(fig)
    if imp and "error" not in imp:
        fig, ax = plt.subplots(figsize=(6, 0.35 * len(imp) + 1.2))
        keys = list(imp)[::-1]
        ax.barh(keys, [imp[k] for k in keys])
        ax.set_xlabel("importance (optuna.importance, PED-ANOVA, normalized)")
        fig.tight_layout()
        fig.savefig(out / "importance.png", dpi=110)
        made.append("importance.png")
        plt.close(fig)
    return made


STYLE = {"complete": ("o", "tab:blue"), "pruned": ("x", "tab:orange"), "fail": ("v", "tab:red")}


def curve_xy(r: dict, budget_s: float):
    """A trial's validation accuracy against training seconds: its reports (at percent of the budget)
    and its final value at its measured training time."""
    pts = (
        [(budget_s * step / 100, acc) for step, acc in r["curve"] if step < 100] if budget_s else []
    )
    if r["val_accuracy"] is not None and r["train_time_s"]:
        pts.append((r["train_time_s"], r["val_accuracy"]))
    return [p[0] for p in pts], [p[1] for p in pts]


def pareto_panel(ax, rows: list[dict], front: list[int], budget_s: float) -> None:
    """Every trial: its curve (thin) and where it ended (marker); the Pareto front of the end points."""
    for state, (marker, color) in STYLE.items():
        pts = [
            r
            for r in rows
            if r["state"] == state and r["val_accuracy"] is not None and r["train_time_s"]
        ]
        for r in pts:
            xs, ys = curve_xy(r, budget_s)
            ax.plot(xs, ys, color=color, lw=0.6, alpha=0.35)
        if pts:
            ax.scatter(
                [r["train_time_s"] for r in pts],
                [r["val_accuracy"] for r in pts],
                marker=marker,
                color=color,
                label=state,
                zorder=3,
            )
    on = sorted((r for r in rows if r["number"] in front), key=lambda r: r["train_time_s"])
    if on:
        ax.step(
            [r["train_time_s"] for r in on],
            [r["val_accuracy"] for r in on],
            where="post",
            color="k",
            lw=1,
            label="Pareto front",
            zorder=4,
        )
        for r in on:
            ax.annotate(str(r["number"]), (r["train_time_s"], r["val_accuracy"]), fontsize=7)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("validation accuracy")
    ax.set_title("every trial: validation accuracy against training time", fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="lower right")


def zoom_panel(ax, rows: list[dict], budget_s: float, final: dict) -> None:
    """The complete trials near the top, each curve labelled, with the repeats' means (the pick's and
    the recipe's as written) where the search has finished."""
    done = sorted(
        (r for r in rows if r["state"] == "complete" and r["val_accuracy"] is not None),
        key=lambda r: -r["val_accuracy"],
    )
    if not done:
        ax.set_axis_off()
        return
    top = done[:8]
    for r in top:
        xs, ys = curve_xy(r, budget_s)
        ax.plot(xs, ys, marker=".", lw=1, label=f"trial {r['number']}: {r['val_accuracy']:.4f}")
    lines = [
        (c, f"trial {c['trial']}, mean of {len(c['values'])} seeds")
        for c in final.get("candidates", [])
    ]
    if final.get("recipe"):
        lines.append(
            (
                final["recipe"],
                f"the recipe as written, mean of {len(final['recipe']['values'])} seeds",
            )
        )
    # every mean drawn
    for (c, label), style in zip(lines, itertools.cycle(("--", ":", "-.", (0, (1, 3))))):
        ax.axhline(
            c["mean"],
            color="k" if c.get("trial") != "recipe" else "tab:red",
            ls=style,
            lw=1,
            label=f"{label}: {c['mean']:.4f}",
        )
    lo = min([top[-1]["val_accuracy"]] + [c["mean"] for c, _ in lines]) - 0.02
    ax.set_ylim(lo, max(r["val_accuracy"] for r in top) + 0.005)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"the best {len(top)} complete trials (zoomed)", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")


def fmt(v, spec=".4f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def markdown(rep: dict, rows: list[dict], plots: list[str], score: Score) -> list[str]:
    final = rep["finish"] or {}
    states = {
        s: sum(r["state"] == s for r in rows)
        for s in ("complete", "pruned", "fail", "running", "waiting")
    }
    lines = [
        f"# Search `{rep['study']}`: {score.title(rep['budget_s'])}"
        + (f" (trials of {rep['budget_s']:g} s of training)" if score.timed else ""),
        "",
        f"`{rep['command']}`",
        "",
        "Trials are scored on a validation split carved from the training set (data.val_fraction, "
        "seeded and stratified); no trial reads the test set. The test set is evaluated once, for the "
        "final pick, below (and, unless --no-recipe, once for the recipe as written, to compare).",
        "",
        f"Trials are ranked by their {score.line()}.",
        "",
        "trials: " + ", ".join(f"{n} {s}" for s, n in states.items() if n),
        "",
    ]
    lines += pick_lines(final, rep, score)
    if "pareto.png" in plots:
        lines += ["", "![accuracy against training time](pareto.png)"]
    lines += ["", "## Key importance (optuna.importance, PED-ANOVA over the complete trials)", ""]
    imp = rep["importance"]
    lines += (
        [f"not available: {imp['error']}"]
        if "error" in imp
        else ["| key | importance |", "|---|---|"]
        + [f"| `{k}` | {v:.3f} |" for k, v in imp.items()]
    )
    lines += trial_lines(rep, rows, score)
    return lines


def trial_lines(rep: dict, rows: list[dict], score: Score) -> list[str]:
    """The trials table, best score first (under time-to-target with the time to the target; with
    held-out sets with the combined score and one column per held-out set: its validation
    accuracy)."""
    timed, others = score.timed, list(score.sets[1:]) if score.combine else []
    lines = [
        "",
        f"## Trials ({score.what}; * = on the Pareto front of validation accuracy and time)",
        "",
        "| # | state |"
        + (f" {score.combine} |" if score.combine else "")
        + " val acc |"
        + "".join(f" {n} |" for n in others)
        + (" to target |" if timed else "")
        + " train s | epochs | keys | note |",
        "|---|---|---|"
        + ("---|" if score.combine else "")
        + "---|" * len(others)
        + ("---|" if timed else "")
        + "---|---|---|---|",
    ]
    if others:
        lines[3:3] = [
            f"val acc = the tuning set's ({score.sets[0]}); one column per held-out set, its "
            "validation accuracy (and the batch x steps its run took; capped = stopped by the "
            f"set's budget_s before the recipe's length); {score.combine} = the trial's score, "
            f"the {score.combine} of "
            "every set's (accuracy - 1/classes) / (1 - 1/classes) (complete trials only: a pruned "
            "or failed one did not train every set).",
            "",
        ]
    worst = float("inf")  # trials without a score last
    for r in sorted(
        rows, key=lambda r: worst if r["score"] is None else score.sort_key(r["score"])
    ):
        keys = " ".join(f"{k}={fmt(v, '.3g')}" for k, v in r["params"].items())
        note = r["error"] or (f"retry of {r['retry_of']}" if r["retry_of"] is not None else "")
        reach = f" {score.reach_text(r['score']) if r['score'] is not None else '-'} |"
        per, ran = r.get("set_accuracy") or {}, r.get("set_runs") or {}
        lines.append(
            f"| {r['number']}{'*' if r['number'] in rep['pareto'] else ''} | {r['state']} | "
            + (f"{fmt(r['score'])} | " if score.combine else "")
            + f"{fmt(r['val_accuracy'])} |"
            + "".join(f" {fmt(per.get(n))}{run_text(ran.get(n))} |" for n in others)
            + f"{reach if timed else ''} {fmt(r['train_time_s'], '.1f')} | "
            f"{fmt(r['epochs'], '.2f')} | {keys} | {note} |"
        )
    return lines


def run_text(took: dict | None) -> str:
    """What a set's run took, after its accuracy in the trials table: ` (b 64 x 600)`, capped."""
    if not took or took.get("batch") is None:
        return ""
    steps = "-" if took.get("steps") is None else took["steps"]
    return f" (b {took['batch']} x {steps}{', capped' if took.get('capped') else ''})"


def pick_lines(final: dict, rep: dict, score: Score) -> list[str]:
    if not final.get("pick"):
        return [
            "No pick: no repeats were run (--repeat-top 0, or no complete trial yet); the test set "
            "was not evaluated."
        ]
    out = [
        f"## The best trials repeated with other seeds ({score.what})",
        "",
        f"Seeds {', '.join(str(s) for s in final.get('seeds', []))}; epochs = how many each run trained "
        "in the budget (the machine's speed moves them from run to run).",
        "",
        "| trial | mean | spread (std) | values | epochs |"
        + (" mean validation accuracy per set |" if score.combine else ""),
        "|---|---|---|---|---|" + ("---|" if score.combine else ""),
    ]
    rec = final.get("recipe")
    for c in final["candidates"] + ([rec] if rec else []):
        name = "the recipe as written" if c["trial"] == "recipe" else c["trial"]
        per = ", ".join(f"{k} {v:.4f}" for k, v in (c.get("set_means") or {}).items()) or "-"
        out.append(
            f"| {name} | {score.fmt(c['mean'])} | {score.fmt(c['std'])} | "
            f"{', '.join(score.fmt(v) for v in c['values'])} | "
            f"{', '.join(fmt(e, '.2f') for e in c.get('epochs', []))} |"
            + (f" {per} |" if score.combine else "")
        )
    p, test = final["pick"], final.get("test")
    out += [
        "",
        f"**Pick: trial {p['trial']}** (best mean): "
        + " ".join(f"`{k}={v}`" for k, v in p["params"].items()),
    ]
    if test:
        times = test.get("evaluations", 1)
        out += [
            "",
            f"**Test set (evaluated once for the pick): accuracy {test['test_accuracy']:.4f} on "
            f"{test['test_count']} images** (the seed-{test['seed']} repeat, trained without the validation "
            f"split)"
            + (
                f"; this folder's search has evaluated {times} picks on the test set over its "
                "history"
                if times > 1
                else ""
            ),
        ]
        out += set_test_lines(test, score)
    rtest = final.get("recipe_test")
    if rtest:
        out += [
            "",
            f"**The recipe as written**, trained under the same protocol (budget, validation split, "
            f"seeds; none of the space's keys changed), tested once on the same seed: **test accuracy "
            f"{rtest['test_accuracy']:.4f}**.",
        ]
        out += set_test_lines(rtest, score)
    out += decision_lines(final.get("decision"), score)
    out += ["", f"Reproduce on the full training set: `{rep['reproduce']}`"]
    return out


def set_test_lines(test: dict, score: Score) -> list[str]:
    """A test evaluation on every set (held-out sets: each one's test split, once)."""
    if not test.get("set_test"):
        return []
    per = ", ".join(f"{k} {v:.4f}" for k, v in test["set_test"].items())
    return [
        "",
        f"On every set's test split (the models of the same seed, each trained on its set): {per}; "
        f"{score.combine} of the normalised accuracies **{test['test_score']:.4f}**.",
    ]


def decision_lines(d: dict | None, score: Score) -> list[str]:
    """The decision (trials.decide's) and the rule it follows, for the score searched."""
    if not d:
        return []
    rule = (
        f"a shorter mean {score.what} over the same seeds and a test accuracy that reaches "
        f"{score.target:g} on the same seed"
        if score.timed
        else f"a higher mean {score.what} over the same seeds and a higher {score.combine} of "
        "the sets' normalised test accuracies on the same seed"
        if score.combine
        else "a higher mean validation accuracy over the same seeds and a higher test accuracy "
        "on the same seed"
    )
    return [
        "",
        f"**Decision: {'adopt the pick' if d['adopt'] else 'keep the recipe'}**: {d['text']}. "
        f"The pick replaces the recipe only with {rule}.",
    ]
