"""CLIP's step compiled whole and captured (issue 51 item 5), on a CPU.

- The capture stand-in (tests/helpers.py's ReplayGraph: a CUDA graph's contract, the step's aten
  operations recorded once and replayed without its Python) replays CLIP's whole step, the
  OpenCLIP loss and FastCLIP v0, v2 and v3 with their per-sample state, across the gamma
  schedule's changes and the temperatures' steps: bit for bit train.capture=none.
- torch.compile(fullgraph=True) traces both towers, the loss and its state writes as one graph (no
  graph break) and gives the eager loss and state within a bound derived from fp32 arithmetic.
- What a captured CLIP step still cannot hold is refused in one line.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import CLIP, ReplayGraph, assert_equal_states, fit_with_graphs, trainer_state

from vitscale.config import load_config
from vitscale.errors import ConfigError
from vitscale.tasks import check_config

# 3 epochs of 4 steps: the capture (after 3 eager warm-up steps) is step 4, in epoch 0 (gamma 1);
# the replays run epochs 1 and 2, where gamma steps to 0.6 and then to its minimum 0.2 (cosine over
# 2 epochs), while the temperatures move every step (a large tau lr) and v0's follows the model's
# warm-up + cosine. AdamW fused: torch keeps its step count on the device (capturable on a GPU).
RECIPE = [
    "train.epochs=3",
    "clip.gamma_decay_epochs=2",
    "run.log_every=1",
    "run.eval_every=0",
    "optim.impl=fused",
    "train.ema_decay=0.9",
    "optim.grad_clip=1.0",
]
LOSSES = {
    "openclip": ["clip.loss=openclip"],
    "fastclip_v0": ["clip.loss=fastclip_v0", "clip.tau_lr=0.05"],
    "fastclip_v2": ["clip.loss=fastclip_v2"],
    "fastclip_v3": ["clip.loss=fastclip_v3", "clip.tau_lr=0.05"],
}


def _train_records(run_dir) -> list[dict]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timing = ("images_per_s", "step_time_s", "data_time_s", "time_s", "elapsed_s")
    return [
        {k: v for k, v in r.items() if k not in timing and not k.endswith("_time_s")}
        for r in recs
        if r.get("kind") == "train"
    ]


def _task_state(tr) -> dict:
    return {k: v for k, v in tr.task.state_dict().items() if torch.is_tensor(v)}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_the_captured_clip_step_replayed_equals_the_eager_step_bit_for_bit(
    tmp_path, monkeypatch, loss
):
    sets = [*RECIPE, *LOSSES[loss]]
    eager, _, _ = fit_with_graphs(load_config(CLIP, sets), tmp_path / "eager")
    cfg = load_config(CLIP, [*sets, "train.capture=step"])
    cap, summary, graphs = fit_with_graphs(cfg, tmp_path / "cap", ReplayGraph, monkeypatch)
    (g,) = graphs
    # CLIP's batches are always whole (contrastive losses drop the last partial batch): every
    # step after the warm-up is a replay, the capture's own included
    assert (g.warmups, g.captures, g.replays) == (3, 1, summary["steps"] - 3)
    assert g.host_reads == 0, "the captured step reads the device"
    assert_equal_states(trainer_state(eager), trainer_state(cap))
    assert_equal_states(_task_state(eager), _task_state(cap))  # u, temperatures and their Adam
    recs = _train_records(cap.run_dir)
    assert recs == _train_records(eager.run_dir)
    # the replayed steps saw the schedules move: gamma's epochs, the temperature every step
    replayed = [r for r in recs if r["step"] > 4]
    if loss != "openclip":
        assert sorted({round(r["gamma"], 6) for r in replayed}) == [0.2, 0.6]
    if loss != "fastclip_v2":  # v2: the logged tau is the mean of the batch's per-sample taus
        taus = [r["tau"] for r in replayed]
        assert len(set(taus)) == len(taus), taus


@pytest.mark.parametrize(
    "loss", ["openclip", "fastclip_v0", "fastclip_v1", "fastclip_v2", "fastclip_v3"]
)
def test_check_config_takes_capture_for_every_clip_loss(loss):
    check_config(load_config(CLIP, ["train.capture=step", f"clip.loss={loss}"]))


@pytest.mark.parametrize(
    "sets, words",
    [
        (["strategy.name=ddp"], "strategy.name=single"),
        (["strategy.name=fsdp"], "strategy.name=single"),
        (["train.precision=fp16"], "loss scaler"),
        (["optim.name=sgd"], "optim.name=sgd"),
    ],
)
def test_what_a_captured_clip_step_cannot_hold_is_refused_in_one_line(sets, words):
    """Several processes (the losses' collectives, FastCLIP's sharded state), the loss scaler's host
    decision, an optimizer whose lr lives on the host: one line each, before anything starts."""
    with pytest.raises(ConfigError) as e:
        check_config(load_config(CLIP, ["train.capture=step", *sets]))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_auto_leaves_clip_uncaptured_until_it_is_timed_on_a_gpu():
    from vitscale.fastpaths import Machine, resolve

    out = resolve(load_config(CLIP), Machine("cuda", (9, 0), "NVIDIA H200"))
    why = out.record()["train.capture"]["why"]
    assert out.cfg.train.capture == "none" and "not measured on a GPU" in why, why


# -- torch.compile(fullgraph=True) -------------------------------------------------------------
#
# The bound, from fp32 arithmetic (u = 2^-24, the unit roundoff). The compiled step computes the
# same operations, but inductor fuses them and may sum in another order. For the loss alone, on
# the same unit-norm features e of width d: a similarity s_ij = <e1_i, e2_j> summed in any order
# is within d u of the eager one (sum_k |e1_ik e2_jk| <= 1, Cauchy-Schwarz); z_ij = (s_ij - s_ii)
# x scale with scale = 1/tau <= 100 is then within 2 d u scale + |z| u <= 2 d u scale + 2 scale u;
# log g = logsumexp(z) - log(N - 1) is 1-Lipschitz in max |dz| plus its own sum of N terms (N u)
# and exp/log (4 u); log u's update (logaddexp, also 1-Lipschitz) adds a few u (4 u). Per step:
#     |d log u| <= u (2 d scale + 2 scale + N + 8),
# and the steps add (each starts from the previous u): S steps -> S times that. The reported loss
# (a mean of g / (eps + u) <= (N - 1) / gamma terms of relative error e^|d| - 1) is checked at the
# same relative bound; the temperatures' Adam state is fp64 arithmetic on these fp32 inputs.
def _log_u_bound(d: int, n: int, scale: float, steps: int) -> float:
    return steps * 2.0**-24 * (2 * d * scale + 2 * scale + n + 8)


def _features(n: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    e1 = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
    e2 = torch.nn.functional.normalize(e1 + 0.5 * torch.randn(n, d, generator=g), dim=1)
    return e1, e2


@pytest.mark.parametrize("variant", ["fastclip_v0", "fastclip_v2", "fastclip_v3"])
def test_the_fastclip_loss_compiles_whole_and_keeps_the_eager_state_within_the_fp32_bound(
    variant,
):
    """The loss's step (gather, z, u update, temperature columns, index writes of u, surrogate)
    compiled with fullgraph=True, beside the eager one, over 6 steps across the gamma schedule's
    change (epochs of 2 steps) with the temperatures' steps between them: the same loss and u
    within the bound above, the temperatures within the same relative bound."""
    from vitscale.losses import FastClipLoss

    torch._dynamo.reset()
    n, d, size = 16, 8, 48

    def make():
        return FastClipLoss(
            variant, dataset_size=size, gamma_decay_epochs=2, tau_lr=0.05, rho=6.5,
            lr_factor=lambda s: 1.0 / (1 + s), total_steps=6,
        )  # fmt: skip

    eager, comp = make(), make()
    compiled = torch.compile(comp.compute, fullgraph=True)
    step = 0
    for epoch in range(3):
        eager.set_epoch(epoch)
        comp.set_epoch(epoch)
        for _ in range(2):
            idx = torch.randperm(size, generator=torch.Generator().manual_seed(step))[:n]
            e1, e2 = _features(n, d, seed=100 + step)
            out = []
            for m, fn in ((eager, eager.compute), (comp, compiled)):
                f1, f2 = e1.clone().requires_grad_(), e2.clone().requires_grad_()
                loss, logs = fn(f1, f2, None, idx)
                loss.backward()
                m.after_step(torch.tensor(step))  # the device step counter of a captured step
                out.append((loss.detach(), dict(logs), f1.grad))
            step += 1
            scale = 1 / min(eager.temperature, comp.temperature, 0.07)
            bound = _log_u_bound(d, n, scale, step)
            (le, ge, gre), (lc, gc, grc) = out
            assert math.isclose(float(le), float(lc), rel_tol=bound, abs_tol=bound)
            assert float(ge["gamma"]) == float(gc["gamma"])
            torch.testing.assert_close(grc, gre, rtol=bound, atol=bound)
    for k, t in eager.tables().items():
        t, c = t.double(), comp.tables()[k].double()
        assert torch.equal(torch.isfinite(t), torch.isfinite(c)), k  # never-seen rows: -inf
        ok = torch.isfinite(t)
        torch.testing.assert_close(c[ok], t[ok], rtol=bound, atol=bound, msg=k)
    assert eager.temperature != pytest.approx(0.07 if variant != "fastclip_v2" else 0.03)


@pytest.mark.parametrize(
    "loss", ["openclip", "fastclip_v0", "fastclip_v1", "fastclip_v2", "fastclip_v3"]
)
def test_the_clip_step_compiles_whole_without_a_graph_break(tmp_path, loss):
    """train.compile=true in one process: both towers, the loss and its state writes as ONE graph
    (fullgraph: a break would raise), compiled once for the run; 8 steps over 2 epochs beside the
    eager run give its losses, temperatures and per-sample state within a relative 1e-3: the fp32
    bound above for the loss alone is ~1e-5 per step at this width, and the towers' reductions
    (width 32-64, 2 blocks each) add errors of the same order per step, far below 1e-3 over 8."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    sets = ["train.epochs=2", "run.log_every=1", "run.eval_every=0", f"clip.loss={loss}"]
    eager, _, _ = fit_with_graphs(load_config(CLIP, sets), tmp_path / "eager")
    comp, _, _ = fit_with_graphs(load_config(CLIP, [*sets, "train.compile=true"]), tmp_path / "c")
    assert comp.task.step is not None and comp.task.step.compiled
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1  # one trace of the whole forward, no recompile
    re, rc = _train_records(eager.run_dir), _train_records(comp.run_dir)
    assert [r["step"] for r in re] == [r["step"] for r in rc] == list(range(1, 9))
    for a, b in zip(re, rc):
        for k in ("loss", "tau") + (("gamma", "objective") if loss != "openclip" else ()):
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-6), (a["step"], k)
    te, tc = _task_state(eager), _task_state(comp)
    for k in te:
        t, c = te[k].double(), tc[k].double()
        assert torch.equal(torch.isfinite(t), torch.isfinite(c)), k
        ok = torch.isfinite(t)
        torch.testing.assert_close(c[ok], t[ok], rtol=1e-3, atol=1e-5, msg=k)
