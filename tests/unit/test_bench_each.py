"""`vitscale bench --each` (issue 51): several candidates, one override each, timed with the recipe in
the same paired rounds (one build per candidate); a candidate refused here or failing to build is
reported with its one-line error and the others still run."""

import json

import pytest

from vitscale.cli import main
from vitscale.lab import each as lab_each

TINY = "configs/tests/tiny.toml"
FAST = ["--steps", "2", "--trials", "1", "--warmup", "1", "--rounds", "2", "--set", "run.threads=1"]
pytestmark = pytest.mark.usefixtures("fixed_peak_and_threads")


def test_each_candidate_beside_the_recipe_in_the_same_rounds(tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = main(
        ["bench", TINY, *FAST, "--set", "model.attention=sdpa", "--json", "--out", str(out)]
        + ["--each", "train.sdpa_backend=math", "--each", "train.precision=bf16_act"]
        + ["--each", "train.sdpa_backend=cudnn", "--each", "train.inductor_combo_kernels=true"]
    )
    assert rc == 0
    r = json.loads(out.read_text())["each"]
    assert r["rounds"] == 2 and r["recipe"]["images_per_s"] > 0
    by = {json.dumps(c["overrides"]): c for c in r["candidates"]}
    assert list(by) == [
        '{"train.sdpa_backend": "math"}',
        '{"train.precision": "bf16_act"}',
        '{"train.sdpa_backend": "cudnn"}',
        '{"train.inductor_combo_kernels": true}',
    ]
    for key in ('{"train.sdpa_backend": "math"}', '{"train.precision": "bf16_act"}'):
        c = by[key]
        assert len(c["speedup_rounds"]) == 2 and c["candidate"]["mfu"] > 0
        assert c["candidate"]["warmup_s"] > 0 and c["speedup"] > 0
    assert "is a CUDA kernel; on cpu" in by['{"train.sdpa_backend": "cudnn"}']["error"]
    assert "needs train.compile=true" in by['{"train.inductor_combo_kernels": true}']["error"]


def test_a_candidate_that_fails_to_build_is_said_and_the_others_run(monkeypatch, capsys):
    real = lab_each.Bench

    def failing(cfg, synthetic=False):
        if cfg.optim.impl == "foreach":
            raise RuntimeError("CUTLASS not found\nsecond line")
        return real(cfg, synthetic)

    monkeypatch.setattr(lab_each, "Bench", failing)
    rc = main(
        ["bench", TINY, *FAST, "--each", "optim.impl=foreach", "--each", "optim.impl=forloop"]
    )
    assert rc == 0
    text = capsys.readouterr()
    assert "optim.impl=foreach: not timed (RuntimeError: CUTLASS not found)" in text.out
    assert "optim.impl=forloop: " in text.out and "x the recipe" in text.out
