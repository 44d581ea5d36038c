"""SigLIP's loss by its definition in float64, and the fp32 rounding bounds of one rank's loss
and gradients: what tests/unit/test_siglip_loss.py and integration/siglip_dist_worker.py compare
vitscale's and OpenCLIP's SigLipLoss with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = torch.finfo(torch.float32).eps


def siglip_bounds(b: int, n: int, d: int, scale: float, bias: float, loss: float) -> dict:
    """Absolute fp32 rounding bounds of one rank's SigLIP loss and gradients (b images scored
    against n texts, unit features of width d, eps = finfo(float32).eps), worst case:

    - a logit z = s <x, y> + t: the log-scale's exp (eps s), the product s x (eps s), the d-term dot
      product of unit vectors (sum |x_k y_k| <= 1: d eps s), the bias's sum (eps |z| <= eps (s + |t|)):
      |dz| <= Z = eps (s (d + 4) + |t|);
    - the loss (1/b) sum of b n terms softplus(-y z), softplus' <= 1: n Z from the logits, and the
      sum of b n non-negative terms: b n eps L;
    - each logit's gradient coefficient c = -y sigmoid(-y z) / b, |c| <= 1/b, sigmoid' <= 1/4:
      |dc| <= (Z/4 + 2 eps) / b; a feature's gradient sums n terms c s x (|x_k| <= 1) in the matmul
      (n + 2) eps of its sum of magnitudes: (n s / b)(Z/4 + (n + 4) eps);
    - d/d(log s) sums b n terms c s <x, y> (|.| <= s / b): n s (Z/4 + (d + b n + 4) eps);
      d/dt sums b n terms c: n (Z/4 + (b n + 2) eps).
    A real bug (a block missed or counted twice, a wrong label, the bias left out) is off by a whole
    block's terms: the tests check that such a change exceeds these bounds."""
    z = EPS * (scale * (d + 4) + abs(bias))
    return {
        "loss": n * z + (b * n + 1) * EPS * loss,
        "features": n * scale / b * (z / 4 + (n + 4) * EPS),
        "logit_scale": n * scale * (z / 4 + (d + b * n + 4) * EPS),
        "logit_bias": n * (z / 4 + (b * n + 2) * EPS),
    }


def naive64(img, txt, log_scale, bias):
    """float64, the definition: -(1/b) sum_ij log sigmoid(y_ij (exp(log_scale) <img_i, txt_j> + bias)),
    y = +1 on the diagonal, -1 elsewhere; txt may hold more rows than img (other ranks' texts)."""
    b = img.shape[0]
    z = log_scale.exp() * img @ txt.T + bias
    y = -torch.ones_like(z)
    y[:, :b] += 2 * torch.eye(b, dtype=z.dtype)
    return -F.logsigmoid(y * z).sum() / b


def features(b: int, d: int, seed: int, align: float = 1.0):
    """Unit image and text features, the pairs correlated by `align` (0: independent)."""
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(b, d, generator=g), dim=1)
    txt = F.normalize(align * img + torch.randn(b, d, generator=g), dim=1)
    return img, txt


def rank_loss64(img_all, txt_all, log_scale, bias, k: int, rank: int):
    """float64, rank `rank`'s loss of K: its b images against its own texts (the pairs) and every
    other rank's (negatives), as OpenCLIP's SigLipLoss on that rank computes it."""
    b = img_all.shape[0] // k
    own = slice(rank * b, (rank + 1) * b)
    others = [txt_all[q * b : (q + 1) * b] for q in range(k) if q != rank]
    return naive64(img_all[own], torch.cat([txt_all[own], *others]), log_scale, bias)
