"""Stop requests (issue 44): a signal, the scheduler's end time or the time limit stops the run at a
step boundary with a checkpoint of that step, and a resume continues bit-equal. In one process here
(signals sent to this process from inside the step, the checkpoint write and the evaluation); the
launched engines at 2 ranks are tests/integration/test_preemption.py."""

import json
import os
import signal
import threading
import time

import pytest
import torch
from helpers import BASE, TINY, sets, weights

from vitscale import checkpoint as ckpt
from vitscale import loop
from vitscale.cli import main
from vitscale.stop import (
    CTRL_C_HINT,
    SLURM_MARGIN_S,
    Agreement,
    StopRequest,
    exit_status,
    slurm_deadline,
)

RUN = BASE + [
    "train.epochs=6",
    "run.checkpoint_every=5",
    "run.keep_last=100",
]  # 24 steps, 6 epochs of 4


def train(out, *extra, resume=False):
    args = (
        ["train", "--resume", str(out)]
        if resume
        else ["train", TINY, "--out", str(out), *sets(RUN + list(extra))]
    )
    return main(args)


def signal_at(monkeypatch, step: int, sig=signal.SIGTERM, where="run_step"):
    """Send `sig` to this process during `step` (run_step: inside the step's call), or during the
    first checkpoint write / evaluation at or after it."""
    target = {
        "run_step": loop.Trainer.run_step,
        "save": loop.Trainer.save,
        "evaluate": loop.Trainer.evaluate,
    }[where]

    def hooked(self, *a, **k):
        current = self.step + 1 if where == "run_step" else self.step
        if current == step or (where != "run_step" and current >= step and not hooked.sent):
            hooked.sent = True
            os.kill(os.getpid(), sig)
        return target(self, *a, **k)

    hooked.sent = False
    monkeypatch.setattr(loop.Trainer, where, hooked)


@pytest.fixture(autouse=True)
def python_signal_handlers():
    """The handlers an interactive Python starts with, whatever this test process inherited (a CI
    job started in the background ignores SIGINT, and a stop request leaves an ignored signal
    ignored: tested below)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    yield
    for s, h in before.items():
        signal.signal(s, h)


@pytest.fixture(scope="module")
def stop_uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("stop") / "whole"
    assert train(out) == 0
    return out


def newest_step(out) -> int:
    return ckpt.load_checkpoint(out)["step"]


@pytest.mark.parametrize(
    "sig, step, extra",
    [
        (signal.SIGTERM, 7, []),
        (signal.SIGUSR1, 13, []),
        (signal.SIGINT, 2, []),
        (signal.SIGTERM, 10, ["train.capture=step"]),
    ],
)
def test_a_signal_stops_at_the_step_with_its_checkpoint_and_the_resume_is_bit_equal(
    tmp_path, capsys, monkeypatch, stop_uninterrupted, sig, step, extra
):
    """train.capture=step: the step as one unit (on a CPU its replay stand-in, bit-equal to the
    uncaptured step: test_capture.py); the stop is read outside it."""
    out = tmp_path / "run"
    signal_at(monkeypatch, step, sig)
    rc = train(out, *extra)
    err = capsys.readouterr().err
    name = signal.Signals(sig).name
    assert rc == 128 + int(sig) == exit_status(name)
    assert newest_step(out) == step  # the step at which it was handled: no step lost, none beyond
    said = [x for x in err.strip().splitlines() if x.startswith("vitscale:")]
    # one line, the stop's at the step (a Ctrl-C alone is told at once how to stop now)
    assert said == [CTRL_C_HINT] * (name == "SIGINT") + [
        f"vitscale: stopped by {name} at step {step} of 24 (epoch {step / 4:.2f}); checkpoint "
        f"{out / 'checkpoints' / f'step_{step:08d}.pt'}; continue with: vitscale train --resume {out}"
    ], err[-2000:]
    assert not (out / "summary.json").exists()  # not finished: no result to report
    assert (
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    )  # the handlers are the process's again
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.undo()
    assert train(out, resume=True) == 0
    a, b = weights(stop_uninterrupted), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    whole = json.loads((stop_uninterrupted / "summary.json").read_text())
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["steps"] == whole["steps"] and resumed["test_accuracy"] == whole["test_accuracy"]


def test_a_signal_during_a_checkpoint_write_lets_it_complete_then_stops_there(
    tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    signal_at(monkeypatch, 5, where="save")  # the write at step 5 (run.checkpoint_every=5)
    assert train(out) == exit_status("SIGTERM")
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000005.pt"]
    assert ckpt.load_checkpoint(out)["step"] == 5  # complete and readable


def test_a_second_ctrl_c_during_a_checkpoint_write_keeps_the_previous_checkpoint_the_newest(
    tmp_path, capsys, monkeypatch
):
    """The first Ctrl-C asks for a stop; a second one (a person's, SECOND_SIGINT_S or more later)
    stops now: inside the write, which leaves no part of its file behind."""
    out = tmp_path / "run"
    real, writes = torch.save, []

    def interrupted_save(obj, f, *a, **k):
        writes.append(obj.get("step"))
        if obj.get("step") == 10:
            f.write(b"the first bytes of a checkpoint")
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(StopRequest.SECOND_SIGINT_S + 0.05)
            os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt, half-way through the file
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", interrupted_save)
    assert train(out) == 130 and writes == [5, 10]
    assert "interrupted; the last complete checkpoint is kept" in capsys.readouterr().err
    assert [p.name for p in (out / "checkpoints").iterdir()] == [
        "step_00000005.pt"
    ]  # no part of step 10's


def test_a_duplicate_sigint_from_a_launcher_is_not_a_second_ctrl_c(tmp_path, capsys, monkeypatch):
    """A launcher may forward the terminal's Ctrl-C to processes that got it already: a second SIGINT
    within SECOND_SIGINT_S is the same request."""
    out = tmp_path / "run"
    real = loop.Trainer.run_step

    def twice(self, batch):
        if self.step + 1 == 6:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, batch)

    monkeypatch.setattr(loop.Trainer, "run_step", twice)
    assert train(out) == 130 and newest_step(out) == 6


def test_a_signal_during_the_evaluation_stops_at_the_epoch_end_after_its_checkpoint(
    tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    signal_at(monkeypatch, 8, where="evaluate")  # the evaluation at the end of epoch 2 (step 8)
    assert train(out) == exit_status("SIGTERM")
    assert newest_step(out) == 8
    evals = [
        json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x
    ]
    assert [e["step"] for e in evals] == [4, 8]  # no step beyond, no extra evaluation


def test_the_scheduler_end_time_stops_the_run_with_its_checkpoint(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time() + SLURM_MARGIN_S + 3)))
    real = loop.Trainer.run_step

    def slow(self, batch):  # 0.25 s a step: the deadline falls inside the run
        time.sleep(0.25)
        return real(self, batch)

    monkeypatch.setattr(loop.Trainer, "run_step", slow)
    rc = train(out)
    err = capsys.readouterr().err
    assert rc == exit_status("job end") == 143, err[-2000:]
    assert (
        "SLURM_JOB_END_TIME is set: the run stops with a checkpoint 120 s before the job's end"
        in err
    )
    step = newest_step(out)
    assert 0 < step < 24 and f"stopped by job end at step {step} of 24" in err


def test_stop_request_handlers_flag_once_and_are_restored():
    """The first signal is the request; only a Ctrl-C says anything on receipt (how to stop now):
    a scheduler's SIGTERM or SIGUSR1 is answered by the stop's one line, at the step."""
    seen = []
    before = signal.getsignal(signal.SIGUSR1)
    with StopRequest(announce=seen.append) as stop:
        assert stop.signal is None
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # within SECOND_SIGINT_S: the same request
        assert stop.signal == "SIGUSR1" and seen == []
    assert signal.getsignal(signal.SIGUSR1) is before
    with StopRequest(announce=seen.append) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == "SIGINT" and seen == [CTRL_C_HINT]
        assert "Ctrl-C again to stop now" in seen[0]
    with StopRequest(signals=False) as stop:  # the lab's trainers: signals keep their handlers
        assert signal.getsignal(signal.SIGUSR1) is before


def test_a_signal_the_process_was_started_ignoring_stays_ignored():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a job started in the background
    with StopRequest(announce=lambda text: None) as stop:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal is None
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_stop_request_outside_the_main_thread_installs_nothing():
    got = []
    t = threading.Thread(target=lambda: got.append(StopRequest().__enter__()._old))
    t.start()
    t.join()
    assert got == [{}]


def test_exit_status_and_deadline():
    assert [
        exit_status(r) for r in ("SIGTERM", "SIGUSR1", "SIGINT", "job end", "time limit", "done")
    ] == [143, 128 + signal.SIGUSR1, 130, 143, 0, 0]
    assert slurm_deadline({"SLURM_JOB_END_TIME": "1000"}) == 1000 - SLURM_MARGIN_S
    assert slurm_deadline({}) is None and slurm_deadline({"SLURM_JOB_END_TIME": "soon"}) is None


class FakeRanks:
    """Two ranks' flags summed, as all_reduce_sum over a process group would."""

    world_size, device = 2, torch.device("cpu")

    def __init__(self, other):
        self.other, self.calls = other, 0

    def all_reduce_sum(self, t):
        self.calls += 1
        return t + torch.tensor(self.other, dtype=t.dtype)


def test_several_ranks_agree_at_collective_steps_only_on_any_ranks_reason():
    stop = StopRequest(signals=False)
    ranks = FakeRanks([0.0, 0.0, 1.0, 0.0, 0.0])  # the other rank got SIGUSR1
    a = Agreement(ranks, stop, time_limit_s=0.0, deadline=None)
    assert (
        a.reason(1.0, collective=False) is None and ranks.calls == 0
    )  # no collective between log steps
    assert a.reason(1.0, collective=True) == "SIGUSR1" and ranks.calls == 1
    one = Agreement(type("One", (), {"world_size": 1})(), stop, time_limit_s=5.0, deadline=None)
    assert (
        one.reason(4.9, collective=False) is None
        and one.reason(5.0, collective=False) == "time limit"
    )
    late = Agreement(FakeRanks([0.0] * 5), stop, 0.0, deadline=10.0, clock=lambda: 10.0)
    assert late.reason(0.0, collective=True) == "job end"


# issue 52: a stop in the final evaluation. run.max_steps=22 ends the run inside epoch 6, so its
# final evaluation is fit()'s, after the last step and before its checkpoint (run.checkpoint_every=5
# saved step 20)
CAPPED = ["run.max_steps=22"]


@pytest.fixture(scope="module")
def capped_uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("stop") / "capped"
    assert train(out, *CAPPED) == 0
    return out


def files_of(out) -> dict:
    """Every file of a run folder and its bytes (the lock file aside: each command takes it)."""
    return {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_during_the_final_evaluation_saves_the_last_step_and_the_resume_finishes_it(
    tmp_path, capsys, monkeypatch, capped_uninterrupted, sig
):
    out = tmp_path / "run"
    signal_at(monkeypatch, 22, sig, where="evaluate")
    name = signal.Signals(sig).name
    assert train(out, *CAPPED) == exit_status(name)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (
        f"vitscale: stopped by {name} at step 22 of 22 (epoch 5.50); checkpoint "
        f"{out / 'checkpoints' / 'step_00000022.pt'}; continue with: vitscale train --resume {out}"
    )
    saved = ckpt.load_checkpoint(out)
    assert saved["step"] == 22 and saved["last_eval"]["step"] == 22  # the evaluation completed
    assert not (out / "summary.json").exists()
    monkeypatch.undo()
    # the resume trains nothing: it writes the summary and the closing line from what was saved
    assert train(out, resume=True) == 0
    text = capsys.readouterr().out.strip().splitlines()
    assert len(text) == 1 and text[0].startswith("test accuracy ") and str(out) in text[0]
    whole = json.loads((capped_uninterrupted / "summary.json").read_text())
    resumed = json.loads((out / "summary.json").read_text())
    assert (resumed["steps"], resumed["test_accuracy"]) == (22, whole["test_accuracy"])
    assert [p.name for p in ckpt.list_checkpoints(out)][-1] == "step_00000022.pt"
    a, b = weights(capped_uninterrupted), weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a finished run: one line, exit 0, nothing written
    before = files_of(out)
    assert train(out, resume=True) == 0
    out_text, err = capsys.readouterr()
    assert out_text.strip().splitlines() == [
        f"vitscale: {out} is finished at step 22 of 22: test accuracy "
        f"{100 * whole['test_accuracy']:.2f}% (best {100 * whole['best_test_accuracy']:.2f}%) on "
        f"32 images (loss {whole['test_loss']:.4f}); nothing to train (for more steps: --resume "
        f"{out} --set run.max_steps=M)"
    ]
    assert err == "" and files_of(out) == before


def test_a_kill_in_the_final_evaluation_after_the_last_checkpoint_is_finished_by_the_resume(
    tmp_path, capsys, monkeypatch, capped_uninterrupted
):
    """run.checkpoint_every=11 saves step 22 before the final evaluation; a kill there (a second
    Ctrl-C here) leaves it without an evaluation: the resume runs it, saves it into the checkpoint
    of that step and writes the summary."""
    out = tmp_path / "run"
    real = loop.Trainer.evaluate

    def killed(self):
        if self.step == 22:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(loop.Trainer, "evaluate", killed)
    assert train(out, *CAPPED, "run.checkpoint_every=11") == 130
    assert ckpt.load_checkpoint(out)["step"] == 22 and not (out / "summary.json").exists()
    assert ckpt.load_checkpoint(out)["last_eval"]["step"] == 20  # epoch 5's
    monkeypatch.undo()
    capsys.readouterr()
    assert train(out, resume=True) == 0
    evals = [
        json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x
    ]
    assert [e["step"] for e in evals][-1] == 22  # the resume's evaluation, no step trained
    assert not any('"train"' in x and '"step": 23' in x for x in (out / "metrics.jsonl").open())
    assert ckpt.load_checkpoint(out)["last_eval"]["step"] == 22
    whole = json.loads((capped_uninterrupted / "summary.json").read_text())
    assert json.loads((out / "summary.json").read_text())["test_accuracy"] == whole["test_accuracy"]
    assert train(out, resume=True) == 0
    assert " is finished at step 22 of 22: " in capsys.readouterr().out


def test_a_signal_during_the_last_epochs_evaluation_of_an_uncapped_run_stops_with_its_line(
    tmp_path, capsys, monkeypatch
):
    """Without a cap, the final evaluation is the last epoch's (step 24), before its checkpoint."""
    out = tmp_path / "run"
    signal_at(monkeypatch, 24, signal.SIGUSR1, where="evaluate")
    assert train(out) == exit_status("SIGUSR1")
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith("vitscale: stopped by SIGUSR1 at step 24 of 24 (epoch 6.00); checkpoint ")
    )
    assert ckpt.load_checkpoint(out)["step"] == 24 and not (out / "summary.json").exists()
    monkeypatch.undo()
    assert train(out, resume=True) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 24
