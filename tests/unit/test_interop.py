"""timm ViT weights in and out (vitscale/interop). Against timm itself where it imports (it needs
torchvision: ../shared/tools/tv_cpu_stub makes that work on a CPU torch), else against the small
state dicts and the logits timm computed for them that tests/fixtures ships (made by timm 1.0.31:
`timm.create_model("vit_tiny_patch16_224", num_classes=5, img_size=32, patch_size=8, embed_dim=32,
depth=2, num_heads=2, ...)` with normal(0, 0.1) weights)."""

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitscale.errors import UserError
from vitscale.interop import from_timm, read_state_dict, timm_vit_spec, to_timm, write_state_dict

FIXTURES = Path(__file__).parents[1] / "fixtures"
try:  # timm imports torchvision, whose CUDA build does not import on a CPU torch without the stub
    import timm  # noqa: F401

    HAVE_TIMM = True
except Exception:
    HAVE_TIMM = False


def fixture(name):
    sd = load_file(str(FIXTURES / f"timm_vit_{name}.safetensors"))
    return sd.pop("__input__"), sd.pop("__logits__"), sd


@pytest.mark.parametrize(
    "name, head, fc_norm, no_embed_class",
    [
        ("token", "token", False, False),
        ("avg", "pool", True, False),
        ("noembed", "token", False, True),
    ],
)
def test_shipped_timm_weights_give_timms_logits(name, head, fc_norm, no_embed_class, tmp_path):
    x, logits, sd = fixture(name)
    spec = timm_vit_spec(sd, heads=2)
    assert (spec.dim, spec.depth, spec.patch_size, spec.image_size, spec.num_classes) == (
        32,
        2,
        8,
        32,
        5,
    )
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
    torch.save(
        {"epoch": 3, "state_dict": {f"module.{k}": v for k, v in sd.items()}}, tmp_path / "ckpt.pth"
    )
    assert read_state_dict(tmp_path / "ckpt.pth").keys() == sd.keys()


def test_bad_inputs_are_one_line_errors(tmp_path):
    _, _, sd = fixture("token")
    (tmp_path / "notes.pt").write_text("not weights")
    torch.save({"a": 1}, tmp_path / "obj.pt")
    cases = [
        (lambda: read_state_dict(tmp_path / "absent.safetensors"), "weights file not found"),
        (lambda: read_state_dict(tmp_path / "notes.pt"), "not a torch state dict file"),
        (lambda: read_state_dict(tmp_path / "obj.pt"), "does not hold a state dict"),
        (
            lambda: from_timm({"foo.weight": torch.zeros(1)}),
            "not a timm VisionTransformer state dict",
        ),
        (
            lambda: from_timm({**sd, "blocks.0.attn.lambda_q1": torch.ones(16)}),
            "differential attention",
        ),
        (  # a distillation token needs its row in pos_embed
            lambda: from_timm({**sd, "dist_token": torch.ones(1, 1, 32)}),
            "pos_embed has 17 rows, which is no square patch grid",
        ),
        (lambda: from_timm({**sd, "blocks.0.0.norm1.weight": torch.ones(32)}), "blocks in groups"),
        (
            lambda: from_timm({**sd, "blocks.0.ls1.gamma": torch.ones(32)}, heads=2),
            "missing keys blocks.0.ls2.gamma",
        ),
        (lambda: from_timm(sd, arch="vit_bse_patch16_224"), "did you mean 'vit_base_patch16_224'"),
        (lambda: from_timm(sd, arch="vit_base_patch16_224"), "the architecture has width"),
        (lambda: from_timm(sd, config={"architecture": "resnet50"}), "not one of timm"),
        (
            lambda: from_timm(
                sd,
                heads=4,
                config={
                    "architecture": "vit_tiny_patch16_224",
                    "model_args": dict(embed_dim=32, depth=2, num_heads=2, patch_size=8),
                },
            ),
            "model.heads=4, but the",
        ),
        (
            lambda: from_timm({**sd, "extra.weight": torch.ones(1)}, heads=2),
            "unknown keys extra.weight",
        ),
        (
            lambda: from_timm({k: v for k, v in sd.items() if k != "blocks.1.norm1.bias"}, heads=2),
            "missing keys blocks.1.norm1.bias",
        ),
        (
            lambda: from_timm({**sd, "pos_embed": torch.zeros(1, 20, 32)}, heads=2),
            "no square patch grid",
        ),
        (
            lambda: from_timm({k: v for k, v in sd.items() if not k.startswith("head.")}),
            "no classifier head",
        ),
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
        torch.testing.assert_close(
            model.forward_head(model.forward_features(x), pre_logits=True),
            ref.forward_head(ref.forward_features(x), pre_logits=True),
        )


# -- against timm itself ----------------------------------------------------------------------------
SIZES = [
    ("vit_tiny_patch16_224", 192, 3),
    ("vit_small_patch32_224", 384, 6),
    ("vit_base_patch16_224", 768, 12),
    ("vit_large_patch16_224", 1024, 16),
    ("vit_huge_patch14_224", 1280, 16),
]
VARIANTS = {
    "token": {},
    "avg": dict(class_token=False, global_pool="avg"),
    "noembed": dict(no_embed_class=True),
}


@pytest.mark.skipif(
    not HAVE_TIMM,
    reason="timm does not import here (pip install timm torchvision and "
    "../shared/tools/tv_cpu_stub on a CPU torch); the shipped fixtures cover it",
)
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
    t = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(path), num_classes=5),
        num_classes=5,
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=2,
    ).eval()
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
    assert torch.equal(
        state["pos_embed"][:, 0], sd["pos_embed"][:, 0]
    )  # the class token's row kept
    torch.testing.assert_close(
        state["patch_embed.proj.weight"], sd["patch_embed.proj.weight"].sum(1, keepdim=True)
    )
    # a grey image through the summed filters = the same image as three equal channels through the originals
    grey = torch.randn(2, 1, 32, 32)
    conv = torch.nn.functional.conv2d
    torch.testing.assert_close(
        conv(grey, state["patch_embed.proj.weight"], stride=8),
        conv(grey.expand(-1, 3, -1, -1), sd["patch_embed.proj.weight"], stride=8),
    )
    if HAVE_TIMM:  # the resampling is timm's
        from timm.layers import resample_abs_pos_embed

        torch.testing.assert_close(
            state["pos_embed"], resample_abs_pos_embed(sd["pos_embed"], [6, 6], num_prefix_tokens=1)
        )
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
    torch.testing.assert_close(
        conv(rgb, adapt_in_chans(w1, 3), stride=8), conv(rgb.mean(1, keepdim=True), w1, stride=8)
    )


def test_train_from_a_timm_file(tmp_path, capsys):
    """`vitscale train --set model.init=FILE`: the tiny recipe's grey 16 px synthetic data fine-tunes
    the shipped timm weights (3-channel, 32 px, 5 classes) with a new 4-class head."""
    import json

    from vitscale.cli import main

    path = weights_file(tmp_path)
    out = tmp_path / "ft"
    rc = main(
        [
            "train",
            "configs/tests/tiny.toml",
            "--out",
            str(out),
            "--set",
            f"model.init={path}",
            "--set",
            "model.heads=2",
            "--set",
            "data.image_size=16",
            "--set",
            "run.threads=1",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    s = json.loads((out / "summary.json").read_text())
    assert (
        s["params"]
        == sum(
            v.numel()
            for k, v in fixture("token")[2].items()
            if k not in ("pos_embed", "head.weight", "head.bias", "patch_embed.proj.weight")
        )
        + 5 * 32
        + 32 * 8 * 8
        + 4 * 32
        + 4
    )  # pos 2x2+1 rows, 1-channel patch filters, the 4-class head
    from vitscale.config import load_config
    from vitscale.tasks import check_config

    with pytest.raises(Exception, match="CLIP models cannot be initialized"):
        check_config(load_config("clip_openclipart", [f"model.init={path}"]))


@pytest.mark.parametrize("head", ["token", "pool", "pool_fc_norm"])
def test_export_a_run_in_timms_layout(tmp_path, capsys, head):
    """`vitscale export RUN --format timm`: a hub folder (model.safetensors and config.json) and the
    printed timm call, which (where timm imports) builds the trained function, bit for bit, with the
    run's image size, channels and mean/std as its preprocessing config; model.init and from_timm read
    the folder back into the same function, with nothing assumed. A pooled head without fc_norm is
    timm's global_pool='avg', fc_norm=False."""

    from vitscale.cli import main
    from vitscale.interop import read_hub_config
    from vitscale.interop.finetune import init_weights, weights_normalization
    from vitscale.state import SavedRun
    from vitscale.tasks import build_task

    run = tmp_path / "run"
    sets = {"token": [], "pool": ["model.head=pool"], "pool_fc_norm": ["model.head=pool"]}[head]
    assert (
        main(
            [
                "train",
                "configs/tests/tiny.toml",
                "--out",
                str(run),
                "--set",
                "train.epochs=1",
                "--set",
                "run.threads=1",
                *[a for kv in sets for a in ("--set", kv)],
            ]
        )
        == 0
    )
    saved = SavedRun.open(run, "exporting", "vitscale export")
    if (
        head == "pool_fc_norm"
    ):  # vitscale's recipes have no fc_norm switch: the spec's option, saved
        from vitscale.checkpoint import resolve_checkpoint

        ckpt = resolve_checkpoint(run)
        st = torch.load(ckpt, weights_only=False)
        st["spec"]["fc_norm"] = True
        sd = st["strategy"]["model"]
        sd["fc_norm.weight"], sd["fc_norm.bias"] = sd.pop("norm.weight"), sd.pop("norm.bias")
        torch.save(st, ckpt)
        saved = SavedRun.open(run, "exporting", "vitscale export")
    capsys.readouterr()
    assert main(["export", str(run), "--format", "timm"]) == 0
    printed = capsys.readouterr().out
    out = run / "timm" / "model.safetensors"
    assert f"wrote {out}" in printed and f"wrote {run / 'timm' / 'config.json'}" in printed
    call = printed.split("load it: ", 1)[1].strip()
    assert call == f"timm.create_model('local-dir:{run / 'timm'}', pretrained=True)"
    hub = read_hub_config(out)
    task = build_task(saved.config(), "vit")
    ours = task.build_model(task.spec_from_dict(saved.spec)).eval()
    ours.load_state_dict(saved.weights(False))
    mean, std = saved.preprocess["mean"], saved.preprocess["std"]
    assert hub["pretrained_cfg"]["input_size"] == [1, 8, 8]
    assert (hub["pretrained_cfg"]["mean"], hub["pretrained_cfg"]["std"]) == (mean, std)
    assert hub["architecture"] == "vit_base_patch16_224" and hub["model_args"] == {
        "img_size": 8,
        "patch_size": 4,
        "in_chans": 1,
        "num_classes": 4,
        "embed_dim": 32,
        "depth": 2,
        "num_heads": 2,
        "mlp_ratio": 2.0,
        **{
            "token": {},
            "pool": dict(class_token=False, global_pool="avg", fc_norm=False),
            "pool_fc_norm": dict(class_token=False, global_pool="avg"),
        }[head],
    }
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        import logging

        logging.getLogger("vitscale.interop").addHandler(h := logging.Handler())
        h.emit = lambda r: pytest.fail(f"assumed something: {r.getMessage()}")
        try:
            back = from_timm(read_state_dict(out), config=hub).eval()
            spec, sd = init_weights(str(run / "timm"), image_size=8, in_chans=1, num_classes=4)
        finally:
            logging.getLogger("vitscale.interop").removeHandler(h)
        assert back.spec == ours.spec
        assert torch.equal(back(x), ours(x))
        assert spec == back.spec and all(
            torch.equal(sd[k], v) for k, v in back.state_dict().items()
        )
        if HAVE_TIMM:
            import timm  # noqa: F401
            from timm.data import resolve_data_config

            for text in (call, printed_overlay_call(tmp_path, run, capsys)):
                t = eval(text).eval()
                assert torch.equal(t(x), ours(x)), text
                data = resolve_data_config(model=t)
                assert (
                    data["input_size"] == (1, 8, 8)
                    and list(data["mean"]) == mean
                    and list(data["std"]) == std
                )
    assert (
        weights_normalization(str(out)) == "imagenet"
    )  # Fashion-MNIST's mean/std: no data.normalize choice


def printed_overlay_call(tmp_path, run, capsys):
    """The call printed for an export whose file timm's local-dir load would not pick (another name)."""
    from vitscale.cli import main

    capsys.readouterr()
    assert (
        main(
            [
                "export",
                str(run),
                "--format",
                "timm",
                "--out",
                str(tmp_path / "vit_timm.safetensors"),
            ]
        )
        == 0
    )
    call = capsys.readouterr().out.split("load it: ", 1)[1].strip()
    assert call.startswith(
        "timm.create_model('vit_base_patch16_224', pretrained=True, pretrained_cfg_overlay=dict("
    )
    return call


def test_export_refusals_are_one_line(tmp_path, capsys):
    from vitscale.cli import main

    conv = tmp_path / "conv"
    assert (
        main(
            [
                "train",
                "configs/tests/tiny.toml",
                "--out",
                str(conv),
                "--set",
                "train.epochs=1",
                "--set",
                "model.stem=conv",
                "--set",
                "run.threads=1",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["export", str(conv), "--format", "timm"]) == 2
    err = capsys.readouterr().err
    assert "model.stem=conv has no timm ViT counterpart" in err and err.count("\n") == 1


def test_layer_wise_lr_decay_groups():
    from vitscale.config import OptimConfig
    from vitscale.models.vit import VisionTransformer, ViTSpec
    from vitscale.optim import build_optimizer, layer_id

    model = VisionTransformer(
        ViTSpec(
            image_size=8,
            patch_size=4,
            in_chans=1,
            num_classes=3,
            dim=16,
            depth=2,
            heads=2,
            mlp_ratio=2.0,
        )
    )
    assert [
        layer_id(n, 2)
        for n in (
            "cls_token",
            "pos_embed",
            "patch_embed.proj.weight",
            "blocks.0.attn.qkv.weight",
            "blocks.1.norm2.bias",
            "norm.weight",
            "head.bias",
        )
    ] == [0, 0, 0, 1, 2, 3, 3]
    opt = build_optimizer(model, OptimConfig(lr=1.0, layer_decay=0.5))
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    wd_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    expect = {
        "cls_token": 0.125,
        "patch_embed.proj.weight": 0.125,
        "blocks.0.mlp.fc1.weight": 0.25,
        "blocks.1.attn.proj.weight": 0.5,
        "norm.weight": 1.0,
        "head.weight": 1.0,
    }
    named = dict(model.named_parameters())
    assert {n: lr_of[id(named[n])] for n in expect} == expect
    assert wd_of[id(named["head.weight"])] == 0.05 and wd_of[id(named["head.bias"])] == 0.0
    assert len(lr_of) == len(named)  # every parameter in exactly one group
    # off (1.0): the two groups as before, the optimizer's own lr
    opt = build_optimizer(model, OptimConfig(lr=1.0))
    assert len(opt.param_groups) == 2 and {g["lr"] for g in opt.param_groups} == {1.0}


@pytest.mark.parametrize(
    "what, blocks, trainable",
    [("backbone", 0, {"head.weight", "head.bias"}), ("embed", 1, "all but embeddings and block 0")],
)
def test_freezing_trains_only_the_rest(tmp_path, capsys, what, blocks, trainable):
    from vitscale.config import load_config
    from vitscale.loop import Trainer

    cfg = load_config(
        "configs/tests/tiny.toml",
        [
            f"model.freeze={what}",
            f"model.freeze_blocks={blocks}",
            "run.max_steps=3",
            "run.threads=1",
        ],
    )
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
        frozen = {
            n
            for n in before
            if n.startswith(("patch_embed.", "cls_token", "pos_embed", "blocks.0."))
        }
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
    cfg = load_config(
        "configs/tests/tiny.toml",
        [f"model.init={timm_file}", "model.heads=2", "data.image_size=16"],
    )
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
    assert (
        main(
            [
                "train",
                "configs/tests/tiny.toml",
                "--out",
                str(run),
                "--set",
                "train.epochs=1",
                "--set",
                "model.stem=conv",
                "--set",
                "model.head=pool",
                "--set",
                "run.threads=1",
            ]
        )
        == 0
    )
    path = tmp_path / "src.safetensors"
    assert main(["export", str(run), "--out", str(path)]) == 0
    assert weights_normalization(str(path)) == "dataset"
    spec, state = init_weights(str(path), image_size=16, in_chans=3, num_classes=6)
    assert (spec.stem, spec.head, spec.image_size, spec.in_chans, spec.num_classes) == (
        "conv",
        "pool",
        16,
        3,
        6,
    )
    assert (
        state["pos_embed"].shape == (1, 16, 32) and state["patch_embed.proj.0.weight"].shape[1] == 3
    )
    out = tmp_path / "ft"
    assert (
        main(
            [
                "train",
                "configs/tests/tiny.toml",
                "--out",
                str(out),
                "--set",
                f"model.init={path}",
                "--set",
                "data.image_size=16",
                "--set",
                "data.channels=3",
                "--set",
                "data.num_classes=6",
                "--set",
                "train.epochs=1",
                "--set",
                "run.threads=1",
            ]
        )
        == 0
    )
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


# -- what the weights leave open: config.json, an architecture name, or an announced default ----------
FIXTURE_ARGS = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
FIXTURE_VARIANT_ARGS = {
    "token": {},
    "avg": dict(class_token=False, global_pool="avg"),
    "noembed": dict(no_embed_class=True),
}


def hub_folder(tmp_path, name="token", folder="", **extra):
    """The fixture's weights as a timm hub folder: model.safetensors and config.json (timm's layout)."""
    import json

    folder = tmp_path / (folder or f"hub_{name}")
    folder.mkdir(exist_ok=True)
    write_state_dict(fixture(name)[2], folder / "model.safetensors")
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architecture": "vit_tiny_patch16_224",
                "num_classes": 5,
                "model_args": {**FIXTURE_ARGS, **FIXTURE_VARIANT_ARGS[name], **extra},
                "pretrained_cfg": {
                    "input_size": [3, 32, 32],
                    "mean": [0.5] * 3,
                    "std": [0.5] * 3,
                    "num_classes": 5,
                },
            }
        )
    )
    return folder


@pytest.mark.parametrize("name", ["token", "avg", "noembed"])
def test_a_hub_folder_gives_timms_function_with_nothing_assumed(tmp_path, caplog, name):
    from vitscale.interop import read_hub_config
    from vitscale.interop.finetune import init_weights
    from vitscale.models.vit import VisionTransformer

    x, logits, sd = fixture(name)
    folder = hub_folder(tmp_path, name)
    with caplog.at_level("WARNING", logger="vitscale.interop"):
        model = from_timm(sd, config=read_hub_config(folder / "model.safetensors")).eval()
        spec, state = init_weights(
            str(folder), image_size=32, in_chans=3, num_classes=5
        )  # the folder itself
    assert caplog.records == []
    assert model.spec.heads == 2 and spec == model.spec
    ours = VisionTransformer(spec).eval()
    ours.load_state_dict(state, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(x), logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(ours(x), model(x))
    # what the config says is what is computed: another activation gives another function
    quick = hub_folder(tmp_path, name, folder="quick", act_layer="quick_gelu")
    other = from_timm(sd, config=read_hub_config(quick / "config.json")).eval()
    assert other.spec.act == "quick_gelu"
    with torch.no_grad():
        assert (other(x) - logits).abs().max() > 1e-4


def test_without_config_or_name_the_assumptions_are_announced_in_one_line(tmp_path, caplog):
    from vitscale.interop.finetune import init_weights, weights_normalization

    path = weights_file(tmp_path)
    with caplog.at_level("WARNING", logger="vitscale.interop"):
        init_weights(path, image_size=32, in_chans=3, num_classes=5)
    (rec,) = caplog.records
    text = rec.getMessage()
    assert "\n" not in text and text.startswith(f"model.init: {path}: no config.json")
    for words in (
        "1 attention heads (model.heads)",
        "exact GELU",
        "LayerNorm eps 1e-6",
        "class token",
        "model.init_arch",
    ):
        assert words in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="vitscale.interop"):
        assert weights_normalization(path) == "imagenet"
    (rec,) = caplog.records
    assert "ImageNet's mean and std" in rec.getMessage() and "data.normalize" in rec.getMessage()


def test_an_architecture_name_says_what_the_weights_leave_open(tmp_path, caplog):
    """model.init_arch: timm's entry point arguments from timm/archs.py (here a real size: the
    width 768 at 16 heads of vit_base_patch16_gap_224, which width // 64 would get wrong)."""
    from vitscale.interop.finetune import weights_normalization
    from vitscale.interop.timm.vision_transformer import timm_vit_spec
    from vitscale.models.vit import VisionTransformer, ViTSpec

    src = ViTSpec(
        image_size=32, patch_size=16, dim=768, depth=12, heads=16, num_classes=10, head="pool"
    )
    with torch.device("meta"):
        sd = VisionTransformer(src).state_dict()
    with caplog.at_level("WARNING", logger="vitscale.interop"):
        spec = timm_vit_spec(sd, arch="vit_base_patch16_gap_224")
    assert caplog.records == [] and spec == src
    spec = timm_vit_spec(sd)  # from the keys alone: 12 heads, announced
    assert (
        spec.heads == 12 and "12 attention heads (model.heads)" in caplog.records[-1].getMessage()
    )
    with pytest.raises(UserError, match="model.heads=12, but the architecture has 16 heads"):
        timm_vit_spec(sd, heads=12, arch="vit_base_patch16_gap_224")
    # the architecture's pretrained config gives the normalization: its tag's mean/std
    path = weights_file(tmp_path)
    assert weights_normalization(path, "vit_base_patch16_clip_224.openai") == "clip"
    assert weights_normalization(path, "deit_small_patch16_224") == "imagenet"
    # an old name timm still accepts: its new name and tag (AugReg's in21k weights: mean 0.5, announced)
    from vitscale.interop.timm.vision_transformer import split_arch

    assert split_arch("vit_base_patch16_224_in21k") == ("vit_base_patch16_224", "augreg_in21k")
    assert timm_vit_spec(sd, arch="vit_base_patch16_gap_224") == timm_vit_spec(
        sd, config={"architecture": "vit_base_patch16_gap_224", "pretrained_cfg": {}}
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="vitscale.interop"):
        assert (
            weights_normalization(path, "vit_base_patch16_224.augreg2_in21k_ft_in1k") == "imagenet"
        )
    assert "mean (0.5, 0.5, 0.5)" in caplog.records[0].getMessage()


def test_init_arch_is_checked_with_the_config(tmp_path):
    """The task's check (tasks.check_config, which every command runs on its config)."""
    from vitscale.config import load_config as load
    from vitscale.errors import ConfigError
    from vitscale.tasks import check_config

    load_config = lambda *a: check_config(load(*a))  # noqa: E731
    path = weights_file(tmp_path)
    with pytest.raises(ConfigError, match="did you mean 'vit_base_patch16_224'"):
        load_config(
            "configs/tests/tiny.toml", [f"model.init={path}", "model.init_arch=vit_bse_patch16_224"]
        )
    with pytest.raises(ConfigError, match="no pretrained tag 'nope'"):
        load_config(
            "configs/tests/tiny.toml",
            [f"model.init={path}", "model.init_arch=vit_base_patch16_224.nope"],
        )
    with pytest.raises(ConfigError, match="given with model.init"):
        load_config("configs/tests/tiny.toml", ["model.init_arch=vit_base_patch16_224"])
    with pytest.raises(ConfigError, match="given with model.init"):
        load_config(
            "configs/tests/clip_tiny.toml",
            [f"model.init={path}", "model.init_arch=vit_base_patch16_224"],
        )
    cfg = load_config(
        "configs/tests/tiny.toml", [f"model.init={path}", "model.init_arch=deit_tiny_patch16_224"]
    )
    assert cfg.model.init_arch == "deit_tiny_patch16_224"


def test_vitspec_options_and_old_specs():
    """The options timm's variants need, without timm: a class token with the patch tokens' average
    (the class and register tokens left out), and a spec saved before the options existed."""
    from dataclasses import asdict

    from vitscale.models.vit import VisionTransformer, ViTSpec

    torch.manual_seed(0)
    spec = ViTSpec(
        image_size=16,
        patch_size=8,
        dim=16,
        depth=1,
        heads=2,
        num_classes=3,
        head="pool",
        class_token=True,
        reg_tokens=2,
        fc_norm=True,
        layer_scale=0.5,
        qkv_bias=False,
        pre_norm=True,
        norm_eps=1e-5,
        act="gelu_tanh",
    )
    m = VisionTransformer(spec).eval()
    assert (
        spec.num_tokens == 4 + 3
        and m.pos_embed.shape == (1, 7, 16)
        and m.patch_embed.proj.bias is None
    )
    assert m.blocks[0].attn.qkv.bias is None and torch.equal(
        m.blocks[0].ls1.gamma, torch.full((16,), 0.5)
    )
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        tokens = m.forward_features(x)
        torch.testing.assert_close(m(x), m.head(m.fc_norm(tokens[:, 3:].mean(1))))
    with pytest.raises(ValueError, match="needs the class token"):
        VisionTransformer(ViTSpec(head="token", class_token=False))
    old = {
        k: v
        for k, v in asdict(ViTSpec(head="pool", fc_norm=True)).items()
        if k
        not in (
            "class_token",
            "reg_tokens",
            "layer_scale",
            "qkv_bias",
            "pre_norm",
            "final_norm",
            "norm_eps",
            "act",
        )
    }
    assert (
        ViTSpec(**old) == ViTSpec(head="pool", fc_norm=True) and not ViTSpec(**old).has_class_token
    )


def test_register_tokens_keep_their_position_rows_at_another_geometry(tmp_path):
    """A class token and register tokens whose position rows come first (timm's reg_tokens without
    no_embed_class): resampled like timm's resample_abs_pos_embed(num_prefix_tokens=3)."""
    import json

    from vitscale.interop.finetune import init_weights
    from vitscale.models.vit import VisionTransformer, ViTSpec

    torch.manual_seed(0)
    src = VisionTransformer(
        ViTSpec(
            image_size=32,
            patch_size=8,
            dim=32,
            depth=1,
            heads=4,
            num_classes=5,
            reg_tokens=2,
            layer_scale=1e-5,
        )
    )
    folder = tmp_path / "reg"
    folder.mkdir()
    write_state_dict(to_timm(src), folder / "model.safetensors")
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architecture": "vit_small_patch16_224",
                "model_args": dict(
                    img_size=32,
                    patch_size=8,
                    embed_dim=32,
                    depth=1,
                    num_heads=4,
                    reg_tokens=2,
                    init_values=1e-5,
                ),
            }
        )
    )
    spec, state = init_weights(str(folder), image_size=48, in_chans=3, num_classes=5)
    assert (spec.reg_tokens, spec.heads, spec.num_tokens) == (
        2,
        4,
        3 + 36,
    ) and spec.layer_scale == 1e-5
    assert state["pos_embed"].shape == (1, 39, 32)
    assert torch.equal(state["pos_embed"][:, :3], src.pos_embed.detach()[:, :3])
    if HAVE_TIMM:
        from timm.layers import resample_abs_pos_embed

        torch.testing.assert_close(
            state["pos_embed"],
            resample_abs_pos_embed(src.pos_embed.detach(), [6, 6], num_prefix_tokens=3),
        )


# -- timm's training checkpoints (issue 35) -------------------------------------------------------
def _timm_checkpoint(path, sd, ema=None, arch="vit_tiny_patch16_224", raw=True):
    """What timm's train.py saves (checkpoint-N.pth.tar, model_best.pth.tar): the weights, their EMA,
    the optimizer's state and the pickled argparse.Namespace of its arguments."""
    import argparse

    obj = {
        "epoch": 3,
        "arch": arch,
        "optimizer": {"state": {}, "param_groups": []},
        "version": 2,
        "args": argparse.Namespace(model=arch, lr=1e-3, model_ema=ema is not None),
        "metric": 71.2,
    }
    if raw:
        obj["state_dict"] = sd
    if ema is not None:
        obj["state_dict_ema"] = ema
    torch.save(obj, path)
    return path


def test_a_timm_training_checkpoint_is_read_safely_and_says_which_weights(tmp_path, caplog):
    from vitscale.interop.files import read_weights

    _, _, sd = fixture("token")
    ema = {k: v + 1 for k, v in sd.items()}
    path = _timm_checkpoint(tmp_path / "model_best.pth.tar", sd, ema)
    with caplog.at_level("WARNING", logger="vitscale.interop"):
        got, arch = read_weights(path)
    assert arch == "vit_tiny_patch16_224" and all(torch.equal(got[k], sd[k]) for k in sd)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "reading its raw weights (state_dict); model.init_weights=ema reads the EMA ones" in line
    got, _ = read_weights(path, "ema")
    assert all(torch.equal(got[k], ema[k]) for k in sd)
    only_ema = _timm_checkpoint(tmp_path / "checkpoint-7.pth.tar", sd, ema, raw=False)
    caplog.clear()
    with caplog.at_level("WARNING", logger="vitscale.interop"):
        got, _ = read_weights(only_ema)
    assert all(torch.equal(got[k], ema[k]) for k in sd)
    assert (
        "reading its EMA weights (state_dict_ema) (it holds no others)"
        in caplog.records[-1].getMessage()
    )
    for which, fn, message in [
        ("ema", lambda: _timm_checkpoint(tmp_path / "raw.pth.tar", sd), "holds no EMA weights"),
        ("raw", lambda: only_ema, "holds only EMA weights"),
    ]:
        with pytest.raises(UserError, match=message) as e:
            read_weights(fn(), which)
        assert "\n" not in str(e.value)


def test_a_pickle_with_code_is_refused_in_one_plain_line(tmp_path):
    import fractions
    from collections import (
        OrderedDict as Code,  # any class torch's weights-only loader does not allow
    )

    _, _, sd = fixture("token")
    torch.save({"state_dict": sd, "args": fractions.Fraction(1, 3)}, tmp_path / "ckpt.pth")
    with pytest.raises(UserError) as e:
        read_state_dict(tmp_path / "ckpt.pth")
    text = str(e.value)
    assert "holds a pickled fractions.Fraction, which a weights-only load does not run" in text, (
        text
    )
    assert "\n" not in text and "\x1b" not in text and len(text) < 300
    assert Code  # (the import above only names what such a class is)


def test_model_init_of_a_timm_checkpoint_takes_its_architecture(tmp_path, caplog):
    """model.init=model_best.pth.tar: the architecture from its `arch` entry (vit_tiny_patch16_224:
    3 heads, announced), so no "timm's defaults" assumption line; the EMA choice by model.init_weights."""
    from vitscale.cli import main
    from vitscale.models.vit import VisionTransformer, ViTSpec

    torch.manual_seed(0)
    sd = VisionTransformer(
        ViTSpec(image_size=224, patch_size=16, dim=192, depth=12, heads=3, num_classes=1000)
    ).state_dict()
    path = _timm_checkpoint(
        tmp_path / "model_best.pth.tar", sd, {k: v.clone() for k, v in sd.items()}
    )
    with caplog.at_level("WARNING"):
        assert (
            main(
                [
                    "info",
                    "configs/tests/tiny.toml",
                    "--set",
                    f"model.init={path}",
                    "--set",
                    "model.init_weights=ema",
                    "--set",
                    "data.image_size=32",
                    "--set",
                    "model.heads=0",
                    "--json",
                ]
            )
            == 0
        )
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        "the architecture is the one the checkpoint names, vit_tiny_patch16_224" in x for x in lines
    ), lines
    assert any("reading its EMA weights (state_dict_ema)" in x for x in lines), lines
    assert not any("no config.json" in x for x in lines), lines


# -- files users have, one line each (issue 35 items 4-6) ----------------------------------------
def test_a_hub_name_or_a_torchscript_archive_is_one_line_that_says_what_to_do(tmp_path):
    from vitscale.interop.files import read_state_dict as read

    with pytest.raises(UserError) as e:
        read("vit_small_patch16_224.augreg_in21k_ft_in1k")
    assert "vitscale reads local files, not a hub" in str(e.value)
    assert "huggingface-cli download timm/vit_small_patch16_224.augreg_in21k_ft_in1k" in str(
        e.value
    )
    with pytest.raises(UserError) as e:
        read(tmp_path / "typo.safetensors")  # a file path that is wrong: no hub advice
    assert str(e.value) == f"weights file not found: {tmp_path / 'typo.safetensors'}"
    torch.jit.script(torch.nn.Linear(2, 2)).save(str(tmp_path / "ViT-B-32.pt"))
    with pytest.raises(UserError) as e:
        read(tmp_path / "ViT-B-32.pt")
    assert "a TorchScript archive" in str(e.value) and "\n" not in str(e.value)


def test_info_with_model_init_is_one_line_named_after_the_weights(tmp_path, capsys):
    """`vitscale info` with model.init: one line, no per-tensor torch warnings (the meta model is
    not loaded), labelled by the architecture given for the weights, not the recipe's model.arch."""
    from safetensors.torch import save_file

    from vitscale.cli import main
    from vitscale.models.vit import VisionTransformer, ViTSpec

    sd = VisionTransformer(
        ViTSpec(image_size=224, patch_size=16, dim=192, depth=12, heads=3, num_classes=1000)
    ).state_dict()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "w.safetensors"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert (
            main(
                [
                    "info",
                    "configs/tests/tiny.toml",
                    "--set",
                    f"model.init={tmp_path / 'w.safetensors'}",
                    "--set",
                    "model.init_arch=vit_tiny_patch16_224",
                    "--set",
                    "model.heads=0",
                    "--set",
                    "data.image_size=32",
                ]
            )
            == 0
        )
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(
        f"vit_tiny_patch16_224 ({tmp_path / 'w.safetensors'}): 5."
    )
    assert not [w for w in caught if "non-meta" in str(w.message)]


def test_an_open_clip_hub_folder_is_read_as_its_weights_file(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from vitscale.cli import main

    folder = tmp_path / "hub"
    folder.mkdir()
    sd = {
        k: v
        for k, v in load_file(str(FIXTURES / "open_clip_tiny.safetensors")).items()
        if not k.startswith("__")
    }
    save_file(sd, str(folder / "open_clip_model.safetensors"))
    errs = []
    for init in (folder / "open_clip_model.safetensors", folder):
        assert main(["info", "configs/tests/clip_tiny.toml", "--set", f"model.init={init}"]) == 2
        errs.append(capsys.readouterr().err)
    assert (
        errs[0] == errs[1] and "weights file not found" not in errs[1]
    )  # (the fixture's 64-token vocabulary)
    (tmp_path / "empty").mkdir()
    assert (
        main(["info", "configs/tests/clip_tiny.toml", "--set", f"model.init={tmp_path / 'empty'}"])
        == 2
    )
    assert "no OpenCLIP weights file (open_clip_model.safetensors" in capsys.readouterr().err


def test_the_keys_only_line_names_the_pooling_it_assumes(caplog):
    """fc_norm keys say the features are pooled, not how: timm's 'avg', 'max' and fc_norm=True with
    the class token all leave them, and differ in function (issue 35 item 3): the line names the
    pooling it assumes and says the file cannot confirm it."""
    _, _, sd = fixture("avg")
    with caplog.at_level("WARNING", logger="vitscale.interop"):
        spec = timm_vit_spec(sd)
    assert spec.head == "pool" and spec.fc_norm
    text = caplog.records[-1].getMessage()
    assert "the file cannot confirm it" in text and "\n" not in text
    assert (
        "the average of the patch tokens, then fc_norm as the feature (global_pool='avg', not 'max'"
        in text
    )
    _, _, sd = fixture("token")
    with caplog.at_level("WARNING", logger="vitscale.interop"):
        timm_vit_spec(sd)
    assert (
        "the class token's features, not the patch tokens' average"
        in caplog.records[-1].getMessage()
    )
