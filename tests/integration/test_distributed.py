"""DDP and FSDP2 on CPU: 2 gloo ranks launched by torchrun give the single-process result."""

import json
import shutil
import socket

import pytest
from helpers import TINY, comm_per_step, rel_diff, torchrun, weights

from vitscale import checkpoint as ckpt
from vitscale.cli import main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "extra,tol",
    [
        (["strategy.name=ddp"], 1e-5),
        (
            ["strategy.name=ddp", "train.accum_steps=2"],
            1e-5,
        ),  # no_sync micro-steps, then one all-reduce
        (
            ["strategy.name=ddp", "strategy.grad_compression=bf16"],
            2e-2,
        ),  # bf16 gradients: ~3 digits
        (["strategy.name=fsdp"], 1e-5),
        (
            ["strategy.name=fsdp", "train.accum_steps=2", "strategy.reshard_after_forward=false"],
            1e-5,
        ),
        (
            ["strategy.name=fsdp", "train.precision=bf16"],
            5e-2,
        ),  # bf16 compute, fp32 reduce and master
        (["strategy.name=fsdp", "train.compile=true"], 1e-5),  # each block compiled, then sharded
    ],
)
def test_ddp_two_ranks_match_single_process(tmp_path, single, extra, tol):
    out = tmp_path / "ddp"
    p = torchrun(out, extra)
    assert p.returncode == 0, p.stderr[-3000:]
    d = rel_diff(weights(out), weights(single))
    print(f"relative weight difference vs single process, {extra}: {d:.2e}")
    assert d <= tol, d
    s_ddp = json.loads((out / "summary.json").read_text())
    s_one = json.loads((single / "summary.json").read_text())
    assert s_ddp["world_size"] == 2 and s_ddp["steps"] == s_one["steps"]
    assert s_ddp["images_seen"] == s_one["images_seen"]
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # evaluation gathered across ranks: every test image counted once
    assert all(e["test_count"] == 32 for e in evals if e["kind"] == "eval")
    assert abs(s_ddp["test_accuracy"] - s_one["test_accuracy"]) <= 1 / 32
    if "strategy.name=ddp" in extra:  # every gradient all-reduced once per optimizer step
        width = 2 if "strategy.grad_compression=bf16" in extra else 4
        train = [e for e in evals if e["kind"] == "train"]
        assert train and all(
            e["comm_allreduce_bytes_per_step"] == width * s_one["params"] for e in train
        )
        assert all(e["comm_allreduce_s_per_step"] > 0 for e in train)
        assert all(set(c) == {"allreduce"} for c in comm_per_step(out))  # nothing else communicates
    else:  # FSDP2: parameters all-gathered per micro-batch (again in backward when resharded), in the
        # compute dtype; gradients reduce-scattered once per step in fp32; shards padded to equal size
        A = 2 if "train.accum_steps=2" in extra else 1
        gathers = (
            A
            * (1 if "strategy.reshard_after_forward=false" in extra else 2)
            * (0.5 if "train.precision=bf16" in extra else 1)
        )
        for c in comm_per_step(out):
            print(f"FSDP2 {extra}: bytes per step / 4P: {c}")
            assert gathers <= c["allgather"] <= 1.05 * gathers, c
            assert 1 <= c["reducescatter"] <= 1.05, c
            assert c["allreduce"] < 0.01, c  # the gradient norm's scalars only
    # memory actually held per rank: DDP replicates everything, FSDP2 holds about half on 2 ranks
    one, ranks = s_one["state_bytes_per_rank"][0], s_ddp["state_bytes_per_rank"]
    for r in ranks:
        total, total_one = sum(r.values()), sum(one.values())
        if "strategy.name=ddp" in extra:
            assert r == one
        else:
            assert 0.45 * total_one <= total <= 0.6 * total_one, (r, one)
    assert "Traceback" not in p.stderr


def test_ddp_batch_not_divisible_is_a_clear_error(tmp_path):
    p = torchrun(
        tmp_path / "bad", ["strategy.name=ddp", "data.batch_size=18", "train.accum_steps=2"]
    )
    assert p.returncode != 0
    # a config refusal is every rank's: rank 0 says it, once (issue 62); torchrun adds its report
    mine = [x for x in p.stderr.splitlines() if x.startswith("vitscale: error")]
    assert mine == [
        "vitscale: error: [rank 0] config: data.batch_size (18) must be a multiple of "
        "processes (2) x train.accum_steps (2)"
    ], mine
    assert "src/vitscale" not in p.stderr  # no traceback from vitscale itself


def test_fsdp_refuses_what_it_does_not_support(tmp_path, capsys):
    assert (
        main(
            [
                "train",
                TINY,
                "--out",
                str(tmp_path / "x"),
                "--set",
                "strategy.name=fsdp",
                "--set",
                "train.ema_decay=0.9",
            ]
        )
        == 2
    )
    assert "strategy.name=fsdp does not support train.ema_decay" in capsys.readouterr().err


def test_ddp_without_launcher_says_how_to_launch(tmp_path, capsys, monkeypatch):
    for k in ("MASTER_ADDR", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    assert main(["train", TINY, "--out", str(tmp_path / "x"), "--set", "strategy.name=ddp"]) == 2
    assert "torchrun --nproc-per-node" in capsys.readouterr().err


def test_fsdp_uneven_eval_shards_do_not_hang(tmp_path):
    # 33 test images over 2 ranks in batches of 16: 2 batches on rank 0, 1 on rank 1; the short
    # rank pads with empty forwards so that every all-gather has both ranks
    out = tmp_path / "uneven"
    p = torchrun(
        out,
        [
            "strategy.name=fsdp",
            "data.test_size=33",
            "data.eval_batch_size=16",
            "strategy.timeout_s=60",
        ],
        timeout=150,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    evals = [
        json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x
    ]
    assert evals and all(e["test_count"] == 33 for e in evals)


def test_fsdp_checkpoint_resumes_on_another_world_size(tmp_path):
    full = tmp_path / "full"
    extra = ["strategy.name=fsdp", "run.checkpoint_every=3", "run.keep_last=100", "train.epochs=3"]
    p = torchrun(full, extra)
    assert p.returncode == 0, p.stderr[-3000:]
    part = tmp_path / "part"
    shutil.copytree(full, part)
    for c in ckpt.list_checkpoints(part):
        if c.name != "step_00000006.pt":
            c.unlink()
    p = torchrun(None, [], nproc=1, resume=part)  # 2 ranks -> 1 rank, same global batch
    assert p.returncode == 0, p.stderr[-3000:]
    d = rel_diff(weights(part), weights(full))
    print(f"relative weight difference FSDP 2->1 ranks resumed vs uninterrupted: {d:.2e}")
    assert d <= 1e-5, d
