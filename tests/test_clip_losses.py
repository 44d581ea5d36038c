"""CLIP losses on one process against naive float64 references written with explicit loops."""
import math

import pytest
import torch
import torch.nn.functional as F

from vitscale.config import ClipConfig
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
    terms = [torch.exp(((e1[j] @ e2[i] if text_anchor else e1[i] @ e2[j]) - sii) / tau)
             for j in range(n) if j != i]
    return sum(terms) / (n - 1)


def ref_fastclip(e1, e2, tau1, tau2, u1_old, u2_old, gamma, rho=0.0):
    """G's surrogate sum_i (c_i/(eps+u_i)) g_i / N with the UPDATED u (detached weights), the new u,
    the objective estimate with u, and h_i = d/dtau_i [tau_i (log(eps+g_i) + rho)] with u for g."""
    n = e1.shape[0]
    total, u1n, u2n, obj, h1, h2 = 0.0, [], [], 0.0, [], []
    for i in range(n):
        ti1 = tau1[i].detach().clone().requires_grad_(True)
        ti2 = tau2[i].detach().clone().requires_grad_(True)
        g1, g2 = ref_g(e1, e2, i, ti1, False), ref_g(e1, e2, i, ti2, True)
        u1 = (1 - gamma) * u1_old[i] + gamma * g1.detach()
        u2 = (1 - gamma) * u2_old[i] + gamma * g2.detach()
        total = total + ti1.detach() / (EPS + u1) * g1 + ti2.detach() / (EPS + u2) * g2
        dg1, = torch.autograd.grad(g1, ti1, retain_graph=True)
        dg2, = torch.autograd.grad(g2, ti2, retain_graph=True)
        h1.append(torch.log(EPS + u1) + ti1.detach() * dg1 / (EPS + u1) + rho)
        h2.append(torch.log(EPS + u2) + ti2.detach() * dg2 / (EPS + u2) + rho)
        obj = obj + ti1.detach() * (torch.log(EPS + u1) + rho) + ti2.detach() * (torch.log(EPS + u2) + rho)
        u1n.append(u1), u2n.append(u2)
    return total / n, torch.stack(u1n), torch.stack(u2n), obj / n, torch.stack(h1), torch.stack(h2)


def make(variant, n_data=50, **kw):
    kw = dict(dict(dataset_size=n_data, gamma_schedule="cosine", gamma_min=0.2, gamma_decay_epochs=4,
                   tau_init=0.07, eps=EPS), **kw)
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
@pytest.mark.parametrize("variant", ["fastclip_v1", "fastclip_v2", "fastclip_v3"])
def test_fastclip_gradient_matches_naive_estimator(variant):
    n, d, n_data = 7, 5, 40
    e1, e2 = feats(n, d, seed=1)
    index = torch.tensor([3, 17, 5, 30, 22, 8, 11])
    m = make(variant, n_data=n_data, rho=6.5)
    m.set_epoch(2)                                          # gamma = 0.5(1+cos(pi/2))(0.8)+0.2 = 0.6
    assert m.gamma == pytest.approx(0.6)
    g = torch.Generator().manual_seed(5)
    u_old = torch.rand(2, n_data, generator=g, dtype=torch.float64) * 3 + 0.5
    m.lu1.copy_(u_old[0].log()), m.lu2.copy_(u_old[1].log())
    if m.individual:
        m.tau1.copy_(torch.rand(n_data, generator=g) * 0.1 + 0.02)
        m.tau2.copy_(torch.rand(n_data, generator=g) * 0.1 + 0.02)
        tau1, tau2 = m.tau1[index].double(), m.tau2[index].double()
    else:
        tau1 = tau2 = torch.full((n,), 0.07, dtype=torch.float64)
    before = m.state_dict()
    x1, x2 = e1.float().requires_grad_(True), e2.float().requires_grad_(True)
    loss, logs = m(x1, x2, None, index)
    loss.backward()
    r1, r2 = e1.clone().requires_grad_(True), e2.clone().requires_grad_(True)
    rho = 0.0 if variant == "fastclip_v1" else 6.5
    sur, u1, u2, obj, h1, h2 = ref_fastclip(r1, r2, tau1, tau2, u_old[0][index], u_old[1][index], 0.6, rho)
    sur.backward()
    assert rel(x1.grad, r1.grad) < 1e-4 and rel(x2.grad, r2.grad) < 1e-4
    assert logs["loss"] == pytest.approx(obj.item(), rel=1e-5) and loss.item() == pytest.approx(obj.item(), rel=1e-5)
    assert rel(m.lu1[index].exp(), u1) < 1e-5 and rel(m.lu2[index].exp(), u2) < 1e-5
    untouched = torch.ones(n_data, dtype=torch.bool)
    untouched[index] = False                                # u updates touch only the batch's indices
    assert torch.equal(m.lu1[untouched], before["lu1"][untouched])
    assert torch.equal(m.lu2[untouched], before["lu2"][untouched])
    if variant == "fastclip_v3":                            # global tau: mean_i (h1_i + h2_i)
        assert m._pending.item() == pytest.approx((h1 + h2).mean().item(), rel=1e-5)
    if variant == "fastclip_v2":
        _, p1, p2 = m._pending
        assert rel(p1, h1) < 1e-5 and rel(p2, h2) < 1e-5
        m.after_step()                                      # per-sample tau: only the batch's indices
        for k in ("tau1", "tau2", "m1", "v1", "count"):
            assert torch.equal(getattr(m, k)[untouched], before[k][untouched])
            assert not torch.equal(getattr(m, k)[index], before[k][index])


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
    sur = ref_fastclip(e1, e2, tau, tau, torch.zeros(n), torch.zeros(n), 1.0)[0]
    ref = torch.autograd.grad(sur, W)
    got = (wi.weight.grad, wi.bias.grad, wt.weight.grad, wt.bias.grad)
    assert max(rel(a, b) for a, b in zip(got, ref)) < 1e-4


@pytest.mark.parametrize("variant", ["fastclip_v0", "fastclip_v3"])
def test_global_tau_gradient_is_the_objective_derivative(variant):
    """gamma = 1 (u = g): the estimated dF/dtau equals autograd of F(tau) =
    tau mean_i [log(eps+g1_i) + log(eps+g2_i)] (+ 2 rho tau for v3), in float64."""
    e1, e2 = feats(6, 4, seed=3)
    m = make(variant, rho=6.5, tau_init=0.05)
    m(e1.float(), e2.float(), None, torch.arange(6))
    tau = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    f = sum(torch.log(EPS + ref_g(e1, e2, i, tau, False)) + torch.log(EPS + ref_g(e1, e2, i, tau, True))
            for i in range(6)) * tau / 6 + (2 * 6.5 * tau if variant == "fastclip_v3" else 0)
    dtau, = torch.autograd.grad(f, tau)
    assert m._pending.item() == pytest.approx(dtau.item(), rel=1e-5)
    h = 1e-6                                                # and a finite difference of F
    fd = [tau.detach() + s for s in (h, -h)]
    fv = [(sum(torch.log(EPS + ref_g(e1, e2, i, t, False)) + torch.log(EPS + ref_g(e1, e2, i, t, True))
               for i in range(6)) * t / 6 + (2 * 6.5 * t if variant == "fastclip_v3" else 0)).item() for t in fd]
    assert (fv[0] - fv[1]) / (2 * h) == pytest.approx(dtau.item(), rel=1e-5)


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
        assert torch.isfinite(loss) and torch.isfinite(x1.grad).all() and torch.isfinite(m.lu1[:n]).all()
        r1, r2 = e1.clone().requires_grad_(True), e2.clone().requires_grad_(True)
        tau = torch.full((n,), 0.01, dtype=torch.float64)
        sur, u1, _, obj, h1, _ = ref_fastclip(r1, r2, tau, tau, torch.zeros(n), torch.zeros(n), 1.0, m.rho)
        sur.backward()
        assert rel(x1.grad, r1.grad) < 1e-4 and rel(x2.grad, r2.grad) < 1e-4
        assert loss.item() == pytest.approx(obj.item(), rel=1e-5)
        assert rel(m.lu1[:n].double(), u1.log()) < 1e-5
        if variant == "fastclip_v2":
            assert rel(m._pending[1], h1) < 1e-4


# ---------------------------------------------------------------- schedules, temperatures, state
def test_gamma_schedule():
    assert gamma_at(0, "cosine", 0.2, 10) == 1.0 and gamma_at(0, "constant", 0.2, 10) == 1.0
    assert gamma_at(5, "cosine", 0.2, 10) == pytest.approx(0.6)          # 0.5*(1+0)*0.8+0.2
    assert gamma_at(2, "cosine", 0.2, 4) == pytest.approx(0.6)
    assert gamma_at(1, "cosine", 0.2, 3) == pytest.approx(0.5 * 1.5 * 0.8 + 0.2)  # cos(pi/3) = 0.5
    assert gamma_at(10, "cosine", 0.2, 10) == 0.2 and gamma_at(25, "cosine", 0.2, 10) == 0.2
    assert gamma_at(1, "constant", 0.8, 10) == 0.8 and gamma_at(7, "constant", 0.8, 10) == 0.8
    c = ClipConfig()
    c.loss, c.gamma_min = "sogclr", 0.3
    m = build_clip_loss(c, dataset_size=10, epochs=20, steps_per_epoch=3, device="cpu")
    m.set_epoch(3)
    assert m.gamma == 0.3
    c.loss = "fastclip_v1"                                  # auto = cosine, E = epochs / 2 = 10
    m = build_clip_loss(c, dataset_size=10, epochs=20, steps_per_epoch=3, device="cpu")
    m.set_epoch(5)
    assert m.gamma == pytest.approx(0.5 * 0.7 + 0.3)


def test_global_tau_adam_clamp_and_lr_cut():
    m = make("fastclip_v3", tau_lr=1e-3, tau_lr_cut=3.0, tau_init=0.0312)
    m._pending = torch.tensor(5.0, dtype=torch.float64)     # Adam's first step = lr * sign(g)
    m.after_step()
    assert m.temperature == pytest.approx(0.0302, abs=1e-9)
    assert m.tau_lr_now.item() == pytest.approx(1e-3)       # 0.0302 > 0.03: no cut yet
    m._pending = torch.tensor(5.0, dtype=torch.float64)
    m.after_step()                                          # m/sqrt(v) is 1 for a constant gradient
    assert m.temperature == pytest.approx(0.0292, abs=1e-9)
    assert m.tau_lr_now.item() == pytest.approx(1e-3 / 3)   # tau <= 0.03: lr cut, sticky
    m._pending = torch.tensor(5.0, dtype=torch.float64)
    m.after_step()
    assert m.temperature == pytest.approx(0.0292 - 1e-3 / 3, abs=1e-9)
    m.tau.fill_(0.0101)
    for _ in range(3):
        m._pending = torch.tensor(5.0, dtype=torch.float64)
        m.after_step()
    assert m.temperature == 0.01                            # clamped below
    m = make("fastclip_v3", tau_lr=1e-3, tau_init=0.9995)  # fresh Adam state
    m._pending = torch.tensor(-1e4, dtype=torch.float64)
    m.after_step()
    assert m.temperature == 1.0                             # clamped above
    v0 = make("fastclip_v0", tau_lr=1e-3, tau_init=0.0305)  # v0: no lr cut
    for _ in range(3):
        v0._pending = torch.tensor(1.0, dtype=torch.float64)
        v0.after_step()
    assert v0.tau_lr_now.item() == 1e-3
    v1 = make("fastclip_v1")                                # constant tau
    v1(*feats(4, 3), None, torch.arange(4))
    v1.after_step()
    assert v1.temperature == pytest.approx(0.07)


def test_per_sample_tau_adam_and_clamp():
    m = make("isogclr", n_data=10, tau_lr=0.02, tau_init=0.03)
    m._pending = (torch.tensor([2, 5]), torch.tensor([1.0, -1.0], dtype=torch.float64),
                  torch.tensor([3.0, 0.0], dtype=torch.float64))
    m.after_step()
    assert m.tau1[2].item() == pytest.approx(0.01) and m.tau1[5].item() == pytest.approx(0.05)
    assert m.tau2[2].item() == pytest.approx(0.01) and m.tau2[5].item() == pytest.approx(0.03)  # zero gradient
    assert m.count.tolist() == [0, 0, 1, 0, 0, 1, 0, 0, 0, 0]
    others = [i for i in range(10) if i not in (2, 5)]
    assert (m.tau1[others] == 0.03).all() and (m.m1[others] == 0).all()


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
    assert make("fastclip_v1", n_data=n).state_bytes() == 2 * 4 * n          # u1, u2
    assert make("fastclip_v3", n_data=n).state_bytes() == 2 * 4 * n
    assert make("isogclr", n_data=n).state_bytes() == 8 * 4 * n + 4 * n       # + tau1,2, m1,2, v1,2, count
    assert make("fastclip_v1", n_data=n, state_dtype=torch.bfloat16).state_bytes() == 2 * 2 * n
    assert make("fastclip_v2", n_data=n, state_dtype=torch.bfloat16).state_bytes() == 8 * 2 * n + 4 * n
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
