"""`vitscale search --heldout FILE --combine worst|mean` (docs/search.md): the held-out sets' file
read and checked (one line naming what is wrong), the normalisation to chance and the combination
against numbers computed by hand, the fingerprint and the refusal of a continued study with other
sets or rule, a folder set's carved validation view, a set of length "recipe" (the recipe's own
length, data.batch_rule fitting the batch, budget_s a cap) and a trial's batch as the rule's cap,
the finish (repeats, the pick, the test evaluation and the decision over every set) with stand-in
runs, and tiny searches over the tuning set and folder sets end to end."""

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY, search_args, sets
from PIL import Image

from vitscale.cli import main
from vitscale.config import load_config
from vitscale.errors import ConfigError, UserError

pytest.importorskip("optuna")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SPACE = "[optim]\nlr = { low = 1e-3, high = 1e-2, log = true }\n"


def grey_folder(root, train=10, test=3):
    """root/{train,test}/{dark,light}/*.png: 8 px grey images a tiny model tells apart."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("test", test)):
        for c, level in (("dark", 60), ("light", 200)):
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(n):
                px = (level + rng.normal(0, 20, (8, 8))).clip(0, 255).astype("uint8")
                Image.fromarray(px, "L").save(d / f"{i}.png")
    return root


def folder_set(root, budget=0.3) -> str:
    return f"""
[fold]
budget_s = {budget}
data.name = "folder"
data.root = "{root}"
data.channels = 1
data.image_size = 8
data.num_workers = 0
data.batch_size = 8
data.drop_last = false
data.eval_batch_size = 4
"""


# ------------------------------------------------------------------ normalisation and combination
@pytest.mark.parametrize(
    "acc, classes, want",
    [
        (0.55, 10, 0.5),  # (0.55 - 0.1) / 0.9
        (0.75, 2, 0.5),  # (0.75 - 0.5) / 0.5
        (0.25, 4, 0.0),  # chance: a collapsed model
        (1.0, 7, 1.0),
        (0.0, 2, -1.0),  # below chance
        (0.9, 100, 0.8989898989898990),  # (0.9 - 0.01) / 0.99
    ],
)
def test_an_accuracy_is_normalised_to_chance(acc, classes, want):
    from vitscale.lab.search.score import normalised

    assert normalised(acc, classes) == pytest.approx(want, abs=1e-12)


def test_the_sets_scores_combine_by_their_worst_or_their_mean():
    from vitscale.lab.search.heldout import HeldOut, Sets
    from vitscale.lab.search.score import combine, normalised

    assert combine([0.5, 0.9, 0.2], "worst") == 0.2
    assert combine([0.5, 0.9, 0.2], "mean") == pytest.approx(1.6 / 3)
    with pytest.raises(ValueError, match="combine must be one of"):
        combine([0.5], "median")
    with pytest.raises(ValueError, match="at least 2 classes"):
        normalised(0.5, 1)
    s = Sets("fashion_mnist", [HeldOut("clip", 10.0, {"data.name": "folder"})], {}, "worst", 0.1)
    s.classes.update(fashion_mnist=10, clip=4)
    norm, worst = s.score({"fashion_mnist": 0.91, "clip": 0.625})
    # (0.91 - 0.1) / 0.9 = 0.9; (0.625 - 0.25) / 0.75 = 0.5
    assert norm == pytest.approx({"fashion_mnist": 0.9, "clip": 0.5}) and worst == pytest.approx(
        0.5
    )
    s.rule = "mean"
    assert s.score({"fashion_mnist": 0.91, "clip": 0.625})[1] == pytest.approx(0.7)


# ------------------------------------------------------------------ the file
def test_the_held_out_file_gives_each_sets_keys_budget_and_share(tmp_path):
    from vitscale.lab.search.heldout import load_heldout, parse_heldout

    (tmp_path / "h.toml").write_text(
        '[digits]\nbudget_s = 30\nval_fraction = 0.2\ndata.name = "synthetic"\n'
        'data.num_classes = 3\n[clip.data]\nname = "folder"\nroot = \'' + str(tmp_path) + "'\n"
        "channels = 1\n[clip]\nbudget_s = 5\n"
    )
    (tmp_path / "train").mkdir()
    digits, clip = load_heldout([tmp_path / "h.toml"])
    assert (digits.name, digits.budget_s, digits.val_fraction) == ("digits", 30.0, 0.2)
    assert digits.overrides == {"data.name": "synthetic", "data.num_classes": 3}
    assert clip.overrides == {"data.name": "folder", "data.root": str(tmp_path), "data.channels": 1}
    assert (clip.kind, clip.val_fraction) == ("folder", None)
    assert digits.length == clip.length == "budget"  # the default: budget_s seconds of training
    assert "length" not in digits.as_dict()  # a study from before `length` keeps its fingerprint
    (mine,) = parse_heldout(
        tomllib.loads('[r]\nlength = "recipe"\nbudget_s = 9\ndata.name = "synthetic"'), "h.toml"
    )
    assert (mine.length, mine.recipe_length, mine.budget_s) == ("recipe", True, 9.0)
    assert mine.as_dict()["length"] == "recipe" and "length" not in mine.overrides
    # the shipped file for the default job parses against the schema (its roots are made elsewhere)
    from vitscale.lab.search.heldout import resolve_file

    data = tomllib.loads(resolve_file("heldout_grey_small").read_text())
    shipped = parse_heldout(data, "heldout_grey_small.toml")
    assert [h.name for h in shipped] == ["openclipart_grey10", "glyphs_strong", "digits"]
    assert {h.length for h in shipped} == {"recipe"}
    assert [h.budget_s for h in shipped] == [120.0, 120.0, 60.0]
    assert shipped[1].overrides["data.root"] == "/work/data/heldout/glyphs_strong"


@pytest.mark.parametrize(
    "text, message",
    [
        (
            '[a]\nbudget_s = 1\ndata.rooot = "x"\ndata.name = "synthetic"',
            "unknown key 'data.rooot' (did you mean 'data.root'?)",
        ),
        (
            '[a]\nbudget = 1\ndata.name = "synthetic"',
            "[a]: unknown key 'budget' (a set takes budget_s",
        ),
        (
            '[a]\ndata.name = "synthetic"',
            "[a]: budget_s (training seconds of every trial on it) is missing",
        ),
        (
            '[a]\nbudget_s = 0\ndata.name = "synthetic"',
            "[a]: budget_s must be a number of seconds > 0, got 0",
        ),
        (
            '[a]\nbudget_s = 1\nval_fraction = 0.9\ndata.name = "synthetic"',
            "[a]: val_fraction must be in (0, 0.5], got 0.9",
        ),
        ("[a]\nbudget_s = 1\ndata.channels = 1", "[a]: data.name is missing"),
        (
            '[a]\nbudget_s = 1\ndata.name = "webdataset"',
            "data.name = 'webdataset': a held-out set is one of",
        ),
        ('[a]\nbudget_s = 1\ndata.name = "folder"', "[a]: data.root is missing"),
        (
            '[a]\nbudget_s = 1\ndata.name = "synthetic"\ntrain.epochs = 3',
            "[a]: train.epochs is the search's: give budget_s",
        ),
        (
            '[a]\nlength = "recipe"\nbudget_s = 1\ndata.name = "synthetic"\ntrain.epochs = 3',
            'or length = "recipe" (the recipe\'s epochs)',
        ),
        (
            '[a]\nlength = "epochs"\nbudget_s = 1\ndata.name = "synthetic"',
            '[a]: length must be "budget" (budget_s seconds, the schedule fitted to them) or '
            "\"recipe\" (the recipe's train.epochs, budget_s their cap), got 'epochs'",
        ),
        (
            '[a]\nlength = 3\nbudget_s = 1\ndata.name = "synthetic"',
            "[a]: length must be",
        ),
        (
            '[a]\nlength = "recipe"\ndata.name = "synthetic"',
            "[a]: budget_s (training seconds of every trial on it) is missing",
        ),
        (
            '[a]\nbudget_s = 1\ndata.name = "synthetic"\ndata.val_fraction = 0.2',
            "give val_fraction",
        ),
        ('[a]\nbudget_s = 1\ndata.name = "synthetic"\ndata.channels = "grey"', "data.channels"),
        ('["a b"]\nbudget_s = 1\ndata.name = "synthetic"', "a set's name is letters"),
        ("a = 3", "'a' must be a table"),
        ("", "no held-out sets"),
    ],
)
def test_a_bad_held_out_file_is_a_one_line_error_naming_it(text, message):
    from vitscale.lab.search.heldout import parse_heldout

    with pytest.raises(ConfigError) as e:
        parse_heldout(tomllib.loads(text), "h.toml")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("h.toml")


def test_a_missing_root_or_file_or_a_name_given_twice_is_one_line(tmp_path):
    from vitscale.lab.search.heldout import load_heldout

    def load(text, name="h.toml"):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as e:
            load_heldout([tmp_path / "h.toml", tmp_path / "g.toml"][: 1 + (name == "g.toml")])
        assert "\n" not in str(e.value)
        return str(e.value)

    gone = tmp_path / "gone"
    assert f"[a]: data.root {gone} is not a directory" in load(
        f'[a]\nbudget_s = 1\ndata.name = "folder"\ndata.root = "{gone}"'
    )
    assert "[a]: data.root" in load(
        f'[a]\nbudget_s = 1\ndata.name = "fashion_mnist"\ndata.root = "{gone}"'
    )
    assert f"data.root {tmp_path} has no train/" in load(
        f'[a]\nbudget_s = 1\ndata.name = "folder"\ndata.root = "{tmp_path}"'
    )
    (tmp_path / "h.toml").write_text('[a]\nbudget_s = 1\ndata.name = "synthetic"')
    assert "g.toml: [a]: another --heldout file names a set so too" in load(
        '[a]\nbudget_s = 2\ndata.name = "synthetic"', "g.toml"
    )
    assert "not valid TOML" in load("[a\n")
    with pytest.raises(ConfigError, match="held-out sets file not found: nope.toml"):
        load_heldout(["nope.toml"])


# ------------------------------------------------------------------ the sets of a search
def args_of(tmp_path, **kw):
    kw = {"overrides": ["data.val_fraction=0.25"], "heldout": ["h.toml"], "combine": None, **kw}
    return search_args(tmp_path / "search", **kw)


def test_a_folder_set_is_carved_into_a_stratified_view_of_its_training_images(tmp_path):
    from vitscale.lab.search import trial_config
    from vitscale.lab.search.heldout import parse_heldout, prepare_sets
    from vitscale.lab.search.space import parse_space

    root = grey_folder(tmp_path / "fold")
    (h,) = parse_heldout(tomllib.loads(folder_set(root)), "h.toml")
    args = args_of(tmp_path)
    base = trial_config(args)
    space = parse_space({"optim": {"lr": [1e-3]}})
    s = prepare_sets([h], base, space, args, tmp_path / "out")
    assert s.classes == {"synthetic": 4, "fold": 2} and s.fraction(h) == 0.25  # the tuning set's
    view = s.views["fold"]
    train = sorted(p.relative_to(view).as_posix() for p in (view / "train").rglob("*.png"))
    val = sorted(p.relative_to(view).as_posix() for p in (view / "val").rglob("*.png"))
    # round(0.25 x 10) = 2 of each class held out (round half to even), every link to the original
    assert len(train) == 16 and len(val) == 4
    assert sum(v.startswith("val/dark/") for v in val) == 2
    assert {p.split("/", 1)[1] for p in train}.isdisjoint(p.split("/", 1)[1] for p in val)
    assert all((view / p).resolve().parent.parent.name == "train" for p in train + val)
    assert (view / "test-view" / "test").resolve() == (root / "test").resolve()
    cfg = s.config(h, base, {"optim.lr": 2e-3}, seed=5)
    assert (cfg.data.root, cfg.data.val_fraction, cfg.train.time_limit_s) == (str(view), 0.0, 0.3)
    assert (cfg.optim.lr, cfg.run.seed, cfg.data.channels, cfg.run.eval_every) == (2e-3, 5, 1, 0)
    assert s.test_overrides(h) == [f"data.root={view / 'test-view'}"]
    # made once: a second search (another worker) reuses it
    again = prepare_sets([h], base, space, args, tmp_path / "out")
    assert again.views == s.views and len(list((tmp_path / "out" / "heldout").iterdir())) == 1


@pytest.mark.parametrize(
    "text, message",
    [
        (
            '[synthetic]\nbudget_s = 1\ndata.name = "synthetic"',
            "the tuning set (the recipe's data) is named synthetic",
        ),
        (
            '[a]\nbudget_s = 1\ndata.name = "synthetic"\noptim.lr = 0.1',
            "[a]: sets optim.lr, which the space searches",
        ),
        (
            '[a]\nbudget_s = 1\ndata.name = "synthetic"\nmodel.num_classes = 7',
            "model.num_classes=7 but the set has 4 classes",
        ),
    ],
)
def test_a_set_at_odds_with_the_recipe_or_the_space_is_refused_in_one_line(tmp_path, text, message):
    from vitscale.lab.search import trial_config
    from vitscale.lab.search.heldout import parse_heldout, prepare_sets
    from vitscale.lab.search.space import parse_space

    args = args_of(tmp_path)
    with pytest.raises(ConfigError) as e:
        prepare_sets(
            parse_heldout(tomllib.loads(text), "h.toml"),
            trial_config(args),
            parse_space({"optim": {"lr": [1e-3]}}),
            args,
            tmp_path,
        )
    assert message in str(e.value) and "\n" not in str(e.value)


def test_combine_and_heldout_are_checked_with_the_score():
    from vitscale.lab.search.score import search_score

    cfg = load_config(TINY)
    ns = types.SimpleNamespace
    with pytest.raises(UserError, match="--combine is for several data sets: give --heldout"):
        search_score(ns(budget_s=1.0, combine="mean", heldout=[]), cfg)
    with pytest.raises(UserError, match="--heldout sets are scored by validation accuracy"):
        search_score(ns(budget_s=1.0, score="time-to-target", target=0.5, heldout=["h"]), cfg)
    s = search_score(ns(budget_s=1.0, heldout=["h"], combine=None), cfg, ("synthetic", "a"))
    assert (s.combine, s.sets, s.direction) == ("worst", ("synthetic", "a"), "maximize")
    assert "worst (minimum) over synthetic, a" in s.line()


# ------------------------------------------------------------------ the fingerprint
def test_the_held_out_sets_and_the_rule_are_part_of_what_makes_a_search_the_same(tmp_path):
    from vitscale.lab.search import fingerprint, import_optuna, open_study, trial_config
    from vitscale.lab.search.heldout import HeldOut, Sets
    from vitscale.lab.search.score import Score
    from vitscale.lab.search.space import parse_space

    args = args_of(tmp_path)
    base, space = trial_config(args), parse_space({"optim": {"lr": [1e-3]}})

    def make(rule="worst", budget=2.0, frac=None, keys=None):
        h = HeldOut("a", budget, keys or {"data.name": "synthetic"}, frac)
        return Sets("synthetic", [h], {"synthetic": 4, "a": 10}, rule, 0.25)

    plain = Score(budget_s=1.0)
    assert fingerprint(base, space, 1.0, plain) == fingerprint(base, space, 1.0, plain, None)
    prints = {
        fingerprint(base, space, 1.0, plain, s)
        for s in (
            None,
            make(),
            make("mean"),
            make(budget=3.0),
            make(frac=0.2),
            make(keys={"data.name": "synthetic", "data.num_classes": 3}),
        )
    }
    assert len(prints) == 6
    same = make()
    same.views["a"] = tmp_path / "elsewhere"  # a worker's own OUT: not part of it
    assert fingerprint(base, space, 1.0, plain, same) == fingerprint(
        base, space, 1.0, plain, make()
    )
    optuna = import_optuna()
    out = tmp_path / "search"
    out.mkdir()
    study = open_study(optuna, args, base, space, out, make())
    assert study.user_attrs["sets"]["combine"] == "worst"
    assert study.user_attrs["score"]["sets"] == ["synthetic", "a"]
    open_study(optuna, args, base, space, out, make())  # the same search: continued
    for other in (make("mean"), make(budget=3.0), None):
        args.combine = other.rule if other else None
        args.heldout = ["h.toml"] if other else []
        with pytest.raises(UserError) as e:
            open_study(optuna, args, base, space, out, other)
        assert "other --heldout sets or --combine" in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ the recipe's length, the rule's cap
RULED = [
    "data.val_fraction=0.25",
    "data.batch_rule=min_steps",
    "data.min_batch_size=4",
    "train.min_steps=12",
]


def ruled_recipe(tmp_path) -> str:
    """tiny.toml with a [per_device] table of every device class: 3 epochs wherever it runs."""
    path = tmp_path / "ruled.toml"
    text = Path(TINY).read_text()
    for cls in ("cpu", "cpu_bf16", "cuda"):
        text += f"\n[per_device.{cls}.train]\nepochs = 3\n"
    path.write_text(text)
    return str(path)


def test_a_trials_batch_is_the_cap_of_the_recipes_rule_on_every_set(tmp_path):
    """data.batch_rule=min_steps kept where a trial names data.batch_size (the tuning set, a held-out
    set of either length), fixed where the recipe or the set fixes it or the trial names the rule;
    a set of length "recipe" trains the recipe's own epochs (its [per_device] table's, the trial's
    where it names them) and schedule clock, budget_s the time limit."""
    from vitscale.lab.search import trial_config
    from vitscale.lab.search.heldout import (
        BIG_EPOCHS,
        HeldOut,
        Sets,
        trial_keys,
        with_overrides,
        with_trial,
    )

    args = args_of(tmp_path)
    args.config, args.overrides = ruled_recipe(tmp_path), list(RULED)
    base, recipe = trial_config(args), trial_config(args, budget=False)
    assert base.data.batch_rule == "min_steps"
    # set_override fixes a named batch: what a trial did before
    assert with_overrides(base, {"data.batch_size": 8}).data.batch_rule == "fixed"
    cfg = with_trial(base, {"data.batch_size": 8, "optim.lr": 1e-3})
    assert (cfg.data.batch_size, cfg.data.batch_rule, cfg.optim.lr) == (8, "min_steps", 1e-3)
    assert trial_keys(base, {"optim.lr": 1e-3}) == {"optim.lr": 1e-3}  # no batch: nothing added
    both = {"data.batch_size": 8, "data.batch_rule": "fixed"}
    assert with_trial(base, both).data.batch_rule == "fixed"  # a trial naming the rule has it
    fixed = with_overrides(base, {"data.batch_rule": "fixed"}, resolve=False)
    assert with_trial(fixed, {"data.batch_size": 8}).data.batch_rule == "fixed"  # the recipe's
    syn = {"data.name": "synthetic", "data.num_classes": 3}
    by_recipe, by_budget = HeldOut("r", 7.0, syn, length="recipe"), HeldOut("b", 5.0, syn)
    pinned = HeldOut("p", 7.0, {**syn, "data.batch_size": 4}, length="recipe")
    s = Sets("synthetic", [by_recipe, by_budget, pinned], {}, "worst", 0.25, recipe=recipe)
    r = s.config(by_recipe, base, {"data.batch_size": 8}, seed=3)
    assert (r.data.batch_size, r.data.batch_rule, r.run.seed) == (8, "min_steps", 3)
    # the recipe's length as `vitscale train` has it on this device, budget_s its cap
    assert (r.train.epochs, r.optim.schedule_clock, r.train.time_limit_s) == (3, "steps", 7.0)
    assert (r.train.min_steps, r.data.val_fraction, r.run.eval_every) == (12, 0.25, 0)
    assert s.config(by_recipe, base, {"train.epochs": 5.0}).train.epochs == 5.0  # the trial's
    b = s.config(by_budget, base, {"data.batch_size": 8})
    assert (b.data.batch_size, b.data.batch_rule) == (8, "min_steps")
    assert (b.train.epochs, b.optim.schedule_clock, b.train.time_limit_s) == (
        BIG_EPOCHS,
        "time",
        5.0,
    )
    p = s.config(pinned, base, {"optim.lr": 1e-3})  # a set that names its batch fixes it
    assert (p.data.batch_size, p.data.batch_rule) == (4, "fixed")
    with pytest.raises(ConfigError, match="length = 'recipe' needs the recipe"):
        Sets("synthetic", [by_recipe], {}, "worst", 0.25).config(by_recipe, base, {})
    # the recipe's length (its [per_device] tables' too) is part of the search's fingerprint
    from vitscale.lab.search import fingerprint
    from vitscale.lab.search.score import Score
    from vitscale.lab.search.space import parse_space

    space, plain = parse_space({"optim": {"lr": [1e-3]}}), Score(budget_s=1.0)
    longer = with_overrides(recipe, {"train.epochs": 4.0}, resolve=False)
    prints = {
        fingerprint(base, space, 1.0, plain, Sets("synthetic", [h], {}, "worst", 0.25, recipe=c))
        for h, c in ((by_budget, recipe), (by_recipe, recipe), (by_recipe, longer))
    }
    assert len(prints) == 3
    length = Sets("synthetic", [by_recipe], {}, "worst", 0.25, recipe=recipe).as_dict()
    assert length["recipe_length"]["train.epochs"] == 2  # tiny.toml's; 3 on every device
    assert length["recipe_length"]["per_device"]["cpu"] == {"train.epochs": 3}
    assert length["heldout"][0]["length"] == "recipe"


def test_what_a_run_took_says_its_batch_steps_and_whether_the_cap_stopped_it():
    from vitscale.lab.search.trials import took

    cfg = load_config(TINY)
    ruled = {"steps": 12, "epochs": 3.0, "train_time_s": 0.4, "stop_reason": "done",
             "auto": {"data.batch_size": {"value": 4, "why": "data.batch_rule=min_steps"}}}  # fmt: skip
    assert took(ruled, cfg, "recipe") == {
        "length": "recipe", "batch": 4, "steps": 12, "epochs": 3.0, "train_time_s": 0.4,
        "capped": False,
    }  # fmt: skip
    cut = {**ruled, "auto": {}, "stop_reason": "time limit"}
    assert took(cut, cfg, "recipe")["capped"] and took(cut, cfg, "recipe")["batch"] == 16
    assert not took(cut, cfg)["capped"]  # a budget run ends on its time limit by design
    assert took({}, cfg)["steps"] is None  # a stand-in run's summary


# ------------------------------------------------------------------ the finish over every set
def test_the_finish_repeats_tests_and_decides_over_every_set(tmp_path, monkeypatch):
    """Stand-in runs with fixed accuracies: the candidates' values are the worst normalised
    accuracy per seed, the pick's and the recipe's test evaluation covers every set, and the
    decision compares the combined scores."""
    import optuna

    from vitscale import evaluate
    from vitscale.lab.search import trial_config
    from vitscale.lab.search import trials as search_trials
    from vitscale.lab.search.heldout import HeldOut, Sets
    from vitscale.lab.search.score import Score

    # (set, lr or recipe) -> validation accuracy; the test accuracy is 0.05 lower
    acc = {
        ("synthetic", 2e-3): 0.85,  # (0.85 - 0.25) / 0.75 = 0.8
        ("syn3", 2e-3): 0.6,  # (0.6 - 1/3) / (2/3) = 0.4: the trial's worst
        ("synthetic", 3e-3): 0.7,  # the recipe (tiny.toml's lr): 0.6
        ("syn3", 3e-3): 0.8,  # 0.7
    }

    def train_run(cfg, run_dir, on_eval=None):
        name = "syn3" if cfg.data.num_classes == 3 else "synthetic"
        return {
            "accuracy": acc[(name, cfg.optim.lr)],
            "train_time_s": 1.0,
            "epochs": 2.0,
            "checkpoint": f"{name}|{cfg.optim.lr}",
        }

    def evaluate_checkpoint(ckpt, overrides):
        name, lr = ckpt.split("|")
        want = ["data.val_fraction=0"]
        assert list(overrides) == want
        return {"test_accuracy": acc[(name, float(lr))] - 0.05, "test_loss": 0.0, "test_count": 9}

    monkeypatch.setattr(search_trials, "train_run", train_run)
    monkeypatch.setattr(evaluate, "evaluate_checkpoint", evaluate_checkpoint)
    args = args_of(tmp_path, repeat_top=1, seeds=1, recipe=True)
    base = trial_config(args)
    s = Sets(
        "synthetic",
        [HeldOut("syn3", 0.5, {"data.name": "synthetic", "data.num_classes": 3})],
        {"synthetic": 4, "syn3": 3},
        "worst",
        0.25,
    )
    study = optuna.create_study(direction="maximize")
    dist = {"optim.lr": optuna.distributions.CategoricalDistribution([2e-3])}
    study.add_trial(
        optuna.trial.create_trial(
            params={"optim.lr": 2e-3},
            distributions=dist,
            value=0.5,
            user_attrs={"epochs": 2.0, "set_accuracy": {"synthetic": 0.9, "syn3": 0.7}},
        )
    )
    score = Score(budget_s=1.0, combine="worst", sets=("synthetic", "syn3"))
    out = tmp_path / "search"
    out.mkdir()
    fin = search_trials.finalize(study, base, args, out, score, s)
    pick, recipe = fin["pick"], fin["recipe"]
    assert pick["values"] == pytest.approx([0.5, 0.4])  # the trial's own, then seed 1's worst
    assert pick["runs"][0]["set_score"] == pytest.approx({"synthetic": 0.8, "syn3": 0.4})
    assert pick["set_means"] == pytest.approx({"synthetic": 0.875, "syn3": 0.65})
    assert recipe["values"] == pytest.approx([0.6, 0.6]) and recipe["mean"] == pytest.approx(0.6)
    # tests: pick 0.8 / 0.55 -> (0.8-0.25)/0.75 = 0.7333, (0.55-1/3)/(2/3) = 0.325: worst 0.325;
    # recipe 0.65 / 0.75 -> 0.5333, 0.625: worst 0.5333
    assert fin["test"]["set_test"] == pytest.approx({"synthetic": 0.8, "syn3": 0.55})
    assert fin["test"]["test_score"] == pytest.approx(0.325)
    assert fin["recipe_test"]["test_score"] == pytest.approx(0.4 / 0.75)
    d = fin["decision"]
    assert not d["adopt"] and d["val_gap"] == pytest.approx(0.45 - 0.6)
    assert d["test_gap"] == pytest.approx(0.325 - (0.65 - 0.25) / 0.75)
    assert "test score 0.3250 vs 0.5333" in d["text"]


# ------------------------------------------------------------------ a tiny search, end to end
def test_a_tiny_search_scores_every_trial_on_the_tuning_and_a_folder_set(tmp_path, capsys):
    from vitscale.lab.search.score import normalised

    root = grey_folder(tmp_path / "fold")
    (tmp_path / "h.toml").write_text(folder_set(root))
    (tmp_path / "space.toml").write_text(SPACE)
    out = tmp_path / "search"
    argv = [
        "search",
        TINY,
        "--space",
        str(tmp_path / "space.toml"),
        "--budget-s",
        "0.5",
        "--trials",
        "1",
        "--out",
        str(out),
        "--repeat-top",
        "0",
        "--pruner",
        "none",
        "--heldout",
        str(tmp_path / "h.toml"),
        "--combine",
        "mean",
        *sets(["run.threads=1", "data.val_fraction=0.25", "run.eval_every=20"]),
    ]
    assert main(argv) == 0
    rep = json.loads((out / "search.json").read_text())
    (t,) = rep["trials"]
    assert rep["sets"]["classes"] == {"synthetic": 4, "fold": 2}
    assert rep["score"]["combine"] == "mean" and rep["score"]["sets"] == ["synthetic", "fold"]
    accs, norm = t["set_accuracy"], t["set_score"]
    assert t["state"] == "complete" and set(accs) == {"synthetic", "fold"}
    assert accs["synthetic"] == t["val_accuracy"]
    assert norm == pytest.approx({k: normalised(accs[k], rep["sets"]["classes"][k]) for k in accs})
    assert t["score"] == pytest.approx((norm["synthetic"] + norm["fold"]) / 2)
    # the folder set trained on its carved view, scored on its 4 validation images, test split unread
    run = out / "trials" / "00000-fold"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_accuracy"] == accs["fold"] and summary["test_count"] == 4
    assert summary["train_time_s"] >= 0.3 and not (run / "checkpoints").exists()
    cfg = load_config(run / "config.toml")
    assert cfg.data.root.startswith(str(out / "heldout" / "fold-")) and cfg.data.val_fraction == 0
    md = (out / "search.md").read_text()
    assert "| # | state | mean | val acc | fold |" in md
    assert f"--heldout {tmp_path / 'h.toml'} --combine mean" in md
    err = capsys.readouterr().err
    assert "trial    0 complete val synthetic " in err and ", mean " in err
    # the same search with another rule is another search: refused in one line
    assert main([*argv[:-7], "worst", *argv[-6:]]) == 2
    assert "other --heldout sets or --combine" in capsys.readouterr().err


def test_a_set_of_the_recipes_length_trains_at_the_batch_the_rule_gives_it(tmp_path):
    """A tiny recipe with data.batch_rule=min_steps (train.min_steps=12, data.min_batch_size=4) and
    a space naming data.batch_size=8: on the tuning set's 48 images the time budget keeps the
    trial's 8; on the 16 training images of a folder set of length "recipe" the rule takes 4 (8
    gives 2 steps an epoch) and grows tiny.toml's 2 epochs to 3 for 12 steps, as `vitscale train`
    would, and the trial records it; a second such set whose min_steps no cap allows is stopped by
    its budget_s and recorded as capped."""
    root = grey_folder(tmp_path / "fold", train=10, test=2)
    one = folder_set(root, budget=30).replace("data.batch_size = 8\n", "")
    one = one.replace("[fold]\n", '[fold]\nlength = "recipe"\n')
    cut = one.replace("[fold]", "[long]").replace("budget_s = 30", "budget_s = 0.3")
    (tmp_path / "h.toml").write_text(one + cut + "train.min_steps = 1000000\n")
    (tmp_path / "space.toml").write_text("[data]\nbatch_size = [8]\n[optim]\nlr = [3e-3]\n")
    out = tmp_path / "search"
    argv = ["search", TINY, "--space", str(tmp_path / "space.toml"), "--budget-s", "0.3"]
    argv += ["--trials", "1", "--out", str(out), "--repeat-top", "0", "--pruner", "none"]
    argv += ["--heldout", str(tmp_path / "h.toml")]
    assert main([*argv, *sets(["run.threads=1", *RULED])]) == 0
    rep = json.loads((out / "search.json").read_text())
    (t,) = rep["trials"]
    assert t["state"] == "complete", t["error"]
    assert [h.get("length") for h in rep["sets"]["heldout"]] == ["recipe", "recipe"]
    assert rep["sets"]["recipe_length"]["train.epochs"] == 2
    ran = t["set_runs"]
    assert ran["synthetic"]["batch"] == 8 and ran["synthetic"]["length"] == "budget"
    summary = json.loads((out / "trials" / "00000-fold" / "summary.json").read_text())
    assert summary["auto"]["data.batch_size"]["value"] == 4 and summary["steps"] == 12
    assert summary["stop_reason"] == "done" and summary["test_count"] == 4
    assert ran["fold"] == {
        "length": "recipe", "batch": 4, "steps": 12, "epochs": pytest.approx(3.0),
        "train_time_s": summary["train_time_s"], "capped": False,
    }  # fmt: skip
    saved = load_config(out / "trials" / "00000-fold" / "config.toml")
    assert (saved.data.batch_size, saved.train.epochs, saved.optim.schedule_clock) == (
        4,
        3,
        "steps",
    )
    long = json.loads((out / "trials" / "00000-long" / "summary.json").read_text())
    assert long["stop_reason"] == "time limit" and ran["long"]["capped"]
    assert ran["long"]["batch"] == 4 and ran["long"]["steps"] == long["steps"] < 1000000
    assert set(t["set_accuracy"]) == {"synthetic", "fold", "long"}
    md = (out / "search.md").read_text()
    assert f" (b 4 x 12) | {fmt_acc(t['set_accuracy']['long'])} (b 4 x " in md
    assert ", capped) |" in md


def fmt_acc(v) -> str:
    return f"{v:.4f}"


def test_a_held_out_sets_failure_fails_the_trial_with_its_one_line_reason(tmp_path, monkeypatch):
    import torch

    from vitscale.lab.search import trials as search_trials

    def train_run(cfg, run_dir, on_eval=None):
        if cfg.data.num_classes == 3:  # the held-out set
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return {"accuracy": 0.75, "train_time_s": 1.0, "steps": 4, "epochs": 1.0,
                "images_per_s": 9.0, "checkpoint": None}  # fmt: skip

    monkeypatch.setattr(search_trials, "train_run", train_run)
    (tmp_path / "h.toml").write_text(
        '[syn3]\nbudget_s = 1\ndata.name = "synthetic"\ndata.num_classes = 3'
    )
    (tmp_path / "space.toml").write_text(SPACE)
    out = tmp_path / "search"
    argv = ["search", TINY, "--space", str(tmp_path / "space.toml"), "--budget-s", "1"]
    argv += ["--trials", "1", "--out", str(out), "--repeat-top", "0"]
    assert main([*argv, "--heldout", str(tmp_path / "h.toml"), *sets(["run.threads=1"])]) == 0
    (t,) = json.loads((out / "search.json").read_text())["trials"]
    why = "held-out set syn3: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert (t["state"], t["error"], t["val_accuracy"], t["score"]) == ("fail", why, 0.75, None)
    assert f"| {why} |" in (out / "search.md").read_text()
