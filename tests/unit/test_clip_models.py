"""The CLIP model: shapes, causality of the text tower, FLOP counts against torch's counter,
parameter counts against OpenCLIP's published architecture, FSDP-friendly logit_scale."""

import math
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vitscale.models import (
    CLIP,
    CLIP_REGISTRY,
    TextSpec,
    TextTransformer,
    clip_forward_flops,
    count_params,
    resolve_clip_spec,
)

EOT = 49407


def tokens(batch, length, lengths, vocab=49408, seed=0):
    """Rows of [sot, random ids, eot, 0 ...] with the given caption lengths."""
    g = torch.Generator().manual_seed(seed)
    t = torch.zeros(batch, length, dtype=torch.long)
    for i, n in enumerate(lengths):
        t[i, 0] = 49406
        t[i, 1 : n - 1] = torch.randint(1, vocab - 2, (n - 2,), generator=g)
        t[i, n - 1] = EOT
    return t


@pytest.mark.parametrize("arch", sorted(CLIP_REGISTRY))
def test_every_registered_clip_builds(arch):
    spec = resolve_clip_spec(arch)
    with torch.device("meta"):
        m = CLIP(spec)
    assert m.logit_scale.shape == (1,)  # FSDP2 cannot shard a 0-d parameter
    assert m.visual.head.out_features == spec.embed_dim == m.text.proj.out_features


def test_forward_shapes_normalized_and_one_sided_calls():
    torch.manual_seed(0)
    m = CLIP(
        resolve_clip_spec(
            "clip_tiny",
            vision=dict(in_chans=1, image_size=16, patch_size=4),
            text=dict(context_length=12),
        )
    )
    x, t = torch.randn(3, 1, 16, 16), tokens(3, 12, [5, 12, 3])
    img, txt, scale = m(x, t)
    assert img.shape == txt.shape == (3, 32)
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(txt.norm(dim=-1), torch.ones(3))
    assert scale.item() == pytest.approx(math.log(1 / 0.07))
    i2, none, _ = m(x, None)
    none2, t2, _ = m(None, t)
    assert none is None and none2 is None
    torch.testing.assert_close(i2, img)
    torch.testing.assert_close(t2, txt)
    # an empty batch passes (ranks pad evaluation with empty batches)
    e_img, e_txt, _ = m(x[:0], t[:0])
    assert e_img.shape == (0, 32) and e_txt.shape == (0, 32)


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_text_tower_is_causal_and_pools_at_end_of_text(attention):
    torch.manual_seed(0)
    m = TextTransformer(
        TextSpec(
            vocab_size=100,
            context_length=10,
            dim=16,
            depth=2,
            heads=2,
            embed_dim=8,
            attention=attention,
        )
    ).eval()
    t = torch.tensor([[5, 6, 7, 99, 0, 0, 0, 0, 0, 0]])  # "end of text" = the largest id, at 3
    out = m(t)
    later = t.clone()
    later[0, 4:] = torch.tensor([1, 2, 3, 4, 5, 6])  # tokens after the end: invisible to it
    torch.testing.assert_close(m(later), out)
    earlier = t.clone()
    earlier[0, 1] = 8  # a token before it changes the feature
    assert not torch.allclose(m(earlier), out)


def test_fused_and_explicit_causal_attention_agree():
    torch.manual_seed(0)
    a = TextTransformer(
        TextSpec(context_length=16, dim=32, depth=2, heads=4, embed_dim=8, attention="explicit")
    )
    b = TextTransformer(replace(a.spec, attention="sdpa"))
    b.load_state_dict(a.state_dict())
    t = tokens(4, 16, [16, 9, 4, 2])
    torch.testing.assert_close(a(t), b(t), atol=1e-5, rtol=1e-5)


def test_flops_match_torch_flop_counter():
    spec = resolve_clip_spec(
        "clip_tiny",
        vision=dict(image_size=16, patch_size=4, attention="explicit"),
        text=dict(context_length=12, attention="explicit"),
    )
    m = CLIP(spec)
    x, t = torch.randn(3, 3, 16, 16), tokens(3, 12, [5, 12, 3])
    with FlopCounterMode(display=False) as fc:
        m(x, t)
    assert fc.get_total_flops() == 3 * clip_forward_flops(spec)


def test_vit_b32_and_b16_match_openclip_architecture():
    # OpenCLIP's ViT-B-32 has 151,277,313 parameters and ViT-B-16 149,620,737. vitscale's towers
    # differ by design in three places: the patch conv has a bias (+768), the image projection is
    # a Linear with a bias (+512) and there is no ln_pre LayerNorm (-1,536): 256 fewer in all.
    with torch.device("meta"):
        b32, b16 = CLIP(resolve_clip_spec("clip_vit_b32")), CLIP(resolve_clip_spec("clip_vit_b16"))
    assert count_params(b32) == 151_277_313 - 256
    assert count_params(b16) == 149_620_737 - 256


def test_no_weight_decay_names_exist():
    m = CLIP(resolve_clip_spec("clip_tiny"))
    names = dict(m.named_parameters())
    assert m.no_weight_decay() <= set(names)
    assert {"logit_scale", "visual.pos_embed", "visual.cls_token"} <= m.no_weight_decay()
