"""`vitscale search` (issue 26): the validation split carved from the training set (the test set
never reaches a trial), the space file, the lr schedule fitted to the time budget, and a tiny
search in this process writing its report. The process tests (kill -9 and resume, two workers on
one database) are in tests/integration/test_search_processes.py."""

import json
import math
import sys
import time
import types

import pytest
import torch
from helpers import TINY, FakeTrial, search_args, sets

from vitscale.cli import main
from vitscale.config import Config, load_config, set_value
from vitscale.errors import ConfigError, UserError

pytest.importorskip("optuna")

SPACE = """
[optim]
lr = { low = 1e-3, high = 1e-2, log = true }
[model]
depth = { low = 1, high = 2 }
"""


# ------------------------------------------------------------------ the validation split
def test_stratified_split_is_disjoint_proportional_and_seeded():
    from vitscale.data.val_split import stratified_split

    g = torch.Generator().manual_seed(0)
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate((50, 37, 120, 9, 64))])[
        torch.randperm(280, generator=g)
    ]
    train, val = stratified_split(labels, 0.2, seed=3)
    assert set(train.tolist()).isdisjoint(val.tolist()) and len(train) + len(val) == len(labels)
    assert sorted(train.tolist() + val.tolist()) == list(range(len(labels)))
    for c in range(5):
        n_c = int((labels == c).sum())
        assert abs(int((labels[val] == c).sum()) - 0.2 * n_c) <= 1, c
    again, val2 = stratified_split(labels, 0.2, seed=3)
    assert torch.equal(val, val2) and torch.equal(train, again)
    assert not torch.equal(val, stratified_split(labels, 0.2, seed=4)[1])


def fmnist_cfg(root, **keys):
    cfg = Config()
    for k, v in {
        "data.name": "fashion_mnist",
        "data.root": str(root),
        "data.batch_size": 8,
        **keys,
    }.items():
        set_value(cfg, k, v)
    return cfg.data


def test_validation_replaces_the_test_set_which_is_never_read(tmp_path, monkeypatch):
    from helpers import write_fmnist

    from vitscale.data import build_data
    from vitscale.data.sources import fashion_mnist
    from vitscale.data.val_split import stratified_split

    data = write_fmnist(tmp_path / "fm", n_train=100, n_test=30)
    read = []
    real = fashion_mnist.load_split
    monkeypatch.setattr(
        fashion_mnist, "load_split", lambda root, split: read.append(split) or real(root, split)
    )
    b = build_data(
        fmnist_cfg(tmp_path / "fm", **{"data.val_fraction": 0.2, "data.val_seed": 5}),
        device="cpu",
        seed=0,
    )
    assert read == ["train"] and b.eval_split == "val"  # the test files were not opened
    x = torch.from_numpy(data["train"][0].astype("uint8")).unsqueeze(1)
    y = torch.from_numpy(data["train"][1].astype("int64"))
    train, val = stratified_split(y, 0.2, seed=5)
    assert torch.equal(b.test.x, x[val]) and torch.equal(
        b.test.y, y[val]
    )  # evaluation = the carved samples
    assert torch.equal(b.train.x, x[train]) and torch.equal(
        b.train.y, y[train]
    )  # trained on the rest only
    assert b.train_size == 80 and b.test_size == 20
    read.clear()
    b0 = build_data(
        fmnist_cfg(tmp_path / "fm"), device="cpu", seed=0
    )  # default: the test set, as before
    assert (
        read == ["train", "test"]
        and b0.eval_split == "test"
        and b0.test_size == 30
        and b0.train_size == 100
    )


def test_val_fraction_is_refused_where_no_split_is_carved(tmp_path):
    from vitscale.data import build_data

    cfg = fmnist_cfg(tmp_path, **{"data.name": "folder", "data.val_fraction": 0.1})
    with pytest.raises(UserError, match="data.val_fraction"):
        build_data(cfg, device="cpu", seed=0)


# ------------------------------------------------------------------ the space file
def test_space_ranges_log_int_and_choices(tmp_path):
    from vitscale.lab.search.space import load_space, parse_space

    dims = {
        d.key: d
        for d in parse_space(
            {
                "optim": {
                    "lr": {"low": 1e-4, "high": 1e-2, "log": True},
                    "weight_decay": {"low": 0, "high": 0.1, "step": 0.05},
                },
                "model": {
                    "depth": {"low": 2, "high": 6},
                    "stem": ["patch", "conv"],
                    "dim": {"choices": [64, 128]},
                },
                "train": {"ema_decay": [0.0, 0.99]},
            }
        )
    }
    assert (dims["optim.lr"].kind, dims["optim.lr"].log) == ("float", True)
    assert (dims["optim.weight_decay"].kind, dims["optim.weight_decay"].step) == ("float", 0.05)
    assert (dims["model.depth"].kind, dims["model.depth"].low, dims["model.depth"].high) == (
        "int",
        2,
        6,
    )
    assert dims["model.stem"].choices == ("patch", "conv") and dims["model.dim"].choices == (
        64,
        128,
    )
    import optuna

    t = optuna.trial.FixedTrial({"optim.lr": 3e-3, "model.depth": 4, "model.stem": "conv"})
    assert dims["model.depth"].suggest(t) == 4 and dims["model.stem"].suggest(t) == "conv"
    (tmp_path / "s.toml").write_text(SPACE)
    assert [d.key for d in load_space(tmp_path / "s.toml")] == ["optim.lr", "model.depth"]
    assert len(load_space(None)) >= 10  # the shipped default space parses against the schema


@pytest.mark.parametrize(
    "space, message",
    [
        (
            {"optim": {"lrr": {"low": 1e-4, "high": 1e-2}}},
            "unknown key 'optim.lrr' (did you mean 'optim.lr'?)",
        ),
        ({"optimm": {"lr": [1e-3]}}, "unknown section 'optimm'"),
        ({"model": {"stem": ["patch", "cnn"]}}, "model.stem must be one of"),
        ({"model": {"stem": {"low": 1, "high": 2}}}, "model.stem is not a number"),
        ({"optim": {"lr": {"low": 1e-2, "high": 1e-3}}}, "optim.lr: low (0.01) must be below high"),
        (
            {"optim": {"lr": {"low": 0.0, "high": 1e-3, "log": True}}},
            "optim.lr: a log range needs low > 0",
        ),
        ({"model": {"depth": {"low": 1.5, "high": 4}}}, "model.depth must be an integer"),
        ({"optim": {"lr": {"low": 1e-4}}}, "optim.lr: a range needs low and high"),
        ({"optim": {"lr": []}}, "optim.lr: choices must be a non-empty list"),
        ({"optim": 3}, "'optim' must be a table"),
        ({}, "the space has no keys"),
    ],
)
def test_a_bad_space_is_a_one_line_error_naming_the_key(space, message):
    from vitscale.lab.search.space import parse_space

    with pytest.raises(ConfigError) as e:
        parse_space(space, "space.toml")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_optuna_is_a_one_line_error_naming_the_pip_command(monkeypatch):
    from vitscale.lab.search import import_optuna

    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(UserError, match=r"pip install 'vitscale\[search\]'"):
        import_optuna()


# ------------------------------------------------------------------ the schedule fitted to the budget
def test_time_schedule_ends_when_the_budget_ends():
    from vitscale.optim import time_schedule

    now = [0.0]
    cfg = load_config(TINY, ["optim.min_lr_ratio=0.1", "optim.warmup_steps=4"]).optim
    f = time_schedule(cfg, budget_s=100.0, steps_per_epoch=10, clock=lambda: now[0])
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # the warm-up, in steps
    now[0] = 50.0
    assert f(10) == pytest.approx(0.1 + 0.9 * 0.5)  # half the budget: half the cosine
    now[0] = 100.0
    assert f(10_000) == pytest.approx(0.1) and f(7) == pytest.approx(
        0.1
    )  # the end, whatever the step count
    now[0] = 250.0
    assert f(3) == pytest.approx(0.1)


def test_a_trained_run_ends_its_schedule_at_the_budget(tmp_path, monkeypatch):
    """A fake clock (each read advances 10 ms): the run stops on its time limit with the lr at the
    schedule's end (min_lr_ratio) within the last steps, never cut off part-way down."""
    from vitscale import loop

    clock = [0.0]

    def perf_counter():
        clock[0] += 0.01
        return clock[0]

    monkeypatch.setattr(
        loop, "time", types.SimpleNamespace(perf_counter=perf_counter, strftime=time.strftime)
    )
    cfg = load_config(
        TINY,
        [
            "run.threads=1",
            "run.log_every=1",
            "train.time_limit_s=0.5",
            "train.epochs=1000",
            "optim.schedule_clock=time",
            "optim.min_lr_ratio=0.1",
            "optim.warmup_steps=2",
            "run.checkpoint_every=1000000",
        ],
    )
    summary = loop.train(cfg, tmp_path / "run")
    assert summary["stop_reason"] == "time limit" and summary["train_time_s"] >= 0.5
    rows = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if r["kind"] == "train"]
    worst = max(r["step_time_s"] for r in rows if r["kind"] == "train")
    base = summary["lr"]
    assert len(lrs) > 10 and all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # decays, step by step
    # the last step's lr follows the training time of two steps before the end: within them of the end
    end = (0.5 - 3 * worst) / 0.5
    assert 0.1 * base <= lrs[-1] <= base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * end))) + 1e-12
    assert lrs[-1] < 0.11 * base


def test_step_clock_runs_ignore_the_clock():
    from vitscale.optim import build_scheduler, lr_factor

    cfg = load_config(TINY, ["optim.warmup_steps=3"]).optim
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = build_scheduler(opt, cfg, 20, 5, clock=lambda: 1e9, budget_s=1.0)
    got = []
    for _ in range(20):
        got.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert got == [lr_factor(s, 20, 3, "cosine", 0.0) for s in range(20)]
    with pytest.raises(ConfigError, match="schedule_clock=time needs train.time_limit_s"):
        load_config(TINY, ["optim.schedule_clock=time"])


# ------------------------------------------------------------------ a tiny search, in this process
def test_a_tiny_search_writes_its_report_and_reads_the_test_set_once(tmp_path, monkeypatch, capsys):
    from vitscale.data import build as data_build

    space = tmp_path / "space.toml"
    space.write_text(SPACE)
    bundles, evals = [], []
    real_bundle = data_build.tensor_bundle
    monkeypatch.setattr(
        data_build,
        "tensor_bundle",
        lambda splits, cfg, **kw: (
            bundles.append((cfg.val_fraction, len(splits.test_y))) or real_bundle(splits, cfg, **kw)
        ),
    )
    import vitscale.evaluate as ev

    real_eval = ev.evaluate_checkpoint
    monkeypatch.setattr(
        ev, "evaluate_checkpoint", lambda *a, **k: evals.append(a) or real_eval(*a, **k)
    )
    out = tmp_path / "search"
    argv = [
        "search",
        TINY,
        "--space",
        str(space),
        "--budget-s",
        "1",
        "--trials",
        "3",
        "--out",
        str(out),
        "--repeat-top",
        "1",
        "--seeds",
        "1",
        "--pruner",
        "none",
        *sets(["run.threads=1", "data.val_fraction=0.25", "run.eval_every=20"]),
    ]
    assert main(argv) == 0
    for f in ("search.md", "search.json", "pareto.png", "best.toml", "test.json", "search.db"):
        assert (out / f).is_file(), f
    rep = json.loads((out / "search.json").read_text())
    assert [t["state"] for t in rep["trials"]] == ["complete"] * 3 and rep["pareto"]
    assert all(0 <= t["val_accuracy"] <= 1 and t["train_time_s"] >= 1 for t in rep["trials"])
    # every trial and repeat evaluated on the validation split (a quarter of the 64 training images,
    # synthetic ones drawn from run.seed: the repeat's differ); the test set (32 images) reached a
    # model once, the pick's evaluation, last
    # model once each: the pick's evaluation, then the recipe's (trained as written under the same
    # protocol: seed 0 and the repeat's seed 1), tested on the same seed as the pick
    assert (
        bundles[0] == bundles[1] == bundles[2] and 14 <= bundles[0][1] <= 18 and len(bundles) == 8
    )
    assert [b[0] for b in bundles] == [0.25] * 4 + [0.0] + [0.25] * 2 + [0.0]
    assert bundles[4] == bundles[7] == (0.0, 32) and len(evals) == 2
    fin = rep["finish"]
    pick, recipe = fin["pick"], fin["recipe"]
    assert fin["test"]["trial"] == pick["trial"] and len(pick["values"]) == 2
    assert (
        recipe["params"] == {}
        and len(recipe["values"]) == 2
        and fin["recipe_test"]["trial"] == "recipe"
    )
    assert fin["recipe_test"]["seed"] == fin["test"]["seed"] == 1
    d = fin["decision"]
    assert d["adopt"] == (
        pick["mean"] > recipe["mean"]
        and fin["test"]["test_accuracy"] > fin["recipe_test"]["test_accuracy"]
    )
    assert abs(d["val_gap"] - (pick["mean"] - recipe["mean"])) < 1e-12
    best = load_config(out / "best.toml")
    assert (best.data.val_fraction, best.optim.schedule_clock, best.train.time_limit_s) == (
        0.0,
        "time",
        1.0,
    )
    assert (
        best.optim.lr == pick["params"]["optim.lr"]
        and best.model.depth == pick["params"]["model.depth"]
    )
    md = (out / "search.md").read_text()
    assert "evaluated once" in md and f"vitscale train {out / 'best.toml'}" in md
    assert "the recipe as written" in md and "**Decision: " in md
    err = capsys.readouterr().err
    assert sum(line.startswith("trial ") for line in err.splitlines()) == 3
    # a second invocation with another budget is not the same search
    assert main([*argv[:5], "2", *argv[6:]]) == 2
    assert "was started with another recipe, space or --budget-s" in capsys.readouterr().err
    assert main([*argv, "--report-only"]) == 0 and len(evals) == 2  # both test results are reused


def test_a_failing_trial_is_failed_with_its_reason_and_the_search_goes_on(tmp_path, capsys):
    space = tmp_path / "space.toml"
    space.write_text("[model]\nheads = [3]\n")  # the tiny recipe's width 32 does not divide by 3
    out = tmp_path / "search"
    assert (
        main(
            [
                "search",
                TINY,
                "--space",
                str(space),
                "--budget-s",
                "1",
                "--trials",
                "2",
                "--out",
                str(out),
                *sets(["run.threads=1"]),
            ]
        )
        == 0
    )
    rep = json.loads((out / "search.json").read_text())
    assert [t["state"] for t in rep["trials"]] == ["fail", "fail"]
    assert all(
        "model.dim (32) must be divisible by model.heads (3)" in t["error"] for t in rep["trials"]
    )
    assert rep["finish"]["pick"] is None and not (out / "best.toml").exists()
    assert (
        note_of(out, 0)
        == rep["trials"][0]["error"]
        == "config: model.dim (32) must be divisible by model.heads (3)"
    )
    err = capsys.readouterr().err
    assert err.count("must be divisible by model.heads") == 2 and "no complete trial" in err


def note_of(out, number: int) -> str:
    """The note column of trial `number`'s row in OUT/search.md."""
    rows = [
        r
        for r in (out / "search.md").read_text().splitlines()
        if r.startswith((f"| {number} |", f"| {number}* |"))
    ]
    assert len(rows) == 1, rows
    return rows[0].rsplit(" | ", 1)[1].removesuffix(" |")


def test_a_nan_loss_fails_its_trial_with_the_step(tmp_path):
    space = tmp_path / "space.toml"
    space.write_text("[optim]\nlr = [1e12]\n")  # the first steps' loss is NaN
    out = tmp_path / "search"
    assert (
        main(
            [
                "search",
                TINY,
                "--space",
                str(space),
                "--budget-s",
                "1",
                "--trials",
                "1",
                "--out",
                str(out),
                "--repeat-top",
                "0",
                *sets(["run.threads=1"]),
            ]
        )
        == 0
    )
    (t,) = json.loads((out / "search.json").read_text())["trials"]
    assert (
        t["state"] == "fail"
        and t["error"].startswith("loss is nan at step ")
        and "\n" not in t["error"]
    )
    assert note_of(out, 0) == t["error"]


@pytest.mark.parametrize(
    "exc, reason",
    [
        (
            torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0)\nsee the docs"
            ),
            "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0)",
        ),
        (
            RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"),
            "RuntimeError: MPS backend out of memory (MPS allocated: 1 GB)",
        ),
        (KeyboardInterrupt(), "stopped by Ctrl-C (KeyboardInterrupt) during the trial"),
    ],
)
def test_a_trial_stopped_by_an_error_or_ctrl_c_records_why(tmp_path, monkeypatch, exc, reason):
    from vitscale.lab.search import trials as search_trials

    def train_run(*a, **k):
        raise exc

    monkeypatch.setattr(search_trials, "train_run", train_run)
    space = tmp_path / "space.toml"
    space.write_text(SPACE)
    out = tmp_path / "search"
    assert (
        main(
            [
                "search",
                TINY,
                "--space",
                str(space),
                "--budget-s",
                "1",
                "--trials",
                "1",
                "--out",
                str(out),
                "--repeat-top",
                "0",
                *sets(["run.threads=1"]),
            ]
        )
        == 0
    )
    (t,) = json.loads((out / "search.json").read_text())["trials"]
    assert (t["state"], t["error"]) == ("fail", reason) and note_of(out, 0) == reason


@pytest.mark.filterwarnings(
    "ignore:Heartbeat of storage is supposed to be used with Study.optimize"
)
def test_a_dead_workers_trial_records_why(tmp_path):
    """A RUNNING trial whose heartbeat is old (its worker was killed), one killed before its first
    heartbeat, and one failed without a reason (by another program, or an older vitscale): each
    failed with its one-line reason, in the database, search.json and the row's note; the
    retry of the first does not carry its reason."""
    import sqlite3

    from vitscale.lab.search import import_optuna, open_study, trial_config
    from vitscale.lab.search.report import UNRECORDED, write_report
    from vitscale.lab.search.space import load_space
    from vitscale.lab.search.trials import fail_dead_trials

    optuna = import_optuna()
    (tmp_path / "space.toml").write_text(SPACE)
    out = tmp_path / "search"
    out.mkdir()
    args = search_args(out, space=str(tmp_path / "space.toml"))
    space = load_space(args.space)
    study = open_study(optuna, args, trial_config(args), space, out)
    stale, _unborn, silent = study.ask(), study.ask(), study.ask()  # _unborn: asked, never started
    stale.set_user_attr("worker", "host:123")
    study._storage.record_heartbeat(stale._trial_id)
    with sqlite3.connect(out / "search.db") as db:  # its worker stopped a minute ago
        db.execute("UPDATE trial_heartbeats SET heartbeat = datetime('now', '-60 seconds')")
    study.tell(silent, state=optuna.trial.TrialState.FAIL)
    fail_dead_trials(optuna, study, 0.0)
    ts = {
        t.number: t
        for t in optuna.load_study(
            study_name="search", storage=f"sqlite:///{out / 'search.db'}"
        ).get_trials()
    }
    assert [ts[n].state.name for n in range(4)] == ["FAIL", "FAIL", "FAIL", "WAITING"]
    why = "worker host:123 stopped: no heartbeat for over 3 s (killed or lost)"
    assert ts[0].user_attrs["error"] == why
    assert (
        ts[1].user_attrs["error"].startswith("worker stopped before the trial's first heartbeat, ")
    )
    assert (
        ts[3].system_attrs["failed_trial"] == 0 and "error" not in ts[3].user_attrs
    )  # the retry, to run
    write_report(study, space, args, out, None, None)
    rows = {t["number"]: t for t in json.loads((out / "search.json").read_text())["trials"]}
    assert [rows[n]["error"] for n in range(4)] == [
        why,
        ts[1].user_attrs["error"],
        UNRECORDED,
        None,
    ]
    assert [note_of(out, n) for n in range(4)] == [
        why,
        ts[1].user_attrs["error"],
        UNRECORDED,
        "retry of 0",
    ]


def test_pruning_reports_percent_of_the_budget_and_never_prunes_the_end():
    import optuna

    from vitscale.lab.search.trials import Pruning

    trial = FakeTrial(prune_after=3)
    prune = Pruning(optuna, trial, budget_s=10.0, metric="test_accuracy")

    def ev(train_time_s, acc, step=0):  # an evaluation's record, as the Trainer passes it
        return {
            "train_time_s": train_time_s,
            "step": step,
            "epoch": step / 10,
            "test_accuracy": acc,
        }

    for step, (t, acc) in enumerate(((1.0, 0.1), (1.2, 0.2), (3.0, 0.3)), 1):
        prune(ev(t, acc, 10 * step))  # 10%, 12% (under 5 points later: skipped), 30%
    assert trial.reports == [(10, 0.1), (30, 0.3)]
    prune(ev(10.5, 0.9))  # the last evaluation, past the budget: not reported here, never pruned
    prune(ev(9.2, 0.05))  # the last 10% of the budget: not reported, never pruned (saves little)
    assert trial.reports == [(10, 0.1), (30, 0.3)]
    with pytest.raises(optuna.TrialPruned, match="pruned at 60% of the budget"):
        prune(ev(6.0, 0.4, 30))
    assert trial.attrs["train_time_s"] == 6.0 and trial.attrs["epochs"] == 3.0


@pytest.mark.parametrize("bf16", [False, True])
def test_an_adamw_trial_of_the_muon_default_recipe_is_a_valid_config(monkeypatch, bf16):
    """The default recipe is Muon with optim.muon_ns_dtype=auto: the trials' base keeps its auto
    keys and [per_device] tables unanswered, so an AdamW trial (the time-to-accuracy space's
    optimizer choice) is not refused for a Newton-Schulz dtype resolved before its optimizer was
    chosen, and a trial's epochs/budget keys win over the bf16 CPU's table."""
    from vitscale import fastpaths
    from vitscale.cli import _parser
    from vitscale.lab.recipes import with_overrides
    from vitscale.lab.search import trial_config

    monkeypatch.setattr(fastpaths, "cpu_has_bf16", lambda *a: bf16)
    base = trial_config(_parser().parse_args(["search", "--budget-s", "5"]))
    assert base.optim.name == "muon" and base.optim.muon_ns_dtype == "auto"
    adamw = with_overrides(base, {"optim.name": "adamw"})
    assert adamw.optim.name == "adamw" and adamw.train.precision == ("bf16" if bf16 else "fp32")
    muon = with_overrides(base, {"optim.name": "muon"})
    assert muon.optim.muon_ns_dtype == ("bf16" if bf16 else "fp32")
    assert muon.train.time_limit_s == 5 and muon.train.epochs > 18  # the budget, not the table
