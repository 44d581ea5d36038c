"""The blocks of the 2022-2025 encoders as recipe keys (issue 58): each key builds its ViTSpec, the
default recipe's model is unchanged, the training switches (patch dropout, stochastic depth in both
modes, activation checkpointing, compile) work with every block, and what tensor parallelism cannot
split is refused in one line. Loading published weights with them: test_zoo_timm*.py; meshes:
tests/integration/test_mesh_dist.py."""

from dataclasses import replace

import pytest
import torch
from helpers import TINY, run, sets

from vitscale.config import load_config
from vitscale.models.layers import Block, BlockOptions, tp_widths
from vitscale.models.vit import VisionTransformer, ViTSpec
from vitscale.strategy.mesh import MeshShape, tp_refusal

ALL = dict(
    image_size=16,
    patch_size=4,
    dim=32,
    depth=2,
    heads=2,
    mlp_ratio=2.0,
    num_classes=5,
    rope="cat",
    mlp="swiglu",
    act="silu",
    norm="rmsnorm",
    qk_norm=True,
    layer_scale=0.1,
    reg_tokens=1,
    head="map",
    pos_embed=False,
)
VARIANTS = {
    "all": ALL,
    "branches": {**ALL, "parallel": "branches"},
    "fused": {**ALL, "parallel": "fused", "mlp": "mlp", "act": "gelu"},
    "diff": {**ALL, "diff_attn": True, "rope": "", "pos_embed": True},
    "diff_fused": {**ALL, "diff_attn": True, "parallel": "fused", "mlp": "mlp", "rope": ""},
    "packed_dinov3": {**ALL, "mlp": "swiglu_packed", "rope": "dinov3", "head": "pool"},
    "mixed_norms": {**ALL, "rope": "mixed", "attn_norm": True, "mlp_norm": True, "post_norm": True},
    "distilled": dict(ALL, head="token", distilled=True, reg_tokens=0, rope="", pos_embed=True),
}


def model(name: str, dtype=torch.float64) -> VisionTransformer:
    torch.manual_seed(0)
    m = VisionTransformer(ViTSpec(**VARIANTS[name])).to(dtype)
    with torch.no_grad():  # away from the init's exact ones and zeros
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def grads(m, x, seed=1):
    m.zero_grad()
    torch.manual_seed(seed)
    m(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("mode", ["mask", "skip"])
def test_activation_checkpointing_recomputes_the_same_step(name, mode):
    """With patch dropout (the rope following the kept tokens) and stochastic depth in training,
    checkpointed blocks give the same gradients: the recomputation replays the same draws."""
    m = model(name).train()
    m.patch_dropout = 0.5
    for blk in m.blocks:
        blk.drop_path, blk.drop_path_mode = 0.5, mode
    x = torch.randn(6, 3, 16, 16, dtype=torch.float64)
    plain = grads(m, x)
    m.set_grad_checkpointing(True)
    again = grads(m, x)
    assert plain.keys() == again.keys() and len(plain) > 10
    for k in plain:
        torch.testing.assert_close(again[k], plain[k], rtol=1e-12, atol=1e-14)


def test_the_skip_form_hands_the_kept_token_rope_the_same_rows():
    """Stochastic depth's skip form with a per-sample rope (patch dropout's kept tokens): the branch
    of each kept row sees that row's rope, so the sum is the mask form's on the same dropped rows."""
    from vitscale.models.layers import kept_rows, residual

    torch.manual_seed(0)
    blk = Block(16, 2, 2.0, options=BlockOptions(layer_scale=0.5)).double().train()
    for b in (blk,):
        b.attn.rope_prefix = 1
    x = torch.randn(8, 5, 16, dtype=torch.float64)
    rope = torch.randn(8, 1, 4, 16, dtype=torch.float64)  # [B, 1, k, 2 * head_dim]
    torch.manual_seed(3)
    out = residual(x, blk.attn_branch, 0.5, True, "skip", rope)
    torch.manual_seed(3)
    rows = kept_rows(8, 4, x.device)
    want = x.clone()
    for r in rows.tolist():
        want[r] = x[r] + blk.attn_branch(x[r : r + 1], rope[r : r + 1])[0] * 8 / 4
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["all", "packed_dinov3"])
def test_the_blocks_trace_as_one_graph(name):
    """torch.compile(fullgraph=True) traces the model with every block, patch dropout included
    (the eager backend: the trace, not inductor's code generation, is what a block can break)."""
    m = model(name, torch.float32).train()
    m.patch_dropout = 0.5
    x = torch.randn(4, 3, 16, 16)
    torch.manual_seed(1)
    want = m(x)
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    torch.manual_seed(1)
    torch.testing.assert_close(compiled(x), want)


@pytest.mark.parametrize(
    "keys,what",
    [
        (dict(attn_norm=True), "norm of the attention's output"),
        (dict(mlp_norm=True), "norm of the MLP's hidden units"),
        (dict(rope="mixed"), "rope=mixed"),
        (dict(parallel="branches"), "parallel block (BranchesBlock)"),
        (dict(diff_attn=True, rope=""), "differential attention"),
        (dict(parallel="fused", mlp="mlp"), "parallel block (FusedBlock)"),
    ],
)
def test_tensor_parallelism_refuses_what_it_cannot_split_in_one_line(keys, what):
    spec = replace(ViTSpec(**VARIANTS["all"]), **keys)
    with torch.device("meta"):
        widths = tp_widths(VisionTransformer(spec))
    line = tp_refusal(MeshShape(dp_replicate=1, dp_shard=1, tp=2), widths)
    assert line is not None and what in line and "\n" not in line, line
    assert (
        tp_refusal(
            MeshShape(dp_replicate=1, dp_shard=1, tp=2),
            tp_widths(VisionTransformer(ViTSpec(**VARIANTS["all"]))),
        )
        is None
    )


def test_recipe_keys_build_the_spec_and_the_defaults_are_the_2021_vit(tmp_path, capsys):
    from vitscale.tasks.classification import spec_from_arch

    keys = [
        "model.rope=dinov3",
        "model.mlp=swiglu",
        "model.norm=rmsnorm",
        "model.qk_norm=true",
        "model.layer_scale=1e-5",
        "model.reg_tokens=4",
        "model.head=map",
        "model.pos_embed=false",
    ]
    cfg = load_config(TINY, keys)
    spec = spec_from_arch(cfg.model, 8, 1, 4)
    assert (spec.rope, spec.mlp, spec.act, spec.norm, spec.qk_norm) == (
        "dinov3",
        "swiglu",
        "silu",
        "rmsnorm",
        True,
    )
    assert (spec.layer_scale, spec.reg_tokens, spec.head, spec.pos_embed) == (1e-5, 4, "map", False)
    plain = spec_from_arch(load_config(TINY, []).model, 8, 1, 4)
    base = ViTSpec(image_size=8, patch_size=4, in_chans=1, num_classes=4, dim=32, depth=2, heads=2)
    assert plain == replace(base, mlp_ratio=2.0, dim=32)
    # with model.init the weights carry their blocks: a block key is refused by name
    rc, _, err = run(
        capsys, "config", TINY, *sets(["model.init=weights.safetensors", "model.rope=cat"])
    )
    assert rc == 2 and "model.rope with model.init" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "keys",
    [
        {},
        dict(mlp="swiglu"),
        dict(mlp="swiglu_packed"),
        dict(head="map"),
        dict(head="map", pool_prefix=True, pool_heads=2, pool_mlp_ratio=2.0, reg_tokens=2),
        dict(parallel="branches"),
        dict(parallel="fused"),
        dict(distilled=True),
    ],
)  # differential attention: its q k^T and attn @ v as two half-width pairs, the same FLOPs
def test_the_analytic_flops_are_torchs_count(keys):
    """models/flops.py's count (what MFU divides by) against torch's FlopCounterMode, per block."""
    from torch.utils.flop_counter import FlopCounterMode

    from vitscale.models.flops import vit_forward_flops

    spec = ViTSpec(
        image_size=32, patch_size=8, dim=64, depth=2, heads=4, num_classes=7, attention="explicit"
    )
    m = VisionTransformer(replace(spec, **keys)).eval()
    with FlopCounterMode(display=False) as count:
        m(torch.randn(1, 3, 32, 32))
    assert count.get_total_flops() == vit_forward_flops(m.spec)
