"""Sharded FSDP2 checkpoints (torch.distributed.checkpoint) and resuming across strategies and
world sizes: an interrupted run resumed elsewhere ends where the uninterrupted run ends."""

import shutil

import pytest
import torch
from helpers import BASE, TINY, check_eval_and_export, rel_diff, sets, torchrun

from vitscale import checkpoint as ckpt
from vitscale.cli import main
from vitscale.errors import UserError
from vitscale.state import SavedRun
from vitscale.strategy.resume import check_resume, read_dcp

# 3 epochs of 4 steps, a checkpoint every 3 steps: interrupted after step 6, resumed to step 12
RUN = ["run.checkpoint_every=3", "run.keep_last=100", "train.epochs=3"]
SHARDED = ["strategy.name=fsdp", "strategy.checkpoint_format=sharded"]
NO_LAUNCHER = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


def final_weights(run_dir):
    """The last checkpoint's model, consolidated (a sharded run's from its step_N.dcp folder)."""
    from vitscale.state import SavedRun

    return SavedRun.open(run_dir, "evaluating", "vitscale eval").model_weights()


def interrupted_copy(run_dir, dest, step=6):
    """`run_dir` as if it had stopped right after the checkpoint of `step`."""
    shutil.copytree(run_dir, dest)
    for p in (dest / "checkpoints").iterdir():
        if not p.name.startswith(f"step_{step:08d}."):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    (dest / "summary.json").unlink()
    return dest


def shown(pytestconfig, capsys, text):
    """print() past capsys, under `pytest -s` only."""
    if pytestconfig.getoption("capture") == "no":
        with capsys.disabled():
            print(text)


def alone(monkeypatch):
    for k in NO_LAUNCHER:  # in this process, without a launcher
        monkeypatch.delenv(k, raising=False)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    assert main(["train", TINY, "--out", str(out), *sets(BASE + RUN)]) == 0
    return out


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "run"
    p = torchrun(out, SHARDED + RUN)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def test_sharded_layout(sharded_run):
    folder = sharded_run / "checkpoints"
    pts = ckpt.list_checkpoints(sharded_run)
    assert [p.name for p in pts] == [f"step_{s:08d}.pt" for s in (3, 6, 9, 12)]
    for p in pts:
        dcp = p.with_suffix(".dcp")
        assert (dcp / ".metadata").is_file() and len(
            list(dcp.glob("*.distcp"))
        ) == 2  # one per rank
        state = torch.load(p, weights_only=False)
        assert (
            state["engine"] == ".dcp" and "model" not in state["strategy"]
        )  # small: no tensors of the model
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_sharded_resumes_on_one_rank(sharded_run, tmp_path):
    part = interrupted_copy(sharded_run, tmp_path / "part")
    p = torchrun(None, [], nproc=1, resume=part)  # 2 ranks -> 1 rank: DCP re-shards on load
    assert p.returncode == 0, p.stderr[-3000:]
    d = rel_diff(final_weights(part), final_weights(sharded_run))
    print(f"relative weight difference FSDP sharded 2->1 ranks resumed vs uninterrupted: {d:.2e}")
    assert d <= 1e-5, d
    # and back: the one-rank run's step-9 folder (one shard file) resumed on 2 ranks
    assert len(list((part / "checkpoints" / "step_00000009.dcp").glob("*.distcp"))) == 1
    back = interrupted_copy(part, tmp_path / "back", step=9)
    p = torchrun(None, [], nproc=2, resume=back)
    assert p.returncode == 0, p.stderr[-3000:]
    d = rel_diff(final_weights(back), final_weights(sharded_run))
    print(
        f"relative weight difference FSDP sharded 2->1->2 ranks resumed vs uninterrupted: {d:.2e}"
    )
    assert d <= 1e-5, d


def test_sharded_resumes_under_single_and_exports(
    sharded_run, tmp_path, monkeypatch, capsys, pytestconfig
):
    alone(monkeypatch)
    part = interrupted_copy(sharded_run, tmp_path / "part")
    # FSDP2 sharded (name-keyed optimizer state) -> one process without FSDP (index-keyed)
    assert (
        main(
            [
                "train",
                "--resume",
                str(part),
                "--set",
                "strategy.name=single",
                "--set",
                "run.keep_last=1",
            ]
        )
        == 0
    )
    # pruning the step-6 checkpoint took its .dcp folder too, though this strategy writes none
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == ["step_00000012.pt"]
    d = rel_diff(final_weights(part), final_weights(sharded_run))
    shown(
        pytestconfig,
        capsys,
        f"relative weight difference FSDP sharded (2 ranks) -> single resumed vs "
        f"uninterrupted: {d:.2e}",
    )
    assert d <= 1e-5, d
    # eval and export consolidate the sharded folder in this one process
    dcp = read_dcp(sharded_run / "checkpoints" / "step_00000012.dcp")["model"]
    assert check_eval_and_export(sharded_run, tmp_path, capsys, dcp)["step"] == 12


def test_single_resumes_under_fsdp_and_back(single_run, tmp_path):
    # single (index-keyed optimizer state) -> FSDP2 on 2 ranks writing sharded checkpoints, of
    # which it keeps the last 2 (.pt files and .dcp folders)
    part = interrupted_copy(single_run, tmp_path / "part")
    p = torchrun(None, SHARDED + ["run.keep_last=2"], resume=part)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == [
        "step_00000009.dcp",
        "step_00000009.pt",
        "step_00000012.dcp",
        "step_00000012.pt",
    ]
    d = rel_diff(final_weights(part), final_weights(single_run))
    print(
        f"relative weight difference single -> FSDP sharded (2 ranks) resumed vs uninterrupted: {d:.2e}"
    )
    assert d <= 1e-5, d
    # single -> FSDP2 full from step 3 (name-keyed optimizer state in its .pt), then that run
    # interrupted after step 6 and resumed under DDP (2 ranks)
    full = interrupted_copy(single_run, tmp_path / "full", step=3)
    p = torchrun(None, ["strategy.name=fsdp"], resume=full)
    assert p.returncode == 0, p.stderr[-3000:]
    assert all(
        isinstance(k, str)
        for k in torch.load(ckpt.list_checkpoints(full)[-1], weights_only=False)["strategy"][
            "optimizer"
        ]["state"]
    )
    d = rel_diff(final_weights(full), final_weights(single_run))
    print(
        f"relative weight difference single -> FSDP full (2 ranks) resumed vs uninterrupted: {d:.2e}"
    )
    assert d <= 1e-5, d
    ddp = interrupted_copy(full, tmp_path / "ddp")
    p = torchrun(None, ["strategy.name=ddp"], resume=ddp)
    assert p.returncode == 0, p.stderr[-3000:]
    last = torch.load(ckpt.list_checkpoints(ddp)[-1], weights_only=False)
    assert (
        last["config"]["strategy"]["name"] == "ddp"
        and last["world_size"] == 2
        and last["step"] == 12
    )
    d = rel_diff(final_weights(ddp), final_weights(single_run))
    print(
        f"relative weight difference single -> FSDP full -> DDP (2 ranks) resumed vs uninterrupted: {d:.2e}"
    )
    assert d <= 1e-5, d


def test_deepspeed_and_other_engines_refuse_each_other(
    single_run, tmp_path, monkeypatch, capsys, pytestconfig
):
    alone(monkeypatch)
    part = interrupted_copy(single_run, tmp_path / "part")
    capsys.readouterr()
    # a plain checkpoint under DeepSpeed: refused before DeepSpeed starts
    assert main(["train", "--resume", str(part), "--set", "strategy.name=deepspeed"]) == 2
    err = capsys.readouterr().err.strip()
    shown(pytestconfig, capsys, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "under strategy.name=deepspeed" in err and "written by strategy.name=single" in err
    # a DeepSpeed checkpoint (its .pt says so) under another strategy
    path = ckpt.list_checkpoints(part)[-1]
    state = torch.load(path, weights_only=False)
    state["config"]["strategy"]["name"] = "deepspeed"
    with pytest.raises(
        UserError,
        match=r"under strategy.name=fsdp: it was written by "
        r"strategy.name=deepspeed.*ds_to_universal.*vitscale export",
    ):
        check_resume(SavedRun(path, state).strategy_name, path, "fsdp")
    del state["strategy"]["optimizer"]  # as DeepSpeed writes it: the optimizer is in step_N.ds
    torch.save(state, path)
    assert main(["train", "--resume", str(part), "--set", "strategy.name=single"]) == 2
    err = capsys.readouterr().err.strip()
    shown(pytestconfig, capsys, err)
    assert len(err.splitlines()) == 1 and "written by strategy.name=deepspeed" in err


def test_optimizer_state_conversion_round_trips():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[1].weight]},
            {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0},
        ]
    )
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    names = ["0.weight", "1.weight", "0.bias", "1.bias"]
    by_name = ckpt.optim_state_by_name(opt.state_dict(), names)
    assert ckpt.optim_keyed_by_name(by_name) and set(by_name["state"]) == set(names)
    assert torch.equal(by_name["state"]["1.bias"]["exp_avg"], opt.state[model[1].bias]["exp_avg"])
    back = ckpt.optim_state_by_index(by_name, names)
    assert back["param_groups"] == opt.state_dict()["param_groups"]
    with pytest.raises(UserError, match="not the same model"):
        ckpt.optim_state_by_index(by_name, names[:3])
