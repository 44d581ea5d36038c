"""clip.loss=siglip (issue 58 part 3): SigLIP's sigmoid loss against OpenCLIP's `SigLipLoss` and a
naive float64 formula on identical inputs in one process (2 gloo ranks: integration/
test_siglip_dist.py), the CLIP model's logit_bias (SigLIP's init, no parameter for the other losses,
out of weight decay), the FastCLIP keys refused in one line, and `vitscale train` with it: the bias
in the checkpoint, an exact resume, the step compiled whole and captured."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from helpers import (
    CLIP,
    ReplayGraph,
    assert_equal_states,
    fit_with_graphs,
    interrupted_copy,
    last_state,
    rel_diff,
    sets,
    trainer_state,
)
from siglip_reference import features, naive64, siglip_bounds

from vitscale.cli import main
from vitscale.config import load_config
from vitscale.errors import ConfigError
from vitscale.losses import SigLipLoss, build_clip_loss, logit_init
from vitscale.models import CLIP as ClipModel
from vitscale.models import resolve_clip_spec
from vitscale.optim import param_groups
from vitscale.tasks import check_config

# OpenCLIP's SigLIP init; a trained-looking one where the negatives weigh (and features aligned)
CASES = [(math.log(10.0), -10.0, 0.0), (math.log(5.0), -1.0, 1.0), (math.log(30.0), -4.0, 2.0)]


def loss_and_grads(fn, img, txt, ls, lb):
    leaves = [t.detach().clone().requires_grad_() for t in (img, txt, ls, lb)]
    loss = fn(*leaves)
    return loss.detach(), torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("log_scale, bias, align", CASES)
def test_one_process_equals_open_clip_and_the_float64_formula(log_scale, bias, align):
    open_clip_loss = pytest.importorskip("open_clip.loss")
    b, d = 8, 32
    img, txt = features(b, d, seed=3, align=align)
    ls, lb = torch.tensor([log_scale]), torch.tensor([bias])
    ours_mod = SigLipLoss()
    ours = loss_and_grads(
        lambda i, t, s, c: ours_mod.compute(i, t, torch.cat([s, c]))[0], img, txt, ls, lb
    )
    ref = open_clip_loss.SigLipLoss()
    theirs = loss_and_grads(lambda i, t, s, c: ref(i, t, s.exp(), c), img, txt, ls, lb)
    exact = loss_and_grads(naive64, *(x.double() for x in (img, txt, ls, lb)))
    tol = siglip_bounds(b, b, d, math.exp(log_scale), bias, exact[0].item())
    names = ["features", "features", "logit_scale", "logit_bias"]
    for what, got in (("ours", ours), ("open_clip", theirs)):
        assert abs(got[0].double() - exact[0]).item() <= tol["loss"], what
        for name, g, e in zip(names, got[1], exact[1]):
            assert (g.double() - e).abs().max().item() <= tol[name], (what, name)
    assert abs(ours[0] - theirs[0]).item() <= 2 * tol["loss"]
    for name, g, e in zip(names, ours[1], theirs[1]):
        assert (g - e).abs().max().item() <= 2 * tol[name], name
    # the bounds see a bug: a loss without the bias, or with the labels of one pair flipped
    assert abs(naive64(*(x.double() for x in (img, txt, ls)), 0.0) - exact[0]) > 10 * tol["loss"]
    flipped = naive64(img.double(), txt.double()[[1, 0, *range(2, b)]], ls.double(), lb.double())
    assert abs(flipped - exact[0]) > 10 * tol["loss"]


def test_logs_comm_and_the_interface():
    """ClipLoss's interface: forward gives (loss, StepLogs); logs are 0-d device tensors; no state,
    no collective in one process; the bias comes as the model's [2] output or apart; a model without
    a bias is one line."""
    img, txt = features(4, 8, seed=0)
    m = SigLipLoss()
    m.set_epoch(1)
    loss, logs = m(img, txt, torch.tensor([math.log(10.0), -10.0]))
    assert set(logs) == {"loss", "tau", "logit_scale", "logit_bias"}
    assert logs["tau"] == pytest.approx(0.1) and logs["logit_bias"] == -10.0
    assert logs["loss"] == pytest.approx(loss.item())
    assert m.temperature == pytest.approx(0.1)
    m.after_step(1)
    assert m.state_dict() == {} and m.state_bytes() == 0
    assert m.comm_elements == {"features": 0, "scalars": 0, "steps": 1}
    apart, _ = m.compute(img, txt, torch.tensor([math.log(10.0)]), logit_bias=torch.tensor([-10.0]))
    assert torch.equal(apart, loss)
    with pytest.raises(ValueError, match="logit_bias"):
        m.compute(img, txt, torch.tensor([math.log(10.0)]))
    # fp32 inside autocast, like ClipLoss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside, _ = m.compute(img.bfloat16(), txt.bfloat16(), torch.tensor([math.log(10.0), -10.0]))
    assert inside.dtype == torch.float32


def test_the_model_holds_a_bias_only_for_siglip_and_keeps_it_out_of_weight_decay():
    spec = resolve_clip_spec("clip_tiny")
    plain = ClipModel(spec)
    assert not hasattr(plain, "logit_bias") and "logit_bias" not in plain.state_dict()
    torch.manual_seed(0)
    plain = ClipModel(spec)
    torch.manual_seed(0)
    sig = ClipModel(replace(spec, init_tau=0.1, logit_bias=-10.0))
    assert sig.logit_bias.shape == (1,) and sig.logit_bias.item() == -10.0  # FSDP2: not 0-d
    assert sig.logit_scale.item() == pytest.approx(math.log(10.0))
    # the bias is created after every other parameter: the towers' init is the plain model's
    for k, v in plain.state_dict().items():
        if k != "logit_scale":
            assert torch.equal(v, sig.state_dict()[k]), k
    tokens = torch.randint(0, 100, (2, spec.text.context_length))
    images = torch.randn(2, spec.vision.in_chans, spec.vision.image_size, spec.vision.image_size)
    assert plain(images, tokens)[2].shape == (1,)  # what ClipLoss and the evaluation take
    out = sig(images, tokens)[2]
    assert out.shape == (2,) and out.tolist() == pytest.approx([math.log(10.0), -10.0])
    no_wd = {id(p) for g in param_groups(sig, 0.1) if g["weight_decay"] == 0 for p in g["params"]}
    assert id(sig.logit_bias) in no_wd and id(sig.logit_scale) in no_wd
    assert {"logit_scale", "logit_bias"} <= sig.no_weight_decay()


def test_siglip_init_the_builder_and_tau_init():
    cfg = load_config(CLIP, ["clip.loss=siglip"])
    assert logit_init(cfg.clip) == (0.1, -10.0)
    assert logit_init(load_config(CLIP, ["clip.loss=siglip", "clip.tau_init=0.05"]).clip) == (
        0.05,
        -10.0,
    )
    assert logit_init(load_config(CLIP, ["clip.loss=openclip"]).clip) == (0.07, None)
    m = build_clip_loss(cfg.clip, cfg.optim, lr=1e-3, dataset_size=64, epochs=2, device="cpu")
    assert type(m) is SigLipLoss


@pytest.mark.parametrize(
    "key",
    [
        "gamma_schedule=cosine",
        "gamma_min=0.3",
        "gamma_decay_epochs=2",
        "tau_lr=0.01",
        "tau_lr_schedule=model",
        "tau_lr_cut=2",
        "rho=6.5",
        "eps=1e-8",
        "state_dtype=bf16",
        "shard_state=true",
    ],
)
def test_a_fastclip_key_with_siglip_is_refused_in_one_line(key, capsys, tmp_path):
    with pytest.raises(ConfigError) as e:
        check_config(load_config(CLIP, ["clip.loss=siglip", f"clip.{key}"]))
    name = key.split("=")[0]
    assert f"clip.{name}" in str(e.value) and "\n" not in str(e.value)
    if name == "rho":  # the command says it in one line too, before anything starts
        assert (
            main(
                ["train", CLIP, "--out", str(tmp_path), *sets(["clip.loss=siglip", f"clip.{key}"])]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert "clip.rho" in err and err.count("\n") == 1, err


def run(out, *extra):
    assert (
        main(
            ["train", CLIP, "--out", str(out), *sets(["run.threads=1", "clip.loss=siglip", *extra])]
        )
        == 0
    )
    return json.loads((out / "summary.json").read_text())


def test_siglip_trains_the_bias_is_in_the_checkpoint_and_resume_is_exact(tmp_path):
    full = tmp_path / "full"
    s = run(full, "run.checkpoint_every=3", "run.keep_last=100", "train.epochs=3")
    assert s["steps"] == 12 and 0.0 <= s["retrieval_r1"] <= 1.0
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert train and all(math.isfinite(r["loss"]) and "logit_bias" in r for r in train)
    st = last_state(full)
    model = st["strategy"]["model"]
    assert model["logit_bias"].shape == (1,) and model["logit_bias"].item() != -10.0  # it learned
    assert st["spec"]["logit_bias"] == -10.0
    part = interrupted_copy(full, tmp_path / "part", step=6)
    assert main(["train", "--resume", str(part)]) == 0
    a = last_state(part)
    assert a["step"] == st["step"] == 12
    assert rel_diff(a["strategy"]["model"], model) == 0.0


def test_the_siglip_step_replays_captured_bit_for_bit(tmp_path, monkeypatch):
    """train.capture=step: the capture stand-in (helpers.ReplayGraph) replays CLIP's step with the
    SigLIP loss and its bias bit for bit the eager run, with no host read (AdamW fused: torch keeps
    its step count on the device)."""
    base = ["train.epochs=2", "run.log_every=1", "run.eval_every=0", "clip.loss=siglip"]
    base += ["optim.impl=fused", "train.ema_decay=0.9", "optim.grad_clip=1.0"]
    eager, _, _ = fit_with_graphs(load_config(CLIP, base), tmp_path / "eager")
    cap, summary, graphs = fit_with_graphs(
        load_config(CLIP, [*base, "train.capture=step"]), tmp_path / "cap", ReplayGraph, monkeypatch
    )
    (g,) = graphs
    assert (g.captures, g.replays, g.host_reads) == (1, summary["steps"] - 3, 0)
    assert_equal_states(trainer_state(eager), trainer_state(cap))
    assert "model.logit_bias" in trainer_state(cap)


def test_the_siglip_forward_traces_as_one_graph_in_one_process():
    """What train.compile=true compiles in one process (tasks/clip_step.clip_forward: both towers and
    the loss) traces with fullgraph=True: no collective, no graph break, the eager values (dynamo's
    eager backend: the trace, not inductor's code generation, which the other losses' tests time)."""
    from torch._dynamo.utils import counters

    from vitscale.tasks.clip_step import clip_forward

    spec = replace(resolve_clip_spec("clip_tiny"), init_tau=0.1, logit_bias=-10.0)
    torch.manual_seed(0)
    model, loss = ClipModel(spec), SigLipLoss()
    images = torch.randn(4, spec.vision.in_chans, spec.vision.image_size, spec.vision.image_size)
    tokens = torch.randint(0, 100, (4, spec.text.context_length))
    torch._dynamo.reset()
    counters.clear()
    traced = torch.compile(clip_forward, fullgraph=True, backend="eager")
    got, logs = traced(model, loss, images, tokens, None)
    want, want_logs = clip_forward(model, loss, images, tokens, None)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    assert torch.equal(got, want) and torch.equal(logs["logit_bias"], want_logs["logit_bias"])
    got.backward()
    assert model.logit_bias.grad is not None and model.logit_scale.grad is not None
