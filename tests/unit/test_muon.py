"""optim.name = muon (issue 50): the blocks' 2-D weights with Muon, the rest with AdamW, bit-equal to
torch.optim.Muon and torch.optim.AdamW driven by hand on the same split; the Newton-Schulz iteration
in fp32 against a float64 one; the split; the refusals; the state through a checkpoint."""

import copy
import os
import shutil
import signal

import pytest
import torch
from helpers import BASE, TINY, sets, weights

from vitscale import loop
from vitscale.checks import check_run
from vitscale.cli import main
from vitscale.config import OptimConfig, load_config
from vitscale.errors import ConfigError
from vitscale.models import vit
from vitscale.muon import MuonAdamW, orthogonalize
from vitscale.optim import build_optimizer, check_optimizer, is_muon_param, optimizer_groups


def tiny():
    torch.manual_seed(0)
    return vit(
        "vit_pico", image_size=8, patch_size=4, in_chans=1, num_classes=4, dim=16, depth=2, heads=2
    )


def muon_cfg(**kw) -> OptimConfig:
    base = dict(name="muon", lr=3e-3, weight_decay=0.05, muon_ns_dtype="bf16", muon_lr=0.02)
    return OptimConfig(**{**base, **kw})


def loss_of(m: torch.nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 1, 8, 8, generator=g)
    y = torch.randint(0, 4, (6,), generator=g)
    return torch.nn.functional.cross_entropy(m(x), y)


def test_split_hidden_matrices_to_muon_the_rest_to_adamw():
    m = tiny()
    groups = optimizer_groups(m, muon_cfg(muon_weight_decay=0.2))
    names = {id(p): n for n, p in m.named_parameters()}
    muon = [g for g in groups if g.get("muon")]
    assert len(muon) == 1 and muon[0]["weight_decay"] == 0.2
    hidden = {names[id(p)] for p in muon[0]["params"]}
    assert hidden == {
        f"blocks.{i}.{w}.weight"
        for i in range(2)
        for w in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    }
    rest = {names[id(p)] for g in groups if not g.get("muon") for p in g["params"]}
    assert {"head.weight", "patch_embed.proj.weight", "pos_embed", "blocks.0.norm1.weight"} <= rest
    assert len(rest) + len(hidden) == len(list(m.parameters()))
    # -1: the AdamW weight decay
    assert [g for g in optimizer_groups(m, muon_cfg()) if g.get("muon")][0]["weight_decay"] == 0.05


@pytest.mark.parametrize("impl", ["forloop", "foreach"])
@pytest.mark.parametrize("adjust,nesterov", [("original", True), ("match_rms_adamw", False)])
def test_bit_equal_to_torch_muon_and_adamw_by_hand(impl, adjust, nesterov):
    cfg = muon_cfg(impl=impl, muon_adjust_lr=adjust, muon_nesterov=nesterov, muon_momentum=0.9)
    ours_m, ref_m = tiny(), tiny()
    ours = build_optimizer(ours_m, cfg)
    assert isinstance(ours, MuonAdamW)
    named = list(ref_m.named_parameters())
    hidden = [p for n, p in named if is_muon_param(n, p)]
    skip = ref_m.no_weight_decay()  # norms, biases, pos_embed, cls_token: no weight decay
    rest = [(n, p) for n, p in named if not is_muon_param(n, p)]
    decay = [p for n, p in rest if p.ndim > 1 and n not in skip]
    no_decay = [p for n, p in rest if p.ndim <= 1 or n in skip]
    foreach = {"forloop": False, "foreach": True}[impl]
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3,
        foreach=foreach,
    )
    muon = torch.optim.Muon(
        hidden, lr=0.02, weight_decay=0.05, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust
    )
    for step in range(4):
        for m, opts in ((ours_m, [ours]), (ref_m, [adamw, muon])):
            for o in opts:
                o.zero_grad()
            loss_of(m, step).backward()
            for o in opts:
                o.step()
        for (n, a), b in zip(ours_m.named_parameters(), ref_m.parameters()):
            assert torch.equal(a, b), (step, n)


def test_fp32_iteration_against_float64():
    g = torch.Generator().manual_seed(1)
    for shape in [(24, 8), (8, 24), (16, 16)]:
        G = torch.randn(*shape, generator=g)
        ref = orthogonalize(G.double(), 5, torch.float64)
        got = orthogonalize(G, 5, torch.float32)
        # five matmul rounds of unit-norm matrices: the fp32 error is a few ulps of 1, x the size
        assert (got.double() - ref).abs().max() < 1e-5 * max(shape)
        # what the iteration is for: singular values pushed towards 1 (Keller Jordan's 0.5-1.5 band
        # for the ones that are not tiny), the singular vectors of G kept
        s = torch.linalg.svdvals(ref)
        assert s.max() < 1.25 and (s > 0.3).sum() >= min(shape) - 1
        u, _, vh = torch.linalg.svd(G.double(), full_matrices=False)
        assert torch.allclose(u.T @ ref @ vh.T, torch.diag(u.T @ ref @ vh.T).diag(), atol=1e-6)


def test_state_survives_a_state_dict_round_trip_bit_equal():
    cfg = muon_cfg(impl="forloop")
    a_m = tiny()
    a = build_optimizer(a_m, cfg)
    for s in range(2):
        a.zero_grad()
        loss_of(a_m, s).backward()
        a.step()
    b_m = copy.deepcopy(a_m)
    b = build_optimizer(b_m, cfg)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert any("momentum_buffer" in st for st in b.state.values())
    for m, o in ((a_m, a), (b_m, b)):
        o.zero_grad()
        loss_of(m, 7).backward()
        o.step()
    for x, y in zip(a_m.parameters(), b_m.parameters()):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            ["optim.name=adamw", "optim.muon_lr=0.02"],
            "optim.muon_lr is a key of optim.name=muon, unused by adamw",
        ),
        (["optim.name=muon", "optim.layer_decay=0.7"], "layer_decay < 1 is refused"),
        (
            ["optim.name=muon", "strategy.name=deepspeed", "train.ema_decay=0"],
            "strategy.name=deepspeed does not support optim.name=muon",
        ),
    ],
)
def test_refusals_in_one_line(overrides, needle):
    with pytest.raises(ConfigError) as e:
        cfg = check_run(load_config("fashion_mnist", overrides), world_size=1)
        check_optimizer(cfg.optim)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_refused_where_no_block_has_a_matrix():
    m = tiny()
    for n, p in m.named_parameters():
        p.requires_grad_(not n.startswith("blocks."))
    with pytest.raises(ConfigError, match="found no 2-D weights"):
        optimizer_groups(m, muon_cfg())


# -- a Muon run stopped and resumed continues bit-equal --------------------------------------------
RUN = [*BASE, "train.epochs=4", "run.checkpoint_every=5", "run.keep_last=100", "optim.name=muon"]


def train_tiny(out, *extra) -> int:
    return main(["train", TINY, "--out", str(out), *sets(RUN + list(extra))])


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_a_stopped_muon_run_and_one_killed_after_a_checkpoint_resume_bit_equal(
    tmp_path, monkeypatch, ns_dtype
):
    """SIGTERM in step 7 (the stop saves step 7), and a copy of the whole run cut back to its step
    10 checkpoint (what kill -9 after that write leaves): both resume to the uninterrupted run's
    weights, bit for bit: Muon's momentum and AdamW's moments travel in the checkpoint."""
    whole = tmp_path / "whole"
    assert train_tiny(whole, f"optim.muon_ns_dtype={ns_dtype}") == 0
    stopped = tmp_path / "stopped"
    target = loop.Trainer.run_step

    def hooked(self, *a, **k):
        if self.step + 1 == 7:
            os.kill(os.getpid(), signal.SIGTERM)
        return target(self, *a, **k)

    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        monkeypatch.setattr(loop.Trainer, "run_step", hooked)
        assert train_tiny(stopped, f"optim.muon_ns_dtype={ns_dtype}") == 128 + signal.SIGTERM
        monkeypatch.undo()
    finally:
        signal.signal(signal.SIGTERM, before)
    assert main(["train", "--resume", str(stopped)]) == 0
    killed = tmp_path / "killed"
    shutil.copytree(whole, killed)
    (killed / "summary.json").unlink()
    assert main(["train", "--resume", str(killed / "checkpoints" / "step_00000010.pt")]) == 0
    a = weights(whole)
    for run in (stopped, killed):
        b = weights(run)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), run.name
