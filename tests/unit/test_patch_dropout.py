"""FLIP's patch dropout (model.patch_dropout, issue 43), as OpenCLIP's PatchDropout: the kept count,
the class token kept, the position embeddings added before the draw, a model given only the kept
tokens computing the same function, evaluation on every token, 0 as the model without it, the
unmasked tail (model.patch_dropout_until), the FLOPs a masked step computes, OpenCLIP's own module
given the same seed, gradient checkpointing and compile, and a CLIP run of each loss."""

import copy
import json
from dataclasses import replace

import pytest
import torch
from helpers import interrupted_copy, last_state, sets
from torch.utils.flop_counter import FlopCounterMode

from vitscale.cli import main
from vitscale.config import ConfigError, capture_refusal, check, load_config
from vitscale.models import (
    CLIP,
    VisionTransformer,
    ViTSpec,
    clip_forward_flops,
    kept_patches,
    resolve_clip_spec,
    set_patch_dropout,
    vit_forward_flops,
)
from vitscale.models.vit import drop_patches
from vitscale.tasks import build_task
from vitscale.tasks.patch_dropout import first_unmasked_epoch, masked_epoch

CLIP_TINY = "configs/tests/clip_tiny.toml"


def fp64_vit(head="token", pre_norm=True, seed=0, **kw) -> VisionTransformer:
    torch.manual_seed(seed)
    spec = ViTSpec(
        image_size=16, patch_size=4, num_classes=5, dim=16, depth=2, heads=2, mlp_ratio=2.0,
        head=head, pre_norm=pre_norm, **kw,
    )  # fmt: skip
    m = VisionTransformer(spec).double()
    with torch.no_grad():  # position embeddings and class token far from their small init
        m.pos_embed.normal_()
        if m.cls_token is not None:
            m.cls_token.normal_()
    return m


def tokens_in(model, x):
    """The tokens that enter norm_pre (OpenCLIP's ln_pre) in one forward."""
    seen = []
    h = model.norm_pre.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    out = model(x)
    h.remove()
    return seen[0], out


# -- the count and the draw -------------------------------------------------------------------------
def test_the_kept_count_is_open_clips():
    """OpenCLIP: num_patches_keep = max(1, int(num_tokens * (1 - prob))), the class token apart."""
    for n, p, want in [
        (196, 0.5, 98), (196, 0.75, 49), (64, 0.5, 32), (64, 0.75, 16), (49, 0.5, 24),
        (64, 0.7, 19), (4, 0.99, 1), (16, 0.0, 16), (49, 0.9, 4),
    ]:  # fmt: skip
        assert kept_patches(n, p) == want == max(1, int(n * (1 - p))), (n, p)


def test_the_class_token_is_kept_and_the_patches_carry_their_own_position():
    """Every token that reaches the blocks is the class token (first, with its position) or a distinct
    patch with its own position embedding added before the draw."""
    m = set_patch_dropout(fp64_vit(), 0.5).train()
    x = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    seen, _ = tokens_in(m, x)
    assert seen.shape == (3, 1 + 8, 16)  # 16 patches, 8 kept
    cls = (m.cls_token + m.pos_embed[:, :1])[0, 0]
    full = m.patch_embed(x) + m.pos_embed[:, 1:]  # [B, 16, D]
    for b in range(3):
        assert torch.equal(seen[b, 0], cls)
        idx = [int((full[b] == t).all(-1).nonzero()) for t in seen[b, 1:]]
        assert len(set(idx)) == 8  # distinct patches, each equal to one with its own position


def test_a_model_given_only_the_kept_tokens_computes_the_same():
    """The masked forward against a naive reference: each sample's kept tokens gathered by hand (in
    position order) and run through the blocks alone, fp64; heads: class token, and the mean of
    the kept patch tokens."""
    for head in ("token", "pool"):
        m = set_patch_dropout(fp64_vit(head=head, class_token=True), 0.75).train()
        x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
        torch.manual_seed(7)
        got = m(x)
        torch.manual_seed(7)  # the same draw: the top 4 of Gaussian noise over the 16 patches
        keep = torch.randn(4, 16).topk(4, dim=-1).indices
        want = []
        for b in range(4):
            kept = keep[b].sort().values
            t = m.patch_embed(x[b : b + 1]) + m.pos_embed[:, 1:]
            t = torch.cat([m.cls_token + m.pos_embed[:, :1], t[:, kept]], dim=1)
            t = m.norm_pre(t)
            for blk in m.blocks:
                t = blk(t)
            want.append(m.forward_head(m.norm(t)))
        torch.testing.assert_close(got, torch.cat(want), rtol=1e-12, atol=1e-12)


def test_drop_patches_keeps_every_prefix_token_and_works_without_one():
    x = torch.randn(2, 3 + 10, 4)
    torch.manual_seed(0)
    y = drop_patches(x, 3, 0.5)
    assert y.shape == (2, 3 + 5, 4) and torch.equal(y[:, :3], x[:, :3])
    torch.manual_seed(0)
    z = drop_patches(x[:, 3:], 0, 0.5)  # no class token (head=pool): only patches, the same draw
    assert torch.equal(z, y[:, 3:])


def test_evaluation_sees_every_token_and_zero_is_the_model_without_it():
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    plain, masked = fp64_vit(), set_patch_dropout(fp64_vit(), 0.5)
    seen, out = tokens_in(masked.eval(), x)
    assert seen.shape[1] == 17 and torch.equal(out, plain.eval()(x))
    zero = set_patch_dropout(fp64_vit(), 0.0).train()
    rng = torch.get_rng_state()
    assert torch.equal(zero(x), plain.train()(x))
    assert torch.equal(
        torch.get_rng_state(), rng
    )  # p = 0 draws nothing: the run's stream unchanged
    assert set(zero.state_dict()) == set(plain.state_dict())
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        set_patch_dropout(plain, 1.0)


@pytest.mark.parametrize("arch,sets_", [("vit_pico", []), ("clip_tiny", ["data.captions=true"])])
def test_zero_builds_the_model_of_today_bit_for_bit(arch, sets_):
    """The tasks' models with model.patch_dropout=0 (the default) and without the key: the same
    weights, the same training forward, nothing drawn."""
    base = [f"model.arch={arch}", "data.name=synthetic", "data.image_size=16", "model.patch_size=4"]
    outs = []
    for extra in ([], ["model.patch_dropout=0"]):
        # a recipe without the key (the default one drops a quarter since issue 50)
        task = build_task(load_config("configs/tests/tiny.toml", base + sets_ + extra))
        torch.manual_seed(0)
        model = task.build_model(task.build_spec(16, 3, 10)).train()
        x = torch.randn(2, 3, 16, 16)
        vis = model.visual if arch.startswith("clip") else model
        outs.append((model.state_dict(), vis(x)))
    assert all(torch.equal(a, b) for a, b in zip(outs[0][0].values(), outs[1][0].values()))
    assert torch.equal(outs[0][1], outs[1][1])


# -- OpenCLIP itself ---------------------------------------------------------------------------------
def test_open_clips_patch_dropout_gives_the_same_features_from_the_same_seed():
    """OpenCLIP's CLIP with patch_dropout and vitscale's from its weights, in training mode: the same
    seed draws the same kept tokens (both take the top-k of Gaussian noise on the CPU generator)."""
    open_clip = pytest.importorskip("open_clip")  # needs torchvision (tv_cpu_stub on a CPU torch)
    from vitscale.interop import from_open_clip

    cfg = dict(
        embed_dim=16,
        vision_cfg=dict(
            image_size=32, patch_size=8, width=32, layers=2, head_width=16, patch_dropout=0.5
        ),
        text_cfg=dict(context_length=16, vocab_size=64, width=32, heads=2, layers=2),
    )
    torch.manual_seed(0)
    theirs = open_clip.CLIP(**cfg)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name != "logit_scale":
                p.normal_(0, 0.1)
    ours = from_open_clip(theirs.state_dict(), quick_gelu=False, vision_heads=2, text_heads=2)
    set_patch_dropout(ours, 0.5)
    x = torch.randn(3, 3, 32, 32)
    out = []
    for model, kw in ((theirs, {}), (ours, {"normalize": False})):
        torch.manual_seed(11)
        with torch.no_grad():
            out.append(model.train().encode_image(x, **kw))
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # and in evaluation both see every token
        torch.testing.assert_close(
            ours.eval().encode_image(x, normalize=False), theirs.eval().encode_image(x)
        )


# -- FLOPs, checkpointing, compile -------------------------------------------------------------------
def test_the_flops_of_a_masked_step_are_what_torch_counts():
    spec = resolve_clip_spec(
        "clip_tiny",
        vision=dict(image_size=16, patch_size=4, attention="explicit"),
        text=dict(context_length=12, attention="explicit"),
    )
    m = set_patch_dropout(CLIP(spec), 0.75).train()
    x, t = torch.randn(3, 3, 16, 16), torch.randint(1, 100, (3, 12))
    with FlopCounterMode(display=False) as fc:
        m(x, t)
    assert fc.get_total_flops() == 3 * clip_forward_flops(spec, patch_dropout=0.75)
    assert clip_forward_flops(spec, patch_dropout=0.75) < clip_forward_flops(spec)
    v = replace(spec.vision, num_classes=10)
    assert vit_forward_flops(v, 0.0) == vit_forward_flops(v)


def test_the_run_counts_the_masked_and_unmasked_epochs_flops():
    base = ["model.arch=clip_tiny", "data.name=synthetic", "data.captions=true", "train.epochs=4"]
    flops = {}
    for pd, until in ((0, 1), (0.5, 1), (0.5, 0.5)):
        task = build_task(
            load_config(
                None, base + [f"model.patch_dropout={pd}", f"model.patch_dropout_until={until}"]
            )
        )
        flops[pd, until] = task.flops(task.build_spec(32, 3, 4))
    full, masked = flops[0, 1], flops[0.5, 1]
    assert masked < full and flops[0.5, 0.5] == round((full + masked) / 2)


def test_gradient_checkpointing_keeps_the_draw():
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    res = []
    for ckpt in (False, True):
        m = set_patch_dropout(fp64_vit(), 0.5).train()
        m.set_grad_checkpointing(ckpt)
        torch.manual_seed(3)
        y = m(x)
        y.sum().backward()
        res.append((y.detach(), [p.grad for p in m.parameters()]))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=0, atol=0)
    for a, b in zip(res[0][1], res[1][1]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_a_fullgraph_compile_draws_the_same_tokens():
    """Static shapes (a fixed count) and tensor ops only: one graph (fullgraph), the eager result.
    aot_eager runs torch's own kernels; inductor's compiled step is trained in
    tests/integration/test_patch_dropout_dist.py (train.compile=true)."""
    torch._dynamo.reset()
    m = set_patch_dropout(fp64_vit(), 0.5).float().train()
    x = torch.randn(4, 3, 16, 16)
    torch.manual_seed(5)
    want = m(x)
    fn = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    got = fn(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


# -- the tail, the config, training runs ------------------------------------------------------------
def test_the_tail_starts_at_the_first_epoch_that_would_end_past_the_fraction():
    assert [masked_epoch(e, 6, 0.9) for e in range(6)] == [True] * 5 + [False]
    assert first_unmasked_epoch(6, 0.9) == 5 and first_unmasked_epoch(6, 1.0) is None
    assert first_unmasked_epoch(9.4, 1.0) is None  # a partial last epoch stays masked
    assert first_unmasked_epoch(10, 0.75) == 7 and first_unmasked_epoch(4, 0.0) == 0
    task = build_task(
        load_config(
            None,
            ["model.arch=clip_tiny", "data.name=synthetic", "data.captions=true", "train.epochs=4",
             "model.patch_dropout=0.5", "model.patch_dropout_until=0.5", "run.progress=off"],
        )
    )  # fmt: skip
    model = task.build_model(task.build_spec(32, 3, 4))
    assert model.visual.patch_dropout == 0.5
    for epoch, want in ((1, 0.5), (2, 0.0), (3, 0.0), (0, 0.5)):  # (0: a run resumed before it)
        task.patch_dropout.set_epoch(epoch)
        assert model.visual.patch_dropout == want, epoch


def test_config_refuses_a_full_drop_and_a_captured_switch_in_one_line():
    with pytest.raises(ConfigError, match=r"model.patch_dropout must be < 1") as e:
        check(load_config(None, ["model.patch_dropout=1"]))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="must be <= 1"):
        load_config(None, ["model.patch_dropout=1.5"])
    adamw = ["optim.name=adamw"]  # the default recipe's Muon is refused by the capture first
    cfg = load_config(None, [*adamw, "model.patch_dropout=0.5", "model.patch_dropout_until=0.8"])
    assert "patch_dropout_until" in capture_refusal(cfg)
    assert capture_refusal(load_config(None, [*adamw, "model.patch_dropout=0.5"])) is None
    with pytest.raises(ConfigError, match="patch_dropout_until < 1"):
        check(load_config(None, [*adamw, "model.patch_dropout=0.5", "model.patch_dropout_until=0.8",
                                 "train.capture=step"]))  # fmt: skip


def run(out, *extra):
    assert main(["train", CLIP_TINY, "--out", str(out), *sets(["run.threads=1", *extra])]) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("loss", ["openclip", "fastclip_v3"])  # v0-v2: test_patch_dropout_dist.py
def test_every_loss_trains_with_patch_dropout_and_its_tail(tmp_path, loss, capsys):
    s = run(
        tmp_path / "r",
        f"clip.loss={loss}",
        "model.patch_dropout=0.5",
        "model.patch_dropout_until=0.5",
        "run.progress=plain",
    )
    err = capsys.readouterr().err
    assert "patch dropout 0.5 in training until epoch 1 (then every token): 2 of 4 patch" in err
    assert err.count("patch dropout off from epoch 1") == 1
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if r["kind"] == "train")
    assert s["steps"] == 8 and 0 <= s["retrieval_r1"] <= 1


def test_a_resume_that_turns_patch_dropout_off_is_the_run_with_that_tail(tmp_path):
    """Stopped after epoch 0 of a masked run and resumed with model.patch_dropout=0: bit-equal to
    one run whose tail starts at epoch 1 (the same draws in epoch 0, none after)."""
    tail = tmp_path / "tail"
    run(tail, "model.patch_dropout=0.5", "model.patch_dropout_until=0.5")
    full = tmp_path / "full"
    run(full, "model.patch_dropout=0.5", "run.checkpoint_every=4", "run.keep_last=10")
    part = interrupted_copy(full, tmp_path / "part", step=4)
    assert main(["train", "--resume", str(part), "--set", "model.patch_dropout=0"]) == 0
    a, b = last_state(part)["strategy"]["model"], last_state(tail)["strategy"]["model"]
    assert all(torch.equal(a[k], b[k]) for k in b)
    c = last_state(full)["strategy"]["model"]  # the masked epoch 1 differs: the switch took effect
    assert not all(torch.equal(c[k], b[k]) for k in b)


def test_a_copy_keeps_the_rate():
    m = set_patch_dropout(fp64_vit(), 0.5)
    assert copy.deepcopy(m).patch_dropout == 0.5
