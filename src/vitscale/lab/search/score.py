"""How `vitscale search` scores a trial (--score): its validation accuracy at the end of the budget
(higher is better), or its training time to a target validation accuracy (--target; lower is
better); with held-out data sets (--heldout), the --combine (worst or mean) of every set's
validation accuracy normalised to chance (normalised, combine). The study keeps its score (its
direction, and a user attribute the report and the finish read), and the score is part of what
makes two workers' searches the same one."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ...errors import UserError
from ...run_report import percent, seconds, target_key

ACCURACY, TIME_TO_TARGET = "accuracy", "time-to-target"
SCORES = (ACCURACY, TIME_TO_TARGET)
WORST, MEAN = "worst", "mean"
COMBINES = (WORST, MEAN)


def normalised(accuracy: float, classes: int) -> float:
    """A validation accuracy on a set of `classes` classes, relative to chance: (accuracy - 1/classes)
    / (1 - 1/classes); 0 = chance (a collapsed model), 1 = every image right, below 0 = worse than
    chance. It puts sets of different class counts on one scale (50% is good on 2 classes of
    nothing, and far above chance on 100) without a reference run."""
    if classes < 2:
        raise ValueError(f"a classification set has at least 2 classes, got {classes}")
    chance = 1.0 / classes
    return (accuracy - chance) / (1.0 - chance)


def combine(values, rule: str) -> float:
    """The sets' normalised scores in one number: their minimum (`worst`: a trial is as good as its
    worst set) or their mean (`mean`)."""
    values = list(values)
    if not values:
        raise ValueError("no scores to combine")
    if rule == WORST:
        return min(values)
    if rule == MEAN:
        return sum(values) / len(values)
    raise ValueError(f"combine must be one of {', '.join(COMBINES)}, got {rule!r}")


def time_score(reached_s: float | None, accuracy: float | None, budget_s: float) -> float | None:
    """A trial's time-to-target score, lower is better: the training seconds at its first evaluation
    that reached the target; a trial that never reached it scores budget_s x (3 - its accuracy),
    in [2 x budget, 3 x budget]: after every trial that reached it (at most the budget plus the
    last step), and among those that did not, the more accurate first. None without an accuracy."""
    if reached_s is not None:
        return float(reached_s)
    if accuracy is None:
        return None
    return budget_s * (3.0 - accuracy)


@dataclass(frozen=True)
class Score:
    """`name`: accuracy or time-to-target; `target`: the validation accuracy to reach (time only);
    `budget_s`: the trials' training budget; `combine`: worst or mean over `sets` (the tuning set
    first, then the held-out ones) of their normalised validation accuracies (None: the tuning
    set's score alone)."""

    name: str = ACCURACY
    target: float | None = None
    budget_s: float = 0.0
    combine: str | None = None
    sets: tuple = ()

    @property
    def timed(self) -> bool:
        return self.name == TIME_TO_TARGET

    @property
    def direction(self) -> str:
        """The Optuna study's direction."""
        return "minimize" if self.timed else "maximize"

    def title(self, budget_s: float) -> str:
        """What the search looks for, for the report's title."""
        if self.timed:
            return f"the fastest model to {percent(self.target or 0)} validation accuracy"
        if self.combine:
            return f"the best model in {budget_s:g} s of training, over {len(self.sets)} data sets"
        return f"the best model in {budget_s:g} s of training"

    @property
    def what(self) -> str:
        """What the score is, in words."""
        if self.timed:
            return f"training time to {percent(self.target or 0)} validation accuracy"
        if self.combine:
            return f"{self.combine} normalised validation accuracy of {len(self.sets)} sets"
        return "validation accuracy"

    def value(self, accuracy: float | None, reached_s: float | None = None) -> float | None:
        """The score of a run whose validation accuracy is `accuracy` (so far, or at its end) and
        that first reached the target after `reached_s` training seconds (None: not yet)."""
        if not self.timed:
            return accuracy
        return time_score(reached_s, accuracy, self.budget_s)

    def of_run(self, r: dict) -> float | None:
        """The score of a trained run: its summary with "accuracy" (the task's metric) and
        "time_to_target" (train.targets holds the target: search.trial_config puts it there)."""
        hit = (r.get("time_to_target") or {}).get(target_key(self.target or 0))
        return self.value(r.get("accuracy"), hit and hit["train_time_s"])

    def gain(self, a: float, b: float) -> float:
        """How much better score `a` is than `b` (> 0: better), in the score's unit."""
        return b - a if self.timed else a - b

    def sort_key(self, v: float) -> float:
        """Sorts scores best first."""
        return v if self.timed else -v

    def reached(self, v: float | None) -> bool:
        """Whether a time-to-target score is a time the target was reached at (not the score of
        a trial that never reached it: 2 x budget or more)."""
        return v is not None and v < 2 * self.budget_s

    def reach_text(self, v: float | None) -> str:
        """A time-to-target score in words: "90% at 41.2s", "90% not reached"."""
        at = f"at {seconds(v)}" if v is not None and self.reached(v) else "not reached"
        return f"{percent(self.target or 0)} {at}"

    def fmt(self, v: float | None) -> str:
        if v is None:
            return "-"
        return seconds(v) if self.timed else f"{v:.4f}"

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        """The score in one line, for the log and the report."""
        if self.combine:
            rule = "minimum" if self.combine == WORST else "mean"
            return (
                f"score: the {self.combine} ({rule}) over {', '.join(self.sets)} of each set's "
                "validation accuracy at the end of its budget, normalised to chance: (accuracy - "
                "1/classes) / (1 - 1/classes) (higher is better)"
            )
        if not self.timed:
            return "score: validation accuracy at the end of the budget (higher is better)"
        return (
            f"score: {self.what} (lower is better; a trial that never reached it scores "
            f"{self.budget_s:g} s x (3 - its final validation accuracy), after every trial that did)"
        )


def search_score(args, cfg, sets: tuple = ()) -> Score:
    """--score and --target (a target defaults to the recipe's first train.targets entry), and with
    --heldout sets --combine (default worst) over `sets` (their names, the tuning set's first); one
    line where they do not fit. Callers that build their own arguments (tests) may leave them out:
    the accuracy score."""
    name, target = getattr(args, "score", ACCURACY), getattr(args, "target", None)
    heldout, rule = getattr(args, "heldout", None), getattr(args, "combine", None)
    if rule is not None and rule not in COMBINES:
        raise UserError(f"search: --combine must be one of {', '.join(COMBINES)}, got {rule!r}")
    if rule is not None and not heldout:
        raise UserError("search: --combine is for several data sets: give --heldout FILE")
    if heldout and name != ACCURACY:
        raise UserError(
            "search: --heldout sets are scored by validation accuracy; --score time-to-target "
            "scores one data set"
        )
    if name == ACCURACY:
        if target is not None:
            raise UserError("search: --target is for --score time-to-target")
        if heldout:
            return Score(ACCURACY, None, float(args.budget_s), rule or WORST, tuple(sets))
        return Score(ACCURACY, None, float(args.budget_s))
    if name != TIME_TO_TARGET:
        raise UserError(f"search: --score must be one of {', '.join(SCORES)}, got {name!r}")
    if target is None:
        if not cfg.train.targets:
            raise UserError(
                "search: --score time-to-target needs a target: --target 0.9, or train.targets "
                "in the recipe"
            )
        target = cfg.train.targets[0]
    if not 0 < target <= 1:
        raise UserError(f"search: --target is a validation accuracy in (0, 1], got {target!r}")
    return Score(TIME_TO_TARGET, float(target), float(args.budget_s))


def study_score(study) -> Score:
    """The score a study was started with (a study from before --score: accuracy)."""
    saved = study.user_attrs.get("score")
    if saved:
        return Score(**{**saved, "sets": tuple(saved.get("sets") or ())})
    return Score(ACCURACY, None, float(study.user_attrs.get("budget_s") or 0.0))
