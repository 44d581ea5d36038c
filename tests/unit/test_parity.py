"""`vitscale parity` (issue 51): the recipe at two seeds defines the tolerance (their spread), the
candidate at the first seed passes within it. The verdict's arithmetic on made-up curves, then a
tiny model for a few steps: autocast bf16 beside bf16_act."""

import json

import pytest

from vitscale.cli import main
from vitscale.lab.parity import verdict, window_means

TINY = "configs/tests/tiny.toml"


def test_window_means_and_the_verdict():
    assert window_means([1, 2, 3, 4, 5], 2) == [1.5, 3.5, 5.0]
    base = [2.0, 1.8, 1.6, 1.4]
    other = [2.1, 1.9, 1.5, 1.5]  # spread over windows of 2: max(0.1, 0.0) = 0.1
    v = verdict(base, other, [2.05, 1.85, 1.6, 1.4], 2)
    assert v["spread"] == pytest.approx(0.1) and v["difference"] == pytest.approx(0.05)
    assert v["passed"]
    assert not verdict(base, other, [2.0, 1.8, 1.9, 1.7], 2)["passed"]  # 0.3 > 0.1
    assert not verdict(base, other, [2.0, float("nan"), 1.6, 1.4], 2)["passed"]


def test_parity_of_bf16_act_beside_autocast_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "parity.json"
    rc = main(
        [
            "parity",
            TINY,
            "--set",
            "train.precision=bf16",
            "--set",
            "run.threads=1",
            "--candidate",
            "train.precision=bf16_act",
            "--steps",
            "4",
            "--window",
            "2",
            "--out",
            str(out),
        ]
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    r = json.loads(out.read_text())
    assert line.startswith("parity: PASS" if r["passed"] else "parity: FAIL")
    assert rc == (0 if r["passed"] else 1)
    assert r["candidate"] == {"train.precision": "bf16_act"} and r["seeds"] == [0, 1]
    assert [len(r["losses"][k]) for k in ("recipe", "recipe_other_seed", "candidate")] == [4] * 3
    assert r["config"]["train"]["precision"] == "bf16"
    # the seed changes the run (the spread is not zero), the candidate starts from seed 0's weights
    assert r["losses"]["recipe"] != r["losses"]["recipe_other_seed"]
    assert r["losses"]["candidate"][0] == pytest.approx(r["losses"]["recipe"][0], rel=0.05)


@pytest.mark.parametrize(
    "args, says",
    [
        ([], "name the candidate with --candidate"),
        (["--candidate", "train.precision"], "--candidate takes KEY=VALUE"),
        (["--candidate", "train.precision=bf16_act", "--seeds", "1,1"], "two different seeds"),
        (["--candidate", "train.precision=bf16_act", "--steps", "1"], "--steps must be >= 2"),
    ],
)
def test_bad_arguments_one_line(args, says, capsys):
    assert main(["parity", TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_synthetic_parity_streams_as_many_batches_as_steps():
    from vitscale.config import load_config
    from vitscale.lab.parity import parity_config

    cfg = parity_config(load_config(TINY, ["data.batch_size=8"]), 5, synthetic=True)
    assert cfg.data.name == "synthetic" and cfg.data.train_size == 40
    assert parity_config(load_config(TINY, ["data.batch_size=8"]), 50, True).data.train_size == 160
