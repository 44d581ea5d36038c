"""timm ViT weights in and out (vitscale/interop). Against timm itself where it imports (it needs
torchvision: ../shared/tools/tv_cpu_stub makes that work on a CPU torch), else against the small
state dicts and the logits timm computed for them that tests/fixtures ships (made by timm 1.0.31:
`timm.create_model("vit_tiny_patch16_224", num_classes=5, img_size=32, patch_size=8, embed_dim=32,
depth=2, num_heads=2, ...)` with normal(0, 0.1) weights)."""
import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitscale.errors import UserError
from vitscale.interop import from_timm, read_state_dict, timm_vit_spec, to_timm, write_state_dict

FIXTURES = Path(__file__).parent / "fixtures"
HAVE_TIMM = importlib.util.find_spec("timm") is not None and importlib.util.find_spec("torchvision") is not None


def fixture(name):
    sd = load_file(str(FIXTURES / f"timm_vit_{name}.safetensors"))
    return sd.pop("__input__"), sd.pop("__logits__"), sd


@pytest.mark.parametrize("name, head, fc_norm, no_embed_class", [("token", "token", False, False),
                                                                 ("avg", "pool", True, False),
                                                                 ("noembed", "token", False, True)])
def test_shipped_timm_weights_give_timms_logits(name, head, fc_norm, no_embed_class, tmp_path):
    x, logits, sd = fixture(name)
    spec = timm_vit_spec(sd, heads=2)
    assert (spec.dim, spec.depth, spec.patch_size, spec.image_size, spec.num_classes) == (32, 2, 8, 32, 5)
    assert (spec.head, spec.fc_norm, spec.no_embed_class) == (head, fc_norm, no_embed_class)
    model = from_timm(sd, heads=2).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), logits, rtol=1e-5, atol=1e-5)
    # and back: the exported state dict is timm's, key for key and value for value
    out = to_timm(model)
    assert out.keys() == sd.keys() and all(torch.equal(out[k], sd[k]) for k in sd)
    # through files in every format
    for suffix in (".safetensors", ".pt", ".bin", ".pth"):
        path = write_state_dict(out, tmp_path / f"w{suffix}")
        again = from_timm(read_state_dict(path), heads=2).eval()
        with torch.no_grad():
            assert torch.equal(again(x), model(x))


def test_wrapped_and_ddp_saved_files(tmp_path):
    _, _, sd = fixture("token")
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in sd.items()}}, tmp_path / "ckpt.pth")
    assert read_state_dict(tmp_path / "ckpt.pth").keys() == sd.keys()


def test_bad_inputs_are_one_line_errors(tmp_path):
    _, _, sd = fixture("token")
    (tmp_path / "notes.pt").write_text("not weights")
    torch.save({"a": 1}, tmp_path / "obj.pt")
    cases = [
        (lambda: read_state_dict(tmp_path / "absent.safetensors"), "weights file not found"),
        (lambda: read_state_dict(tmp_path / "notes.pt"), "not a torch state dict file"),
        (lambda: read_state_dict(tmp_path / "obj.pt"), "does not hold a state dict"),
        (lambda: from_timm({"foo.weight": torch.zeros(1)}), "not a timm VisionTransformer state dict"),
        (lambda: from_timm({**sd, "blocks.0.ls1.gamma": torch.ones(32)}), "layer scale"),
        (lambda: from_timm({**sd, "extra.weight": torch.ones(1)}, heads=2), "unknown keys extra.weight"),
        (lambda: from_timm({k: v for k, v in sd.items() if k != "blocks.1.norm1.bias"}, heads=2),
         "missing keys blocks.1.norm1.bias"),
        (lambda: from_timm({**sd, "pos_embed": torch.zeros(1, 20, 32)}, heads=2), "no square patch grid"),
        (lambda: from_timm({k: v for k, v in sd.items() if not k.startswith("head.")}), "no classifier head"),
        (lambda: from_timm(sd, heads=3), "not divisible by 3 heads"),
    ]
    for fn, message in cases:
        with pytest.raises(UserError, match=message) as e:
            fn()
        assert "\n" not in str(e.value)


def test_a_headless_checkpoint_gets_a_new_head():
    x, _, sd = fixture("token")
    body = {k: v for k, v in sd.items() if not k.startswith("head.")}
    model = from_timm(body, heads=2, num_classes=7).eval()
    assert model.head.weight.shape == (7, 32)
    ref = from_timm(sd, heads=2).eval()
    with torch.no_grad():  # the same features, whatever the head
        torch.testing.assert_close(model.forward_head(model.forward_features(x), pre_logits=True),
                                   ref.forward_head(ref.forward_features(x), pre_logits=True))


# -- against timm itself ----------------------------------------------------------------------------
SIZES = [("vit_tiny_patch16_224", 192, 3), ("vit_small_patch32_224", 384, 6), ("vit_base_patch16_224", 768, 12),
         ("vit_large_patch16_224", 1024, 16), ("vit_huge_patch14_224", 1280, 16)]
VARIANTS = {"token": {}, "avg": dict(class_token=False, global_pool="avg"), "noembed": dict(no_embed_class=True)}


@pytest.mark.skipif(not HAVE_TIMM, reason="timm does not import here (pip install timm torchvision and "
                                          "../shared/tools/tv_cpu_stub on a CPU torch); the shipped fixtures cover it")
@pytest.mark.parametrize("arch, dim, heads", SIZES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_timm_vitscale_timm(arch, dim, heads, variant):
    """Every standard size (2 blocks, 32 px images: the real widths, heads and patch sizes) and
    head variant: timm -> vitscale gives timm's logits, vitscale -> timm loads strictly and gives them too."""
    import timm
    torch.manual_seed(0)
    patch = int(arch.split("patch")[1].split("_")[0])
    kw = dict(pretrained=False, num_classes=10, img_size=2 * patch, depth=2, **VARIANTS[variant])
    theirs = timm.create_model(arch, **kw).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.05)
    ours = from_timm(theirs.state_dict()).eval()
    assert (ours.spec.dim, ours.spec.heads, ours.spec.patch_size) == (dim, heads, patch)
    x = torch.randn(2, 3, 2 * patch, 2 * patch)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
        back = timm.create_model(arch, **kw).eval()
        back.load_state_dict(to_timm(ours), strict=True)
        torch.testing.assert_close(back(x), theirs(x), rtol=0, atol=0)


@pytest.mark.skipif(not HAVE_TIMM, reason="timm does not import here")
def test_timm_loads_an_exported_file_through_pretrained_cfg_overlay(tmp_path):
    import timm
    x, logits, sd = fixture("token")
    path = write_state_dict(to_timm(from_timm(sd, heads=2)), tmp_path / "vit.safetensors")
    t = timm.create_model("vit_tiny_patch16_224", pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=5),
                          num_classes=5, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2).eval()
    with torch.no_grad():
        torch.testing.assert_close(t(x), logits, rtol=1e-5, atol=1e-5)
