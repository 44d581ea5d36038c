"""How `vitscale search` scores a trial (--score): its validation accuracy at the end of the budget
(higher is better), or its training time to a target validation accuracy (--target; lower is
better). The study keeps its score (its direction, and a user attribute the report and the finish
read), and the score is part of what makes two workers' searches the same one."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ...errors import UserError
from ...run_report import percent, seconds, target_key

ACCURACY, TIME_TO_TARGET = "accuracy", "time-to-target"
SCORES = (ACCURACY, TIME_TO_TARGET)


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
    `budget_s`: the trials' training budget."""

    name: str = ACCURACY
    target: float | None = None
    budget_s: float = 0.0

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
        return f"the best model in {budget_s:g} s of training"

    @property
    def what(self) -> str:
        """What the score is, in words."""
        if self.timed:
            return f"training time to {percent(self.target or 0)} validation accuracy"
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
        if not self.timed:
            return "score: validation accuracy at the end of the budget (higher is better)"
        return (
            f"score: {self.what} (lower is better; a trial that never reached it scores "
            f"{self.budget_s:g} s x (3 - its final validation accuracy), after every trial that did)"
        )


def search_score(args, cfg) -> Score:
    """--score and --target (a target defaults to the recipe's first train.targets entry); one
    line where they do not fit. Callers that build their own arguments (tests) may leave both out:
    the accuracy score."""
    name, target = getattr(args, "score", ACCURACY), getattr(args, "target", None)
    if name == ACCURACY:
        if target is not None:
            raise UserError("search: --target is for --score time-to-target")
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
        return Score(**saved)
    return Score(ACCURACY, None, float(study.user_attrs.get("budget_s") or 0.0))
