"""Checkpoint saves that did not complete (issue 62 items 4 and 5), in one process: what a kill or
an interrupted write left is never read and goes at the next save and at resume (keep_last counts
complete checkpoints only); a save the disk refuses is one line, exit 2, nothing of it left."""

import errno
import os
import re

import pytest
import torch
from helpers import interrupted_copy, run

from vitscale import checkpoint as ckpt
from vitscale.errors import SaveError

TINY = "configs/tests/tiny.toml"


def leftovers(run_dir):
    """What interrupted saves leave: an engine folder without its .pt, temp files and folders."""
    folder = run_dir / "checkpoints"
    for name in ("step_00000009.ds", ".step_00000010.dcp.tmp", ".step_00000010.ds.tmp"):
        (folder / name).mkdir()
        (folder / name / "part.pt").write_bytes(b"half")
    (folder / ".step_00000011.pt.tmp4242").write_bytes(b"half")
    return {"step_00000009.ds", ".step_00000010.dcp.tmp", ".step_00000010.ds.tmp"} | {
        ".step_00000011.pt.tmp4242"
    }


def test_the_next_save_removes_incomplete_checkpoints_and_keep_last_counts_complete_ones(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, {"a": torch.ones(3)}, keep_last=2)
    (tmp_path / "checkpoints" / "step_00000003.dcp").mkdir()  # complete: its .pt is there
    left = leftovers(tmp_path)
    assert {p.name for p in ckpt.incomplete_checkpoints(tmp_path)} == left
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step_00000002.pt",
        "step_00000003.pt",
    ]
    ckpt.save_checkpoint(tmp_path, 12, {"a": torch.ones(3)}, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000003.dcp",
        "step_00000003.pt",
        "step_00000012.pt",
    ]


def test_a_resume_removes_what_interrupted_saves_left_and_never_reads_it(tmp_path, capsys, caplog):
    full = tmp_path / "full"
    rc, _, err = run(capsys, "train", TINY, "--out", full, "--set", "run.checkpoint_every=2")
    assert rc == 0, err
    part = interrupted_copy(full, tmp_path / "part", step=6)
    left = leftovers(part)  # step 9's engine folder is newer than any .pt: still never read
    rc, _, err = run(capsys, "train", "--resume", part)
    assert rc == 0, err
    said = [
        r.getMessage() for r in caplog.records if "interrupted checkpoint saves" in r.getMessage()
    ]
    assert said == [
        "removed what interrupted checkpoint saves left (never read): step_00000009.ds, "
        ".step_00000010.dcp.tmp, .step_00000010.ds.tmp and 1 more"
    ]
    assert ckpt.incomplete_checkpoints(part) == []
    assert not left & {p.name for p in (part / "checkpoints").iterdir()}


@pytest.mark.parametrize(
    "code,fix",
    [
        (errno.ENOSPC, "free space"),
        (errno.EDQUOT, "free space"),
        (errno.EROFS, "make the folder writable"),
        (errno.EACCES, "make the folder writable"),
    ],
)
def test_a_refused_save_is_one_line_and_exit_2_then_the_resume_finishes(
    tmp_path, capsys, monkeypatch, code, fix
):
    real = torch.save

    def refusing_save(obj, f, *args, **kwargs):
        if "step_00000004" in str(getattr(f, "name", f)):
            f.write(b"half")  # a write that got this far
            raise OSError(code, os.strerror(code))
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", refusing_save)
    out = tmp_path / "run"
    rc, _, err = run(capsys, "train", TINY, "--out", out, "--set", "run.checkpoint_every=2")
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    folder = out / "checkpoints"
    said = re.sub(r"about [\d.]+ MB", "about N MB", err.strip())
    assert said == (
        f"vitscale: error: checkpoint save failed: {folder}: {os.strerror(code)} "
        f"(it needed about N MB); the last good checkpoint is {folder / 'step_00000002.pt'}; "
        f"{fix} and continue with: vitscale train --resume {out}"
    )
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000002.pt"]  # no temp file
    monkeypatch.undo()
    rc, _, err = run(capsys, "train", "--resume", out)
    assert rc == 0, err


def test_a_refused_first_save_says_there_is_no_checkpoint_yet(tmp_path):
    e = ckpt.save_failed(tmp_path, OSError(errno.ENOSPC, "No space left on device"), 3 * 10**7)
    assert isinstance(e, SaveError)
    assert str(e).endswith(
        "(it needed about 30 MB); no checkpoint of this run was written before it; free space and "
        "start it again"
    )


def test_a_dcp_write_failure_is_found_inside_its_checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = CheckpointException("save failed", {1: (full, None)})
    assert ckpt.write_failure(wrapped) is full
    assert ckpt.write_failure(full) is full
    assert ckpt.write_failure(CheckpointException("x", {0: (ValueError("no"), None)})) is None
    assert ckpt.write_failure(RuntimeError("not the disk")) is None
