"""What a run reports (run_report.py): the start line's batch split in words that agree with their
counts, and summary.json's record of the strategy and mesh the run used (issue 62 item 6)."""

import json
from types import SimpleNamespace

from helpers import BASE, TINY, sets

from vitscale.cli import main
from vitscale.run_report import dp_text, plural


def test_counts_agree_with_their_nouns():
    assert [plural(n, "process") for n in (1, 2)] == ["1 process", "2 processes"]
    assert [plural(n, "micro-batch") for n in (1, 4)] == ["1 micro-batch", "4 micro-batches"]
    one = SimpleNamespace(world_size=1, dp_size=1)
    two = SimpleNamespace(world_size=2, dp_size=2)
    tp2 = SimpleNamespace(world_size=2, dp_size=1)
    tp2x2 = SimpleNamespace(world_size=4, dp_size=2)
    assert [dp_text(s) for s in (one, two, tp2, tp2x2)] == [  # type: ignore[arg-type]
        "1 process",
        "2 processes",
        "1 data-parallel group of 2 tensor-parallel processes",
        "2 data-parallel groups of 2 tensor-parallel processes",
    ]


def test_the_start_line_and_summary_json_name_the_strategy_and_mesh(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                TINY,
                "--out",
                str(out),
                *sets(BASE + ["run.max_steps=2", "run.progress=plain"]),
            ]
        )
        == 0
    )
    said = capsys.readouterr()
    assert "= 1 process x 1 micro-batch x " in said.out + said.err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "single" and summary["world_size"] == 1
    assert summary["mesh"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 1}
