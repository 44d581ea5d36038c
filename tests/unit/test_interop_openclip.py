"""OpenCLIP ViT CLIP weights in and out (vitscale/interop/open_clip/convert.py). Against open_clip itself
where it imports (it needs torchvision: ../shared/tools/tv_cpu_stub makes that work on a CPU torch),
else against the small state dict and the features open_clip computed for it that
tests/fixtures/open_clip_tiny.safetensors ships (made by open_clip 3.3.0 with `make_fixture` below:
`open_clip.CLIP(embed_dim=16, vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=2,
head_width=16), text_cfg=dict(context_length=16, vocab_size=64, width=32, heads=2, layers=2))`,
every parameter normal(0, 0.1) rounded to fp16, features for GELU and QuickGELU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vitscale.errors import UserError
from vitscale.interop import (
    from_open_clip,
    open_clip_spec,
    read_state_dict,
    to_open_clip,
    write_state_dict,
)
from vitscale.models import CLIP, resolve_clip_spec

FIXTURE = Path(__file__).parents[1] / "fixtures" / "open_clip_tiny.safetensors"
TINY = dict(
    embed_dim=16,
    vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=2, head_width=16),
    text_cfg=dict(context_length=16, vocab_size=64, width=32, heads=2, layers=2),
)
HEADS = dict(vision_heads=2, text_heads=2)  # not in the weights; width // 64 would give 1

try:
    import open_clip

    HAVE_OPEN_CLIP, WHY = True, ""
except Exception as e:  # not installed, or torchvision missing (CI)
    open_clip, HAVE_OPEN_CLIP = None, False
    WHY = f"open_clip does not import ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"
needs_open_clip = pytest.mark.skipif(
    not HAVE_OPEN_CLIP, reason=WHY + "; the shipped fixture is checked instead"
)


def inputs(image_size: int, context: int, vocab: int, n: int = 3, seed: int = 0):
    """Images, and token rows as the tokenizer writes them: start, words, end (the largest id), padding."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, image_size, image_size, generator=g)
    tokens = torch.zeros(n, context, dtype=torch.long)
    for i, length in enumerate((context - 1 - 3 * i) for i in range(n)):
        tokens[i, 0] = vocab - 2
        tokens[i, 1:length] = torch.randint(1, vocab - 2, (length - 1,), generator=g)
        tokens[i, length] = vocab - 1
    return images, tokens


def features(model, images, tokens, theirs: bool):
    """Unnormalized image and text features (OpenCLIP's encode_* default; vitscale's normalize=False)."""
    with torch.no_grad():
        if theirs:
            return model.encode_image(images), model.encode_text(tokens)
        return model.encode_image(images, normalize=False), model.encode_text(
            tokens, normalize=False
        )


def perturb(model, std: float = 0.1, seed: int = 0):
    """Every parameter random (OpenCLIP's init has zero biases and unit norms, which would hide a swap)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "logit_scale":
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def make_fixture(path: Path = FIXTURE) -> None:
    """The shipped fixture (needs open_clip):
    `python -c "import tests.test_interop_openclip as t; t.make_fixture()"`."""
    model = perturb(open_clip.CLIP(**TINY)).eval()
    with torch.no_grad():  # fp16-exact values, so that the file can hold them in half the bytes
        for p in model.parameters():
            p.copy_(p.half().float())
    sd = {k: v.half() for k, v in model.state_dict().items()}
    images, tokens = inputs(32, 16, 64)
    out = {**sd, "__images__": images, "__tokens__": tokens}
    for act, quick in (("gelu", False), ("quick_gelu", True)):
        m = open_clip.CLIP(**TINY, quick_gelu=quick).eval()
        m.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
        out[f"__image_{act}__"], out[f"__text_{act}__"] = features(m, images, tokens, theirs=True)
    save_file(
        {k: v.contiguous() for k, v in out.items()},
        str(path),
        metadata={"open_clip": open_clip.__version__},
    )


def fixture():
    sd = load_file(str(FIXTURE))
    extra = {k: sd.pop(k) for k in list(sd) if k.startswith("__")}
    return sd, extra


def assert_close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# -- the shipped fixture (always) --------------------------------------------------------------------
def test_fixture_spec_is_read_from_the_shapes():
    sd, _ = fixture()
    spec = open_clip_spec(sd, **HEADS)
    v, t = spec.vision, spec.text
    assert (v.image_size, v.patch_size, v.dim, v.depth, v.heads, v.mlp_ratio, v.head) == (
        32,
        8,
        32,
        2,
        2,
        4.0,
        "token",
    )
    assert (t.vocab_size, t.context_length, t.dim, t.depth, t.heads, t.mlp_ratio) == (
        64,
        16,
        32,
        2,
        2,
        4.0,
    )
    assert spec.embed_dim == 16 == t.embed_dim == v.num_classes
    assert (spec.ln_pre, spec.patch_bias, spec.proj_bias, spec.vision_norm_eps, t.norm_eps) == (
        True,
        False,
        False,
        1e-5,
        1e-5,
    )
    assert (spec.vision_act, t.act) == ("gelu", "gelu")
    q = open_clip_spec(sd, quick_gelu=True)
    assert (q.vision_act, q.text.act, q.vision.heads, q.text.heads) == (
        "quick_gelu",
        "quick_gelu",
        1,
        1,
    )


@pytest.mark.parametrize("act", ["gelu", "quick_gelu"])
@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_shipped_weights_give_open_clips_features(act, attention):
    sd, x = fixture()
    model = from_open_clip(sd, quick_gelu=act == "quick_gelu", attention=attention, **HEADS).eval()
    img, txt = features(model, x["__images__"], x["__tokens__"], theirs=False)
    assert_close(img, x[f"__image_{act}__"])
    assert_close(txt, x[f"__text_{act}__"])
    # forward: the same, L2-normalized, and OpenCLIP's logit_scale as shape [1]
    with torch.no_grad():
        fi, ft, scale = model(x["__images__"], x["__tokens__"])
    assert_close(fi, torch.nn.functional.normalize(x[f"__image_{act}__"], dim=-1))
    assert_close(ft, torch.nn.functional.normalize(x[f"__text_{act}__"], dim=-1))
    assert scale.shape == (1,) and scale.item() == sd["logit_scale"].float().item()


def test_shipped_weights_round_trip_exactly(tmp_path):
    sd, x = fixture()
    model = from_open_clip(sd, **HEADS).eval()
    out = to_open_clip(model)
    assert out.keys() == sd.keys()
    for k in sd:
        assert (
            out[k].dtype == torch.float32
            and out[k].shape == sd[k].shape
            and torch.equal(out[k], sd[k].float())
        ), k
    for suffix in (".safetensors", ".pt"):
        again = from_open_clip(
            read_state_dict(write_state_dict(out, tmp_path / f"w{suffix}")), **HEADS
        ).eval()
        assert torch.equal(
            features(again, x["__images__"], x["__tokens__"], False)[1],
            features(model, x["__images__"], x["__tokens__"], False)[1],
        )


def test_custom_text_layout_and_openai_extras_are_read():
    """CustomTextCLIP keeps the text tower under `text.`; OpenAI's files carry three size scalars."""
    sd, x = fixture()
    custom = {
        (k if k.startswith(("visual.", "logit_scale")) else f"text.{k}"): v for k, v in sd.items()
    }
    custom.update(
        input_resolution=torch.tensor(32),
        context_length=torch.tensor(16),
        vocab_size=torch.tensor(64),
    )
    model = from_open_clip(custom, **HEADS).eval()
    assert_close(features(model, x["__images__"], x["__tokens__"], False)[1], x["__text_gelu__"])


def test_no_ln_pre_is_read_as_such():
    sd, _ = fixture()
    sd = {k: v for k, v in sd.items() if not k.startswith("visual.ln_pre.")}
    model = from_open_clip(sd, **HEADS)
    assert not model.spec.ln_pre and isinstance(model.visual.norm_pre, torch.nn.Identity)
    assert to_open_clip(model).keys() == sd.keys()


def test_defaults_keep_vitscales_clip():
    spec = resolve_clip_spec("clip_tiny")
    assert (
        spec.ln_pre,
        spec.patch_bias,
        spec.proj_bias,
        spec.vision_norm_eps,
        spec.vision_act,
    ) == (False, True, True, 1e-6, "gelu")
    assert (spec.text.norm_eps, spec.text.act) == (1e-6, "gelu")
    model = CLIP(spec)
    assert (
        isinstance(model.visual.norm_pre, torch.nn.Identity) and model.visual.head.bias is not None
    )
    assert model.visual.patch_embed.proj.bias is not None
    assert {m.eps for m in model.modules() if isinstance(m, torch.nn.LayerNorm)} == {1e-6}
    assert all(type(m.act) is torch.nn.GELU for m in model.modules() if hasattr(m, "fc1"))


def one_line(fn) -> str:
    with pytest.raises(UserError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_bad_inputs_are_one_line_errors():
    sd, _ = fixture()
    timm_like = {
        "pos_embed": torch.zeros(1, 5, 8),
        "patch_embed.proj.weight": torch.zeros(8, 3, 4, 4),
    }
    unknown = {**sd, "visual.extra.weight": torch.zeros(3)}
    missing = {k: v for k, v in sd.items() if k != "transformer.resblocks.1.mlp.c_proj.bias"}
    bad_shape = {**sd, "visual.ln_post.weight": torch.zeros(7)}
    siglip = {**sd, "logit_bias": torch.zeros(())}
    gap = {k: v for k, v in sd.items() if not k.startswith("transformer.resblocks.0.")}
    grid = {**sd, "visual.positional_embedding": torch.zeros(19, 32)}
    cases = [
        (lambda: from_open_clip(timm_like), "not an OpenCLIP ViT CLIP state dict"),
        (lambda: from_open_clip(unknown, **HEADS), "unknown keys visual.extra.weight"),
        (
            lambda: from_open_clip(missing, **HEADS),
            "missing keys transformer.resblocks.1.mlp.c_proj.bias",
        ),
        (lambda: from_open_clip(bad_shape, **HEADS), "visual.ln_post.weight has shape (7,)"),
        (lambda: from_open_clip(siglip, **HEADS), "SigLIP's logit_bias"),
        (lambda: from_open_clip(gap, **HEADS), "not numbered 0..N-1"),
        (lambda: from_open_clip(grid, **HEADS), "no square patch grid"),
        (lambda: open_clip_spec(sd, vision_heads=3), "image width 32 is not divisible by 3 heads"),
        (lambda: to_open_clip(CLIP(resolve_clip_spec("clip_tiny"))), "lacks OpenCLIP's layout"),
        (lambda: to_open_clip(torch.nn.Linear(2, 2)), "not a vitscale CLIP model"),
    ]
    for fn, want in cases:
        msg = one_line(fn)
        assert want in msg, msg


# -- what the weights leave open: OpenCLIP's configuration, else announced defaults ----------------------
TINY_CONFIG = {"model_cfg": {"embed_dim": 16, **TINY}}  # an open_clip_config.json's content


def layout(model_cfg: dict) -> dict:
    """OpenCLIP's CLIP keys and shapes (meta tensors: no memory) for a ViT model_cfg."""
    v, t, E = model_cfg["vision_cfg"], model_cfg["text_cfg"], model_cfg["embed_dim"]
    W, p, S, tw = v["width"], v["patch_size"], v["image_size"], t["width"]
    e = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
    sd = {
        "visual.conv1.weight": e(W, 3, p, p),
        "visual.class_embedding": e(W),
        "visual.positional_embedding": e((S // p) ** 2 + 1, W),
        "visual.proj": e(W, E),
        "logit_scale": e(),
        "token_embedding.weight": e(t.get("vocab_size", 49408), tw),
        "positional_embedding": e(t.get("context_length", 77), tw),
        "text_projection": e(tw, E),
    }
    norms = ["visual.ln_post", "ln_final"] + ([] if v.get("no_ln_pre") else ["visual.ln_pre"])
    sd |= {
        f"{n}.{q}": e(W if n.startswith("visual") else tw)
        for n in norms
        for q in ("weight", "bias")
    }
    for pre, w, n, ratio in (
        ("visual.", W, v["layers"], v.get("mlp_ratio", 4.0)),
        ("", tw, t["layers"], t.get("mlp_ratio", 4.0)),
    ):
        h = int(w * ratio)
        for i in range(n):
            b = f"{pre}transformer.resblocks.{i}."
            sd |= {
                b + "ln_1.weight": e(w),
                b + "ln_1.bias": e(w),
                b + "ln_2.weight": e(w),
                b + "ln_2.bias": e(w),
                b + "attn.in_proj_weight": e(3 * w, w),
                b + "attn.in_proj_bias": e(3 * w),
                b + "attn.out_proj.weight": e(w, w),
                b + "attn.out_proj.bias": e(w),
                b + "mlp.c_fc.weight": e(h, w),
                b + "mlp.c_fc.bias": e(h),
                b + "mlp.c_proj.weight": e(w, h),
                b + "mlp.c_proj.bias": e(w),
            }
    return sd


def announcements(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "OpenCLIP's defaults" in r.getMessage()]


def test_open_clip_config_says_what_the_weights_leave_open(tmp_path, caplog):
    """Heads and activation from OpenCLIP's configuration (given, or the open_clip_config.json beside
    the file): OpenCLIP's features with no argument and no warning; without one, one warning line."""
    import json

    from vitscale.interop.open_clip.convert import load_open_clip

    sd, x = fixture()
    for act in ("gelu", "quick_gelu"):
        config = {"model_cfg": {**TINY_CONFIG["model_cfg"], "quick_gelu": act == "quick_gelu"}}
        caplog.clear()
        model = from_open_clip(sd, config).eval()
        assert (model.spec.vision.heads, model.spec.text.heads, model.spec.vision_act) == (
            2,
            2,
            act,
        )
        assert_close(
            features(model, x["__images__"], x["__tokens__"], False)[1], x[f"__text_{act}__"]
        )
        folder = tmp_path / act
        write_state_dict(sd, folder / "open_clip_pytorch_model.safetensors")
        (folder / "open_clip_config.json").write_text(json.dumps(config))
        model = load_open_clip(folder / "open_clip_pytorch_model.safetensors").eval()
        img, txt = features(model, x["__images__"], x["__tokens__"], False)
        assert_close(img, x[f"__image_{act}__"])
        assert_close(txt, x[f"__text_{act}__"])
        assert announcements(caplog) == []
    # a bare file: OpenCLIP's defaults, said in one line with the arguments that change them
    caplog.clear()
    bare = load_open_clip(write_state_dict(sd, tmp_path / "bare.safetensors"))
    (line,) = announcements(caplog)
    assert (
        "\n" not in line and "image heads 1 (width 32 / head width 64)" in line and "GELU" in line
    )
    assert "config=NAME or an open_clip_config.json" in line and bare.spec.vision.heads == 1
    caplog.clear()
    from_open_clip(sd, **HEADS)
    (line,) = announcements(caplog)
    assert "image heads 2 (given)" in line and "the class token's image feature" in line


def test_a_configuration_that_does_not_fit_the_weights_is_refused(tmp_path):
    import json

    from vitscale.interop.open_clip.convert import load_open_clip

    sd, _ = fixture()
    other = json.loads(json.dumps(TINY_CONFIG))
    other["model_cfg"]["vision_cfg"]["patch_size"] = 16
    quick = {"model_cfg": {**TINY_CONFIG["model_cfg"], "quick_gelu": True}}
    cases = [
        (
            lambda: from_open_clip(sd, other),
            "does not describe these weights: patch size 16 (the weights: 8)",
        ),
        (
            lambda: from_open_clip(sd, "ViT-B-32"),
            "the ViT-B-32 configuration does not describe these weights",
        ),
        (
            lambda: from_open_clip(sd, "ViT-B-31"),
            "no model configuration 'ViT-B-31' in OpenCLIP 3.3.0",
        ),
        (lambda: from_open_clip(sd, TINY_CONFIG, vision_heads=4), "vision_heads=4 disagrees with"),
        (lambda: from_open_clip(sd, quick, quick_gelu=False), "quick_gelu=gelu disagrees with"),
        (
            lambda: from_open_clip(sd, str(tmp_path / "missing.json")),
            "not a readable open_clip_config.json",
        ),
    ]
    for fn, want in cases:
        msg = one_line(fn)
        assert want in msg, msg
    (tmp_path / "open_clip_config.json").write_text("{not json")
    path = write_state_dict(sd, tmp_path / "w.safetensors")
    assert "open_clip_config.json: not a readable open_clip_config.json" in one_line(
        lambda: load_open_clip(path)
    )


def test_wide_towers_take_their_head_count_from_the_configuration(caplog):
    """ViT-H-14, ViT-g-14, ViT-bigG-14 and ViT-e-14 have head widths 80, 88, 104 and 112: width // 64
    would split them wrongly, so without a configuration they are refused; named, they are exact."""
    from vitscale.interop.open_clip.configs import CONFIGS
    from vitscale.interop.open_clip.convert import open_clip_spec

    for name, heads in (("ViT-H-14", 16), ("ViT-g-14", 16), ("ViT-bigG-14", 16), ("ViT-e-14", 16)):
        mc = CONFIGS[name]
        sd = layout(mc)
        caplog.clear()
        spec = open_clip_spec(sd, name)
        v, t = spec.vision, spec.text
        assert (v.heads, t.heads) == (heads, mc["text_cfg"]["heads"]) and announcements(
            caplog
        ) == []
        assert int(v.dim * v.mlp_ratio) == int(
            mc["vision_cfg"]["width"] * mc["vision_cfg"].get("mlp_ratio", 4.0)
        )
        msg = one_line(lambda: open_clip_spec(sd))  # noqa: B023 - called at once
        assert (
            f"have {heads} heads (head width {v.dim // heads}), not width // 64 = {v.dim // 64}"
            in msg
        ), msg
        assert (
            open_clip_spec(sd, vision_heads=heads).vision.heads == heads
        )  # given: taken (and announced)


def test_configurations_vitscale_does_not_compute_are_refused_with_their_cause():
    """OpenCLIP's own configurations by name: the configuration key that shows the variant."""
    from vitscale.interop.open_clip.convert import open_clip_spec

    sd = layout(
        {
            "embed_dim": 512,
            **{k: v for k, v in TINY_CONFIG["model_cfg"].items() if k != "embed_dim"},
        }
    )
    for name, want in (
        (
            "convnext_base",
            "a timm image tower other than timm's ViTs (vision_cfg.timm_model_name='convnext_base')",
        ),
        (
            "vit_medium_patch16_gap_256",
            "a projection head after the timm trunk (vision_cfg.timm_proj='linear')",
        ),
        ("RN50", "a ResNet image tower (vision_cfg.layers=[3, 4, 6, 3])"),
        ("roberta-ViT-B-32", "a Hugging Face text tower (text_cfg.hf_model_name='roberta-base')"),
        ("coca_ViT-B-32", "CoCa's text decoder (multimodal_cfg)"),
    ):
        msg = one_line(lambda: open_clip_spec(sd, name))  # noqa: B023 - called at once
        assert (
            f"OpenCLIP: the {name} configuration: {want}" in msg
            and "is not implemented by vitscale's CLIP" in msg
        ), msg


def test_clip_model_init_config_check_names_the_real_cause(tmp_path):
    """`vitscale train` with model.init of an OpenCLIP file vitscale cannot start from: one line, the cause."""
    import json

    from vitscale.config import load_config as load
    from vitscale.errors import ConfigError
    from vitscale.tasks import check_config

    load_config = lambda *a: check_config(load(*a))  # noqa: E731  (the task's check, as every command runs it)
    text = {k: v for k, v in fixture()[0].items() if not k.startswith("visual.")}
    convnext = {
        **text,
        "visual.trunk.stem.0.weight": torch.zeros(8, 3, 4, 4),
        "visual.head.proj.weight": torch.zeros(4, 8),
    }
    cases = [
        (
            write_state_dict(convnext, tmp_path / "convnext.safetensors"),
            "",
            "a timm image tower (visual.trunk.",
        )
    ]
    siglip = tmp_path / "siglip"
    write_state_dict(convnext, siglip / "open_clip_model.safetensors")
    from vitscale.interop.open_clip.configs import CONFIGS

    (siglip / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": CONFIGS["ViT-B-16-SigLIP"]})
    )
    cases.append(  # (SigLIP's weights load: its tokenizer is what a run cannot have)
        (
            siglip / "open_clip_model.safetensors",
            "",
            "another tokenizer (text_cfg.hf_tokenizer_name='timm/ViT-B-16-SigLIP')",
        )
    )
    sd, _ = fixture()
    clipa = tmp_path / "clipa"
    write_state_dict(sd, clipa / "open_clip_model.safetensors")
    cfg = json.loads(json.dumps(TINY_CONFIG))
    cfg["model_cfg"]["text_cfg"]["hf_tokenizer_name"] = "bert-base-uncased"
    (clipa / "open_clip_config.json").write_text(json.dumps(cfg))
    cases.append(
        (
            clipa / "open_clip_model.safetensors",
            "",
            "another tokenizer (text_cfg.hf_tokenizer_name=",
        )
    )
    cases.append(
        (
            write_state_dict(sd, tmp_path / "oc.safetensors"),
            "ViT-L-99",
            "no model configuration 'ViT-L-99'",
        )
    )
    for path, name, want in cases:
        with pytest.raises(ConfigError) as e:
            load_config(
                "configs/tests/clip_tiny.toml",
                [f"model.init={path}", f"model.init_open_clip={name}"],
            )
        assert want in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="model.init_open_clip describes CLIP weights"):
        load_config("configs/tests/tiny.toml", ["model.init_open_clip=ViT-B-32"])


def test_export_writes_open_clip_config_beside_the_weights(tmp_path, caplog):
    import json

    from vitscale.interop.open_clip.convert import (
        load_call,
        load_open_clip,
        open_clip_config,
        save_open_clip,
    )

    sd, x = fixture()
    model = from_open_clip(sd, TINY_CONFIG).eval()
    cfg = open_clip_config(model.spec)["model_cfg"]
    assert cfg == {
        "embed_dim": 16,
        "quick_gelu": False,
        "vision_cfg": {**TINY["vision_cfg"], "mlp_ratio": 4.0},
        "text_cfg": {**TINY["text_cfg"], "mlp_ratio": 4.0},
    }
    pre = {"size": 32, "mean": [0.5] * 3, "std": [0.25] * 3}
    path = save_open_clip(model, tmp_path / "out", pre)
    assert path == tmp_path / "out" / "open_clip_model.safetensors"
    saved = json.loads((tmp_path / "out" / "open_clip_config.json").read_text())
    assert saved == {"model_cfg": cfg, "preprocess_cfg": pre}
    caplog.clear()
    again = load_open_clip(path).eval()  # the configuration beside it: no default taken
    assert announcements(caplog) == []
    for a, b in zip(
        features(again, x["__images__"], x["__tokens__"], False),
        features(model, x["__images__"], x["__tokens__"], False),
    ):
        assert torch.equal(a, b)
    assert f'create_model_and_transforms("local-dir:{path.parent}")' in load_call(path)
    assert save_open_clip(model, tmp_path / "out", pre) == path  # the same model again: fine
    other = from_open_clip(sd, {"model_cfg": {**TINY_CONFIG["model_cfg"], "quick_gelu": True}})
    assert "already describes another model" in one_line(
        lambda: save_open_clip(other, tmp_path / "out", pre)
    )
    # a file in a folder whose other weights open_clip's local-dir: loader would take first
    write_state_dict({"a": torch.zeros(1)}, tmp_path / "mixed" / "model.safetensors")
    path = save_open_clip(model, tmp_path / "mixed" / "clip.safetensors", pre)
    assert "would read model.safetensors" in load_call(path) and "\n" not in load_call(path)
    assert "give a folder or a .safetensors file" in one_line(
        lambda: save_open_clip(model, tmp_path / "m.bin")
    )
    # the preprocessing a run's data had (a checkpoint without its record: derived from its config)
    from dataclasses import asdict

    from vitscale.config import load_config
    from vitscale.tasks import build_task

    for name, mode, interp in (
        ("openclipart", "longest", "bicubic"),
        ("csv", "shortest", "bilinear"),
    ):
        c = load_config("configs/tests/clip_tiny.toml", [f"data.name={name}", "data.channels=3"])
        task = build_task(c)
        p = task.run_preprocess(asdict(task.build_spec(64, 3)))
        assert (p["size"], p["resize_mode"], p["interpolation"]) == (64, mode, interp)
        assert p["mean"] == [0.48145466, 0.4578275, 0.40821073]


# -- against open_clip itself (where it imports) ------------------------------------------------------
@needs_open_clip
def test_shipped_fixture_is_what_open_clip_computes():
    sd, x = fixture()
    for act, quick in (("gelu", False), ("quick_gelu", True)):
        m = open_clip.CLIP(**TINY, quick_gelu=quick).eval()
        m.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
        img, txt = features(m, x["__images__"], x["__tokens__"], theirs=True)
        assert_close(img, x[f"__image_{act}__"])
        assert_close(txt, x[f"__text_{act}__"])


def open_clip_model(name: str, layers: int | None, **cfg):
    """open_clip's configuration `name` (its `layers` reduced where given: 2 CPU cores), random weights;
    the full models as open_clip.create_model builds them."""
    if layers is None and not cfg:
        model = open_clip.create_model(name, pretrained=None)
        return (
            perturb(model, std=0.02).eval(),
            open_clip.get_model_config(name),
            name.endswith("-quickgelu"),
        )
    c = open_clip.get_model_config(name)
    c = {**c, "vision_cfg": dict(c["vision_cfg"]), "text_cfg": dict(c["text_cfg"]), **cfg}
    quick = c.pop("quick_gelu", False)
    if layers:
        c["vision_cfg"]["layers"] = c["text_cfg"]["layers"] = layers
    return perturb(open_clip.CLIP(**c, quick_gelu=quick), std=0.02).eval(), c, quick


@needs_open_clip
@pytest.mark.parametrize(
    "name, layers, cfg",
    [
        ("ViT-B-32", None, {}),  # the full model, as open_clip.create_model builds it
        ("ViT-B-32-quickgelu", 3, {}),  # fewer layers: 2 CPU cores
        ("ViT-B-16", 3, {}),
        ("ViT-S-32", 2, {}),
        ("ViT-M-16", 2, {}),
        (
            "ViT-B-32",
            2,
            {"vision_cfg": dict(image_size=96, patch_size=32, layers=2, width=768, no_ln_pre=True)},
        ),
    ],
)
def test_open_clip_models_give_the_same_features(name, layers, cfg):
    theirs, c, quick = open_clip_model(name, layers, **cfg)
    assert quick == name.endswith("-quickgelu")
    images, tokens = inputs(
        c["vision_cfg"]["image_size"], c["text_cfg"]["context_length"], 49408, n=2
    )
    ours = from_open_clip(theirs.state_dict(), quick_gelu=quick).eval()
    assert ours.spec.vision.heads == c["vision_cfg"]["width"] // 64
    assert ours.spec.text.heads == c["text_cfg"].get("heads", 8)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    (a, b), (p, q) = features(theirs, images, tokens, True), features(ours, images, tokens, False)
    assert_close(p, a)
    assert_close(q, b)
    for mine, ref in (
        (p, a),
        (q, b),
    ):  # the features are ~0.05 here: relative to their size as well
        assert (mine - ref).abs().max() <= 1e-5 * ref.abs().max()
    with torch.no_grad():
        assert_close(ours.encode_image(images), theirs.encode_image(images, normalize=True))
        assert_close(ours.encode_text(tokens), theirs.encode_text(tokens, normalize=True))
    # and back: OpenCLIP's model of the same configuration loads it strictly and computes the same
    back = open_clip.CLIP(
        **{k: v for k, v in c.items() if k != "quick_gelu"}, quick_gelu=quick
    ).eval()
    back.load_state_dict(to_open_clip(ours), strict=True)
    (a2, b2) = features(back, images, tokens, True)
    assert torch.equal(a2, a) and torch.equal(b2, b)


@needs_open_clip
def test_open_clip_custom_text_layout():
    """CustomTextCLIP's layout (the text tower under `text.`) reads the same; it exports as CLIP's."""
    c = open_clip.get_model_config("ViT-B-32")
    c = {
        **c,
        "vision_cfg": {**c["vision_cfg"], "layers": 2},
        "text_cfg": {**c["text_cfg"], "layers": 2},
    }
    theirs = perturb(open_clip.CustomTextCLIP(**c), std=0.02).eval()
    assert any(k.startswith("text.") for k in theirs.state_dict())
    images, tokens = inputs(224, 77, 49408, n=2)
    ours = from_open_clip(theirs.state_dict()).eval()
    (a, b), (p, q) = features(theirs, images, tokens, True), features(ours, images, tokens, False)
    assert_close(p, a)
    assert_close(q, b)
    plain = open_clip.CLIP(**c).eval()
    plain.load_state_dict(to_open_clip(ours), strict=True)


# -- model.init: a CLIP run starting from OpenCLIP weights ------------------------------------------------
def test_init_weights_adapts_the_geometry_exactly_where_it_can(tmp_path):
    from vitscale.interop.open_clip.convert import init_weights, uses_quick_gelu

    sd, x = fixture()
    path = write_state_dict(sd, tmp_path / "oc.safetensors")
    # the same geometry and a shorter context: the same function (causal attention never looks ahead)
    spec, state = init_weights(
        path, image_size=32, in_chans=3, context_length=12, vocab_size=64, **HEADS
    )
    assert spec.text.context_length == 12 and state["text.positional_embedding"].shape == (12, 32)
    model = CLIP(spec).eval()
    model.load_state_dict(state, strict=True)
    img, txt = features(model, x["__images__"], x["__tokens__"][2:, :12], False)
    assert_close(img, x["__image_gelu__"])
    assert_close(txt, x["__text_gelu__"][2:])
    # another image size and grey images: position embeddings resampled, RGB filters summed
    spec, state = init_weights(
        path, image_size=16, in_chans=1, context_length=16, vocab_size=64, **HEADS
    )
    assert (spec.vision.image_size, spec.vision.in_chans, state["visual.pos_embed"].shape) == (
        16,
        1,
        (1, 5, 32),
    )
    CLIP(spec).load_state_dict(state, strict=True)
    assert uses_quick_gelu("ViT-B-32-quickgelu.safetensors") and uses_quick_gelu(
        "hub/clip_224.openai/m.bin"
    )
    assert not uses_quick_gelu("laion2b_s34b_b79k.safetensors")
    for kw, want in (
        (dict(context_length=17), "longer than the weights' 16"),
        (dict(vocab_size=49408), "vocabulary"),
        (dict(image_size=20), "not divisible by the weights' patch size 8"),
    ):
        args = dict(image_size=32, in_chans=3, context_length=16, vocab_size=64, **HEADS) | kw
        assert want in one_line(lambda: init_weights(path, **args))  # noqa: B023 - called at once
    timm_like = write_state_dict({"pos_embed": torch.zeros(1, 5, 8)}, tmp_path / "vit.safetensors")
    assert "model.init: " in one_line(lambda: init_weights(timm_like, **args))


def test_a_clip_run_starts_from_open_clip_weights(tmp_path, capsys):
    """`vitscale train` with model.init=<OpenCLIP file>: the fixture's towers with the tokenizer's
    49,408-token vocabulary, on 16 px grey synthetic images; the run resumes and evaluates."""
    import json

    from vitscale.cli import main

    sd, _ = fixture()
    vocab = torch.randn(49408, 32) * 0.02
    vocab[:64] = sd["token_embedding.weight"].float()
    path = write_state_dict({**sd, "token_embedding.weight": vocab}, tmp_path / "oc.safetensors")
    out = tmp_path / "run"
    args = [
        "--set",
        f"model.init={path}",
        "--set",
        "model.heads=2",
        "--set",
        "model.text_heads=2",
        "--set",
        "data.image_size=16",
        "--set",
        "run.threads=1",
        "--set",
        "train.epochs=1",
    ]
    assert main(["train", "configs/tests/clip_tiny.toml", "--out", str(out), *args]) == 0, (
        capsys.readouterr().err
    )
    s = json.loads((out / "summary.json").read_text())
    expected = sum(
        v.numel()
        for k, v in sd.items()
        if k not in ("token_embedding.weight", "visual.conv1.weight", "visual.positional_embedding")
    )
    assert (
        s["params"] == expected + 49408 * 32 + 32 * 1 * 8 * 8 + 5 * 32
    )  # grey filters, 2x2+1 positions
    from vitscale import checkpoint as ckpt

    saved = torch.load(ckpt.list_checkpoints(out)[-1], weights_only=False)
    spec = saved["spec"]
    assert (spec["ln_pre"], spec["proj_bias"], spec["text"]["norm_eps"]) == (True, False, 1e-5)
    w0 = sd["visual.transformer.resblocks.0.attn.in_proj_weight"].float()
    w = saved["strategy"]["model"]["visual.blocks.0.attn.qkv.weight"]
    assert (w - w0).abs().max() < 0.05 < w0.abs().max()  # a few steps from the file's weights
    assert main(["eval", str(out), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev["test_i2t_r1"] == pytest.approx(s["test_i2t_r1"])
    # a timm ViT file is refused when the config is read
    from vitscale.config import load_config
    from vitscale.tasks import check_config

    vit = write_state_dict(
        {"pos_embed": torch.zeros(1, 5, 8), "patch_embed.proj.weight": torch.zeros(8, 3, 4, 4)},
        tmp_path / "vit.safetensors",
    )
    with pytest.raises(Exception, match="CLIP models cannot be initialized"):
        check_config(load_config("configs/tests/clip_tiny.toml", [f"model.init={vit}"]))
    # OpenCLIP's image tower takes RGB: a model trained on grey images is not exported as one
    # (test_an_exported_run_loads_in_open_clip_as_the_trained_function exports an RGB run)
    assert main(["export", str(out), "--format", "open_clip", "--out", str(tmp_path / "back")]) == 2
    assert "1-channel images; OpenCLIP's image tower takes RGB" in capsys.readouterr().err
    # a CLIP model without OpenCLIP's layout, or a ViT classifier: one line
    assert (
        main(
            [
                "train",
                "configs/tests/clip_tiny.toml",
                "--out",
                str(tmp_path / "plain"),
                "--set",
                "train.epochs=1",
                "--set",
                "run.threads=1",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "export",
                str(tmp_path / "plain"),
                "--format",
                "open_clip",
                "--out",
                str(tmp_path / "x.st"),
            ]
        )
        == 2
    )
    assert "lacks OpenCLIP's layout" in capsys.readouterr().err


def test_init_act_chooses_quick_gelu(tmp_path):
    """QuickGELU is not in the weights: model.init_act says it (auto: from the file name)."""
    from vitscale.config import load_config
    from vitscale.tasks import build_task

    sd, _ = fixture()
    vocab = torch.zeros(49408, 32)
    for name, act, want in [
        ("oc.safetensors", "auto", "gelu"),
        ("oc_openai.safetensors", "auto", "quick_gelu"),
        ("oc.safetensors", "quick_gelu", "quick_gelu"),
        ("oc_quickgelu.safetensors", "gelu", "gelu"),
    ]:
        path = write_state_dict({**sd, "token_embedding.weight": vocab}, tmp_path / name)
        cfg = load_config(
            "configs/tests/clip_tiny.toml",
            [f"model.init={path}", f"model.init_act={act}", "model.heads=2", "model.text_heads=2"],
        )
        spec = build_task(cfg).build_spec(32, 3)
        assert (spec.vision_act, spec.text.act) == (want, want), (name, act)


@needs_open_clip
def test_open_clip_loads_an_exported_file_as_pretrained(tmp_path):
    """The path `open_clip.create_model_and_transforms(name, pretrained=FILE)` takes for a local
    file (`open_clip.load_checkpoint`) reads vitscale's export: the same features."""
    import open_clip

    theirs, c, quick = open_clip_model("ViT-S-32", 2)
    ours = from_open_clip(theirs.state_dict(), quick_gelu=quick).eval()
    path = write_state_dict(to_open_clip(ours), tmp_path / "clip.safetensors")
    fresh = open_clip.CLIP(
        **{k: v for k, v in c.items() if k != "quick_gelu"}, quick_gelu=quick
    ).eval()
    open_clip.load_checkpoint(fresh, str(path))
    images, tokens = inputs(
        c["vision_cfg"]["image_size"], c["text_cfg"]["context_length"], 49408, n=2
    )
    a, b = features(fresh, images, tokens, True)
    p, q = features(theirs, images, tokens, True)
    assert torch.equal(a, p) and torch.equal(b, q)


@needs_open_clip
def test_an_exported_run_loads_in_open_clip_as_the_trained_function(tmp_path, capsys):
    """`vitscale export RUN --format open_clip` of a run started from OpenCLIP weights (RGB, 16 px,
    12-token captions): the printed call, run as printed, gives open_clip's model with the trained
    image size and context length and the run's normalization, computing the run's features."""
    import json

    from vitscale.cli import main
    from vitscale.data.tokenizer import tokenize
    from vitscale.evaluate import _rebuild
    from vitscale.state import SavedRun
    from vitscale.tasks import build_task

    sd, _ = fixture()
    vocab = torch.randn(49408, 32) * 0.02
    vocab[:64] = sd["token_embedding.weight"].float()
    weights = write_state_dict(
        {**sd, "token_embedding.weight": vocab}, tmp_path / "hub" / "open_clip_model.safetensors"
    )
    config = {
        "model_cfg": {
            "embed_dim": 16,
            "vision_cfg": TINY["vision_cfg"],
            "text_cfg": {**TINY["text_cfg"], "vocab_size": 49408},
        }
    }
    (tmp_path / "hub" / "open_clip_config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    args = [
        "--set",
        f"model.init={weights}",
        "--set",
        "data.channels=3",
        "--set",
        "data.image_size=16",
        "--set",
        "model.context_length=12",
        "--set",
        "run.threads=1",
        "--set",
        "train.epochs=1",
    ]
    assert main(["train", "configs/tests/clip_tiny.toml", "--out", str(out), *args]) == 0, (
        capsys.readouterr().err
    )
    capsys.readouterr()
    assert main(["export", str(out), "--format", "open_clip"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0] == f"wrote {out / 'open_clip' / 'open_clip_model.safetensors'}"
    assert printed[1] == f"wrote {out / 'open_clip' / 'open_clip_config.json'}"
    prefix = "load it in OpenCLIP: "
    assert printed[2].startswith(prefix), printed[2]
    scope = {"open_clip": open_clip}
    exec(printed[2][len(prefix) :], scope)  # the call, literally
    model, preprocess, tokenizer = scope["model"].eval(), scope["preprocess"], scope["tokenizer"]
    saved = SavedRun.open(out, "exporting", "vitscale export")
    cfg = saved.config()
    ours = _rebuild(
        build_task(cfg, "clip"), saved.spec, {k: v.float() for k, v in saved.weights(True).items()}
    ).eval()
    captions = ["a photo of class 1.", "hello world", ""]
    tokens = tokenizer(captions)
    assert tokens.shape == (3, 12) and torch.equal(tokens, tokenize(captions, 12))
    images = torch.randn(3, 3, 16, 16)
    (a, b), (p, q) = features(model, images, tokens, True), features(ours, images, tokens, False)
    assert_close(a, p)
    assert_close(b, q)
    # the preprocessing: the trained size and the run's mean/std (the synthetic data's own)
    from PIL import Image

    from vitscale.data.sources.synthetic import make

    data = make(cfg.data, cfg.run.seed)
    norm = [t for t in preprocess.transforms if type(t).__name__ == "Normalize"][0]
    assert list(norm.mean) == list(data.mean) and list(norm.std) == list(data.std)
    assert preprocess(Image.new("RGB", (40, 30))).shape == (3, 16, 16)
    # a file next to other weights: the printed text says what local-dir: would read instead
    assert (
        main(
            [
                "export",
                str(out),
                "--format",
                "open_clip",
                "--out",
                str(tmp_path / "hub" / "ft.safetensors"),
            ]
        )
        == 2
    )
    assert "already describes another model" in capsys.readouterr().err
    (tmp_path / "flat").mkdir()
    write_state_dict({"x": torch.zeros(1)}, tmp_path / "flat" / "model.safetensors")
    assert (
        main(
            [
                "export",
                str(out),
                "--format",
                "open_clip",
                "--out",
                str(tmp_path / "flat" / "ft.safetensors"),
            ]
        )
        == 0
    )
    assert "loader would read model.safetensors" in capsys.readouterr().out
