"""The CLI as its own process (`python -m vitscale`): what a user sees on the console."""

import subprocess
import sys

from helpers import TINY, folder_args, make_tree, sets


def test_image_folder_warnings_reach_stderr_as_warnings(tmp_path):
    """The real console entry point: unreadable files are one warning line each, exit code 0."""
    root = make_tree(tmp_path / "tree")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "vitscale",
            "train",
            TINY,
            "--out",
            str(tmp_path / "run"),
            *sets(["run.threads=1", *folder_args(root, 0)]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    bad = [ln for ln in lines if "skipped unreadable image" in ln]
    assert len(bad) == 2 and all(ln.startswith("vitscale: warning: ") for ln in bad)
    assert not any(ln.startswith("vitscale: error") for ln in lines) and "Traceback" not in p.stderr
    assert "test accuracy" in p.stdout
