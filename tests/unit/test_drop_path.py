"""Stochastic depth that skips the work it drops (model.drop_path_mode = "skip", issue 41): given the
same dropped rows it computes what the mask form computes, forward and gradients; its dropped rows are
a uniform draw of a fixed count; everything that wraps a block (gradient checkpointing, compile, the
tasks' builds) sees the same rows."""

import copy

import pytest
import torch

from vitscale.config import ConfigError, load_config
from vitscale.models import set_drop_path_mode, vit
from vitscale.models.layers import Block, dropped_count, kept_rows, residual, skip_residual
from vitscale.models.vit import LayerScaleBlock
from vitscale.tasks import build_task


def fp64_block(cls=Block, p=0.3, seed=0):
    torch.manual_seed(seed)
    blk = cls(16, 4, 2.0, drop_path=p).double()
    if cls is LayerScaleBlock:  # layer scale away from its 1e-5 start, so the branch matters
        for ls in (blk.ls1, blk.ls2):
            ls.gamma.data.uniform_(0.5, 1.5)
    return blk


def mask_reference(x, branch, rows):
    """The mask form with the dropped rows given: every row's branch computed, the dropped ones
    multiplied by 0, the kept ones by batch / kept."""
    mask = torch.zeros(x.shape[0], 1, 1, dtype=x.dtype)
    mask[rows] = x.shape[0] / rows.numel()
    return x + branch(x) * mask


def grads(module, x):
    return [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("cls", [Block, LayerScaleBlock])
def test_skip_computes_the_mask_form_given_the_same_dropped_rows(cls):
    """Forward and every gradient (parameters and input), in fp64: the only differences are the
    summation orders of matmuls over fewer rows, far below the tolerance."""
    blk = fp64_block(cls)
    torch.manual_seed(1)
    x0 = torch.randn(8, 5, 16, dtype=torch.float64)
    rows = torch.tensor([0, 2, 3, 5, 7])
    outs, gs = [], []
    for form in (mask_reference, skip_residual):
        b = copy.deepcopy(blk)
        x = x0.clone().requires_grad_(True)
        y = form(x, b.attn_branch, rows)
        y = form(y, b.mlp_branch, rows)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        outs.append(y.detach())
        gs.append(grads(b, x))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    for g_skip, g_mask in zip(gs[1], gs[0]):
        torch.testing.assert_close(g_skip, g_mask, rtol=1e-10, atol=1e-12)
    # a row dropped from both branches passes through unchanged, with the identity's gradient; a
    # kept row does not (attention mixes tokens, never samples)
    for r in range(8):
        assert torch.equal(outs[1][r], x0[r]) == (r not in rows.tolist())


def test_a_skip_block_draws_its_rows_from_the_seeded_stream_and_matches_the_reference():
    blk = fp64_block(p=0.3).train()
    set_drop_path_mode(blk, "skip")
    x = torch.randn(10, 5, 16, dtype=torch.float64)
    torch.manual_seed(7)
    y = blk(x)
    torch.manual_seed(7)  # the same two draws, in the same order: attention's rows, then the MLP's
    n = dropped_count(10, 0.3)
    r1, r2 = kept_rows(10, n, x.device), kept_rows(10, n, x.device)
    ref = mask_reference(mask_reference(x, blk.attn_branch, r1), blk.mlp_branch, r2)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    torch.manual_seed(7)
    assert torch.equal(blk(x), y)  # seeded: the same rows again


def test_the_dropped_rows_are_a_uniform_draw_of_a_fixed_count():
    torch.manual_seed(0)
    B, n, draws = 8, 2, 4000
    kept = torch.zeros(B)
    for _ in range(draws):
        rows = kept_rows(B, n, "cpu")
        assert rows.numel() == B - n and rows.unique().numel() == B - n
        assert torch.equal(rows, rows.sort().values)
        kept[rows] += 1
    freq = 1 - kept / draws  # each row's dropped fraction: n / B = 0.25, binomial sd 0.0068
    assert (freq - n / B).abs().max() < 5 * (0.25 * 0.75 / draws) ** 0.5, freq


def test_counts_round_and_the_edges_drop_nothing_or_everything():
    assert [dropped_count(256, p) for p in (0.0, 0.001, 0.1, 0.4, 1.0)] == [0, 0, 26, 102, 256]
    x = torch.randn(4, 3, 16)
    branch = lambda t: t * 2 + 1  # noqa: E731
    torch.manual_seed(0)
    assert torch.equal(
        residual(x, branch, 0.1, True, "skip"), x + branch(x)
    )  # round(0.4) = 0: no row
    assert torch.equal(residual(x, branch, 0.9, True, "skip"), x)  # round(3.6) = 4: every row
    for mode in ("mask", "skip"):  # evaluation and rate 0: the branch, whatever the mode
        assert torch.equal(residual(x, branch, 0.5, False, mode), x + branch(x))
        assert torch.equal(residual(x, branch, 0.0, True, mode), x + branch(x))


def test_without_drop_path_both_modes_are_the_same_model_bit_for_bit():
    torch.manual_seed(0)
    a = vit("vit_tiny_patch16", image_size=32, patch_size=8, num_classes=10).train()
    b = set_drop_path_mode(copy.deepcopy(a), "skip")
    x = torch.randn(4, 3, 32, 32)
    assert torch.equal(a(x), b(x))


def test_the_expected_output_is_the_undropped_one():
    """Kept rows scaled by batch / kept: averaged over many draws, each sample's output tends to
    x + branch(x), as the mask form's does."""
    torch.manual_seed(0)
    x = torch.randn(6, 2, 4, dtype=torch.float64)
    branch = lambda t: t.sin()  # noqa: E731
    mean = sum(residual(x, branch, 0.5, True, "skip") for _ in range(6000)) / 6000
    # each draw: x + sin(x) * 2 on the 3 kept rows; the mean's sd per element is |sin(x)| / sqrt(6000)
    assert ((mean - (x + x.sin())).abs() <= 5 * x.sin().abs() / 6000**0.5 + 1e-12).all()


def test_gradient_checkpointing_recomputes_the_same_rows():
    torch.manual_seed(0)
    model = vit(
        "vit_tiny_patch16", image_size=32, patch_size=8, num_classes=10, drop_path=0.5
    ).train()
    set_drop_path_mode(model, "skip")
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    out = []
    for ckpt in (False, True):
        m = copy.deepcopy(model)
        m.set_grad_checkpointing(ckpt)
        torch.manual_seed(3)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        out.append([p.grad for p in m.parameters()])
    for a, b in zip(*out):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_compiled_skip_blocks_compute_the_eager_ones():
    """Static shapes (a fixed count): one graph, the eager result (inductor's random numbers made
    torch's own, so both draw the same rows)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    blk = Block(16, 4, 2.0, drop_path=0.5).train()
    set_drop_path_mode(blk, "skip")
    x = torch.randn(8, 5, 16)
    torch.manual_seed(1)
    want = blk(x)
    with torch._inductor.config.patch(fallback_random=True):
        fn = torch.compile(blk, fullgraph=True)
        torch.manual_seed(1)
        got = fn(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "arch,sets",
    [
        ("vit_tiny_patch16", []),
        ("clip_tiny", ["data.name=synthetic", "data.captions=true"]),
    ],
)
def test_the_tasks_build_every_block_in_the_configured_mode(arch, sets):
    cfg = load_config(
        None,
        [
            f"model.arch={arch}",
            "model.drop_path=0.2",
            "model.drop_path_mode=skip",
            "data.image_size=32",
            "model.patch_size=8",
            *sets,
        ],
    )
    task = build_task(cfg)
    spec = task.build_spec(32, 3, 10)
    model = task.build_model(spec)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert blocks and all(b.drop_path_mode == "skip" for b in blocks)


def test_an_unknown_mode_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="drop_path_mode"):
        load_config(None, ["model.drop_path_mode=drop"])
    with pytest.raises(ValueError, match="unknown drop-path mode"):
        set_drop_path_mode(Block(8, 2, 2.0), "drop")
