"""The timm eva zoo sweep: every model configuration of timm's `eva` module (EVA02, DINOv3, Perception
Encoder, the vit_*_rope_* models, ...), built by timm at one block with perturbed weights (the rotary
embedding's learned frequencies included) on a 4x4 patch grid, is either

- exact: vitscale's ViT built from the weights and the config.json timm writes for them gives timm's
  logits within float32 rounding, and its export (to_timm + timm_hub_config) loads back into timm
  strictly and gives them again; or
- refused in one line naming the cause.

Nothing may be silently different. Weights of the family without config.json are refused in one
line (their rotary embedding and pooling are not in the keys). Needs timm (skipped otherwise)."""

import collections
import logging
import zlib

import pytest
import torch

from vitscale.errors import UserError

try:
    import timm
    from timm.models._hub import save_config_for_hf

    HAVE_TIMM = True
except Exception:
    HAVE_TIMM = False

pytestmark = pytest.mark.skipif(not HAVE_TIMM, reason="timm does not import here")

QUICK = [  # one of each kind, the fast tier's
    "eva02_base_patch14_224",  # rope cat with ref_feat_shape, split SwiGLU with its norm, q/v bias
    "eva02_large_patch14_clip_224",
    "eva_giant_patch14_224",  # no rope
    "vit_base_patch16_dinov3",  # dinov3 rope, registers, layer scale, no abs position
    "vit_small_plus_patch16_dinov3",  # split SwiGLU without a norm (swiglu_align_to)
    "vit_pe_core_base_patch16_224",  # MAP head over every token, its own heads, pre-norm
    "vit_pe_lang_large_patch14_448",
    "vit_base_patch16_rope_mixed_ape_224",  # learned rope frequencies and absolute position
    "vit_base_patch16_rope_reg1_gap_256",
    "vit_base_patch16_sapiens2",  # grouped-query attention: refused
]
REFUSED = {"sapiens2": "grouped-query attention"}


def perturbed(name: str):
    """timm's model at one block, 10 classes, a 4x4 patch grid, every parameter perturbed."""
    with torch.device("meta"):
        patch = timm.create_model(name, depth=1, num_classes=10).patch_embed.patch_size[0]
    m = timm.create_model(name, depth=1, num_classes=10, img_size=4 * patch).eval()
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    with torch.no_grad():
        for k, p in m.named_parameters():
            if k in ("cls_token", "reg_token", "pos_embed"):
                p.normal_(0, 0.02, generator=g)
            elif "rope" in k:  # learned frequencies: away from their initial draw
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1 and not k.endswith("bias"):
                p.uniform_(0.5, 1.5, generator=g)  # norm weights, layer-scale gammas
            else:
                p.normal_(0, 0.05, generator=g)
    return m, 4 * patch


def refusal_at_full_depth(name: str, tmp_path) -> str:
    """Models timm cannot build at one block (a per-block head-count list): the refusal of the
    config.json of the whole model, read from its shapes (meta weights)."""
    from vitscale.interop import read_hub_config, timm_vit_spec

    with torch.device("meta"):
        m = timm.create_model(name, num_classes=10)
    save_config_for_hf(m, tmp_path / "config.json")
    with pytest.raises(UserError) as e:
        timm_vit_spec(m.state_dict(), config=read_hub_config(tmp_path / "config.json"))
    return str(e.value)


def keys_only(sd: dict) -> None:
    """Without config.json: refused in one line (a rotary embedding's family: its keys show
    gamma_1, q_bias, ...; or shapes a plain ViT does not have), or, where the keys are a plain
    ViT's (eva_giant_*, PE's), loaded under the one warning line naming what was assumed (no
    rotary embedding among it)."""
    from vitscale.interop import from_timm

    announced = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: announced.append(record.getMessage())
    logging.getLogger("vitscale.interop").addHandler(handler)
    try:
        from_timm(sd)
    except UserError as e:
        assert "\n" not in str(e), str(e)
        return
    finally:
        logging.getLogger("vitscale.interop").removeHandler(handler)
    assert len(announced) == 1 and "no rotary position embedding" in announced[0], announced


def check_one(name: str, tmp_path) -> str:
    """'exact' or the refusal's message; AssertionError for a silently different model."""
    from vitscale.interop import from_timm, read_hub_config, timm_hub_config, to_timm

    folder = tmp_path / name
    folder.mkdir()
    try:
        theirs, size = perturbed(name)
    except AssertionError:
        return refusal_at_full_depth(name, folder)
    save_config_for_hf(theirs, folder / "config.json")
    sd = theirs.state_dict()
    x = 0.5 * torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = theirs(x)
    keys_only(sd)
    try:
        ours = from_timm(sd, config=read_hub_config(folder / "config.json")).eval()
    except UserError as e:
        assert "\n" not in str(e)
        return str(e)
    bound = 1e-5 * max(1.0, ref.abs().max().item())
    with torch.no_grad():
        diff = (ours(x) - ref).abs().max().item()
        assert diff <= bound, f"{name}: silently different (logits differ by {diff:.3g})"
        cfg = timm_hub_config(ours.spec, mean=(0.5,) * 3, std=(0.5,) * 3)
        back = timm.create_model(cfg["architecture"], **cfg["model_args"]).eval()
        back.load_state_dict(to_timm(ours), strict=True)
        diff = (back(x) - ref).abs().max().item()
        assert diff <= bound, f"{name}: the export computes another function ({diff:.3g})"
    return "exact"


@pytest.mark.parametrize("scope", ["quick", "all"])  # all: the slow tier (tests/tiers.py)
def test_every_timm_eva_is_exact_or_refused_with_its_cause(tmp_path, capsys, scope):
    names = QUICK if scope == "quick" else timm.list_models(module="eva")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = {n: check_one(n, tmp_path) for n in names}
    finally:
        torch.set_num_threads(threads)
    refused = {n: r for n, r in results.items() if r != "exact"}
    for name, r in refused.items():
        cause = next((c for key, c in REFUSED.items() if key in name), None)
        assert cause is not None and cause in r, f"{name}: refused: {r}"
    kinds = collections.Counter(
        next(c for c in REFUSED.values() if c in r) for r in refused.values()
    )
    with capsys.disabled():
        print(
            f"\ntimm {timm.__version__} eva zoo ({scope}): {len(results)} configurations, "
            f"{len(results) - len(refused)} exact, {len(refused)} refused ({dict(kinds)}), "
            "0 silently different"
        )
    if scope == "all":
        assert len(results) - len(refused) >= 60  # timm 1.0.31: 65 names, 5 of them sapiens2


@pytest.mark.parametrize(
    "name",
    ["eva02_base_patch14_224", "vit_base_patch16_dinov3", "vit_pe_core_base_patch16_224"],
)
def test_float64_is_the_same_function(tmp_path, name):
    """In float64 the rounding of float32 is gone: vitscale's model and timm's, both cast to
    float64, agree to float64 rounding (the rope computed in float32 in both, as timm's fixed-size
    Eva computes it)."""
    from vitscale.interop import from_timm, read_hub_config

    theirs, size = perturbed(name)
    save_config_for_hf(theirs, tmp_path / "config.json")
    ours = from_timm(theirs.state_dict(), config=read_hub_config(tmp_path / "config.json"))
    theirs, ours = theirs.double(), ours.eval().double()
    x = torch.randn(
        2, 3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        ref = theirs(x)
        assert (ours(x) - ref).abs().max().item() <= 1e-12 * ref.abs().max().item()


def test_eva_weights_fine_tune_at_another_size_and_a_size_the_patch_misses_is_refused(tmp_path):
    """model.init of an eva hub folder: converted to vitscale's names, its rope (no pos_embed to
    resample) computed for the run's grid, a new head; an image size the patch does not divide is
    refused naming the nearest that does."""
    from safetensors.torch import save_file

    from vitscale.interop.finetune import init_weights

    theirs, _ = perturbed("vit_small_patch16_dinov3")
    save_config_for_hf(theirs, tmp_path / "config.json")
    save_file(
        {k: v.contiguous() for k, v in theirs.state_dict().items()}, tmp_path / "model.safetensors"
    )
    spec, sd = init_weights(str(tmp_path), image_size=32, in_chans=3, num_classes=4)
    assert (spec.image_size, spec.rope, spec.reg_tokens, spec.pos_embed) == (32, "dinov3", 4, False)
    from vitscale.models.vit import VisionTransformer

    model = VisionTransformer(spec)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert set(missing) == {"head.weight", "head.bias"} and not unexpected
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 4)
    with pytest.raises(UserError, match=r"nearest size that is, 48 \(set data.image_size=48\)"):
        init_weights(str(tmp_path), image_size=44, in_chans=3, num_classes=4)
