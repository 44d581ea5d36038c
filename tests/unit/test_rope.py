"""models/rope.py against timm (issue 58): for every rope configuration a timm eva.py entry point
builds (its keyword arguments read from the entry points themselves), timm's Eva builds its rope
and vitscale builds its own from rope_from_timm_kwargs; timm's state dict loads with strict=True
(RoPE-Mixed's frequencies perturbed first), and the embeddings and the rotated q / k are timm's in
float64 (8 ulps of their size, ~2e-15) and float32 (4 ulps), patch dropout's kept tokens
included (today they agree bit for bit); then the options no timm model uses, the train-time coordinate augmentations,
the spec's refusals and its inverse."""

import pytest
import torch

from vitscale.models.rope import (
    RopeCat,
    RopeDinoV3,
    RopeMixed,
    apply_rope,
    build_rope,
    keep_rope,
    rope_from_timm_kwargs,
    rope_to_timm_kwargs,
)

timm = pytest.importorskip("timm")
eva = pytest.importorskip("timm.models.eva")
sincos = pytest.importorskip("timm.layers.pos_embed_sincos")

GRID = (6, 9)  # not square: the two axes cannot stand in for each other
ARCH = ("embed_dim", "num_heads", "class_token", "num_reg_tokens", "dynamic_img_size")


def eva_entry_kwargs() -> dict[str, dict]:
    """The keyword arguments each timm eva.py entry point passes to _create_eva."""

    class Captured(Exception):
        pass

    captured = {}

    def capture(variant, pretrained=False, **kwargs):
        captured[variant] = kwargs
        raise Captured

    real = eva._create_eva
    eva._create_eva = capture
    try:
        for name in timm.list_models(module="eva"):
            try:
                timm.models.model_entrypoint(name)()
            except Captured:
                pass
    finally:
        eva._create_eva = real
    return captured


def rope_configs() -> tuple[dict[str, tuple[dict, int, int, bool]], dict[str, str]]:
    """One entry point per distinct (rope arguments, head_dim, prefix tokens, dynamic size):
    name -> (rope kwargs, head_dim, num_prefix_tokens, dynamic_img_size); and for every entry
    point with a rope, the one that stands for it."""
    out, stands_for, seen = {}, {}, {}
    for name, kw in sorted(eva_entry_kwargs().items()):
        if not kw.get("use_rot_pos_emb"):
            continue
        rope_kw = {k: v for k, v in kw.items() if k.startswith("rope_") or k == "ref_feat_shape"}
        rope_kw["use_rot_pos_emb"] = True
        head_dim = kw["embed_dim"] // kw["num_heads"]
        prefix = (kw.get("class_token", True) is not False) + (kw.get("num_reg_tokens") or 0)
        dynamic = bool(kw.get("dynamic_img_size"))
        key = (repr(sorted(rope_kw.items())), head_dim, prefix, dynamic)
        if key not in seen:
            seen[key] = name
            out[name] = (rope_kw, head_dim, prefix, dynamic)
        stands_for[name] = seen[key]
    return out, stands_for


CONFIGS, STANDS_FOR = rope_configs()


def tiny_eva(rope_kw: dict, head_dim: int, prefix: int, dynamic: bool, dtype=torch.float32):
    """timm's Eva with this rope (two heads, two blocks, a 6 x 9 grid of 2-pixel patches)."""
    return eva.Eva(
        img_size=(GRID[0] * 2, GRID[1] * 2), patch_size=2, embed_dim=2 * head_dim, depth=2,
        num_heads=2, mlp_ratio=1.0, class_token=prefix > 0, num_reg_tokens=max(prefix - 1, 0),
        dynamic_img_size=dynamic, dtype=dtype, **rope_kw,
    )  # fmt: skip


def timm_rope_of(model) -> torch.Tensor:
    """The rope tensor Eva._pos_embed computes for its grid."""
    if model.dynamic_img_size:
        return model.rope.get_embed(shape=GRID)
    return model.rope.get_embed()


def timm_rotate(q: torch.Tensor, rope: torch.Tensor, prefix: int, half: bool) -> torch.Tensor:
    """EvaAttention's rotation of q (or k), timm's code."""
    rotated = sincos.apply_rot_embed_cat(q[:, :, prefix:, :], rope, half=half)
    return torch.cat([q[:, :, :prefix, :], rotated], dim=2)


def vitscale_rope(rope_kw: dict, head_dim: int, timm_model, dtype: torch.dtype):
    """vitscale's rope for these timm arguments, holding timm's (perturbed) state dict."""
    variant, options = rope_from_timm_kwargs(rope_kw)
    mine = build_rope(variant, head_dim, 2, 2, **options)
    if variant == "mixed":
        with torch.no_grad():  # learned: make timm's differ from any fresh draw
            timm_model.rope.freqs.add_(0.01 * torch.randn_like(timm_model.rope.freqs))
    mine.load_state_dict(timm_model.rope.state_dict(), strict=True)
    return variant, mine.to(dtype)


def close(a: torch.Tensor, b: torch.Tensor, ulps: float) -> None:
    """|a - b| <= ulps * eps(dtype) * max|b| elementwise, dtypes equal."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    bound = ulps * torch.finfo(b.dtype).eps * b.abs().max().item()
    assert (a - b).abs().max().item() <= bound


def check_against_timm(name: str, dtype: torch.dtype, ulps: float, keep: bool = False) -> None:
    rope_kw, head_dim, prefix, dynamic = CONFIGS[name]
    torch.manual_seed(0)
    # "cat" in float64: timm's fixed-size Eva computes its rope in float32 at build and a float64
    # copy of the model (.double()) keeps those values; vitscale's RopeCat keeps float32 bands
    cat64 = dtype == torch.float64 and rope_kw.get("rope_type", "cat") == "cat" and not dynamic
    build = torch.float32 if cat64 else dtype
    model = tiny_eva(rope_kw, head_dim, prefix, dynamic or build == torch.float64, build).eval()
    variant, mine = vitscale_rope(rope_kw, head_dim, model, dtype)
    mine.eval()  # Sapiens2 augments its dinov3 coordinates in training
    if cat64:
        theirs = timm_rope_of(model).to(dtype)
    elif dtype == torch.float32:
        theirs = timm_rope_of(model)
    else:
        theirs = model.rope.get_embed(GRID, dtype)
    ours = mine.get_embed(GRID, dtype if dtype == torch.float64 else None)
    close(ours, theirs, ulps)
    n = GRID[0] * GRID[1]
    q = torch.randn(3, 2, prefix + n, head_dim, dtype=dtype) * 3
    if keep:  # patch dropout: 4 of the n patch tokens per sample, as timm's _pos_embed then
        idx = torch.stack([torch.randperm(n)[:4] for _ in range(3)])
        theirs = sincos.apply_keep_indices_nlc(q, theirs, idx)
        theirs = theirs.transpose(0, 1) if variant == "mixed" else theirs.unsqueeze(1)
        ours = keep_rope(ours, idx)
        close(ours, theirs, 0)
        q = torch.cat([q[:, :, :prefix], q[:, :, prefix:][:, :, :4]], dim=2)
    half = bool(rope_kw.get("rope_rotate_half", False))
    for block in range(2) if variant == "mixed" else [None]:
        a, b = (ours, theirs) if block is None else (ours[block], theirs[block])
        close(apply_rope(q, a, prefix, half), timm_rotate(q, b, prefix, half), ulps)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_eva_rope_is_timms_in_float64(name):
    check_against_timm(name, torch.float64, 8)  # 8 ulps of float64: ~2e-15 of the size


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_eva_rope_is_timms_in_float32(name):
    check_against_timm(name, torch.float32, 4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_patch_dropout_keeps_the_rope_of_the_kept_tokens(name):
    check_against_timm(name, torch.float32, 4, keep=True)


def test_the_configurations_cover_every_variant_and_model_group():
    variants = {rope_from_timm_kwargs(kw)[0] for kw, *_ in CONFIGS.values()}
    assert variants == {"cat", "mixed", "dinov3"}
    names = " ".join(STANDS_FOR)  # every entry point with a rope, by the one tested for it
    for group in ("eva02_", "_rope_reg", "vit_pe_core", "vit_pe_lang", "vit_pe_spatial", "dinov3"):
        assert group in names, group
    assert len(STANDS_FOR) >= 50 and set(STANDS_FOR.values()) == set(CONFIGS)


def test_the_kept_rope_rotates_like_the_full_one_gathered():
    """Patch dropout: rotating the kept tokens with keep_rope's rope gives the rotated full
    sequence's kept rows (class token untouched)."""
    torch.manual_seed(1)
    rope = RopeCat(16, grid_indexing="xy").get_embed(GRID)
    q = torch.randn(2, 3, 1 + 54, 16)
    keep = torch.stack([torch.randperm(54)[:7] for _ in range(2)])
    kept_q = torch.cat(
        [q[:, :, :1], q[:, :, 1:].gather(2, keep[:, None, :, None].expand(-1, 3, -1, 16))], 2
    )
    full = apply_rope(q, rope, 1)
    want = torch.cat(
        [full[:, :, :1], full[:, :, 1:].gather(2, keep[:, None, :, None].expand(-1, 3, -1, 16))], 2
    )
    torch.testing.assert_close(apply_rope(kept_q, keep_rope(rope, keep), 1), want, rtol=0, atol=0)


DIRECT = [  # options no timm eva model uses, against timm's classes built directly
    ("cat", dict(in_pixels=True), dict(in_pixels=True)),
    ("cat", dict(in_pixels=True, linear_bands=True, max_res=64), dict(in_pixels=True, linear_bands=True, max_res=64)),
    ("cat", dict(in_pixels=False, rotate_half=True, grid_offset=0.5, temperature=100.0),
     dict(in_pixels=False, rotate_half=True, grid_offset=0.5, temperature=100.0)),
    ("cat", dict(in_pixels=False, ref_feat_shape=(4, 5), grid_indexing="xy"),
     dict(in_pixels=False, ref_feat_shape=(4, 5), grid_indexing="xy")),
    ("dinov3", dict(normalize_coords="max", rotate_half=False, grid_indexing="xy"),
     dict(normalize_coords="max", rotate_half=False, grid_indexing="xy")),
    ("dinov3", dict(normalize_coords="min", min_period=0.5, max_period=50.0, temperature=None),
     dict(normalize_coords="min", min_period=0.5, max_period=50.0, temperature=None)),
    ("mixed", dict(grid_indexing="ij", temperature=100.0), dict(grid_indexing="ij", temperature=100.0)),
]  # fmt: skip


def timm_direct(variant: str, kw: dict, head_dim: int = 16, dtype=None):
    if variant == "mixed":
        return sincos.RotaryEmbeddingMixed(head_dim * 2, depth=3, num_heads=2, dtype=dtype, **kw)
    cls = sincos.RotaryEmbeddingCat if variant == "cat" else sincos.RotaryEmbeddingDinoV3
    return cls(head_dim, dtype=dtype, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("variant,theirs_kw,ours_kw", DIRECT)
def test_options_no_eva_model_uses(variant, theirs_kw, ours_kw, dtype):
    torch.manual_seed(0)
    # "cat" keeps float32 bands in a float64 model, as timm's fixed-size Eva computes its rope in
    # float32 whatever the model's dtype later: its float64 embedding is timm's float32 class's
    theirs = timm_direct(variant, theirs_kw, dtype=torch.float32 if variant == "cat" else dtype)
    ours = build_rope(variant, 16, 2, 3, **ours_kw).to(dtype)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    for grid in (GRID, (5, 5)):
        close(ours.get_embed(grid, dtype), theirs.get_embed(grid, dtype), 8)


AUGS = dict(shift_coords=0.3, jitter_coords=1.5, rescale_coords=2.0)


@pytest.mark.parametrize("variant", ["cat", "mixed", "dinov3"])
def test_coordinate_augmentations_draw_as_timms_in_training_only(variant):
    """Sapiens2 trains its dinov3 rope with rescale_coords=2; timm applies the augmentations of
    every variant in training only, with the same draws from the same seed."""
    kw = dict(in_pixels=False) if variant == "cat" else {}
    torch.manual_seed(0)
    theirs = timm_direct(variant, kw | AUGS)
    ours = build_rope(variant, 16, 2, 3, **kw, **AUGS)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    for seed in (1, 2):
        torch.manual_seed(seed)
        want = theirs.train().get_embed(GRID)
        torch.manual_seed(seed)
        close(ours.train().get_embed(GRID), want, 0)
    plain = build_rope(variant, 16, 2, 3, **kw)
    plain.load_state_dict(ours.state_dict())
    close(ours.eval().get_embed(GRID), plain.get_embed(GRID), 0)
    assert not torch.equal(ours.train().get_embed(GRID), plain.get_embed(GRID))


def test_state_dict_names_and_persistence_are_timms():
    for variant, theirs in [
        ("cat", timm_direct("cat", dict(in_pixels=False))),
        ("mixed", timm_direct("mixed", {})),
        ("dinov3", timm_direct("dinov3", {})),
    ]:
        ours = build_rope(variant, 16, 2, 3)
        assert set(ours.state_dict()) == set(theirs.state_dict())
        assert {n for n, _ in ours.named_parameters()} == {n for n, _ in theirs.named_parameters()}
        assert {n for n, _ in ours.named_buffers()} <= {n for n, _ in theirs.named_buffers()}


def test_mixed_initial_frequencies_are_timms_draw():
    torch.manual_seed(3)
    theirs = sincos.RotaryEmbeddingMixed(64, depth=3, num_heads=4, temperature=10.0)
    torch.manual_seed(3)
    ours = RopeMixed(16, depth=3, num_heads=4, temperature=10.0)
    torch.testing.assert_close(ours.freqs, theirs.freqs, rtol=0, atol=0)
    assert ours.no_weight_decay() == theirs.no_weight_decay()


def test_half_precision_keeps_the_frequencies_in_float32():
    for ours, theirs in [
        (RopeCat(16), timm_direct("cat", dict(in_pixels=False))),
        (RopeDinoV3(16), timm_direct("dinov3", {})),
    ]:
        ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
        name = "bands" if isinstance(ours, RopeCat) else "periods"
        assert getattr(ours, name).dtype == torch.float32
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=0, atol=0)
        want = theirs.get_embed(GRID, torch.bfloat16)
        torch.testing.assert_close(ours.get_embed(GRID, torch.bfloat16), want, rtol=0, atol=0)


def test_a_float64_fixed_size_eva_caches_a_float32_cat_rope():
    """timm's fixed-size Eva computes its 'cat' cache in float32 even in float64; the same tensor
    comes from a float32 RopeCat asked for float64 (a float64 one computes in float64)."""
    rope_kw, head_dim, prefix, _ = CONFIGS["eva02_base_patch14_224"]
    model = tiny_eva(rope_kw, head_dim, prefix, False, torch.float64)
    variant, options = rope_from_timm_kwargs(rope_kw)
    ours = build_rope(variant, head_dim, 2, 2, **options)
    close(ours.get_embed(GRID, torch.float64), model.rope.get_embed(), 0)


def test_spec_round_trips_for_every_eva_model():
    for name, kw in eva_entry_kwargs().items():
        spec = rope_from_timm_kwargs(kw)
        if spec is None:
            assert not kw.get("use_rot_pos_emb"), name
            continue
        back = rope_to_timm_kwargs(*spec)
        assert rope_from_timm_kwargs(back) == spec, name
        for key, value in kw.items():  # what the entry point says, the export says
            if key in back and not (spec[0] != "cat" and key == "ref_feat_shape"):
                assert back[key] == value, (name, key)


def test_spec_refusals_are_one_line():
    bad_from = [
        (dict(use_rot_pos_emb=True, rope_type="mrope"), "mrope"),
        (dict(use_rot_pos_emb=True, rope_type=None), "None"),
        (dict(use_rot_pos_emb=True, rope_type="mixed", rope_rotate_half=True), "rotate_half"),
        (dict(use_rot_pos_emb=True, rope_frobnicate=1), "rope_frobnicate"),
    ]
    for kw, word in bad_from:
        with pytest.raises(ValueError, match=word) as err:
            rope_from_timm_kwargs(kw)
        assert "\n" not in str(err.value)
    assert rope_from_timm_kwargs(dict(rope_type="mrope")) is None  # no rope at all
    for variant, options, word in [
        ("cat", dict(in_pixels=True), "in_pixels"),
        ("dinov3", dict(normalize_coords="max"), "normalize_coords"),
        ("mixed", dict(grid_offset=1.0), "grid_offset"),
        ("mrope", {}, "mrope"),
    ]:
        with pytest.raises(ValueError, match=word):
            rope_to_timm_kwargs(variant, options)
    with pytest.raises(ValueError, match="divisible by 4"):
        RopeCat(18)


def test_eva_mapping_per_model_group():
    kw = {name: rope_from_timm_kwargs(eva_entry_kwargs()[name]) for name in [
        "eva02_base_patch14_224", "vit_pe_core_large_patch14_336", "vit_base_patch16_rope_224",
        "vit_base_patch16_rope_mixed_224", "vit_large_patch16_dinov3",
    ]}  # fmt: skip
    cat = dict(in_pixels=False, rotate_half=False, shift_coords=None, jitter_coords=None)
    cat |= dict(rescale_coords=None, temperature=10000.0)
    assert kw["eva02_base_patch14_224"] == (
        "cat", cat | dict(grid_offset=0.0, grid_indexing="ij", ref_feat_shape=(16, 16)),
    )  # fmt: skip
    assert kw["vit_pe_core_large_patch14_336"] == (
        "cat", cat | dict(grid_offset=1.0, grid_indexing="xy", ref_feat_shape=(24, 24)),
    )  # fmt: skip
    assert kw["vit_base_patch16_rope_224"] == (
        "cat",
        cat | dict(grid_offset=0.0, grid_indexing="xy", ref_feat_shape=None, temperature=100.0),
    )
    assert kw["vit_base_patch16_rope_mixed_224"][0] == "mixed"
    assert kw["vit_base_patch16_rope_mixed_224"][1]["temperature"] == 10.0
    assert kw["vit_large_patch16_dinov3"][0] == "dinov3"
    assert kw["vit_large_patch16_dinov3"][1]["rotate_half"] is True


def test_reset_parameters_fills_a_module_made_on_meta():
    for variant in ("cat", "mixed", "dinov3"):
        with torch.device("meta"):
            meta = build_rope(variant, 16, 2, 3)
        meta.to_empty(device="cpu")
        meta.reset_parameters()
        fresh = build_rope(variant, 16, 2, 3)
        fresh.load_state_dict(meta.state_dict())  # mixed: the learned part is a fresh draw
        close(meta.get_embed(GRID), fresh.get_embed(GRID), 0)
        assert torch.isfinite(meta.get_embed(GRID)).all()
