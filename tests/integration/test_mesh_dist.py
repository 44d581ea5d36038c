"""Parallelism as parts on one device mesh (issue 49), on CPU with gloo processes: tensor parallel
(2 processes), FSDP x TP, HSDP and DDP x TP (2 x 2 on 4 processes) train the one-process run, and a
checkpoint moves between meshes.

Tolerances, from the arithmetic: every run computes in fp32 (eps = 2^-24 relative per operation),
and a mesh changes only the order of the sums: a tensor-parallel all-reduce adds 2 partial
products where one process adds them in its matmul, a data-parallel reduction adds 2 or 4
per-rank gradients. Each such sum moves by at most a few eps relative; AdamW at lr 3e-3 over 8
steps turns gradient round-off into weight round-off of the same relative size for every
gradient above its epsilon (1e-8), so the relative weight difference stays orders below 1e-5;
the loss, a mean of 16 logs of softmaxes, moves by as little: 1e-5 relative. Both bounds are the
ones test_distributed.py states for DDP and FSDP2."""

import json
import shutil

import pytest
from helpers import BASE, CLIP, TINY, assert_loss_state_close, rel_diff, sets, torchrun, weights

from vitscale.cli import main

MESHES = {
    "tp2": (2, ["strategy.name=fsdp", "strategy.tp=2"]),
    "fsdp2xtp2": (4, ["strategy.name=fsdp", "strategy.tp=2"]),
    "hsdp2x2": (4, ["strategy.name=hsdp", "strategy.dp_shard=2"]),
    "ddp2xtp2": (4, ["strategy.name=ddp", "strategy.tp=2"]),
    # sequence parallel: the norms on their tokens (5 tokens over 2 ranks: an uneven split)
    "tp2sp": (2, ["strategy.name=fsdp", "strategy.tp=2", "strategy.sequence_parallel=true"]),
}
RTOL = 1e-5
# the (dp_replicate, dp_shard, tp) each mesh above is, as summary.json records it
SIZES = {
    "tp2": (1, 1, 2),
    "fsdp2xtp2": (1, 2, 2),
    "hsdp2x2": (2, 2, 1),
    "ddp2xtp2": (2, 1, 2),
    "tp2sp": (1, 1, 2),
}


def losses(run) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_a_mesh_trains_the_one_process_run(tmp_path, single, mesh):
    nproc, extra = MESHES[mesh]
    out = tmp_path / mesh
    p = torchrun(out, extra, nproc=nproc)
    assert p.returncode == 0, p.stderr[-3000:]
    mine, one = losses(out), losses(single)
    assert mine.keys() == one.keys() and 8 in mine
    for step in one:  # the loss curve, step 8 included
        assert abs(mine[step] - one[step]) <= RTOL * abs(one[step]), (step, mine[step], one[step])
    d = rel_diff(weights(out), weights(single))
    print(f"{mesh}: relative weight difference vs one process {d:.2e}")
    assert d <= RTOL, d
    summary = json.loads((out / "summary.json").read_text())
    s1 = json.loads((single / "summary.json").read_text())
    assert summary["world_size"] == nproc and summary["images_seen"] == s1["images_seen"]
    assert summary["strategy"] == extra[0].split("=")[1]
    assert summary["mesh"] == dict(zip(("dp_replicate", "dp_shard", "tp"), SIZES[mesh]))
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # every test image evaluated once: a tensor-parallel group counts its shard once
    assert all(e["test_count"] == 32 for e in evals if e["kind"] == "eval")
    assert summary["test_accuracy"] == pytest.approx(s1["test_accuracy"], abs=1 / 32)
    check_comm_per_dimension(mesh, nproc, [e for e in evals if e["kind"] == "train"], s1["params"])


# issue 58: the blocks of the 2022-2025 encoders, each named by a recipe key
BLOCKS = {
    "rope_swiglu_map": [
        "model.rope=cat",
        "model.mlp=swiglu",
        "model.norm=rmsnorm",
        "model.qk_norm=true",
        "model.layer_scale=0.1",
        "model.reg_tokens=1",
        "model.head=map",
        "model.pos_embed=false",
    ],
    "packed_dinov3": ["model.mlp=swiglu_packed", "model.rope=dinov3", "model.head=pool"],
}


@pytest.mark.parametrize("blocks", list(BLOCKS))
def test_the_modern_blocks_train_the_one_process_run_under_fsdp_x_tp(tmp_path, blocks):
    """Each block under FSDP x TP 2x2 (SwiGLU's up-projections column-wise, the packed one as two
    blocks, q/k norms on each rank's heads with their gradients summed, MAP and the rope
    replicated) trains what one process trains, within the bound of the meshes above."""
    one = tmp_path / "one"
    assert main(["train", TINY, "--out", str(one), *sets(BASE + BLOCKS[blocks])]) == 0
    out = tmp_path / "mesh"
    p = torchrun(out, ["strategy.name=fsdp", "strategy.tp=2", *BLOCKS[blocks]], nproc=4)
    assert p.returncode == 0, p.stderr[-3000:]
    mine, ref = losses(out), losses(one)
    assert mine.keys() == ref.keys() and 8 in mine
    for step in ref:
        assert abs(mine[step] - ref[step]) <= RTOL * abs(ref[step]), (step, mine[step], ref[step])
    d = rel_diff(weights(out), weights(one))
    print(f"{blocks}: relative weight difference vs one process {d:.2e}")
    assert d <= RTOL, d


def check_comm_per_dimension(mesh: str, nproc: int, train: list[dict], params: int) -> None:
    """The collectives per step, per mesh dimension (strategy/comm.py), against what the mesh
    implies for tiny.toml (depth 2, width 32, 5 tokens, a global batch of 16 in fp32).

    Tensor parallelism: per block one all-reduce of the branch's output in forward for attention
    and one for the MLP, and one of each branch's input gradient in backward: 4 per block, each of
    the data-parallel rank's activations [16 / dp, 5, 32] in fp32; a few scalars beyond (the
    gradient norm's). HSDP: FSDP2 reduce-scatters the gradients in its shard group (the padded
    parameters, once per step) and all-reduces each shard across the replicas (1 / shard of them)."""
    tp = 2 if "tp" in mesh else 1
    dp = nproc // tp
    for row in train:
        if mesh.endswith("sp"):  # each all-reduce a reduce-scatter of the tokens padded to 6
            per_call = (16 // dp) * 6 * 32 * 4
            assert row["comm_tp_reducescatter_calls_per_step"] == 4 * 2
            assert row["comm_tp_reducescatter_bytes_per_step"] == 4 * 2 * per_call
            assert row["comm_tp_allgather_calls_per_step"] >= 4 * 2
        elif tp > 1:
            per_call = (16 // dp) * 5 * 32 * 4
            assert row["comm_tp_allreduce_calls_per_step"] >= 4 * 2
            assert (
                4 * 2 * per_call
                <= row["comm_tp_allreduce_bytes_per_step"]
                <= 4 * 2 * per_call + 1024
            )
        else:
            assert not any(k.startswith("comm_tp_") for k in row)
        if mesh.startswith("hsdp"):
            assert row["comm_dp_shard_reducescatter_bytes_per_step"] == pytest.approx(
                4 * params, rel=0.05
            )
            replicas = row["comm_dp_replicate_allreduce_bytes_per_step"]
            assert 4 * params / 2 <= replicas <= 1.05 * 4 * params / 2 + 1024


@pytest.mark.parametrize(
    "loss,mesh", [("openclip", "fsdp2xtp2"), ("fastclip_v3", "fsdp2xtp2"), ("fastclip_v3", "tp2sp")]
)
def test_clip_under_fsdp_x_tp_trains_the_one_process_run(tmp_path, loss, mesh):
    """Both towers split by the plan; FastCLIP's features gathered and its gradient reduced over
    the data-parallel group (2 of the 4 processes), its per-sample state indexed by it."""
    base = ["run.threads=1", "optim.grad_clip=1.0", "optim.name=sgd", "optim.lr=0.05"]
    base.append(f"clip.loss={loss}")
    one = tmp_path / "one"
    assert main(["train", CLIP, "--out", str(one), *sets(base)]) == 0
    out = tmp_path / "mesh"
    p = torchrun(out, MESHES[mesh][1], nproc=MESHES[mesh][0], config=CLIP, base=base)
    assert p.returncode == 0, p.stderr[-3000:]
    d = rel_diff(weights(out), weights(one))
    print(f"CLIP {loss} under {mesh}: relative weight difference vs one process {d:.2e}")
    assert d <= RTOL, d
    assert_loss_state_close(out, one)  # FastCLIP's per-sample state: the fp32 bound
    a = json.loads((out / "summary.json").read_text())
    b = json.loads((one / "summary.json").read_text())
    assert a["test_pairs"] == b["test_pairs"] == 32  # every held-out pair once


def test_a_resume_onto_another_strategy_takes_its_mesh_defaults(tmp_path, single, capsys):
    """issue 62: saved at step 4 under tensor parallelism (fsdp, tp=2, 2 processes), resumed in one
    process with strategy.name=single alone: tp takes single's default and the run ends on the
    one-process run (the bound of a checkpoint's move between meshes, above). Resumed with its
    saved strategy in one process, it is refused in one line naming where tp=2 came from."""
    out = tmp_path / "tp"
    keep = ["run.checkpoint_every=4", "run.keep_last=10"]
    p = torchrun(out, MESHES["tp2"][1] + keep, nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    step4 = out / "checkpoints" / "step_00000004.pt"
    capsys.readouterr()
    assert main(["train", "--resume", str(step4)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "vitscale: error: config: the mesh dp_replicate=1 x dp_shard=-1 x tp=2 (from the saved "
        "run) does not divide 1 processes (2 does not divide 1)"
    ]
    assert main(["train", "--resume", str(step4), *sets(["strategy.name=single"])]) == 0
    d = rel_diff(weights(out), weights(single))
    print(f"TP 2 step 4 resumed under single: {d:.2e}")
    assert d <= RTOL, d
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "single" and summary["mesh"]["tp"] == 1


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_checkpoint_moves_between_meshes(tmp_path, single, fmt):
    """Saved at step 4 under FSDP x TP 2x2, resumed under DDP on 2 processes and in one process;
    saved in one process, resumed under FSDP x TP 2x2: each ends on the one-process run."""
    keep = ["run.checkpoint_every=4", "run.keep_last=10", f"strategy.checkpoint_format={fmt}"]
    mesh = tmp_path / "mesh"
    p = torchrun(mesh, MESHES["fsdp2xtp2"][1] + keep, nproc=4)
    assert p.returncode == 0, p.stderr[-3000:]
    for name, nproc, engine in [("ddp", 2, "ddp"), ("one", 1, "single")]:
        out = tmp_path / name  # a copy of the mesh's run, continued from its step 4
        shutil.copytree(mesh, out)
        step4 = out / "checkpoints" / "step_00000004.pt"
        if nproc == 1:
            assert (
                main(
                    [
                        "train",
                        "--resume",
                        str(step4),
                        *sets([f"strategy.name={engine}", "strategy.tp=1"]),
                    ]
                )
                == 0
            )
        else:
            p = torchrun(
                None, [f"strategy.name={engine}", "strategy.tp=1"], nproc=nproc, resume=step4
            )
            assert p.returncode == 0, p.stderr[-3000:]
        d = rel_diff(weights(out), weights(single))
        print(f"{fmt}: FSDP x TP step 4 resumed under {name}: {d:.2e}")
        assert d <= RTOL, (name, d)
    if fmt == "full":  # and back: one process's step 4 under FSDP x TP
        back = tmp_path / "back"
        shutil.copytree(single, back)
        step4 = back / "checkpoints" / "step_00000004.pt"
        p = torchrun(None, ["strategy.name=fsdp", "strategy.tp=2"], nproc=4, resume=step4)
        assert p.returncode == 0, p.stderr[-3000:]
        assert rel_diff(weights(back), weights(single)) <= RTOL
