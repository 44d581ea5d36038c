"""Batched augmentation on the training device: every op is vectorized over the batch.

Random parameters for a whole *global* batch are drawn from a CPU torch.Generator seeded by
(seed, epoch, batch index) and each rank keeps its slice, so the augmentation of a sample does
not depend on the number of processes or workers (mixup/cutmix pair images inside the local
batch, by flipping it, as timm does). Pixels: uint8 in, float32 normalized out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

# RandAugment-style op set; magnitude m in [0, 1] sets the strength, each op gets a random sign.
# At m = 1: brightness/contrast x(1 +- 0.9), solarize threshold 0, posterize to 4 bits,
# translate +-45% of the side, rotate +-30 degrees, shear +-0.3, cutout square of half the side.
OPS = (
    "identity",
    "brightness",
    "contrast",
    "solarize",
    "posterize",
    "translate_x",
    "translate_y",
    "rotate",
    "shear_x",
    "shear_y",
    "cutout",
)
OP = {name: i for i, name in enumerate(OPS)}
GEOMETRY = ("translate_x", "translate_y", "rotate", "shear_x", "shear_y")


# the mean/std that published weights were trained with (data.normalize)
NORMALIZATIONS = {
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
}


def normalization(name: str, mean, std) -> tuple[tuple, tuple]:
    """(mean, std) for data.normalize=`name` given the dataset's own: "auto"/"dataset" keep them;
    "imagenet"/"clip" take those constants, averaged over the channels for 1-channel data (a grey
    image seen as three equal channels, as the 3 -> 1 filter sum of model.init sees it)."""
    if name in ("auto", "dataset"):
        return tuple(mean), tuple(std)
    m, s = NORMALIZATIONS[name]
    if len(mean) == 1:
        return (sum(m) / 3,), (sum(s) / 3,)
    return m, s


class Normalizer:
    """uint8 [B,C,H,W] -> float32 (x/255 - mean)/std, constants cached per device."""

    def __init__(self, mean, std):
        self.mean, self.std = tuple(mean), tuple(std)
        self._cache: dict = {}

    def _consts(self, device):
        if device not in self._cache:
            mean = torch.tensor(self.mean, device=device).view(1, -1, 1, 1)
            std = torch.tensor(self.std, device=device).view(1, -1, 1, 1)
            self._cache[device] = (mean, std, 1.0 / (255.0 * std), -mean / std)
        return self._cache[device]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # uint8 [B,C,H,W]
        _, _, scale, shift = self._consts(x.device)
        return x.float().mul_(scale).add_(shift)

    def from_unit(self, x: torch.Tensor) -> torch.Tensor:  # float [B,C,H,W] in [0, 1]
        mean, std, _, _ = self._consts(x.device)
        return x.sub_(mean).div_(std)


def resize_u8(x: torch.Tensor, size: int, chunk: int = 2048) -> torch.Tensor:
    """[N,C,h,w] uint8 -> [N,C,size,size] uint8 (bilinear, antialiased), in chunks."""
    out = torch.empty(x.shape[0], x.shape[1], size, size, dtype=torch.uint8, device=x.device)
    for s in range(0, x.shape[0], chunk):
        y = F.interpolate(
            x[s : s + chunk].float(),
            size=(size, size),
            mode="bilinear",
            align_corners=False,
            antialias=True,
        )
        out[s : s + chunk] = y.round_().clamp_(0, 255).to(torch.uint8)
    return out


def crop_flip(
    x: torch.Tensor, offset: torch.Tensor | None, flip: torch.Tensor | None, pad: int
) -> torch.Tensor:
    """Per-sample crop of the zero-padded image at `offset` and/or mirror, as one gather.

    x [B,C,H,W] (any dtype); offset [B,2] int64 (dy, dx) in [0, 2*pad]; flip [B] bool.
    """
    B, C, H, W = x.shape
    dev = x.device
    if pad:
        x = F.pad(x, (pad, pad, pad, pad))
    Hp, Wp = x.shape[-2:]
    rows = torch.arange(H, device=dev).expand(B, H)  # [B,H]
    cols = torch.arange(W, device=dev).expand(B, W)  # [B,W]
    if flip is not None:
        cols = torch.where(flip[:, None], W - 1 - cols, cols)
    if offset is not None:
        rows = rows + offset[:, :1]
        cols = cols + offset[:, 1:]
    idx = (rows[:, :, None] * Wp + cols[:, None, :]).view(B, 1, H * W)  # [B,1,H*W]
    return x.reshape(B, C, Hp * Wp).gather(2, idx.expand(B, C, H * W)).view(B, C, H, W)


def _affine_grid(theta: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """F.affine_grid(theta [S,2,3], align_corners=False) as one matmul -> [S,H,W,2] (faster on CPU)."""
    X = (torch.arange(W, device=theta.device, dtype=theta.dtype) * 2 + 1) / W - 1  # [W]
    Y = (torch.arange(H, device=theta.device, dtype=theta.dtype) * 2 + 1) / H - 1  # [H]
    base = torch.stack([X.expand(H, W), Y[:, None].expand(H, W), torch.ones_like(X).expand(H, W)])
    g = theta.reshape(-1, 3) @ base.view(3, H * W)  # [2S,H*W]
    return g.view(-1, 2, H, W).permute(0, 2, 3, 1).contiguous()


def rand_augment(x: torch.Tensor, ops: torch.Tensor, signs: torch.Tensor, m: float) -> torch.Tensor:
    """Colour + geometric ops, each on the subset of samples that drew it (in place).

    x float [B,C,H,W] in [0,1]; ops [B,k] op ids, signs [B,k] +-1 (CPU tensors).
    """
    onehot = F.one_hot(ops, len(OPS)).float()  # [B,k,n_ops]
    chosen = onehot.amax(1) > 0  # [B,n_ops]
    amount = (onehot * signs[..., None]).sum(1) * m  # [B,n_ops] signed
    dev = x.device

    def apply(names, fn):
        cols = [OP[n] for n in names]
        sel = chosen[:, cols].any(1).nonzero().flatten()  # [S] CPU
        if len(sel):
            sel_d = sel.to(dev)
            x.index_copy_(0, sel_d, fn(x.index_select(0, sel_d), sel))

    def factor(name, sel):  # [S,1,1,1] multiplicative
        f = torch.where(ops[sel] == OP[name], 1 + 0.9 * m * signs[sel], 1.0).prod(1)
        return f.to(dev).view(-1, 1, 1, 1)

    q = 2.0 ** round(4 * m)  # posterize: drop bits
    apply(["posterize"], lambda v, s: torch.floor(torch.round(v * 255) / q) * (q / 255))
    thr = 256 * (1 - m) / 255  # solarize threshold
    apply(["solarize"], lambda v, s: torch.where(v >= thr, 1 - v, v))
    apply(["brightness"], lambda v, s: v * factor("brightness", s))
    apply(
        ["contrast"],
        lambda v, s: (v - (mu := v.mean(dim=(1, 2, 3), keepdim=True))) * factor("contrast", s) + mu,
    )
    x.clamp_(0, 1)

    def warp(v, s):
        tx, ty, rot, shx, shy = amount[s][:, [OP[n] for n in GEOMETRY]].unbind(1)
        tx, ty, rot, shx, shy = 0.9 * tx, 0.9 * ty, rot * math.radians(30), 0.3 * shx, 0.3 * shy
        cos, sin = torch.cos(rot), torch.sin(rot)
        # theta = [R @ Shear | t] (normalized coords, output -> input)            [S,2,3]
        theta = torch.stack(
            [
                torch.stack([cos - sin * shy, cos * shx - sin, tx], 1),
                torch.stack([sin + cos * shy, sin * shx + cos, ty], 1),
            ],
            1,
        )
        grid = _affine_grid(theta.to(dev, v.dtype), v.shape[2], v.shape[3])
        return F.grid_sample(v, grid, mode="bilinear", padding_mode="zeros", align_corners=False)

    if m > 0:
        apply(GEOMETRY, warp)
    return x


def cutout(x: torch.Tensor, chosen: torch.Tensor, centre: torch.Tensor, m: float) -> torch.Tensor:
    """Zero (after normalization: the mean colour) a square of side 0.5*m*H centred at `centre`.

    x [B,C,H,W]; chosen [B] bool and centre [B,2] in [0,1) (CPU). In place on the chosen rows.
    """
    B, _, H, W = x.shape
    side = round(0.5 * m * H)
    sel = chosen.nonzero().flatten()  # [S]
    if not len(sel) or side == 0:
        return x
    dev = x.device
    cy, cx = (centre[sel, :1] * H).to(dev), (centre[sel, 1:] * W).to(dev)  # [S,1]
    r = (torch.arange(H, device=dev) + 0.5)[None] - cy  # [S,H]
    c = (torch.arange(W, device=dev) + 0.5)[None] - cx  # [S,W]
    mask = (r.abs() <= side / 2)[:, :, None] & (c.abs() <= side / 2)[:, None, :]  # [S,H,W]
    sel = sel.to(dev)
    return x.index_copy_(0, sel, x.index_select(0, sel).masked_fill_(mask[:, None], 0.0))


def mixup(x: torch.Tensor, t: torch.Tensor, lam: float):
    """x [B,C,H,W], t [B,K] soft targets: blend each sample with its mirror in the batch."""
    return x * lam + x.flip(0) * (1 - lam), t * lam + t.flip(0) * (1 - lam)


def cutmix(x: torch.Tensor, t: torch.Tensor, lam: float, centre: tuple[float, float]):
    """Paste a box (area ~ 1-lam, at `centre` in [0,1)^2) from the mirrored batch; exact weights."""
    _, _, H, W = x.shape
    ch, cw = int(H * math.sqrt(1 - lam)), int(W * math.sqrt(1 - lam))
    cy, cx = int(centre[0] * H), int(centre[1] * W)
    y0, y1 = max(cy - ch // 2, 0), min(cy + ch - ch // 2, H)
    x0, x1 = max(cx - cw // 2, 0), min(cx + cw - cw // 2, W)
    lam = 1 - (y1 - y0) * (x1 - x0) / (H * W)
    x = x.clone()
    x[:, :, y0:y1, x0:x1] = x.flip(0)[:, :, y0:y1, x0:x1]
    return x, t * lam + t.flip(0) * (1 - lam), lam


@dataclass
class AugParams:
    """Random draws for n samples (per-sample tensors on CPU) plus the per-batch mix choice."""

    offset: torch.Tensor | None = None  # [n,2] int64 crop offsets (dy, dx)
    flip: torch.Tensor | None = None  # [n] bool
    ops: torch.Tensor | None = None  # [n,k] int64 RandAugment op ids
    signs: torch.Tensor | None = None  # [n,k] float +-1
    centre: torch.Tensor | None = None  # [n,2] float cutout centres in [0,1)
    mix: str | None = None  # None | "mixup" | "cutmix"
    lam: float = 1.0
    box: tuple[float, float] = (0.5, 0.5)

    def take(self, idx) -> AugParams:
        """The params of samples `idx` (a slice or an index tensor)."""
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return replace(
            self,
            offset=pick(self.offset),
            flip=pick(self.flip),
            ops=pick(self.ops),
            signs=pick(self.signs),
            centre=pick(self.centre),
        )


class BatchAugment:
    """The train-time pipeline: crop/flip (uint8) -> RandAugment -> normalize -> cutout -> mix."""

    def __init__(self, cfg, *, mean, std, num_classes: int, crop_flip: bool = True):
        self.pad = cfg.crop_padding if crop_flip else 0
        self.hflip = bool(cfg.hflip and crop_flip)
        self.k, self.m = cfg.randaugment_ops, float(cfg.randaugment_magnitude)
        self.mixup_alpha, self.cutmix_alpha = float(cfg.mixup_alpha), float(cfg.cutmix_alpha)
        self.mix_prob = float(cfg.mix_prob)
        self.soft = self.mixup_alpha > 0 or self.cutmix_alpha > 0
        self.num_classes = num_classes
        self.norm = Normalizer(mean, std)

    def draw(self, g: torch.Generator, n: int) -> AugParams:
        p = AugParams()
        if self.pad:
            p.offset = torch.randint(0, 2 * self.pad + 1, (n, 2), generator=g)
        if self.hflip:
            p.flip = torch.rand(n, generator=g) < 0.5
        if self.k:
            p.ops = torch.randint(0, len(OPS), (n, self.k), generator=g)
            p.signs = (torch.rand(n, self.k, generator=g) < 0.5).float() * 2 - 1
            p.centre = torch.rand(n, 2, generator=g)
        if self.soft:
            u = torch.rand(4, generator=g).tolist()
            if u[0] < self.mix_prob:
                use_mixup = self.cutmix_alpha <= 0 or (self.mixup_alpha > 0 and u[1] < 0.5)
                p.mix = "mixup" if use_mixup else "cutmix"
                alpha = self.mixup_alpha if use_mixup else self.cutmix_alpha
                rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=g)))
                p.lam, p.box = float(rng.beta(alpha, alpha)), (u[2], u[3])
        return p

    def __call__(self, x: torch.Tensor, y: torch.Tensor, p: AugParams):
        """x uint8 [B,C,H,W], y int64 [B] (same device) -> float32 [B,C,H,W], y or soft [B,K]."""
        return self.finish(self.geometry(x, p), y, p)

    def geometry(self, x: torch.Tensor, p: AugParams) -> torch.Tensor:
        """The per-sample crop and mirror (uint8 in, uint8 out: one gather)."""
        if p.offset is None and p.flip is None:
            return x
        dev = x.device
        return crop_flip(
            x,
            None if p.offset is None else p.offset.to(dev),
            None if p.flip is None else p.flip.to(dev),
            self.pad,
        )

    def block(self, x: torch.Tensor, y: torch.Tensor, params: list[AugParams], sizes: list[int]):
        """Several batches at once (x, y: their samples in order; `params` and `sizes`: each
        batch's draws and sample count): one crop/flip gather and, without RandAugment or mixing,
        one normalization for all of them; yields each batch. Per-sample ops and a batch's own
        mixing: the numbers of one batch at a time."""
        cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
        whole = AugParams(
            offset=cat([p.offset for p in params]), flip=cat([p.flip for p in params])
        )
        x = self.geometry(x, whole)
        if not (self.k and self.m > 0) and not self.soft:
            yield from zip(self.norm(x).split(sizes), y.split(sizes))
            return
        for xb, yb, p in zip(x.split(sizes), y.split(sizes), params):
            yield self.finish(xb, yb, p)

    def finish(self, x: torch.Tensor, y: torch.Tensor, p: AugParams):
        """After the geometry: RandAugment, normalization, cutout, mixing."""
        if self.k and self.m > 0:
            x = rand_augment(x.float().div_(255), p.ops, p.signs, self.m)
            x = cutout(self.norm.from_unit(x), (p.ops == OP["cutout"]).any(1), p.centre, self.m)
        else:
            x = self.norm(x)
        if not self.soft:
            return x, y
        t = torch.zeros(len(y), self.num_classes, device=y.device)  # [B,K] one-hot; unlike
        t.scatter_(1, y[:, None], 1.0)  # F.one_hot: no GPU sync
        if p.mix == "mixup":
            x, t = mixup(x, t, p.lam)
        elif p.mix == "cutmix":
            x, t, _ = cutmix(x, t, p.lam, p.box)
        return x, t
