"""Every OpenCLIP model configuration, as a user would have it, through vitscale: exact or refused.

Where open_clip imports (../shared/tools/tv_cpu_stub makes it work on a CPU torch), each of the
configurations `open_clip.list_models()` names is built at one block per tower (timm towers too:
timm.create_model gets depth=1 / depths=(1,)*4 / layers=(1,)*4), with images of 2x2 patches where
the image tower is OpenCLIP's own ViT, a 256-token vocabulary and at most 16 text positions (the
widths, head widths, MLP ratios, pooling, masks and activations are the configuration's), every
weight random. Its state dict is saved as safetensors with that configuration's
open_clip_config.json beside it, and `vitscale.interop.open_clip.load_open_clip(file)` reads the
folder. Each configuration must then be one of:
- exact: image and text features within 1e-5 of open_clip's in fp32, and the export round trip
  bit-identical: to_open_clip gives back every tensor of the file, and open_clip's CLIP built from
  the exported open_clip_config.json computes bit-identical features with them;
- refused in one line naming a real cause: one of the causes the configuration shows (a timm,
  ResNet or Hugging Face tower, CoCa, SigLIP's logit_bias, ...: `real_causes`, read
  from the configuration by this test).
A configuration whose text tower is a Hugging Face model cannot be built without `transformers`
(and its hub configuration): its image tower's weights are saved with its open_clip_config.json.
The files vitscale imports are then read again without their configuration (a bare weights
file): vitscale takes OpenCLIP's defaults, said in one warning line, or refuses; how many bare
files are exact, refused or different under the announced defaults is reported, not asserted (the
announcement is what the user gets). The counts print with `pytest -s`; 0 silently different and
every refusal naming a real cause are asserted. ~25 s on 2 CPU cores."""

from __future__ import annotations

import collections
import copy
import logging
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vitscale.errors import UserError

try:
    import open_clip
    import timm

    HAVE, WHY = True, ""
except Exception as e:  # not installed, or torchvision missing
    open_clip = timm = None
    HAVE, WHY = (
        False,
        f"open_clip/timm do not import ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})",
    )
pytestmark = pytest.mark.skipif(not HAVE, reason=WHY)

VOCAB, CONTEXT = 256, 16


# the families of timm image towers that must load exactly (issue 58): SigLIP, SigLIP 2 and their
# i18n / SO400M / gopt variants, EVA01/EVA02-CLIP, PE-Core; OpenCLIP's TimmModel with timm_proj
# None or "none" around a timm ViT (vision_transformer or eva)
TIMM_FAMILIES = {
    "SigLIP": re.compile(r"ViT-.*-SigLIP(?!2)"),
    "SigLIP 2": re.compile(r"ViT-.*-SigLIP2"),
    "EVA-CLIP": re.compile(r"EVA0[12]-"),
    "PE-Core": re.compile(r"PE-Core-"),
}


def family(name: str, c: dict) -> str:
    """The family of a configuration whose image tower is a timm ViT in OpenCLIP's TimmModel without
    a head of OpenCLIP's own (timm_proj None or "none", timm's token / MAP / average pooling), its
    text tower OpenCLIP's: one of TIMM_FAMILIES or "other timm ViT"; "" for the others. Read by this
    test from the configuration and timm's class of the trunk."""
    v = c["vision_cfg"]
    if (
        not v.get("timm_model_name")
        or c["text_cfg"].get("hf_model_name")
        or "multimodal_cfg" in c
        or v.get("timm_proj", "linear") not in (None, "", "none")
        or v.get("timm_pool", "avg") not in ("token", "map", "avg")
    ):
        return ""
    with torch.device("meta"):
        trunk = timm.create_model(v["timm_model_name"])
    if type(trunk).__name__ not in ("VisionTransformer", "Eva"):
        return ""
    return next((f for f, r in TIMM_FAMILIES.items() if r.match(name)), "other timm ViT")


def real_causes(c: dict, name: str = "") -> list[tuple[str, str]]:
    """(what the configuration shows, a word the refusal must hold) for each variant vitscale does not
    compute, read from the configuration by this test (not by vitscale)."""
    v, t, out = c["vision_cfg"], c["text_cfg"], []
    fam = family(name, c)
    timm_family = bool(fam)  # (a timm ViT outside TIMM_FAMILIES may be one vitscale's table lacks)
    if v.get("timm_model_name") and fam in ("", "other timm ViT"):
        out.append(("timm image tower", "timm"))
    if isinstance(v.get("layers"), (list, tuple)):
        out.append(("ResNet image tower", "ResNet"))
    if t.get("hf_model_name"):
        out.append(("Hugging Face text tower", "Hugging Face"))
    if "multimodal_cfg" in c:
        out.append(("CoCa", "CoCa"))
    if c.get("init_logit_bias") is not None and not timm_family:
        out.append(("SigLIP logit_bias", "logit_bias"))
    if t.get("ls_init_value"):  # (the image tower's is vitscale's ViTSpec.layer_scale)
        out.append(("text layer scale", "layer scale"))
    for cfg in (v, t):
        if cfg.get("attentional_pool"):
            out.append(("attentional pooling", "attentional pooling"))
        if cfg.get("output_tokens"):
            out.append(("token outputs", "token outputs"))
        if cfg.get("act_kwargs") and not timm_family:
            out.append(("activation arguments", "act_kwargs"))
        if cfg.get("qk_norm") or cfg.get("scaled_cosine_attn") or cfg.get("scale_heads"):
            out.append(("custom attention", "attention"))
    if t.get("embed_cls"):
        out.append(("text class token", "class token"))
    if t.get("proj_bias") and not timm_family:
        out.append(("text projection bias", "projection with a bias"))
    if t.get("proj_type", "linear") != "linear" and not timm_family:
        out.append(("no text projection", "projection"))
    return out


def small(name: str) -> dict:
    """The configuration with one block per tower, small images and vocabulary."""
    c = copy.deepcopy(open_clip.get_model_config(name))
    v, t = c["vision_cfg"], c["text_cfg"]
    if isinstance(v.get("layers"), (list, tuple)):
        v["layers"], v["image_size"] = [1] * len(v["layers"]), 64
    elif not v.get("timm_model_name"):
        v["layers"], v["image_size"] = 1, 2 * v.get("patch_size", 16)
    if not t.get("hf_model_name"):
        t["layers"], t["vocab_size"] = 1, VOCAB
        t["context_length"] = min(t.get("context_length", 77), CONTEXT)
    if "multimodal_cfg" in c:
        c["multimodal_cfg"].update(layers=1, vocab_size=VOCAB)
        c["multimodal_cfg"]["context_length"] = min(
            c["multimodal_cfg"].get("context_length", 76), CONTEXT
        )
    return c


def timm_one_block(create):
    def create_model(name, *args, **kwargs):
        for extra in ({"depth": 1}, {"depths": (1, 1, 1, 1)}, {"layers": (1, 1, 1, 1)}):
            try:
                return create(name, *args, **kwargs, **extra)
            except TypeError:
                continue
        return create(name, *args, **kwargs)

    return create_model


def build_meta(c: dict):
    """open_clip's model of configuration `c`, on the meta device (no memory, no initialization);
    with a timm image tower on the CPU (timm's rotary embeddings keep buffers no state dict holds)."""
    c = dict(c)
    meta = not c["vision_cfg"].get("timm_model_name")
    custom = c.pop("custom_text", False) or bool(c["text_cfg"].get("hf_model_name"))
    cls = (
        open_clip.CoCa
        if "multimodal_cfg" in c
        else open_clip.CustomTextCLIP
        if custom
        else open_clip.CLIP
    )
    with torch.device("meta" if meta else "cpu"):
        return cls(**c)


class Pool:
    """Random values, drawn once: each tensor is a scaled slice at a random offset (drawing every
    tensor afresh would cost more than the whole sweep's other work)."""

    def __init__(self, n: int = 48_000_000):
        self.g = torch.Generator().manual_seed(0)
        self.values = torch.randn(n, generator=self.g)

    def state_dict(self, meta: dict) -> dict:
        """Random weights for `meta`'s keys and shapes."""
        out = {}
        for k, t in meta.items():
            n = t.numel()
            if n > self.values.numel():
                raise AssertionError(f"{k}: {n} values, the pool holds {self.values.numel()}")
            start = int(torch.randint(0, self.values.numel() - n + 1, (1,), generator=self.g))
            x = self.values[start : start + n].view(t.shape)
            if t.ndim >= 2:  # fan-in scaling: features of order 1 through the towers
                fan_in = (
                    t.shape[0]
                    if k == "visual.proj" or k.endswith("text_projection")
                    else t[0].numel()
                )
                x = x * fan_in**-0.5
            elif t.ndim == 1:  # norms around 1, biases and embeddings around 0
                x = (
                    1 + 0.1 * x
                    if k.endswith(
                        (
                            "ln_1.weight",
                            "ln_2.weight",
                            "ln_pre.weight",
                            "ln_post.weight",
                            "ln_final.weight",
                            "norm.weight",
                            "norm1.weight",
                            "norm2.weight",
                        )
                    )
                    else 0.1 * x
                )
            else:
                x = torch.tensor(math.log(1 / 0.07))
            out[k] = x.contiguous()
        return out


def materialize(model, sd: dict):
    """`model` (meta) holding `sd` in fp32, its causal mask rebuilt."""
    model.load_state_dict(sd, strict=True, assign=True)
    for mod in model.modules():  # (a model built on the CPU has none on the meta device)
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf.is_meta:
                assert name == "attn_mask", name
                n = buf.shape[0]
                mod._buffers[name] = torch.full((n, n), float("-inf")).triu_(1)
    return model.eval()


def inputs(c: dict, n: int = 2):
    v, t = c["vision_cfg"], c["text_cfg"]
    g = torch.Generator().manual_seed(1)
    images = torch.randn(n, 3, v["image_size"], v["image_size"], generator=g)
    context, vocab = t.get("context_length", 77), t.get("vocab_size", 49408)
    end = t.get("eos_id", 2) if t.get("pool_type") == "eos" else vocab - 1
    tokens = torch.zeros(n, context, dtype=torch.long)
    for i in range(n):
        length = context - 1 - 5 * i
        tokens[i, :length] = torch.randint(3, vocab - 1, (length,), generator=g)
        tokens[i, length] = end
    return images, tokens


def close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def one_line_refusal(e: Exception) -> str:
    msg = str(e)
    assert isinstance(e, UserError), f"{type(e).__name__}: {msg}"
    assert "\n" not in msg and len(msg) < 500, msg
    return msg


@pytest.fixture
def one_thread():
    """The sweep's matrices are small: one intra-op thread is as fast, and does not slow down by
    half or more when another process holds a core (2-core machines)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def scratch(tmp_path):
    """A folder in memory where there is room (the sweep writes 17 GB of weights, at most 0.53 GB
    at a time: each file is deleted before the next)."""
    shm = "/dev/shm"
    roomy = (
        os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 << 30
    )  # (containers: often 64 MB)
    base = shm if roomy else str(tmp_path)
    d = Path(tempfile.mkdtemp(dir=base, prefix="zoo_open_clip_"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


QUICK_EVERY = (
    6  # the fast tier's subset: every 6th configuration by name (the full sweep is the slow tier's)
)


@pytest.mark.parametrize("scope", ["quick", "all"])  # all: the slow tier (tests/tiers.py)
def test_every_open_clip_configuration_is_exact_or_refused(
    scratch, one_thread, monkeypatch, caplog, scope
):
    import json

    from vitscale.interop.open_clip.convert import load_open_clip, open_clip_config, to_open_clip

    monkeypatch.setattr(timm, "create_model", timm_one_block(timm.create_model))
    torch.manual_seed(0)
    start, pool = time.perf_counter(), Pool()
    counts, bare, silent, wrong_cause = collections.Counter(), collections.Counter(), [], []
    families, not_exact = collections.Counter(), []
    names = open_clip.list_models()
    if scope == "quick":
        names = sorted(names)[::QUICK_EVERY]
    for name in names:
        c = small(name)
        causes, fam = real_causes(c, name), family(name, c)
        folder = scratch / name
        folder.mkdir()
        try:
            meta = build_meta(c)
        except Exception as e:  # a Hugging Face text tower without `transformers`
            assert c["text_cfg"].get("hf_model_name"), f"{name}: {e}"
            with torch.device("meta"):
                visual = open_clip.model._build_vision_tower(
                    c["embed_dim"], c["vision_cfg"], c.get("quick_gelu", False)
                )
            meta, built = None, {f"visual.{k}": v for k, v in visual.state_dict().items()}
        else:
            built = meta.state_dict()
        sd = pool.state_dict(built)
        save_file(sd, str(folder / "open_clip_model.safetensors"))
        (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": c}))
        try:
            ours = load_open_clip(folder / "open_clip_model.safetensors").eval()
        except Exception as e:
            msg = one_line_refusal(e)
            if fam in TIMM_FAMILIES:
                not_exact.append(f"{name}: {msg}")
            hit = [what for what, word in causes if word.lower() in msg.lower()]
            if not hit:
                wrong_cause.append(f"{name}: {msg}")
            counts[
                f"refused: {hit[0] if hit else 'WRONG CAUSE'}"
                + ("" if meta is not None else " (text tower not built: needs transformers)")
            ] += 1
        else:
            theirs = materialize(meta, sd)
            images, tokens = inputs(c)
            with torch.no_grad():
                a, b = theirs.encode_image(images), theirs.encode_text(tokens)
                p, q = (
                    ours.encode_image(images, normalize=False),
                    ours.encode_text(tokens, normalize=False),
                )
            logits_same = close(ours.logit_scale.reshape(()), theirs.logit_scale.reshape(())) and (
                (getattr(theirs, "logit_bias", None) is None) == (ours.spec.logit_bias is None)
            )
            if logits_same and ours.spec.logit_bias is not None:
                logits_same = close(ours.logit_bias.reshape(()), theirs.logit_bias.reshape(()))
            # (a timm ViT outside TIMM_FAMILIES: its only cause is that vitscale may lack its arch)
            if (causes and fam != "other timm ViT") or not (
                close(p, a) and close(q, b) and logits_same
            ):
                silent.append(
                    f"{name}: image {(p - a).abs().max():.2e}, text {(q - b).abs().max():.2e}, "
                    f"causes {causes}"
                )
                counts["SILENTLY DIFFERENT"] += 1
            else:
                # the export round trip: every tensor back, and open_clip's CLIP of the exported config
                back, cfg = to_open_clip(ours), open_clip_config(ours.spec)["model_cfg"]
                assert back.keys() == sd.keys(), name
                assert all(torch.equal(back[k], sd[k]) for k in sd), name
                again = materialize(build_meta(cfg), back)
                with torch.no_grad():
                    assert torch.equal(again.encode_image(images), a) and torch.equal(
                        again.encode_text(tokens), b
                    ), name
                counts["exact"] += 1
                if fam:
                    families[fam] += 1
            # the same file without its configuration
            (folder / "open_clip_config.json").unlink()
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="vitscale"):
                try:
                    plain = load_open_clip(folder / "open_clip_model.safetensors").eval()
                except UserError as e:
                    one_line_refusal(e)
                    bare["refused"] += 1
                else:
                    announced = [
                        r for r in caplog.records if "OpenCLIP's defaults" in r.getMessage()
                    ]
                    assert len(announced) == 1 and "\n" not in announced[0].getMessage(), name
                    with torch.no_grad():
                        same = close(plain.encode_image(images, normalize=False), a) and close(
                            plain.encode_text(tokens, normalize=False), b
                        )
                    bare[
                        "exact (defaults announced)" if same else "different (defaults announced)"
                    ] += 1
            del theirs, ours
        shutil.rmtree(folder)
    seconds = time.perf_counter() - start
    print(f"\nOpenCLIP {open_clip.__version__}: {len(names)} configurations in {seconds:.1f} s")
    for k, n in sorted(counts.items()):
        print(f"  {n:4d}  {k}")
    print(
        "  bare weights files (no configuration) of those imported: "
        + ", ".join(f"{n} {k}" for k, n in sorted(bare.items()))
    )
    print(
        "  exact timm-tower families: " + ", ".join(f"{n} {f}" for f, n in sorted(families.items()))
    )
    assert sum(counts.values()) == len(names)
    assert not not_exact, f"{len(not_exact)} of the timm-tower families refused: {not_exact[:5]}"
    assert not silent, f"{len(silent)} silently different: {silent[:5]}"
    assert not wrong_cause, f"{len(wrong_cause)} refused without a real cause: {wrong_cause[:5]}"
    assert counts["exact"] >= (40 if scope == "all" else 1)


def test_the_table_of_configurations_is_open_clips():
    """vitscale's copy of OpenCLIP's model configurations (scripts/open_clip_configs.py) is the
    installed open_clip's; after an open_clip upgrade, run the script again."""
    from vitscale.interop.open_clip.configs import CONFIGS, OPEN_CLIP_VERSION

    installed = {n: open_clip.get_model_config(n) for n in open_clip.list_models()}
    assert CONFIGS == installed, (
        f"vitscale's table is OpenCLIP {OPEN_CLIP_VERSION}'s, open_clip "
        f"{open_clip.__version__} is installed: run scripts/open_clip_configs.py"
    )


@pytest.mark.parametrize("name", ["EVA02-B-16", "PE-Core-T-16-384", "ViT-B-16-SigLIP2"])
def test_a_timm_tower_clip_starts_a_run_through_model_init(tmp_path, monkeypatch, name):
    """model.init of an EVA02-CLIP or PE-Core file (CLIP's BPE) gives the model open_clip computes,
    at the weights' image size; another image size is refused in one line naming the size to set;
    SigLIP 2 (a Gemma tokenizer vitscale lacks) is refused in one line naming the tokenizer."""
    import json

    from vitscale.interop.open_clip.convert import init_weights
    from vitscale.models import CLIP

    monkeypatch.setattr(timm, "create_model", timm_one_block(timm.create_model))
    c = small(name)
    theirs = build_meta(c)
    sd = Pool(12_000_000).state_dict(theirs.state_dict())
    theirs = materialize(theirs, sd)
    save_file(sd, str(tmp_path / "open_clip_model.safetensors"))
    (tmp_path / "open_clip_config.json").write_text(json.dumps({"model_cfg": c}))
    size = c["vision_cfg"]["image_size"]
    args = dict(image_size=size, in_chans=3, context_length=CONTEXT, vocab_size=VOCAB)
    if c["text_cfg"].get("hf_tokenizer_name"):
        msg = str(pytest.raises(UserError, init_weights, tmp_path, **args).value)
        assert "\n" not in msg and "another tokenizer (text_cfg.hf_tokenizer_name=" in msg, msg
        return
    spec, state = init_weights(tmp_path, **args)
    ours = CLIP(spec).eval()
    ours.load_state_dict(state, strict=True)
    images, tokens = inputs(c)
    with torch.no_grad():
        assert close(ours.encode_image(images, normalize=False), theirs.encode_image(images))
        assert close(ours.encode_text(tokens, normalize=False), theirs.encode_text(tokens))
    msg = str(
        pytest.raises(UserError, init_weights, tmp_path, **{**args, "image_size": size // 2}).value
    )
    assert "\n" not in msg and f"set data.image_size={size}" in msg, msg
