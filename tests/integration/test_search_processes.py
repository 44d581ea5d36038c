"""`vitscale search` as processes (issue 26): a search killed with SIGKILL mid-trial continues from
its database when the same command runs again (the killed trial is failed by the heartbeat, not left
RUNNING, its reason recorded, and retried), and two workers on one SQLite database share one study."""

import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import TINY, sets

optuna = pytest.importorskip("optuna")

SPACE = """
[optim]
lr = { low = 1e-3, high = 1e-2, log = true }
[model]
depth = { low = 1, high = 2 }
"""


def command(tmp_path, out, budget, trials, *extra):
    space = tmp_path / "space.toml"
    space.write_text(SPACE)
    return [
        sys.executable,
        "-m",
        "vitscale",
        "search",
        TINY,
        "--space",
        str(space),
        "--budget-s",
        str(budget),
        "--trials",
        str(trials),
        "--out",
        str(out),
        "--repeat-top",
        "0",
        "--pruner",
        "none",
        "--heartbeat-s",
        "1",
        *extra,
        *sets(["run.threads=1", "run.eval_every=20"]),
    ]


def trials(out):
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        return optuna.load_study(
            study_name="search", storage=f"sqlite:///{out / 'search.db'}"
        ).get_trials()
    except Exception:  # noqa: BLE001 - not created yet
        return []


def test_a_killed_search_continues_from_its_database(tmp_path):
    out = tmp_path / "search"
    cmd = command(
        tmp_path, out, 2, 5
    )  # 5 chances to find a trial running (a loaded machine polls slowly)
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    killed = None
    try:
        while killed is None and p.poll() is None and time.monotonic() < deadline:
            ts = trials(out)
            # a trial with its keys, started under 1.5 s ago (it trains for 2 s): surely running at the kill
            running = [
                t
                for t in ts
                if t.state.name == "RUNNING"
                and t.params
                and (datetime.datetime.now() - t.datetime_start).total_seconds() < 1.5
            ]
            if any(t.state.name == "COMPLETE" for t in ts) and running:
                killed = running[0].number
                os.kill(p.pid, signal.SIGKILL)
            time.sleep(0.2)
    finally:
        if p.poll() is None and killed is None:
            p.kill()
        p.wait(timeout=60)
    assert killed is not None, (
        f"no trial was running after a complete one: {p.stderr.read()[-2000:]}"
    )
    assert p.returncode == -signal.SIGKILL
    before = trials(out)
    assert {t.number: t.state.name for t in before}[killed] == "RUNNING"  # left behind by the kill
    time.sleep(3.5)  # its heartbeat (1 s) is now past the 3 s grace
    # --report-only runs no trial, but does not list the killed one as running: failed, retry queued
    r = subprocess.run(
        command(tmp_path, out, 2, 0, "--report-only"), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    states = {t.number: t.state.name for t in trials(out)}
    assert (
        states[killed] == "FAIL"
        and "RUNNING" not in states.values()
        and "WAITING" in states.values()
    )
    # with its reason, in the database, search.json and its row's note
    why = (
        f"worker {socket.gethostname()}:{p.pid} stopped: no heartbeat for over 3 s (killed or lost)"
    )
    assert next(t for t in trials(out) if t.number == killed).user_attrs["error"] == why
    assert (
        next(
            t
            for t in json.loads((out / "search.json").read_text())["trials"]
            if t["number"] == killed
        )["error"]
        == why
    )
    assert re.search(
        rf"^\| {killed}\*? \| fail \|.* \| {re.escape(why)} \|$",
        (out / "search.md").read_text(),
        re.M,
    )
    r = subprocess.run(command(tmp_path, out, 2, 2), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    after = trials(out)
    states = {t.number: t.state.name for t in after}
    assert (
        states[killed] == "FAIL" and "RUNNING" not in states.values()
    )  # failed by its stale heartbeat
    assert len(after) >= len(before) + 2 and sum(s == "COMPLETE" for s in states.values()) >= 3
    assert "WAITING" not in states.values()  # the retry queued by --report-only was run
    retries = [t for t in after if t.system_attrs.get("failed_trial") == killed]
    assert len(retries) == 1
    assert (
        retries[0].params == next(t for t in after if t.number == killed).params
    )  # the same keys again
    assert (
        retries[0].state.name == "COMPLETE" and "error" not in retries[0].user_attrs
    )  # not its parent's reason
    assert (out / "search.md").is_file() and "trial" in r.stderr


def test_two_workers_share_one_study(tmp_path):
    out = tmp_path / "search"
    procs = [
        subprocess.Popen(
            command(tmp_path, out, 1, 2, "--sampler-seed", str(i)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errs]
    ts = trials(out)
    assert sorted(t.number for t in ts) == [0, 1, 2, 3] and all(
        t.state.name == "COMPLETE" for t in ts
    )
    by_worker = {}
    for t in ts:
        by_worker.setdefault(t.user_attrs["worker"].split(":")[-1], set()).add(t.number)
    assert sorted(by_worker) == sorted(str(p.pid) for p in procs)  # each worker ran its own trials
    assert [len(v) for v in by_worker.values()] == [2, 2] and set.isdisjoint(*by_worker.values())
    assert all(sum(ln.startswith("trial ") for ln in e.splitlines()) == 2 for e in errs)
