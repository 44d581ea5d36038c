"""A checkpoint written by older code still works with today's: tests/fixtures/dd5435d_tiny_step4.pt
(how it was made: dd5435d_tiny_step4.md) is the tiny recipe's step 4 of 8 as the code at commit
dd5435d wrote it; today's `vitscale train --resume`, `eval` and `export` take it as it is."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import TINY, rel_diff, run, sets, weights

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "dd5435d_tiny_step4.pt"
STEP4 = "step_00000004.pt"
# the old code's own evaluation of the fixture (dd5435d_tiny_step4.md)
OLD_ACCURACY, OLD_LOSS = 15 / 32, 1.1934101581573486
SETTINGS = ["run.threads=1", "run.max_steps=4", "run.checkpoint_every=4"]  # what wrote the fixture
U = 2.0**-24  # fp32 unit roundoff
N_SUM = 96  # the longest sum in a training step of the tiny model: back through qkv's 96 outputs


def fixture_run(folder: Path) -> Path:
    """A run folder holding only the fixture, where a run keeps its checkpoints (RUN/checkpoints/)."""
    (folder / "checkpoints").mkdir(parents=True)
    shutil.copyfile(FIXTURE, folder / "checkpoints" / STEP4)
    return folder


def load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def state(ckpt: dict) -> dict:
    """A checkpoint's weights and optimizer state, by name."""
    s = ckpt["strategy"]
    out = {f"model.{k}": v for k, v in s["model"].items()}
    for i, st in s["optimizer"]["state"].items():
        out |= {f"opt{i}.{k}": v for k, v in st.items()}
    return out


def bit_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def resume(capsys, folder: Path) -> None:
    """`vitscale train --resume FOLDER --set run.max_steps=0`: the saved cap of 4 lifted, the recipe's
    2 epochs of 4 steps finished."""
    rc, _, err = run(capsys, "train", "--resume", folder, *sets(["run.max_steps=0"]))
    assert rc == 0, err


def test_todays_code_resumes_the_dd5435d_checkpoint_to_step_8_and_twice_alike(
    tmp_path, capsys, caplog
):
    """Steps 5-8 trained from the old checkpoint: the summary, the metrics, the checkpoints and the
    schedule (rebuilt for 8 steps: the saved one had run to its lr of 0 at the cap of 4), and a second
    resume from the same file gives the same weights and optimizer state, bit for bit."""
    a = fixture_run(tmp_path / "a")
    resume(capsys, a)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: ")]
    assert said == [f"resume: {a} from step 4 with run.max_steps 4 -> 0"], said
    summary = json.loads((a / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["epochs"] == 2.0 and summary["stop_reason"] == "done"
    assert summary["images_seen"] == 128  # 64 restored with step 4, 64 more in steps 5-8
    assert summary["checkpoint"] == str(a / "checkpoints" / "step_00000008.pt")
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == [STEP4, "step_00000008.pt"]
    last = load(a / "checkpoints" / "step_00000008.pt")
    assert last["step"] == 8 and last["images_seen"] == 128
    records = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [6, 8]  # log_every = 2, nothing logged again for 1-4
    lr = load(FIXTURE)["config"]["optim"]["lr"]
    # warmup 2, then cosine to 0 at step 8: a quarter of the peak at step 6
    assert train[0]["lr"] == pytest.approx(lr * 0.25) and train[1]["lr"] == pytest.approx(0.0)
    assert all(r["loss"] == r["loss"] and 0 < r["loss"] < 10 for r in train)
    assert [r["step"] for r in records if r["kind"] == "eval"] == [8]
    # the file resumed from is unchanged, and a second resume of it trains the same steps alike
    assert (a / "checkpoints" / STEP4).read_bytes() == FIXTURE.read_bytes()
    b = fixture_run(tmp_path / "b")
    resume(capsys, b)
    assert bit_equal(state(load(b / "checkpoints" / "step_00000008.pt")), state(last))


def test_the_resumed_dd5435d_checkpoint_ends_where_todays_uninterrupted_run_does(tmp_path, capsys):
    """The old checkpoint resumed to step 8 against today's code running the same command from the
    start (4 steps with the cap, then the same resume).

    Where today's step 4 is bit-equal to the fixture's (weights and optimizer state: the same
    arithmetic as the CPU that wrote it, e.g. the same machine), so is step 8: the resume adds
    nothing of its own. On another CPU (AVX2 vs AVX-512 kernels, another BLAS) the fp32 sums are
    done in another order, so both runs' step 4 differ from the fixture by rounding and step 8 can
    only be close, within a bound from fp32 arithmetic, not from one machine's measurement: a sum
    of n fp32 terms is within n*u of the exact one, relative (u = 2**-24, the standard gamma_n
    bound); the longest sum in a step has n = 96 terms (the gradient back through qkv's 96
    outputs; a weight gradient sums 16 images x 5 tokens = 80); each of the 8 steps adds such an
    error; Adam's m/sqrt(v) carries a relative error of the gradient through at most twice.
    Step 4's weights: 2*4*96*u (4.6e-5); step 8's: 2*8*96*u (9.2e-5).
    (For scale, an AVX-512 CPU made to compute as AVX2 gave 7.5e-6 at step 4 and 1.3e-5 at step 8.)"""
    fresh = tmp_path / "fresh"
    rc, _, err = run(capsys, "train", TINY, "--out", fresh, *sets(SETTINGS))
    assert rc == 0, err
    fresh4 = load(fresh / "checkpoints" / STEP4)
    resume(capsys, fresh)
    old = fixture_run(tmp_path / "old")
    resume(capsys, old)
    fixture4 = load(FIXTURE)
    assert fresh4["step"] == fixture4["step"] == 4
    if bit_equal(state(fresh4), state(fixture4)):
        assert bit_equal(
            state(load(old / "checkpoints" / "step_00000008.pt")),
            state(load(fresh / "checkpoints" / "step_00000008.pt")),
        )
    else:
        assert (
            rel_diff(fresh4["strategy"]["model"], fixture4["strategy"]["model"])
            <= 2 * 4 * N_SUM * U
        )
        assert rel_diff(weights(old), weights(fresh)) <= 2 * 8 * N_SUM * U


def test_eval_of_the_dd5435d_checkpoint_gives_the_old_codes_accuracy(tmp_path, capsys):
    """The loss agrees with the old code's to the rounding of an fp32 forward pass on another CPU:
    at most 24 sums in sequence (the patch embedding; per block 2 norms, qkv, attention scores,
    softmax, the weighted values, the projection, 2 MLP layers; the final norm, the head, the
    cross-entropy, the mean over 32 images), each of at most 64 terms: 24*64*u = 9.2e-5, relative.
    The accuracy (15 of 32) is a count: the same unless an image's top two logits are that close."""
    path = fixture_run(tmp_path / "run") / "checkpoints" / STEP4
    rc, out, err = run(capsys, "eval", path)
    assert rc == 0, err
    assert out.strip() == f"test accuracy 46.88% on 32 images (loss 1.1934) from {path}"
    rc, out, err = run(capsys, "eval", path, "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert result["test_accuracy"] == OLD_ACCURACY and result["test_count"] == 32
    assert result["step"] == 4 and result["checkpoint"] == str(path)
    assert abs(result["test_loss"] - OLD_LOSS) <= 24 * 64 * U * OLD_LOSS


def test_export_of_the_dd5435d_checkpoint_writes_its_weights(tmp_path, capsys):
    from safetensors.torch import load_file

    path = fixture_run(tmp_path / "run") / "checkpoints" / STEP4
    target = tmp_path / "m.safetensors"
    rc, out, err = run(capsys, "export", path, "--out", target)
    assert rc == 0 and target.is_file(), err
    saved = load(FIXTURE)["strategy"]["model"]
    exported = load_file(str(target))
    assert len(saved) == 32 and sum(v.numel() for v in saved.values()) == 18020
    assert exported.keys() == saved.keys()
    assert all(
        exported[k].dtype == torch.float32 and torch.equal(exported[k], saved[k]) for k in saved
    )
