"""CLIP losses on one process against naive float64 references written with explicit loops."""

import math

import pytest
import torch
import torch.nn.functional as F

from vitscale.config import ClipConfig, OptimConfig
from vitscale.losses import ClipLoss, FastClipLoss, build_clip_loss, gamma_at

EPS = 1e-14


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def feats(n, d, seed=0, anti=False):
    g = torch.Generator().manual_seed(seed)
    e1 = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    noise = torch.randn(n, d, generator=g, dtype=torch.float64)
    e2 = F.normalize((-e1 + 0.3 * noise) if anti else noise, dim=1)
    return e1, e2


# ---------------------------------------------------------------- naive references (float64)
def ref_infonce(e1, e2, scale):
    n, tot = e1.shape[0], 0.0
    for i in range(n):  # image i -> texts, text i -> images
        li = scale * torch.stack([e1[i] @ e2[j] for j in range(n)])
        lt = scale * torch.stack([e1[j] @ e2[i] for j in range(n)])
        tot = tot - (li[i] - torch.logsumexp(li, 0)) - (lt[i] - torch.logsumexp(lt, 0))
    return tot / (2 * n)


def ref_g(e1, e2, i, tau, text_anchor):
    """g_i = mean_{j != i} exp((s_ij - s_ii)/tau) (image anchor) or with s_ji (text anchor)."""
    n = e1.shape[0]
    sii = e1[i] @ e2[i]
    terms = [
        torch.exp(((e1[j] @ e2[i] if text_anchor else e1[i] @ e2[j]) - sii) / tau)
        for j in range(n)
        if j != i
    ]
    return sum(terms) / (n - 1)


def ref_fastclip(e1, e2, tau1, tau2, u1_old, u2_old, gamma, rho=0.0):
    """With the UPDATED u (detached weights): V = mean_i [g1_i/(eps+u1_i) + g2_i/(eps+u2_i)] (a
    function of the features), the new u, and h_i = d/dtau_i [tau_i (log(eps+g_i) + rho)] with u
    for g (the per-sample temperature gradient before the reference's clamp)."""
    n = e1.shape[0]
    total, u1n, u2n, h1, h2 = 0.0, [], [], [], []
    for i in range(n):
        ti1 = tau1[i].detach().clone().requires_grad_(True)
        ti2 = tau2[i].detach().clone().requires_grad_(True)
        g1, g2 = ref_g(e1, e2, i, ti1, False), ref_g(e1, e2, i, ti2, True)
        u1 = (1 - gamma) * u1_old[i] + gamma * g1.detach()
        u2 = (1 - gamma) * u2_old[i] + gamma * g2.detach()
        total = total + g1 / (EPS + u1) + g2 / (EPS + u2)
        (dg1,) = torch.autograd.grad(g1, ti1, retain_graph=True)
        (dg2,) = torch.autograd.grad(g2, ti2, retain_graph=True)
        h1.append(torch.log(EPS + u1) + ti1.detach() * dg1 / (EPS + u1) + rho)
        h2.append(torch.log(EPS + u2) + ti2.detach() * dg2 / (EPS + u2) + rho)
        u1n.append(u1), u2n.append(u2)
    return total / n, torch.stack(u1n), torch.stack(u2n), torch.stack(h1), torch.stack(h2)


def make(variant, n_data=50, **kw):
    kw = dict(
        dict(
            dataset_size=n_data,
            gamma_schedule="cosine",
            gamma_min=0.2,
            gamma_decay_epochs=4,
            tau_init=0.07,
            eps=EPS,
        ),
        **kw,
    )
    return FastClipLoss(variant, **kw)


# ---------------------------------------------------------------- OpenCLIP
def test_openclip_matches_naive_infonce():
    e1, e2 = feats(6, 5)
    for ls0 in (math.log(1 / 0.07), math.log(200.0)):  # the second is clamped to scale 100
        x1, x2 = e1.float().requires_grad_(True), e2.float().requires_grad_(True)
        ls = torch.tensor(ls0, requires_grad=True)
        loss, logs = ClipLoss()(x1, x2, ls, torch.arange(6))
        loss.backward()
        r1, r2 = e1.clone().requires_grad_(True), e2.clone().requires_grad_(True)
        rl = torch.tensor(ls0, dtype=torch.float64, requires_grad=True)
        ref = ref_infonce(r1, r2, rl.exp().clamp(max=100.0))
        ref.backward()
        assert abs(loss.item() - ref.item()) < 1e-5 * abs(ref.item())
        assert rel(x1.grad, r1.grad) < 1e-5 and rel(x2.grad, r2.grad) < 1e-5
        assert abs(ls.grad.item() - rl.grad.item()) < 1e-5 * max(1.0, abs(rl.grad.item()))
        assert logs["loss"] == pytest.approx(ref.item(), rel=1e-5)


# ---------------------------------------------------------------- FastCLIP gradient estimator
# (tests/unit/test_fastclip_reference.py checks the same quantities against the authors' code's numbers;
# these check them against independent float64 formulas at other sizes and settings)
@pytest.mark.parametrize("variant", ["fastclip_v1", "fastclip_v2", "fastclip_v3"])
def test_fastclip_gradient_matches_naive_estimator(variant):
    """Feature gradient = c grad V with c = 1/2 (tau/2 for v3), per-sample taus only inside the
    exponents (v2); loss = V (v3: tau V + rho tau + tau/2 mean(log u1 + log u2))."""
    n, d, n_data = 7, 5, 40
    e1, e2 = feats(n, d, seed=1)
    index = torch.tensor([3, 17, 5, 30, 22, 8, 11])
    m = make(variant, n_data=n_data, rho=6.5)
    m.set_epoch(2)  # gamma = 0.5(1+cos(pi/2))(0.8)+0.2 = 0.6
    assert m.gamma == pytest.approx(0.6)
    g = torch.Generator().manual_seed(5)
    u_old = torch.rand(2, n_data, generator=g, dtype=torch.float64) * 3 + 0.5
    m.lu1.copy_(u_old[0].log()), m.lu2.copy_(u_old[1].log())
    if m.individual:
        m.temperatures.tau1.copy_(torch.rand(n_data, generator=g) * 0.1 + 0.02)
        m.temperatures.tau2.copy_(torch.rand(n_data, generator=g) * 0.1 + 0.02)
        tau1, tau2 = m.temperatures.tau1[index].double(), m.temperatures.tau2[index].double()
    else:
        tau1 = tau2 = torch.full((n,), m.temperature, dtype=torch.float64)
    before = m.state_dict()
    x1, x2 = e1.float().requires_grad_(True), e2.float().requires_grad_(True)
    loss, logs = m(x1, x2, None, index)
    loss.backward()
    r1, r2 = e1.clone().requires_grad_(True), e2.clone().requires_grad_(True)
    rho = 0.0 if variant == "fastclip_v1" else 6.5
    v, u1, u2, h1, h2 = ref_fastclip(r1, r2, tau1, tau2, u_old[0][index], u_old[1][index], 0.6, rho)
    tau = tau1[0].item()
    c = tau / 2 if variant == "fastclip_v3" else 0.5
    (c * v).backward()
    assert rel(x1.grad, r1.grad) < 1e-4 and rel(x2.grad, r2.grad) < 1e-4
    value = v.item()
    if variant == "fastclip_v3":
        value = tau * v.item() + 6.5 * tau + tau * (u1.log() + u2.log()).mean().item() / 2
    assert logs["loss"] == pytest.approx(value, rel=1e-5) and loss.item() == pytest.approx(
        value, rel=1e-5
    )
    assert rel(m.lu1[index].exp(), u1) < 1e-5 and rel(m.lu2[index].exp(), u2) < 1e-5
    untouched = torch.ones(n_data, dtype=torch.bool)
    untouched[index] = False  # u updates touch only the batch's indices
    assert torch.equal(m.lu1[untouched], before["lu1"][untouched])
    assert torch.equal(m.lu2[untouched], before["lu2"][untouched])
    if variant == "fastclip_v2":  # h clamped to [-5, 5]
        _, p1, p2 = m.temperature_grad()
        assert rel(p1, h1.clamp(-5, 5)) < 1e-5 and rel(p2, h2.clamp(-5, 5)) < 1e-5
        m.after_step()  # per-sample tau: only the batch's indices
        for k in ("tau1", "tau2", "m1", "v1"):
            assert torch.equal(getattr(m.temperatures, k)[untouched], before[k][untouched])
            assert not torch.equal(getattr(m.temperatures, k)[index], before[k][index])


def test_fastclip_params_gradient_through_linear_model():
    torch.manual_seed(0)
    n, p, d = 6, 8, 4
    xi, xt = torch.randn(n, p), torch.randn(n, p)
    wi, wt = torch.nn.Linear(p, d), torch.nn.Linear(p, d)
    m = make("fastclip_v1")
    loss, _ = m(F.normalize(wi(xi), dim=1), F.normalize(wt(xt), dim=1), None, torch.arange(n))
    loss.backward()
    W = [w.detach().double().requires_grad_(True) for w in (wi.weight, wi.bias, wt.weight, wt.bias)]
    e1 = F.normalize(xi.double() @ W[0].T + W[1], dim=1)
    e2 = F.normalize(xt.double() @ W[2].T + W[3], dim=1)
    tau = torch.full((n,), 0.07, dtype=torch.float64)
    v = ref_fastclip(e1, e2, tau, tau, torch.zeros(n), torch.zeros(n), 1.0)[0]
    ref = torch.autograd.grad(v / 2, W)
    got = (wi.weight.grad, wi.bias.grad, wt.weight.grad, wt.bias.grad)
    assert max(rel(a, b) for a, b in zip(got, ref)) < 1e-4


@pytest.mark.parametrize("variant", ["fastclip_v0", "fastclip_v3"])
def test_global_temperature_gradient_is_the_reference_objective_derivative(variant):
    """gamma = 1 (u = g, detached): d(loss)/d(theta), theta = log(1/tau), equals autograd and a
    finite difference of the reference's loss as a function of theta, in float64:
    v0: F = V(theta);  v3: F = V(theta) e^-theta0 + rho e^-theta + mean(log u1 + log u2)/2 e^-theta."""
    n, theta0 = 6, math.log(1 / 0.05)
    e1, e2 = feats(n, 4, seed=3)
    m = make(variant, rho=6.5, tau_init=0.05)
    m(e1.float(), e2.float(), None, torch.arange(n))
    u = [
        torch.stack(
            [ref_g(e1, e2, i, torch.tensor(0.05, dtype=torch.float64), t) for i in range(n)]
        )
        for t in (False, True)
    ]

    def f(theta):
        tau = torch.exp(-theta)
        v = (
            sum(
                ref_g(e1, e2, i, tau, False) / (EPS + u[0][i])
                + ref_g(e1, e2, i, tau, True) / (EPS + u[1][i])
                for i in range(n)
            )
            / n
        )
        if variant == "fastclip_v0":
            return v
        return v * math.exp(-theta0) + 6.5 * tau + (u[0].log() + u[1].log()).mean() / 2 * tau

    theta = torch.tensor(theta0, dtype=torch.float64, requires_grad=True)
    (dtheta,) = torch.autograd.grad(f(theta), theta)
    assert m.temperature_grad().item() == pytest.approx(dtheta.item(), rel=1e-5)
    h = 1e-6
    fd = (
        f(torch.tensor(theta0 + h, dtype=torch.float64))
        - f(torch.tensor(theta0 - h, dtype=torch.float64))
    ) / (2 * h)
    assert fd.item() == pytest.approx(dtheta.item(), rel=1e-5)


def test_lse_stability_at_tau_001():
    """tau = 0.01 with anti-aligned positives: (s_ij - s_ii)/tau reaches ~150, exp of which overflows
    fp32; the loss and gradient stay finite and equal the float64 reference."""
    n = 6
    e1, e2 = feats(n, 3, seed=4, anti=True)
    zmax = max(((e1[i] @ e2[j] - e1[i] @ e2[i]) / 0.01).item() for i in range(n) for j in range(n))
    assert zmax > 120 and torch.isinf(torch.tensor(zmax).float().exp())  # naive fp32 exp overflows
    for variant in ("fastclip_v1", "fastclip_v2"):
        m = make(variant, tau_init=0.01)
        x1, x2 = e1.float().requires_grad_(True), e2.float().requires_grad_(True)
        loss, logs = m(x1, x2, None, torch.arange(n))
        loss.backward()
        assert (
            torch.isfinite(loss)
            and torch.isfinite(x1.grad).all()
            and torch.isfinite(m.lu1[:n]).all()
        )
        r1, r2 = e1.clone().requires_grad_(True), e2.clone().requires_grad_(True)
        tau = torch.full((n,), 0.01, dtype=torch.float64)
        v, u1, _, h1, _ = ref_fastclip(r1, r2, tau, tau, torch.zeros(n), torch.zeros(n), 1.0, m.rho)
        (v / 2).backward()
        assert rel(x1.grad, r1.grad) < 1e-4 and rel(x2.grad, r2.grad) < 1e-4
        assert loss.item() == pytest.approx(v.item(), rel=1e-5)
        assert rel(m.lu1[:n].double(), u1.log()) < 1e-5
        if variant == "fastclip_v2":
            assert rel(m.temperature_grad()[1], h1.clamp(-5, 5)) < 1e-4


# ---------------------------------------------------------------- schedules, temperatures, state
def test_gamma_schedule():
    assert gamma_at(0, "cosine", 0.2, 10) == 1.0 and gamma_at(0, "constant", 0.2, 10) == 1.0
    assert gamma_at(5, "cosine", 0.2, 10) == pytest.approx(0.6)  # 0.5*(1+0)*0.8+0.2
    assert gamma_at(2, "cosine", 0.2, 4) == pytest.approx(0.6)
    assert gamma_at(1, "cosine", 0.2, 3) == pytest.approx(0.5 * 1.5 * 0.8 + 0.2)  # cos(pi/3) = 0.5
    assert gamma_at(10, "cosine", 0.2, 10) == 0.2 and gamma_at(25, "cosine", 0.2, 10) == 0.2
    assert gamma_at(1, "constant", 0.8, 10) == 0.8 and gamma_at(7, "constant", 0.8, 10) == 0.8
    c, o = ClipConfig(), OptimConfig()
    c.loss, c.gamma_min = "sogclr", 0.3
    m = build_clip_loss(c, o, lr=1e-3, dataset_size=10, epochs=20, device="cpu")
    m.set_epoch(3)
    assert m.gamma == 0.3
    c.loss = "fastclip_v1"  # auto = cosine, E = epochs / 2 = 10
    m = build_clip_loss(c, o, lr=1e-3, dataset_size=10, epochs=20, device="cpu")
    m.set_epoch(5)
    assert m.gamma == pytest.approx(0.5 * 0.7 + 0.3)


@pytest.mark.parametrize(
    "loss, tau_init, tau_lr, schedule, rho, gamma_min",
    [
        (
            "fastclip_v0",
            0.07,
            5e-4,
            "model",
            0.0,
            0.2,
        ),  # lr_tau < 0 in the reference: the model's lr
        ("fastclip_v1", 0.07, 0.0, "constant", 0.0, 0.2),
        ("fastclip_v2", 0.03, 0.0133, "constant", 7.0, 0.2),
        ("fastclip_v3", 0.07, 2e-4, "threshold", 6.5, 0.2),
        ("sogclr", 0.07, 0.0, "constant", 0.0, 0.8),
        ("isogclr", 0.03, 0.0133, "constant", 7.0, 0.8),
    ],
)
def test_auto_settings_are_the_reference_recipe(loss, tau_init, tau_lr, schedule, rho, gamma_min):
    c = ClipConfig()
    c.loss = loss
    m = build_clip_loss(
        c, OptimConfig(beta2=0.98, eps=1e-6), lr=5e-4, dataset_size=10, epochs=8, device="cpu"
    )
    assert (m.temperature, m.tau_lr, m.tau_lr_schedule, m.rho, m.gamma_min) == (
        pytest.approx(tau_init),
        tau_lr,
        schedule,
        rho,
        gamma_min,
    )
    assert m.betas == (0.9, 0.98) and m.tau_eps == 1e-6  # the model optimizer's, as the reference
    c.tau_init, c.tau_lr, c.rho, c.gamma_min, c.tau_lr_schedule = 0.05, 1e-3, 3.0, 0.5, "constant"
    m = build_clip_loss(c, OptimConfig(), lr=5e-4, dataset_size=10, epochs=8, device="cpu")
    assert (m.temperature, m.tau_lr, m.tau_lr_schedule, m.gamma_min) == (
        pytest.approx(0.05),
        1e-3,
        "constant",
        0.5,
    )


def adam_steps(m, grads, steps=None):
    """Drive the global temperature with given d/dtheta values (the forward's role)."""
    for k, g in enumerate(grads):
        m.pending_grad = torch.tensor(g, dtype=torch.float64)
        m.after_step(None if steps is None else steps[k])


def test_global_temperature_adam_on_logit_scale_clamp_and_lr_cut():
    """theta = log(1/tau) gets Adam steps (the first is lr * sign(g); m/sqrt(v) stays 1 for a
    constant g), is clamped to [0, ln 100], and v3's lr is cut 3x exactly while tau <= 0.03."""
    th = lambda tau: math.log(1 / tau)  # noqa: E731
    m = make("fastclip_v3", tau_lr=1e-3, tau_lr_cut=3.0, tau_init=math.exp(-(th(0.03) - 1.5e-3)))
    m.multiply_tau = False  # feed d/dtheta directly (v3 scales its per-anchor sum by tau)
    adam_steps(m, [-1.0])  # tau > 0.03: full lr, theta rises by 1e-3
    assert m.temperatures.theta.item() == pytest.approx(th(0.03) - 0.5e-3, abs=1e-9)
    assert m.temperatures.lr_at().item() == pytest.approx(1e-3)
    adam_steps(m, [-1.0])  # still the full lr; now tau < 0.03
    assert m.temperatures.theta.item() == pytest.approx(th(0.03) + 0.5e-3, abs=1e-9)
    assert m.temperatures.lr_at().item() == pytest.approx(1e-3 / 3)
    adam_steps(m, [-1.0])  # the cut lr
    assert m.temperatures.theta.item() == pytest.approx(th(0.03) + 0.5e-3 + 1e-3 / 3, abs=1e-9)
    m.temperatures.theta.fill_(th(0.031))
    assert m.temperatures.lr_at().item() == pytest.approx(1e-3)  # not latched: back to the full lr
    m.temperatures.theta.fill_(math.log(100.0) - 1e-4)
    adam_steps(m, [-5.0] * 3)
    assert m.temperature == pytest.approx(0.01)  # clamped at theta = ln 100
    m = make("fastclip_v3", tau_lr=1e-3, tau_init=0.9995)  # fresh Adam state
    m.multiply_tau = False
    adam_steps(m, [1e4])
    assert m.temperatures.theta.item() == 0.0 and m.temperature == 1.0  # clamped at theta = 0
    v0 = make(
        "fastclip_v0",
        tau_lr=1e-3,
        tau_init=0.07,
        tau_lr_schedule="model",
        lr_factor=lambda s: [0.5, 1.0, 0.25][s],
    )  # v0: the model's schedule, no cut
    assert [v0.temperatures.lr_at(s).item() for s in range(3)] == [5e-4, 1e-3, 2.5e-4]
    adam_steps(v0, [1.0, 1.0, 1.0], steps=[0, 1, 2])
    assert v0.temperatures.theta.item() == pytest.approx(th(0.07) - 5e-4 - 1e-3 - 2.5e-4, abs=1e-9)
    v1 = make("fastclip_v1")  # constant tau
    v1(*(f.float() for f in feats(4, 3)), None, torch.arange(4))
    assert v1.temperature_grad() is None
    v1.after_step()
    assert v1.temperature == pytest.approx(0.07)


def test_per_sample_tau_adam_betas_zero_in_epoch_0_and_clamp():
    m = make("isogclr", n_data=10, tau_lr=0.02, tau_init=0.03, tau_beta1=0.9, tau_beta2=0.999)
    m.pending_grad = (
        torch.tensor([2, 5]),
        torch.tensor([1.0, -1.0], dtype=torch.float64),
        torch.tensor([3.0, 0.0], dtype=torch.float64),
    )
    m.after_step()  # epoch 0: betas 0, the step is lr * sign(h)
    t = m.temperatures
    assert t.tau1[2].item() == pytest.approx(0.01) and t.tau1[5].item() == pytest.approx(0.05)
    assert t.tau2[2].item() == pytest.approx(0.01) and t.tau2[5].item() == pytest.approx(
        0.03
    )  # zero gradient
    assert t.m1[2].item() == 1.0 and t.v1[5].item() == 1.0  # m = h, v = h^2
    others = [i for i in range(10) if i not in (2, 5)]
    assert (t.tau1[others] == 0.03).all() and (t.m1[others] == 0).all()
    m.set_epoch(2)  # betas back; bias correction 1 - b^(epoch+1)
    m.pending_grad = (
        torch.tensor([5]),
        torch.tensor([2.0], dtype=torch.float64),
        torch.tensor([0.0], dtype=torch.float64),
    )
    m.after_step()
    mi, vi = 0.9 * -1.0 + 0.1 * 2.0, 0.999 * 1.0 + 0.001 * 4.0
    step = 0.02 * (mi / (1 - 0.9**3)) / (math.sqrt(vi / (1 - 0.999**3)) + 1e-8)
    assert t.tau1[5].item() == pytest.approx(0.05 - step, rel=1e-6)


@pytest.mark.parametrize("variant", ["fastclip_v2", "fastclip_v3", "sogclr"])
def test_state_dict_round_trip(variant):
    torch.manual_seed(0)
    a = make(variant, n_data=20, tau_lr=1e-3)
    a.set_epoch(1)
    for step in range(3):
        e1, e2 = feats(5, 4, seed=step)
        loss, _ = a(e1.float(), e2.float(), None, torch.randperm(20)[:5])
        a.after_step()
    b = make(variant, n_data=20, tau_lr=1e-3)
    b.load_state_dict(a.state_dict())
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k], k
    e1, e2 = feats(5, 4, seed=9)
    la, _ = a(e1.float(), e2.float(), None, torch.arange(5))
    lb, _ = b(e1.float(), e2.float(), None, torch.arange(5))
    assert la.item() == lb.item()
    with pytest.raises(ValueError, match="dataset size"):
        make(variant, n_data=21).load_state_dict(sa)


def test_state_bytes_and_bf16():
    n = 1000
    assert make("fastclip_v1", n_data=n).state_bytes() == 2 * 4 * n  # u1, u2
    assert make("fastclip_v3", n_data=n).state_bytes() == 2 * 4 * n
    assert make("isogclr", n_data=n).state_bytes() == 10 * 4 * n  # + tau1,2, m1,2, v1,2, bound1,2
    assert make("fastclip_v1", n_data=n, state_dtype=torch.bfloat16).state_bytes() == 2 * 2 * n
    assert make("fastclip_v2", n_data=n, state_dtype=torch.bfloat16).state_bytes() == 10 * 2 * n
    assert ClipLoss().state_bytes() == 0
    m = make("fastclip_v2", n_data=n, state_dtype=torch.bfloat16)
    e1, e2 = feats(8, 4)
    loss, _ = m(e1.float().requires_grad_(True), e2.float(), None, torch.arange(8))
    loss.backward()
    m.after_step()
    assert torch.isfinite(loss) and torch.isfinite(m.lu1[:8]).all()


def test_losses_compute_in_fp32_under_autocast_and_take_bf16_features():
    e1, e2 = feats(6, 8, seed=7)
    for m in (ClipLoss(), make("fastclip_v3")):
        a, _ = m(e1.float(), e2.float(), torch.tensor(2.0), torch.arange(6))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b, _ = m(e1.float(), e2.float(), torch.tensor(2.0), torch.arange(6))
            c, _ = m(e1.bfloat16(), e2.bfloat16(), torch.tensor(2.0), torch.arange(6))
        assert b.dtype == torch.float32 and a.item() == b.item() and torch.isfinite(c)


def test_gamma_zero_keeps_u():
    m = make("fastclip_v1", gamma_min=0.0, gamma_decay_epochs=1)
    e1, e2 = feats(4, 3)
    m(e1.float(), e2.float(), None, torch.arange(4))
    u = m.lu1.clone()
    m.set_epoch(3)
    assert m.gamma == 0.0
    loss, _ = m(e1.float(), e2.float(), None, torch.arange(4))
    assert torch.equal(m.lu1, u) and torch.isfinite(loss)
