"""The timm zoo sweep: every model configuration of timm's `vision_transformer` and `deit` modules
(plus a few argument variants a user passes to timm.create_model), built by timm at one block with
random weights on a 2x2 patch grid, is either

- exact: vitscale's ViT built from the weights and the hub-style config.json that timm itself
  writes for them (`save_config_for_hf`: architecture, model_args, pretrained_cfg; what a user
  downloads with the weights) gives timm's logits within 1e-5 in fp32, and its timm export (the
  state dict and timm_hub_config's architecture + model_args) loads back into timm strictly and gives
  timm's logits bit for bit; or
- refused in one line that names the real cause (a keyword per kind below).

Nothing may be silently different. The same weights without config.json or name (the keys alone)
are exact, another function announced in one warning line naming the assumptions, or refused with
the cause. Needs timm (skipped otherwise; CI installs it)."""

import collections
import time
import zlib

import pytest
import torch

from vitscale.errors import UserError

try:  # timm imports torchvision, whose CUDA build does not import on a CPU torch without the stub
    import timm
    from timm.models._hub import save_config_for_hf

    HAVE_TIMM = True
except Exception:
    HAVE_TIMM = False

pytestmark = pytest.mark.skipif(
    not HAVE_TIMM,
    reason="timm does not import here (pip install timm torchvision, "
    "and ../shared/tools/tv_cpu_stub on a CPU torch)",
)

# the causes a refusal may give, by kind (the first keyword found in the message names its kind)
CAUSES = {
    "distillation token": "distillation token",
    "attention pooling": "attention pooling",
    "differential attention": "differential attention",
    "parallel blocks": "parallel blocks",
    "parallel attention and MLP": "parallel attention and MLP",
    "gated MLP": "a gated MLP",
    "norms inside attention and MLP": "norms inside attention",
    "RMSNorm": "RMSNorm",
    "post-norm blocks": "post-norm blocks",
    "q/k normalization": "q/k normalization",
    "patch-embedding norm": "patch-embedding norm",
}
# arguments users give timm.create_model that make other functions of the same weights' layout
VARIANTS = [
    ("vit_base_patch16_224", dict(global_pool="avg")),  # class token + average, fc_norm
    ("vit_base_patch16_224", dict(global_pool="avg", fc_norm=False)),
    ("vit_small_patch16_224", dict(class_token=False, global_pool="avg")),
    ("vit_small_patch16_224", dict(qkv_bias=False, final_norm=False, act_layer="gelu_tanh")),
    ("vit_small_patch16_224", dict(reg_tokens=2, init_values=0.1, global_pool="avg")),
]
# must be exact (each was silently different, or refused for a variant vitscale now computes)
MUST_BE_EXACT = [
    "vit_base_patch16_gap_224",
    "vit_giant_patch14_224",
    "vit_gigantic_patch14_224",
    "vit_so400m_patch14_siglip_gap_224",
    "vit_base_patch32_siglip_gap_256",
    "eva_large_patch14_196",
    "vit_base_patch16_clip_224",
    "vit_base_patch32_clip_quickgelu_224",
    "deit3_small_patch16_224",
    "vit_small_patch14_reg4_dinov2",
    "vit_base_patch16_224_miil",
    "vit_base_patch16_radio_v3",
    "test_vit",
    "vit_base_patch16_224+global_pool=avg",
    # issue 58: the blocks of the 2022-2025 encoders
    "deit_base_distilled_patch16_224",  # distillation token and second head
    "vit_base_patch16_siglip_224",  # SigLIP's MAP head
    "vit_so400m_patch14_siglip_224",
    "aimv2_large_patch14_224",  # RMSNorm, SwiGLU, a patch-embedding norm, no projection biases
    "vit_giant_patch14_dinov2",  # packed SwiGLU
    "vit_base_patch16_rpn_224",  # post-norm blocks
    "beit3_base_patch16_224",  # norms inside attention and MLP
    "test_vit3",  # MAP over the class and register tokens
    "test_vit4",  # RMSNorm by name
    "vit_small_patch16_18x2_224",  # parallel blocks (ParallelThingsBlock)
    "vit_base_patch16_xp_224",  # parallel attention and MLP (ParallelScalingBlock)
    "vit_dwee_patch16_reg1_gap_256",  # differential attention
    "vit_dpwee_patch16_reg1_gap_256",  # ... in parallel blocks
]
MUST_BE_REFUSED: dict[str, str] = {}


def configurations(scope: str = "all"):
    """Every configuration (`all`), or the quick subset of the fast tier (`quick`: the ones that
    must be exact or refused, and the argument variants)."""
    names = timm.list_models(module="vision_transformer") + timm.list_models(module="deit")
    if scope == "quick":
        names = [n for n in [*MUST_BE_EXACT, *MUST_BE_REFUSED] if n in names]
    return [(n, {}) for n in names] + VARIANTS


def label(name, extra):
    return name + "".join(f"+{k}={v}" for k, v in extra.items())


def timm_model(name, extra):
    """timm's model at one block on a 2x2 patch grid, 10 classes, random weights (filled without
    timm's initialization: built on the meta device, then filled)."""
    with torch.device(
        "meta"
    ):  # no initialization (weight_init="skip"): the weights are filled below
        probe = timm.create_model(name, depth=1, num_classes=10, weight_init="skip", **extra)
        patch = probe.patch_embed.patch_size[0]
        m = timm.create_model(
            name, depth=1, num_classes=10, img_size=2 * patch, weight_init="skip", **extra
        )
    assert not list(m.buffers()), name  # to_empty leaves buffers unset
    m = m.to_empty(device="cpu").eval()
    g = torch.Generator().manual_seed(zlib.crc32(label(name, extra).encode()))
    with torch.no_grad():
        for k, p in m.named_parameters():
            if k in ("cls_token", "reg_token", "dist_token", "pos_embed"):
                p.normal_(0, 0.02, generator=g)  # small, as the images: the norms' eps shows
            elif p.ndim == 1 and not k.endswith("bias"):
                p.uniform_(0.5, 1.5, generator=g)  # norm weights, layer-scale gammas
            else:
                p.normal_(0, 0.05, generator=g)
    return m, 2 * patch


def keys_only(sd, x, ref, announced: list):
    """The same weights without config.json or name: 'exact', 'announced' (another function, with the
    one-line warning naming the assumptions), or the refusal's message."""
    from vitscale.interop import from_timm

    before = len(announced)
    try:
        ours = from_timm(sd).eval()
    except UserError as e:
        assert "\n" not in str(e)
        return str(e)
    assert len(announced) == before + 1 and "\n" not in announced[-1], announced[before:]
    with torch.no_grad():
        return "exact" if (ours(x) - ref).abs().max().item() <= 1e-5 else "announced"


def check_one(name, extra, tmp_path, announced):
    """('exact' or the refusal's message, keys_only's result); raises AssertionError for a silently
    different model."""
    from vitscale.interop import from_timm, read_hub_config, timm_hub_config, to_timm

    theirs, size = timm_model(name, extra)
    folder = tmp_path / label(name, extra)
    folder.mkdir()
    save_config_for_hf(
        theirs, folder / "config.json"
    )  # what the hub folder holds next to the weights
    sd = theirs.state_dict()
    # small inputs: the first LayerNorms see a variance near their eps (1e-6 or 1e-5), which then matters
    x = 0.02 * torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = theirs(x)
    keys = keys_only(sd, x, ref, announced)
    try:
        ours = from_timm(sd, config=read_hub_config(folder / "model.safetensors")).eval()
    except UserError as e:
        assert "\n" not in str(e)
        return str(e), keys
    with torch.no_grad():
        diff = (ours(x) - ref).abs().max().item()
        assert diff <= 1e-5, (
            f"{label(name, extra)}: silently different (logits differ by {diff:.3g})"
        )
        # the export: timm's keys and values, and a config that builds the same function in timm
        out = to_timm(ours)
        assert out.keys() == sd.keys() and all(torch.equal(out[k], sd[k]) for k in sd), label(
            name, extra
        )
        cfg = timm_hub_config(ours.spec, mean=(0.5,) * 3, std=(0.5,) * 3)
        with torch.device("meta"):
            back = timm.create_model(cfg["architecture"], **cfg["model_args"])
        back.load_state_dict(out, strict=True, assign=True)
        assert torch.equal(back.eval()(x), ref), (
            f"{label(name, extra)}: the export computes another function"
        )
    return "exact", keys


@pytest.mark.parametrize("scope", ["quick", "all"])  # all: the slow tier (tests/tiers.py)
def test_every_timm_vit_is_exact_or_refused_with_its_cause(tmp_path, capsys, scope):
    import logging

    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # tiny matmuls: one thread is as fast, and a busy machine does not stall it
    announced = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: announced.append(record.getMessage())
    logging.getLogger("vitscale.interop").addHandler(handler)
    try:
        start = time.perf_counter()
        both = {label(n, e): check_one(n, e, tmp_path, announced) for n, e in configurations(scope)}
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
        logging.getLogger("vitscale.interop").removeHandler(handler)
    results = {n: r for n, (r, _) in both.items()}

    def cause(name, r):
        kind = next((k for k, word in CAUSES.items() if word in r), None)
        assert kind is not None, f"{name}: refused without a known cause: {r}"
        return kind

    kinds = collections.Counter(cause(n, r) for n, r in results.items() if r != "exact")
    for name, (_, k) in both.items():  # refusals from the keys alone name the causes too
        if k not in ("exact", "announced"):
            cause(name, k)
    exact = sum(r == "exact" for r in results.values())
    keys = collections.Counter(
        k if k in ("exact", "announced") else "refused" for _, k in both.values()
    )
    with capsys.disabled():
        print(
            f"\ntimm {timm.__version__} zoo sweep ({scope}): {len(results)} configurations, {exact} exact, "
            f"{len(results) - exact} refused ({', '.join(f'{k} {n}' for k, n in kinds.most_common())}), "
            f"0 silently different, {seconds:.0f} s; without config.json: {keys['exact']} exact, "
            f"{keys['announced']} other functions announced, {keys['refused']} refused"
        )
    assert [n for n in MUST_BE_EXACT if results[n] != "exact"] == []
    for name, word in MUST_BE_REFUSED.items():
        assert CAUSES[word] in results[name], results[name]
    if scope == "all":
        assert exact == len(results)  # the zoo's 179 names and every variant above (timm 1.0.31)
    else:
        assert (
            len(results) == len(MUST_BE_EXACT) + len(MUST_BE_REFUSED) + len(VARIANTS) - 1
        )  # +global_pool=avg is a variant


def test_the_architecture_table_is_timms():
    """src/vitscale/interop/timm/archs.py is what scripts/timm_vit_table.py makes from this timm."""
    import importlib.util
    from pathlib import Path

    from vitscale.interop.timm import archs as timm_archs

    if timm.__version__ != timm_archs.TIMM_VERSION:
        pytest.skip(
            f"the table is timm {timm_archs.TIMM_VERSION}'s; this is timm {timm.__version__}"
        )
    path = Path(__file__).parents[2] / "scripts" / "timm_vit_table.py"
    spec = importlib.util.spec_from_file_location("timm_vit_table", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    version, archs, cfgs, deprecated = script.build_table()
    assert (
        archs == timm_archs.ARCHS
        and cfgs == timm_archs.PRETRAINED
        and deprecated == timm_archs.DEPRECATED
    )
    assert Path(timm_archs.__file__).read_text() == script.render(version, archs, cfgs, deprecated)


@pytest.mark.parametrize(
    "name",
    [
        "vit_base_patch16_clip_224",
        "vit_base_patch32_clip_quickgelu_224",
        "deit3_small_patch16_224",
        "vit_small_patch14_reg4_dinov2",
        "vit_base_patch16_siglip_gap_224",
        "eva_large_patch14_196",
        "vit_base_patch16_radio_v3",
        "vit_medium_patch16_gap_256",
    ],
)
def test_exports_load_through_timms_own_loader(tmp_path, name):
    """The sweep loads exports with load_state_dict; here timm's pretrained loader (its checkpoint
    filter, strictness and pretrained config) reads a hub folder through both printed calls."""
    import json

    from timm.data import resolve_data_config

    from vitscale.interop import (
        from_timm,
        read_hub_config,
        timm_hub_config,
        timm_load_call,
        to_timm,
        write_state_dict,
    )

    theirs, size = timm_model(name, {})
    save_config_for_hf(theirs, tmp_path / "config.json")
    ours = from_timm(theirs.state_dict(), config=read_hub_config(tmp_path / "config.json")).eval()
    cfg = timm_hub_config(ours.spec, mean=(0.1, 0.2, 0.3), std=(0.4, 0.5, 0.6), crop_pct=0.875)
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    x = 0.02 * torch.randn(2, 3, size, size)
    for file in ("model.safetensors", "other_name.safetensors"):
        write_state_dict(to_timm(ours), folder / file)
        call = timm_load_call(cfg, folder / file)
        assert call.startswith(
            "timm.create_model('local-dir:"
            if file == "model.safetensors"
            else f"timm.create_model('{cfg['architecture']}', pretrained=True, pretrained_cfg_overlay="
        )
        back = eval(call).eval()
        with torch.no_grad():
            assert torch.equal(back(x), theirs(x)), call
        data = resolve_data_config(model=back)
        assert data["input_size"] == (3, size, size) and tuple(data["mean"]) == (0.1, 0.2, 0.3)
        assert tuple(data["std"]) == (0.4, 0.5, 0.6) and data["crop_pct"] == 0.875
