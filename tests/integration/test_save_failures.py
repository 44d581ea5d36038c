"""Checkpoint saves that do not complete (issue 62 items 4 and 5), at 2 gloo ranks: a save the disk
refuses (full, quota, read-only) on any rank and engine is one line, exit 2 on every rank, nothing of
it left behind; a kill between a ZeRO-2 engine folder and its .pt leaves nothing once the run
resumes and finishes. refuse_saves.py, run as torchrun's script, refuses or kills the save."""

import re
from pathlib import Path

import pytest
from helpers import ENGINES, KILL_RUN, launch, torchrun

from vitscale import checkpoint as ckpt

ENTRY = (str(Path(__file__).with_name("refuse_saves.py")),)
SHARDED = ENGINES["fsdp"] + ["strategy.checkpoint_format=sharded"]


def names(out: Path) -> list[str]:
    """RUN/checkpoints' checkpoints and temp files (not DeepSpeed's zero_to_fp32.py scripts)."""
    return sorted(p.name for p in (out / "checkpoints").iterdir() if "step_" in p.name)


@pytest.mark.parametrize(
    "engine,refused_on,kept",
    [
        ("ddp", None, ["step_00000004.pt"]),  # step_N.pt: rank 0 writes it
        ("fsdp", "1", ["step_00000004.dcp", "step_00000004.pt"]),  # one rank's DCP shard
        ("zero2", "1", ["step_00000004.ds", "step_00000004.pt"]),  # one rank's ZeRO-2 state
    ],
)
def test_a_refused_save_is_one_line_and_exit_2_on_every_rank(tmp_path, engine, refused_on, kept):
    if engine == "zero2":
        pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    extra = (SHARDED if engine == "fsdp" else ENGINES[engine]) + KILL_RUN
    env = {"REFUSE_STEP": "8", **({"REFUSE_RANK": refused_on} if refused_on else {})}
    p = launch(out, extra, 2, entry=ENTRY, env=env)
    _, err = p.communicate(timeout=180)
    said = [line for line in err.splitlines() if "checkpoint save failed" in line]
    assert said, err[-3000:]
    line = said[0]
    assert f"{out / 'checkpoints'}: No space left on device (it needed about" in line, line
    assert f"the last good checkpoint is {out / 'checkpoints' / 'step_00000004.pt'}" in line
    assert line.endswith(f"free space and continue with: vitscale train --resume {out}"), line
    assert len(said) == 1  # rank 0 says it; every rank exits 2
    assert len(re.findall(r"exitcode\s*: 2\b", err)) >= 1, err[-3000:]  # the ranks' status
    assert "refusing_open" not in err  # no rank's traceback
    assert names(out) == kept  # nothing of step 8: no temp file or folder, no engine folder


def test_a_kill_during_a_zero2_save_leaves_no_orphan_once_the_run_finishes(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    extra = ENGINES["zero2"] + KILL_RUN
    p = launch(out, extra, 2, entry=ENTRY, env={"KILL_STEP": "8"})
    p.communicate(timeout=180)
    # the issue's state: step 8's engine folder committed, its .pt never written
    assert names(out) == [
        "step_00000004.ds",
        "step_00000004.pt",
        "step_00000008.ds",
    ], names(out)
    assert [q.name for q in ckpt.incomplete_checkpoints(out)] == ["step_00000008.ds"]
    r = torchrun(None, ["run.checkpoint_every=6"], nproc=2, resume=out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step_00000008.ds" in r.stderr and "removed what interrupted" in r.stderr
    assert ckpt.incomplete_checkpoints(out) == []
    found = names(out)
    assert "step_00000008.ds" not in found
    assert all(f"{n[:-3]}.pt" in found for n in found if n.endswith(".ds")), found
