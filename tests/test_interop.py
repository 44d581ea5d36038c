"""timm ViT weights in and out (vitscale/interop). Against timm itself where it imports (it needs
torchvision: ../shared/tools/tv_cpu_stub makes that work on a CPU torch), else against the small
state dicts and the logits timm computed for them that tests/fixtures ships (made by timm 1.0.31:
`timm.create_model("vit_tiny_patch16_224", num_classes=5, img_size=32, patch_size=8, embed_dim=32,
depth=2, num_heads=2, ...)` with normal(0, 0.1) weights)."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitscale.errors import UserError
from vitscale.interop import from_timm, read_state_dict, timm_vit_spec, to_timm, write_state_dict

FIXTURES = Path(__file__).parent / "fixtures"
try:  # timm imports torchvision, whose CUDA build does not import on a CPU torch without the stub
    import timm  # noqa: F401
    HAVE_TIMM = True
except Exception:
    HAVE_TIMM = False


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


# -- model.init: fine-tuning from a file ------------------------------------------------------------
def weights_file(tmp_path, name="token"):
    """The fixture's weights alone, as a published file would hold them."""
    return str(write_state_dict(fixture(name)[2], tmp_path / f"{name}.safetensors"))


def test_init_weights_for_another_geometry(tmp_path):
    from vitscale.interop.finetune import init_weights
    x, logits, sd = fixture("token")
    path = weights_file(tmp_path)
    # the same geometry and classes: the very function timm computes, head kept
    spec, state = init_weights(path, image_size=32, in_chans=3, num_classes=5, heads=2)
    from vitscale.models.vit import VisionTransformer
    model = VisionTransformer(spec).eval()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(x), logits, rtol=1e-5, atol=1e-5)
    # 48 px grey images, 4 classes: a 6x6 grid, one input channel, a new head
    spec, state = init_weights(path, image_size=48, in_chans=1, num_classes=4, heads=2)
    assert (spec.image_size, spec.in_chans, spec.num_classes, spec.patch_size) == (48, 1, 4, 8)
    assert state["pos_embed"].shape == (1, 37, 32) and "head.weight" not in state
    assert torch.equal(state["pos_embed"][:, 0], sd["pos_embed"][:, 0])  # the class token's row kept
    torch.testing.assert_close(state["patch_embed.proj.weight"], sd["patch_embed.proj.weight"].sum(1, keepdim=True))
    # a grey image through the summed filters = the same image as three equal channels through the originals
    grey = torch.randn(2, 1, 32, 32)
    conv = torch.nn.functional.conv2d
    torch.testing.assert_close(conv(grey, state["patch_embed.proj.weight"], stride=8),
                               conv(grey.expand(-1, 3, -1, -1), sd["patch_embed.proj.weight"], stride=8))
    if HAVE_TIMM:  # the resampling is timm's
        from timm.layers import resample_abs_pos_embed
        torch.testing.assert_close(state["pos_embed"], resample_abs_pos_embed(sd["pos_embed"], [6, 6],
                                                                              num_prefix_tokens=1))
    with pytest.raises(UserError, match="init_head=keep"):
        init_weights(path, image_size=32, in_chans=3, num_classes=4, heads=2, head_policy="keep")
    with pytest.raises(UserError, match="not divisible by the weights' patch size 8"):
        init_weights(path, image_size=36, in_chans=3, num_classes=4, heads=2)
    with pytest.raises(UserError, match=r"adapted: 3 -> 1 and 1 -> N"):
        init_weights(path, image_size=32, in_chans=2, num_classes=4, heads=2)
    # grey weights for colour data: a colour image gives its channel mean's response
    from vitscale.interop.finetune import adapt_in_chans
    w1 = torch.randn(4, 1, 8, 8)
    rgb = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(conv(rgb, adapt_in_chans(w1, 3), stride=8), conv(rgb.mean(1, keepdim=True), w1, stride=8))


def test_train_from_a_timm_file(tmp_path, capsys):
    """`vitscale train --set model.init=FILE`: the tiny recipe's grey 16 px synthetic data fine-tunes
    the shipped timm weights (3-channel, 32 px, 5 classes) with a new 4-class head."""
    import json

    from vitscale.cli import main
    path = weights_file(tmp_path)
    out = tmp_path / "ft"
    rc = main(["train", "configs/tests/tiny.toml", "--out", str(out), "--set", f"model.init={path}",
               "--set", "model.heads=2", "--set", "data.image_size=16", "--set", "run.threads=1"])
    assert rc == 0, capsys.readouterr().err
    s = json.loads((out / "summary.json").read_text())
    assert s["params"] == sum(v.numel() for k, v in fixture("token")[2].items()
                              if k not in ("pos_embed", "head.weight", "head.bias", "patch_embed.proj.weight")) \
        + 5 * 32 + 32 * 8 * 8 + 4 * 32 + 4  # pos 2x2+1 rows, 1-channel patch filters, the 4-class head
    from vitscale.config import load_config
    with pytest.raises(Exception, match="CLIP models cannot be initialized"):
        load_config("clip_openclipart", [f"model.init={path}"])


def test_export_a_run_in_timms_layout(tmp_path, capsys):
    """`vitscale export RUN --format timm`: a file timm loads (where timm imports: the same logits),
    and that model.init / from_timm read back into the same function."""
    import json

    from safetensors import safe_open

    from vitscale.cli import main
    from vitscale.evaluate import _load, _weights
    from vitscale.tasks import build_task
    run = tmp_path / "run"
    assert main(["train", "configs/tests/tiny.toml", "--out", str(run), "--set", "train.epochs=1",
                 "--set", "run.threads=1"]) == 0
    out = tmp_path / "vit_timm.safetensors"
    assert main(["export", str(run), "--format", "timm", "--out", str(out)]) == 0
    assert "timm.create_model(" in capsys.readouterr().out
    state, cfg, _ = _load(run)
    task = build_task(cfg, "vit")
    ours = task.build_model(task.spec_from_dict(state["spec"])).eval()
    ours.load_state_dict(_weights(state, False))
    with safe_open(str(out), "pt") as f:
        kw = json.loads(f.metadata()["timm_kwargs"])
    assert kw == dict(img_size=8, patch_size=4, in_chans=1, num_classes=4, embed_dim=32, depth=2, num_heads=2,
                      mlp_ratio=2.0)
    x = torch.randn(3, 1, 8, 8)
    back = from_timm(read_state_dict(out), heads=2).eval()
    with torch.no_grad():
        assert torch.equal(back(x), ours(x))
        if HAVE_TIMM:
            import timm
            t = timm.create_model("vit_base_patch16_224", pretrained=True,
                                  pretrained_cfg_overlay=dict(file=str(out), num_classes=4), **kw).eval()
            torch.testing.assert_close(t(x), ours(x), rtol=1e-5, atol=1e-5)
    # a layout timm has no model for: one line
    pool = tmp_path / "pool"
    assert main(["train", "configs/tests/tiny.toml", "--out", str(pool), "--set", "train.epochs=1",
                 "--set", "model.head=pool", "--set", "run.threads=1"]) == 0
    assert main(["export", str(pool), "--format", "timm", "--out", str(tmp_path / "p.safetensors")]) == 2
    assert "head=pool without fc_norm" in capsys.readouterr().err


def test_layer_wise_lr_decay_groups():
    from vitscale.config import OptimConfig
    from vitscale.models.vit import VisionTransformer, ViTSpec
    from vitscale.optim import build_optimizer, layer_id
    model = VisionTransformer(ViTSpec(image_size=8, patch_size=4, in_chans=1, num_classes=3, dim=16, depth=2,
                                      heads=2, mlp_ratio=2.0))
    assert [layer_id(n, 2) for n in ("cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight",
                                     "blocks.1.norm2.bias", "norm.weight", "head.bias")] == [0, 0, 0, 1, 2, 3, 3]
    opt = build_optimizer(model, OptimConfig(lr=1.0, layer_decay=0.5))
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    wd_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    expect = {"cls_token": 0.125, "patch_embed.proj.weight": 0.125, "blocks.0.mlp.fc1.weight": 0.25,
              "blocks.1.attn.proj.weight": 0.5, "norm.weight": 1.0, "head.weight": 1.0}
    named = dict(model.named_parameters())
    assert {n: lr_of[id(named[n])] for n in expect} == expect
    assert wd_of[id(named["head.weight"])] == 0.05 and wd_of[id(named["head.bias"])] == 0.0
    assert len(lr_of) == len(named)  # every parameter in exactly one group
    # off (1.0): the two groups as before, the optimizer's own lr
    opt = build_optimizer(model, OptimConfig(lr=1.0))
    assert len(opt.param_groups) == 2 and {g["lr"] for g in opt.param_groups} == {1.0}


@pytest.mark.parametrize("what, blocks, trainable", [
    ("backbone", 0, {"head.weight", "head.bias"}),
    ("embed", 1, "all but embeddings and block 0")])
def test_freezing_trains_only_the_rest(tmp_path, capsys, what, blocks, trainable):
    from vitscale.config import load_config
    from vitscale.loop import Trainer
    cfg = load_config("configs/tests/tiny.toml", [f"model.freeze={what}", f"model.freeze_blocks={blocks}",
                                                  "run.max_steps=3", "run.threads=1"])
    t = Trainer(cfg, tmp_path / what)
    before = {n: p.detach().clone() for n, p in t.strategy.module.named_parameters()}
    try:
        t.fit()
    finally:
        t.data.close()
    changed = {n for n, p in t.strategy.module.named_parameters() if not torch.equal(before[n], p)}
    if what == "backbone":
        assert changed == trainable
    else:
        frozen = {n for n in before if n.startswith(("patch_embed.", "cls_token", "pos_embed", "blocks.0."))}
        assert changed == set(before) - frozen and frozen


def test_normalization_that_belongs_to_the_weights(tmp_path):
    from vitscale.config import load_config
    from vitscale.data.transforms import NORMALIZATIONS, normalization
    from vitscale.interop.finetune import weights_normalization
    from vitscale.strategy import SingleDevice
    from vitscale.tasks import build_task
    assert normalization("dataset", (0.3,), (0.2,)) == ((0.3,), (0.2,))
    assert normalization("imagenet", (0.1, 0.2, 0.3), (1, 1, 1)) == NORMALIZATIONS["imagenet"]
    m, s = normalization("clip", (0.3,), (0.2,))
    assert m == pytest.approx((sum(NORMALIZATIONS["clip"][0]) / 3,)) and len(s) == 1
    timm_file = weights_file(tmp_path)
    assert weights_normalization(timm_file) == "imagenet"
    cfg = load_config("configs/tests/tiny.toml", [f"model.init={timm_file}", "model.heads=2", "data.image_size=16"])
    task = build_task(cfg)
    data = task.build_data(SingleDevice(cfg.train, cfg.optim, torch.device("cpu")))
    assert data.mean == pytest.approx((sum(NORMALIZATIONS["imagenet"][0]) / 3,))


def test_init_from_a_vitscale_export_with_its_own_stem_and_head(tmp_path, capsys):
    """vitscale's own exports carry their spec: a conv-stem, mean-pool model (no timm counterpart)
    starts a run at another size, with colour images and another class count."""
    import json

    from vitscale.cli import main
    from vitscale.interop.finetune import init_weights, weights_normalization
    run = tmp_path / "src"
    assert main(["train", "configs/tests/tiny.toml", "--out", str(run), "--set", "train.epochs=1", "--set",
                 "model.stem=conv", "--set", "model.head=pool", "--set", "run.threads=1"]) == 0
    path = tmp_path / "src.safetensors"
    assert main(["export", str(run), "--out", str(path)]) == 0
    assert weights_normalization(str(path)) == "dataset"
    spec, state = init_weights(str(path), image_size=16, in_chans=3, num_classes=6)
    assert (spec.stem, spec.head, spec.image_size, spec.in_chans, spec.num_classes) == ("conv", "pool", 16, 3, 6)
    assert state["pos_embed"].shape == (1, 16, 32) and state["patch_embed.proj.0.weight"].shape[1] == 3
    out = tmp_path / "ft"
    assert main(["train", "configs/tests/tiny.toml", "--out", str(out), "--set", f"model.init={path}",
                 "--set", "data.image_size=16", "--set", "data.channels=3", "--set", "data.num_classes=6",
                 "--set", "train.epochs=1", "--set", "run.threads=1"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
