"""The recipe that travels (issue 59): data.batch_rule=min_steps fits the batch and, at its floor,
the epochs to the training set's size (datafit.py), resolved once and announced, saved as fixed;
train.ema_warmup's decay schedule is timm's ModelEmaV3(use_warmup=True)."""

import copy
import json
import math

import pytest
import torch

from vitscale.cli import main
from vitscale.config import OptimConfig, TrainConfig, load_config
from vitscale.datafit import candidates, epoch_batches, fit_batch, fit_to_data, total_steps
from vitscale.errors import DataError

TINY = "configs/tests/tiny.toml"


def naive_fit(n, batch, epochs, min_steps, min_batch, unit, drop_last):
    """The rule by enumeration: every batch batch/2^k that splits over `unit`, fits the data and
    is not below the floor (or, when none is, the largest that fits); the largest giving the
    steps, else the smallest with the epochs that give them."""
    ok = [b for b in range(batch, 0, -1) if batch % b == 0 and (batch // b) & (batch // b - 1) == 0]
    ok = [b for b in ok if b % unit == 0 and b <= n]
    floor = [b for b in ok if b >= min_batch] or ok[:1]
    per = {b: (n // b if drop_last else math.ceil(n / b)) for b in floor}
    good = [b for b in floor if math.ceil(epochs * per[b]) >= min_steps]
    if good:
        return good[0], epochs
    b = floor[-1]
    return b, min_steps / per[b]


@pytest.mark.parametrize("n", [1, 7, 31, 100, 1000, 1437, 4666, 8000, 60000, 100000])
@pytest.mark.parametrize("unit", [1, 2, 4, 6])
@pytest.mark.parametrize("epochs,min_steps", [(11, 600), (18, 600), (0.5, 50), (3, 0)])
@pytest.mark.parametrize("drop_last", [True, False])
def test_the_rule_is_the_enumerated_one(n, unit, epochs, min_steps, drop_last):
    batch = 1024 if unit != 6 else 768
    if n < candidates(batch, unit)[-1]:
        with pytest.raises(DataError, match=f"has {n} samples"):
            fit_batch(n, batch, epochs, min_steps, 32, unit, drop_last)
        return
    b, e = fit_batch(n, batch, epochs, min_steps, 32, unit, drop_last)
    nb, ne = naive_fit(n, batch, epochs, min_steps, 32, unit, drop_last)
    assert b == nb and b % unit == 0 and b <= n
    assert e == pytest.approx(ne, rel=1e-12)
    steps = total_steps(e, epoch_batches(n, b, drop_last))
    assert steps >= min_steps  # never a step short, whatever the float rounding
    if e != epochs:
        assert steps == min_steps  # grown to the minimum, not beyond


def test_the_default_recipe_keeps_fashion_mnist_and_fits_small_sets():
    """Fashion-MNIST's 60,000 keep the recipe's batch of 1024 on both CPU classes (11 and 18
    epochs); 8,000 images take 128; a folder of 1,000 and one of 100,000 both get at least
    train.min_steps steps with nothing set by hand."""
    cfg = load_config()
    assert cfg.data.batch_rule == "min_steps" and cfg.train.min_steps == 600
    assert cfg.per_device["cpu_bf16"]["train"] == {"epochs": 18, "min_steps": 1000}
    for epochs, least in ((11, 600), (18, 1000)):
        assert fit_batch(60000, 1024, epochs, least, 32, 1, True) == (1024, epochs)
        assert fit_batch(8000, 1024, epochs, least, 32, 1, True)[0] == 128
    for n in (1000, 100000):
        b, e = fit_batch(n, 1024, 11, 600, 32, 1, True)
        assert 600 <= total_steps(e, n // b) <= 1100


def test_a_named_batch_is_never_changed_and_is_announced():
    cfg = load_config(None, ["data.batch_size=512"])
    assert cfg.data.batch_rule == "fixed"  # naming the batch fixes it
    fit = fit_to_data(cfg, 8000, 1)
    assert fit.cfg == cfg and fit.chosen == {}
    assert "data.batch_size=512 gives 165 steps" in fit.note and "min_steps=600" in fit.note
    # ... and a rule named after it keeps the rule, the named batch as its cap
    ruled = load_config(None, ["data.batch_size=512", "data.batch_rule=min_steps"])
    assert fit_to_data(ruled, 8000, 1).cfg.data.batch_size == 128
    assert fit_to_data(cfg, 60000, 1).note == ""  # enough steps: nothing said


def test_the_fit_is_saved_as_fixed_and_refits_to_itself():
    cfg = load_config(None, ["train.epochs=11"])
    fit = fit_to_data(cfg, 1437, 1)
    assert fit.cfg.data.batch_rule == "fixed"
    assert set(fit.chosen) == {"data.batch_size", "train.epochs"}
    assert fit.chosen["data.batch_size"][0] == 32
    again = fit_to_data(copy.deepcopy(fit.cfg), 1437, 1)
    assert again.cfg == fit.cfg and again.chosen == {}
    # unknown size (streamed data): the recipe's batch, said
    unknown = fit_to_data(cfg, None, 1)
    assert unknown.cfg.data.batch_size == 1024 and "tells its size only when read" in unknown.note


def test_a_run_fits_announces_records_and_resumes_as_saved(tmp_path, capsys):
    """Tiny synthetic data (200 samples) under the rule: the run's batch, epochs and lr follow it;
    the fast-paths line says so; config.toml holds the fitted values as fixed; a resume (one more
    epoch) keeps the batch."""
    out = tmp_path / "run"
    sets = ["data.batch_size=64", "data.batch_rule=min_steps", "data.min_batch_size=8"]
    sets += ["data.train_size=200", "train.min_steps=40", "train.epochs=1"]
    sets += ["optim.lr_scaling=sqrt", "optim.lr_ref_batch=64", "optim.lr=0.004"]
    args = ["train", TINY, "--out", str(out), "--set", "run.progress=plain"]
    assert main(args + [x for s in sets for x in ("--set", s)]) == 0
    said = capsys.readouterr()
    line = [x for x in (said.out + said.err).splitlines() if x.startswith("fast paths")]
    assert len(line) == 1 and "batch 8 (of data.batch_size=64)" in line[0], line
    summary = json.loads((out / "summary.json").read_text())
    # 200 // 8 = 25 steps per epoch; 64, 32, 16 give 3, 6, 12: the floor 8, 1.6 epochs for 40
    assert summary["steps"] == 40 and summary["auto"]["data.batch_size"]["value"] == 8
    assert summary["auto"]["train.epochs"]["value"] == pytest.approx(1.6)
    assert summary["lr"] == pytest.approx(0.004 * math.sqrt(8 / 64))
    saved = (out / "config.toml").read_text()
    assert "batch_size = 8\n" in saved and 'batch_rule = "fixed"' in saved
    assert main(["train", "--resume", str(out), "--set", "train.epochs=2.0"]) == 0
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["steps"] == 50 and resumed["auto"] == {}


def test_a_set_smaller_than_one_micro_batch_per_process_is_refused_in_one_line(tmp_path, capsys):
    sets = ["data.batch_size=8", "data.batch_rule=min_steps", "data.train_size=3"]
    sets += ["train.accum_steps=4", "train.min_steps=10"]
    code = main(["train", TINY, "--out", str(tmp_path / "r")] + [f"--set={s}" for s in sets])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "has 3 samples" in err[0] and "data.batch_size=8" in err[0]


def timm_v3_decay(k: int, decay: float) -> float:
    """timm's ModelEmaV3.get_decay(step) with use_warmup=True at its defaults (gamma 1, power
    2/3, update_after_step 0, min_decay 0), for the k-th update counted from 0 (timm's step
    k + 1), written out."""
    step = max(0, k + 1 - 0 - 1)
    if step <= 0:
        return 0.0
    return max(min(1 - (1 + step / 1.0) ** (-2 / 3), decay), 0.0)


def test_the_ema_warmup_is_timms_schedule_in_float64():
    """train.ema_warmup: the strategy's EMA after each update against the running average of the
    same weights computed in float64 with timm's decay per update; the decay reaches the cap."""
    from vitscale.models import vit
    from vitscale.strategy import SingleDevice

    torch.manual_seed(0)
    cfg = TrainConfig(ema_decay=0.6, ema_warmup=True)
    s = SingleDevice(cfg, OptimConfig(lr=1e-2), torch.device("cpu"))
    s.setup(vit("vit_pico", image_size=8, patch_size=4, in_chans=1, num_classes=4, depth=1))
    ref = None
    for k in range(8):
        s.backward(s.model(torch.randn(4, 1, 8, 8)).square().mean())
        s.step()
        now = {n: p.detach().double() for n, p in s.module.named_parameters()}
        d = timm_v3_decay(k, 0.6)
        ref = now if ref is None else {n: d * ref[n] + (1 - d) * now[n] for n in now}
        ema = dict(s.ema.module.named_parameters())
        for n, r in ref.items():  # a few float32 roundings of values of order 1
            torch.testing.assert_close(ema[n].double(), r, rtol=0, atol=1e-6)
    assert timm_v3_decay(7, 0.6) == 0.6 and timm_v3_decay(1, 0.6) < 0.6  # capped, warmed up


def test_the_ema_warmup_matches_timm_where_timm_imports():
    timm_ema = pytest.importorskip("timm.utils.model_ema", reason="timm is not installed")
    from vitscale.models import vit
    from vitscale.strategy import SingleDevice

    torch.manual_seed(1)
    cfg = TrainConfig(ema_decay=0.95, ema_warmup=True)
    s = SingleDevice(cfg, OptimConfig(lr=1e-2), torch.device("cpu"))
    s.setup(vit("vit_pico", image_size=8, patch_size=4, in_chans=1, num_classes=4, depth=1))
    theirs = timm_ema.ModelEmaV3(s.module, decay=0.95, use_warmup=True)
    for step in range(1, 7):
        s.backward(s.model(torch.randn(4, 1, 8, 8)).square().mean())
        s.step()
        theirs.update(s.module, step=step)
        for a, b in zip(theirs.module.parameters(), s.ema.module.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_training_set_is_counted_as_the_run_builds_it(tmp_path):
    """data.build.train_count, before any loader: what build_data's training split holds, for a
    class folder (corrupt files counted: the loader skips and counts them), idx files with and
    without a validation split, synthetic data; None for image-text data."""
    from dataclasses import replace

    from helpers import make_tree, write_fmnist

    from vitscale.config import DataConfig
    from vitscale.data.build import build_data, train_count

    tree = make_tree(tmp_path / "tree")
    fm = tmp_path / "fm"
    write_fmnist(fm, n_train=40, n_test=5)
    cases = [
        DataConfig(name="folder", root=str(tree), image_size=16, num_workers=0),
        DataConfig(name="fashion_mnist", root=str(fm), batch_size=4),
        DataConfig(name="fashion_mnist", root=str(fm), batch_size=4, val_fraction=0.25),
        DataConfig(name="synthetic", train_size=50, val_fraction=0.1, batch_size=4),
    ]
    for d in cases:
        data = build_data(replace(d, batch_size=2), device="cpu", seed=3)
        try:
            assert train_count(d, seed=3) == data.train_size, d.name
        finally:
            data.close()
    assert train_count(cases[2], 3) == 30  # 10 held out of 40, stratified
    assert train_count(DataConfig(name="openclipart"), 0) is None
