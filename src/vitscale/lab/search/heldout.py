"""Held-out data sets of `vitscale search` (--heldout FILE, docs/search.md): every trial trains its
keys on the tuning set (the recipe's data) and on each held-out set too, and is scored by the worst
or the mean of their validation accuracies normalised to chance (score.normalised, score.combine).

A file holds one table per set, named by the table; each set gives its training seconds and, as
recipe keys, its data (and whatever else it needs: a grey folder's channels, its image size):

    [openclipart_grey10]
    budget_s = 60                   # training seconds of every trial on this set (required)
    length = "budget"               # or "recipe": the recipe's epochs, budget_s their cap
    val_fraction = 0.1              # its share held out to score trials (default: the tuning set's)
    data.name = "folder"            # fashion_mnist, cifar10, cifar100, synthetic or folder
    data.root = "/work/data/openclipart_grey10"
    data.channels = 1
    data.image_size = 32

`length` is how long a trial trains on the set: "budget" (the default) trains budget_s seconds with
the lr schedule fitted to them, as the tuning set trains --budget-s; "recipe" trains the recipe's
own length, as `vitscale train` would on that set: its train.epochs (the trial's where the space
searches them; a [per_device] table's on its device) and optim.schedule_clock, so the recipe's
data.batch_rule fits the batch (and epochs) to the set, with budget_s as a hard cap
(train.time_limit_s: a run cut there is scored where it stopped, its record says "capped").

In every run of a trial (the tuning set's too) a recipe with data.batch_rule = min_steps keeps the
rule where the trial names data.batch_size: the trial's batch is the rule's cap (trial_keys), where
naming it anywhere else fixes it.

Every key is checked against the recipe schema when the file is read, and a folder's data.root must
be a class folder (ROOT/train/<class>/...): one line naming what is wrong. Trials score a set on a
validation split of ITS training data: data.val_fraction for the in-memory sets; a folder (which
data.val_fraction does not split) through a view carved here, OUT/heldout/NAME-HASH/{train,val}/
<class>/ of links to its training images, seeded (data.val_seed) and stratified as val_split.py is;
its test split is read once, by the pick's test evaluation (the view's test-view/)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ...config import SECTIONS
from ...data.build import reads_class_folder
from ...errors import ConfigError
from ..recipes import log, with_overrides
from .score import combine, normalised
from .space import SPACES, check_value, key_type

BIG_EPOCHS = 100_000.0  # trials end on the time budget, never on epochs
SET_KEYS = {"budget_s", "val_fraction", "length"}
LENGTHS = ("budget", "recipe")
IN_MEMORY = ("fashion_mnist", "cifar10", "cifar100", "synthetic")  # data.val_fraction carves these
KINDS = (*IN_MEMORY, "folder")
# keys the search sets on every run of a set: a held-out set gives budget_s / val_fraction instead
SEARCH_KEYS = {
    "train.time_limit_s": "give budget_s",
    "train.epochs": 'give budget_s (trials end on the time budget), or length = "recipe" (the '
    "recipe's epochs)",
    "optim.schedule_clock": 'the search fits the schedule to budget_s (length = "recipe": the '
    "recipe's)",
    "data.val_fraction": "give val_fraction",
    "run.seed": "the trial's seed (and the repeats') trains every set",
}
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
DONE = "view.json"  # a finished folder view


def budget_keys(seconds: float) -> dict:
    """What trains a run for `seconds` of training with its lr schedule fitted to them."""
    return {
        "train.time_limit_s": float(seconds),
        "optim.schedule_clock": "time",
        "train.epochs": BIG_EPOCHS,
    }


def cap_keys(recipe, seconds: float) -> dict:
    """What caps a run of `recipe` at its own length (its train.epochs and optim.schedule_clock,
    left as they are) at `seconds` of training (or the recipe's own train.time_limit_s if shorter)."""
    own = recipe.train.time_limit_s
    return {"train.time_limit_s": float(min(seconds, own) if own else seconds)}


def trial_keys(cfg, params: dict) -> dict:
    """A trial's keys `params` as they are set on `cfg`: where cfg's data.batch_rule is min_steps
    and the trial names data.batch_size (not data.batch_rule), the rule kept after it, the trial's
    batch its cap (config.set_override fixes a named batch: the rule would do nothing in a trial)."""
    if (
        "data.batch_size" in params
        and "data.batch_rule" not in params
        and cfg.data.batch_rule == "min_steps"
    ):
        return {**params, "data.batch_rule": "min_steps"}
    return dict(params)


def with_trial(cfg, params: dict, extra: dict | None = None, resolve: bool = True):
    """`cfg` with a trial's keys (trial_keys) and then `extra` set, checked (and resolved)."""
    return with_overrides(cfg, {**trial_keys(cfg, params), **(extra or {})}, resolve=resolve)


@dataclass(frozen=True)
class HeldOut:
    """One held-out set: its `name`, its training seconds per run (the cap under length="recipe"),
    its recipe keys (dotted, data.name among them), its validation share (None: --val-fraction) and
    its `length` ("budget" or "recipe")."""

    name: str
    budget_s: float
    overrides: dict = field(default_factory=dict)
    val_fraction: float | None = None
    source: str = ""
    length: str = "budget"

    @property
    def kind(self) -> str:
        return self.overrides["data.name"]

    @property
    def recipe_length(self) -> bool:
        return self.length == "recipe"

    def as_dict(self) -> dict:
        """What the study records (and its fingerprint holds: `length` only where it is "recipe",
        so a study from before it keeps its fingerprint)."""
        return {
            "name": self.name,
            "budget_s": self.budget_s,
            "val_fraction": self.val_fraction,
            "overrides": dict(self.overrides),
            **({"length": self.length} if self.recipe_length else {}),
        }


# ---------------------------------------------------------------- the file
def resolve_file(path: str) -> Path:
    """A held-out file by path, or by name among the shipped ones (configs/search/NAME.toml)."""
    p = Path(path)
    for cand in (p, SPACES / p.name, SPACES / f"{p.name}.toml"):
        if cand.is_file():
            return cand
    raise ConfigError(f"held-out sets file not found: {path}")


def load_heldout(paths) -> list[HeldOut]:
    """The held-out sets of every file in `paths` (--heldout, repeatable), checked (schema, names,
    roots); ConfigError (one line) on anything wrong."""
    sets: list[HeldOut] = []
    for path in paths or ():
        src = resolve_file(str(path))
        try:
            data = tomllib.loads(src.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{src}: not valid TOML ({e})") from None
        for h in parse_heldout(data, str(src)):
            if any(h.name == s.name for s in sets):
                raise ConfigError(f"{src}: [{h.name}]: another --heldout file names a set so too")
            check_root(h)
            sets.append(h)
    return sets


def parse_heldout(data: dict, source: str = "heldout") -> list[HeldOut]:
    """The sets in a parsed file (the module doc), every key checked against the schema; the roots
    are not looked at (check_root)."""
    if not data:
        raise ConfigError(f"{source}: no held-out sets (one [NAME] table per set)")
    return [parse_set(name, spec, source) for name, spec in data.items()]


def parse_set(name: str, spec, source: str) -> HeldOut:
    where = f"{source}: [{name}]"
    if not isinstance(spec, dict):
        raise ConfigError(
            f"{source}: '{name}' must be a table: [{name}] then budget_s = .. and data.name = .."
        )
    if not NAME.match(name):
        raise ConfigError(f"{where}: a set's name is letters, digits, '_', '-' and '.'")
    overrides = {}
    for key, value in spec.items():
        if key in SET_KEYS:
            continue
        if key not in SECTIONS or not isinstance(value, dict):
            raise ConfigError(
                f"{where}: unknown key '{key}' (a set takes budget_s, val_fraction and recipe "
                "keys such as data.root = ..)"
            )
        for k, v in flatten(key, value):
            if k in SEARCH_KEYS:
                raise ConfigError(f"{where}: {k} is the search's: {SEARCH_KEYS[k]}")
            key_type(k, where)  # an unknown key, named, with the closest one
            overrides[k] = check_value(k, v, where)
    if "budget_s" not in spec:
        raise ConfigError(f"{where}: budget_s (training seconds of every trial on it) is missing")
    budget = spec["budget_s"]
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ConfigError(f"{where}: budget_s must be a number of seconds > 0, got {budget!r}")
    frac = spec.get("val_fraction")
    if frac is not None and (
        isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 0.5
    ):
        raise ConfigError(f"{where}: val_fraction must be in (0, 0.5], got {frac!r}")
    length = spec.get("length", "budget")
    if length not in LENGTHS:
        raise ConfigError(
            f'{where}: length must be "budget" (budget_s seconds, the schedule fitted to them) or '
            f'"recipe" (the recipe\'s train.epochs, budget_s their cap), got {length!r}'
        )
    kind = overrides.get("data.name")
    if kind is None:
        raise ConfigError(f"{where}: data.name is missing (the set's data: {', '.join(KINDS)})")
    if kind not in KINDS:
        raise ConfigError(
            f"{where}: data.name = '{kind}': a held-out set is one of {', '.join(KINDS)} (a "
            "validation split is carved from its training data)"
        )
    if reads_class_folder(kind) and not overrides.get("data.root"):
        raise ConfigError(f"{where}: data.root is missing (data.name = 'folder' reads ROOT/train/)")
    return HeldOut(
        name, float(budget), overrides, None if frac is None else float(frac), str(source), length
    )


def flatten(section: str, table: dict):
    """(section.key, value) of a section's table; a deeper table is a key the schema refuses."""
    for k, v in table.items():
        yield f"{section}.{k}", v


def check_root(h: HeldOut) -> None:
    """A set's data.root is there: a folder set's is a class folder (ROOT/train/), any other's (when
    given; "" = the data's default place) a directory. One line naming the set and the root."""
    root = h.overrides.get("data.root")
    if not root:
        return
    p = Path(root).expanduser()
    where = f"{h.source}: [{h.name}]"
    if not p.is_dir():
        raise ConfigError(f"{where}: data.root {root} is not a directory")
    if reads_class_folder(h.kind) and not (p / "train").is_dir():
        raise ConfigError(f"{where}: data.root {root} has no train/ (ROOT/train/<class>/...)")


# ---------------------------------------------------------------- the sets of a search
@dataclass
class Sets:
    """The data sets a search scores each trial on: the tuning set (the recipe's data, named
    `tuning`) and the held-out ones, with every set's class count (its chance level), the combine
    rule, where a folder set's carved view is (OUT/heldout/), and `recipe`: the recipe as trials
    train it without the time budget (its own train.epochs, optim.schedule_clock and [per_device]
    tables), what a set of length "recipe" starts from."""

    tuning: str
    heldout: list[HeldOut]
    classes: dict
    rule: str
    val_fraction: float  # a held-out set's share when it gives none: the tuning set's
    views: dict = field(default_factory=dict)  # folder set -> its carved view
    recipe: object = None  # a Config: needed where a set's length is "recipe"

    @property
    def names(self) -> tuple:
        return (self.tuning, *(h.name for h in self.heldout))

    def fraction(self, h: HeldOut) -> float:
        return h.val_fraction if h.val_fraction is not None else self.val_fraction

    def config(self, h: HeldOut, base, params: dict, seed: int | None = None):
        """The trial's keys `params` on set `h`: the recipe (`base`, the trials' recipe with their
        time budget; under length="recipe" `self.recipe`, the recipe's own length), the set's keys,
        its budget (or its cap) and validation split, an evaluation at the end only (nothing prunes
        a held-out run), then the trial's keys (a space key no set may set: prepare_sets; a
        batch it names is the cap of the recipe's data.batch_rule=min_steps: trial_keys)."""
        split = (
            {"data.root": str(self.views[h.name]), "data.val_fraction": 0.0}
            if reads_class_folder(h.kind)
            else {"data.val_fraction": self.fraction(h)}
        )
        if h.recipe_length:
            if self.recipe is None:
                raise ConfigError(f"held-out set {h.name}: length = 'recipe' needs the recipe")
            start, length = self.recipe, cap_keys(self.recipe, h.budget_s)
        else:
            start, length = base, budget_keys(h.budget_s)
        on_set = with_overrides(
            start,
            {"run.eval_every": 0, **h.overrides, **length, **split, "train.targets": []},
            resolve=False,
        )
        return with_trial(on_set, params, {} if seed is None else {"run.seed": seed})

    def test_overrides(self, h: HeldOut) -> list[str]:
        """What evaluates a model trained on set `h`'s validation-less part on `h`'s test split."""
        if reads_class_folder(h.kind):
            return [f"data.root={self.views[h.name] / 'test-view'}"]
        return ["data.val_fraction=0"]

    def score(self, accuracies: dict) -> tuple[dict, float]:
        """({set: normalised accuracy}, the combined score) of a run's accuracy on every set."""
        norm = {n: normalised(accuracies[n], self.classes[n]) for n in self.names}
        return norm, combine(norm.values(), self.rule)

    def as_dict(self) -> dict:
        """What the study records (and its fingerprint holds: not the views, which are OUT's)."""
        out = {
            "tuning": self.tuning,
            "combine": self.rule,
            "classes": dict(self.classes),
            "heldout": [{**h.as_dict(), "val_fraction": self.fraction(h)} for h in self.heldout],
        }
        if any(h.recipe_length for h in self.heldout) and self.recipe is not None:
            out["recipe_length"] = recipe_length(self.recipe)
        return out


LENGTH_KEYS = ("train.epochs", "train.time_limit_s", "optim.schedule_clock")


def recipe_length(cfg) -> dict:
    """What sets a run's length in recipe `cfg` (its keys and its [per_device] tables' ones): the
    fingerprint of a search whose sets train the recipe's length (the trials' recipe has the
    budget's instead)."""
    pairs = [k.split(".") for k in LENGTH_KEYS]
    out = {f"{sec}.{name}": getattr(getattr(cfg, sec), name) for sec, name in pairs}
    per = {}
    for cls, sections in sorted(cfg.per_device.items()):
        keys = {
            f"{sec}.{name}": sections[sec][name]
            for sec, name in pairs
            if name in sections.get(sec, {})
        }
        if keys:
            per[cls] = keys
    if per:
        out["per_device"] = per
    return out


def prepare_sets(heldout: list[HeldOut], base, space, args, out: Path, recipe=None) -> Sets | None:
    """The search's sets (None without --heldout): names apart from the tuning set's, no set setting
    a key the space searches, every set's config valid with the recipe, its classes counted, and a
    folder set's validation view carved (OUT/heldout/). One line naming the set where not.
    `recipe`: the trials' recipe without the budget (the command's trial_config(args,
    budget=False)), what a set of length "recipe" trains."""
    if not heldout:
        return None
    if recipe is None and any(h.recipe_length for h in heldout):
        raise ValueError("prepare_sets: a set of length 'recipe' needs the recipe it trains")
    tuning = base.data.name
    classes = {tuning: count_classes(base)}
    searched = {d.key for d in space}
    sets = Sets(
        tuning,
        list(heldout),
        classes,
        getattr(args, "combine", None) or "worst",
        float(base.data.val_fraction),
        recipe=recipe,
    )
    for h in heldout:
        where = f"{h.source}: [{h.name}]"
        if h.name == tuning:
            raise ConfigError(f"{where}: the tuning set (the recipe's data) is named {tuning}")
        both = sorted(searched & set(h.overrides))
        if both:
            raise ConfigError(
                f"{where}: sets {', '.join(both)}, which the space searches (a trial's keys train "
                "every set)"
            )
        try:
            cfg = with_overrides(base, {**h.overrides, **budget_keys(h.budget_s)}, resolve=False)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        if reads_class_folder(h.kind):
            sets.views[h.name], classes[h.name] = carve_folder(
                h, sets.fraction(h), base.data.val_seed, out / "heldout"
            )
        else:
            classes[h.name] = count_classes(cfg)
        if cfg.model.num_classes and cfg.model.num_classes != classes[h.name]:
            raise ConfigError(
                f"{where}: model.num_classes={cfg.model.num_classes} but the set has "
                f"{classes[h.name]} classes (set model.num_classes = 0 to follow the data)"
            )
        try:  # the whole trial config, on the set (the view's root for a folder)
            sets.config(h, base, {})
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    return sets


def count_classes(cfg) -> int:
    """The class count of an in-memory set (a folder's: carve_folder)."""
    from ...data.build import NATIVE_GEOMETRY

    if cfg.data.name in NATIVE_GEOMETRY:
        return NATIVE_GEOMETRY[cfg.data.name][2]
    return cfg.data.num_classes


def carve_folder(h: HeldOut, fraction: float, seed: int, into: Path) -> tuple[Path, int]:
    """(the view, the class count) of folder set `h`: OUT/heldout/NAME-HASH/ with train/ and val/
    holding links to the training images (round(fraction x count) of each class in val/, chosen
    with `seed` as data.val_fraction's split is), and test-view/ (train/ and the folder's own test
    split) for the one test evaluation. Made once (HASH: the images, fraction and seed), in a
    temporary folder renamed into place: workers sharing OUT reuse it, never see half of it."""
    import numpy as np
    import torch

    from ...data.sources.folder import EVAL_SPLITS, scan
    from ...data.val_split import stratified_split

    root = Path(h.overrides["data.root"]).expanduser().resolve()
    classes, (paths, labels), _ = scan(root)
    eval_dir = next(root / s for s in EVAL_SPLITS if (root / s).is_dir())
    key = hashlib.sha256(
        json.dumps([str(root), fraction, seed, paths.tolist()]).encode()
    ).hexdigest()[:12]
    view = into / f"{h.name}-{key}"
    if (view / DONE).is_file():
        return view, len(classes)
    _, val = stratified_split(torch.as_tensor(labels), fraction, seed)
    held = np.zeros(len(paths), dtype=bool)
    held[val.numpy()] = True
    tmp = into / f".{view.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for p, v in zip(paths, held):
        link = tmp / ("val" if v else "train") / Path(p).relative_to(root / "train")
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path(p).resolve())
    (tmp / "test-view").mkdir()
    (tmp / "test-view" / "train").symlink_to(Path("..") / "train")
    (tmp / "test-view" / "test").symlink_to(eval_dir)
    (tmp / DONE).write_text(
        json.dumps(
            {
                "root": str(root),
                "val_fraction": fraction,
                "val_seed": seed,
                "classes": classes,
                "train": int((~held).sum()),
                "val": int(held.sum()),
                "test": str(eval_dir),
            },
            indent=1,
        )
    )
    try:
        tmp.rename(view)
    except OSError:  # another worker made it first
        shutil.rmtree(tmp, ignore_errors=True)
    log(
        f"held-out set {h.name}: {root}, {len(classes)} classes, {int((~held).sum())} training / "
        f"{int(held.sum())} validation images of its train/ (view: {view})"
    )
    return view, len(classes)
