"""FastCLIP parity with the authors' code: every case of tests/fixtures/fastclip_reference_cases.json
(a copy of ../shared/reference/'s; numbers produced by Optimization-AI/fast_clip's own loss and
scheduler code; tests/fixtures/fastclip_reference_README.md gives the conventions and the
tolerances used here) is reproduced by vitscale's FastClipLoss in float32: one step from each
step's `state_before`, and three steps chained from `initial_state`."""

import json
import math
from pathlib import Path

import pytest
import torch

from vitscale.losses import FastClipLoss
from vitscale.optim import lr_factor

# a copy of ../shared/reference/fastclip_reference_cases.json (and its README), so that the parity
# test runs on any clone; test_fixture_copy_matches_shared keeps the copy current where shared/ is
REF = Path(__file__).resolve().parents[1] / "fixtures" / "fastclip_reference_cases.json"
SHARED = (
    Path(__file__).resolve().parents[3] / "shared" / "reference" / "fastclip_reference_cases.json"
)
CASES = json.loads(REF.read_text())["cases"]
SCHEDULES = {"cosine": "model", "step_thresh": "threshold"}


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


def close(got, ref, rtol, what):
    got, ref = torch.as_tensor(got, dtype=torch.float64), t64(ref)
    err = ((got - ref).abs() / ref.abs().clamp_min(1e-300)).max().item()
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


def close_abs(got, ref, atol, what):
    err = (torch.as_tensor(got, dtype=torch.float64) - t64(ref)).abs().max().item()
    assert err <= atol, f"{what}: abs error {err:.3g} > {atol:g}"


def close_log_u(lu, u_ref, what):
    """|log u - log u_ref| <= 1e-4, and u = 0 exactly where the reference has 0 (never seen)."""
    u_ref = t64(u_ref)
    seen = u_ref > 0
    assert torch.equal(torch.isneginf(lu.double()), ~seen), f"{what}: unseen entries differ"
    close_abs(lu.double()[seen], u_ref[seen].log().tolist(), 1e-4, what)


def build(case) -> FastClipLoss:
    o, variant = case["reference_options"], case["id"].split("/")[0]
    if o["loss_class"] == "FastCLIPLossIndividual":
        schedule, betas, eps = "constant", (o["beta1_tau"], o["beta2_tau"]), o["eps_tau"]
    else:
        schedule, betas, eps = (
            SCHEDULES.get(o["lr_tau_scheduler"], "constant"),
            (o["beta1"], o["beta2"]),
            o["eps"],
        )
    factor = (
        (lambda s: lr_factor(s, o["total_steps"], o["warmup"], "cosine", 0.0))
        if schedule == "model"
        else None
    )
    if schedule == "model":
        assert o["lr_min"] == 0.0
    return FastClipLoss(
        variant,
        dataset_size=o["data_size"],
        gamma_schedule=o["gamma_schedule"],
        gamma_min=o["gamma"],
        gamma_decay_epochs=o["gamma_decay_epochs"],
        tau_init=o["temperature"] or 0.07,
        tau_lr=o["lr_tau"] if "learnable" in o["temperature_scheme"] else 0.0,
        tau_lr_schedule=schedule,
        lr_factor=factor,
        rho=o["rho"],
        eps=o["fastclip_eps"],
        tau_beta1=betas[0],
        tau_beta2=betas[1],
        tau_eps=eps,
    )


def load_state(m: FastClipLoss, st: dict) -> None:
    with torch.no_grad():
        for side in (1, 2):
            getattr(m, f"lu{side}").copy_(t64(st[f"u{side}"]).log())
        if m.individual:
            for k in ("tau1", "tau2", "m1", "m2", "v1", "v2", "bound1", "bound2"):
                getattr(m.temperatures, k).copy_(t64(st[k]))
        else:
            m.temperatures.theta.copy_(t64(st["logit_scale_param"]))
            if "adamw_step" in st:
                m.temperatures.theta_step.fill_(st["adamw_step"])
                m.temperatures.theta_m.copy_(t64(st["adamw_exp_avg"]))
                m.temperatures.theta_v.copy_(t64(st["adamw_exp_avg_sq"]))


def check_step(m: FastClipLoss, step: dict, what: str) -> None:
    m.set_epoch(step["epoch"])
    assert abs(m.gamma - step["gamma"]) <= 1e-12, f"{what}: gamma {m.gamma} != {step['gamma']}"
    idx = torch.tensor(step["indices"])
    x1 = t64(step["image_features"]).float().requires_grad_(True)
    x2 = t64(step["text_features"]).float().requires_grad_(True)
    if m.learn_global:  # the lr the reference's scheduler set before this step's forward
        close(m.temperatures.lr_at(step["global_step"]), step["lr_tau"], 1e-12, f"{what} lr_tau")
    loss, logs = m(x1, x2, None, idx)
    loss.backward()
    out = step["outputs"]
    close(loss.item(), out["loss"], 1e-5, f"{what} loss")
    close(logs["loss"], out["loss"], 1e-5, f"{what} logged loss")
    for x, key in ((x1, "grad_image_features"), (x2, "grad_text_features")):
        ref = t64(out[key])
        err = (x.grad.double() - ref).abs().max() / ref.abs().max()
        assert err <= 1e-5, f"{what} {key}: max|g - g_ref| / max|g_ref| = {err:.3g}"
    close_log_u(m.lu1[idx], out["u1_batch"], f"{what} u1")
    close_log_u(m.lu2[idx], out["u2_batch"], f"{what} u2")
    grad = m.temperature_grad()
    if m.learn_global:
        close(grad, out["grad_logit_scale_param"], 1e-5, f"{what} d/dtheta")
    elif m.individual:
        _, h1, h2 = grad
        close_abs(h1, out["grad_tau1_batch"], 5e-5, f"{what} h1")
        close_abs(h2, out["grad_tau2_batch"], 5e-5, f"{what} h2")
        for side in (1, 2):  # the diagonal's z is 0 up to rounding: scaled by the largest bound
            ref = t64(out[f"bound{side}_batch"])
            close_abs(
                getattr(m.temperatures, f"bound{side}")[idx],
                ref.tolist(),
                1e-5 * ref.abs().max().item() + 1e-6,
                f"{what} bound{side}",
            )
    else:
        assert grad is None
    m.after_step(step.get("global_step"))
    after = step["state_after"]
    if m.learn_global:
        close_abs(m.temperatures.theta, out["logit_scale_param_after_clamp"], 2e-6, f"{what} theta")
        hit = out["logit_scale_clamp_hit"]
        assert (m.temperatures.theta.item() in (0.0, math.log(100.0))) == bool(hit), (
            f"{what}: clamp event differs"
        )
        close(m.temperatures.tau, out["tau_after"], 1e-5, f"{what} tau")
        assert m.temperatures.theta_step.item() == after["adamw_step"]
        for k, ref_k in (("theta_m", "adamw_exp_avg"), ("theta_v", "adamw_exp_avg_sq")):
            ref = t64(after[ref_k])
            got = getattr(m.temperatures, k)
            assert (got - ref).abs().item() <= 1e-4 * ref.abs().item() + 1e-5 * ref.abs().item(), k
    elif m.individual:
        for side in (1, 2):
            tau = getattr(m.temperatures, f"tau{side}")[idx]
            close(tau, out[f"tau{side}_batch_after"], 1e-5, f"{what} tau{side}")
            clamped = set(out[f"tau{side}_clamped_indices"])
            for j, i in enumerate(step["indices"]):  # the clamp events are the reference's
                at_bound = min(abs(tau[j].item() - 0.01), abs(tau[j].item() - 1.0)) < 1e-7
                assert at_bound == (i in clamped) or (
                    at_bound and (abs(step["state_before"][f"tau{side}"][i] - tau[j].item()) < 1e-7)
                ), f"{what} clamp {i}"
            for mom in ("m", "v"):
                got, ref = (
                    getattr(m.temperatures, f"{mom}{side}")[idx].double(),
                    t64(out[f"{mom}{side}_batch_after"]),
                )
                err = (got - ref).abs().max().item()
                assert err <= 1e-4 * ref.abs().max().item() + 1e-5 * ref.abs().max().item(), (
                    f"{what} {mom}{side}"
                )
    else:
        close(
            m.temperatures.tau,
            after.get("tau", step["state_before"]["tau"]),
            1e-7,
            f"{what} constant tau",
        )
    # every entry of the table, not only the batch's, is the reference's
    close_log_u(m.lu1, after["u1"], f"{what} u1 (all)")
    close_log_u(m.lu2, after["u2"], f"{what} u2 (all)")
    if m.individual:
        close(m.temperatures.tau1, after["tau1"], 1e-5, f"{what} tau1 (all)")
        close(m.temperatures.tau2, after["tau2"], 1e-5, f"{what} tau2 (all)")


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_three_chained_steps_match_the_reference(case):
    m = build(case)
    load_state(m, case["initial_state"])
    for k, step in enumerate(case["steps"]):
        check_step(m, step, f"{case['id']} step {k}")


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_each_step_alone_matches_the_reference(case):
    for k, step in enumerate(case["steps"]):
        m = build(case)
        load_state(m, step["state_before"])
        check_step(m, step, f"{case['id']} step {k} alone")


def test_the_gamma_schedules_are_the_reference():
    from vitscale.losses import gamma_at

    sched = json.loads(REF.read_text())["gamma_schedules"]
    for name, s in sched.items():
        for e, v in zip(s["epochs"], s["values"]):
            assert (
                abs(gamma_at(e, s["gamma_schedule"], s["gamma"], s["gamma_decay_epochs"]) - v)
                <= 1e-12
            ), (name, e)


@pytest.mark.skipif(
    not SHARED.exists(), reason=f"no shared reference folder at {SHARED} (the fixture copy is used)"
)
def test_fixture_copy_matches_shared():
    assert REF.read_bytes() == SHARED.read_bytes(), (
        "tests/fixtures/fastclip_reference_cases.json is stale: copy it again"
    )
