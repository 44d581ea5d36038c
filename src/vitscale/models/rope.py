"""2-D rotary position embeddings (RoPE) as timm's eva.py family computes them (issue 58).

Three variants, each a small module whose `get_embed(grid_shape)` gives the rope tensor that
`apply_rope` rotates q and k [B, heads, T, head_dim] with (timm's `apply_rot_embed_cat`):

- "cat" (`RopeCat`, timm's RotaryEmbeddingCat): EVA02, PE core/lang/spatial, vit_*_rope_*.
  Fixed bands f_j = 1 / temperature^(j / n), n = head_dim / 4, j < n (or pixel bands); a patch at
  coordinates (c_0, c_1) gets the angles c_a * f_j. [N, 2 * head_dim], N = H * W.
- "mixed" (`RopeMixed`, timm's RotaryEmbeddingMixed, RoPE-Mixed of arXiv 2403.13298): learned
  frequencies per block and head, `freqs` [2, depth, heads, head_dim / 2]; angles
  x * freqs[0] + y * freqs[1]. [depth, heads, N, 2 * head_dim].
- "dinov3" (`RopeDinoV3`, timm's RotaryEmbeddingDinoV3): 0.5-centred coordinates normalised to
  [-1, 1], periods p_j = temperature^(2j / (head_dim / 2)); angles 2 pi c_a / p_j; optional
  train-time shift / jitter / rescale of the coordinates. [N, 2 * head_dim].

The rope tensor is [sin | cos] along its last axis, each half of head_dim in the layout `apply_rope`
reads: interleaved [a0, a0, a1, a1, ..] (pairs (x0, x1), (x2, x3), .. rotate together) or, with
rotate_half, [a0, a1, .., a0, a1, ..] (x_i rotates with x_{i + head_dim / 2}).

Arithmetic follows timm's, operation for operation, so a module here and timm's built with the
same arguments give the same tensors: bands, periods and coordinates are made in float32 (also in
a float64 module), products and sin / cos in the frequency buffer's dtype ("mixed": always
float32, as timm's get_mixed_freqs). State-dict names and persistence are timm's: "cat" and
"dinov3" hold only non-persistent buffers (`bands`, `periods`), "mixed" the parameter `freqs`, so
a timm rope state dict loads with strict=True. timm's fixed-size cache buffers (`pos_embed`,
`pos_embed_cached`, `t_x` / `t_y`, all non-persistent) are not kept: `get_embed` computes.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

VARIANTS = ("cat", "mixed", "dinov3")


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ..] -> [-x1, x0, -x3, x2, ..] (timm's `rot`, the interleaved layout)."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)


def rotate_halves(x: torch.Tensor) -> torch.Tensor:
    """[x_lo, x_hi] -> [-x_hi, x_lo] along the last axis (timm's `rope_rotate_half`)."""
    lo, hi = x.chunk(2, dim=-1)
    return torch.cat([-hi, lo], dim=-1)


def apply_rope(
    x: torch.Tensor, rope: torch.Tensor, num_prefix_tokens: int = 0, rotate_half: bool = False
) -> torch.Tensor:
    """Rotate q or k x [B, heads, T, head_dim] by `rope` [..., T - p, 2 * head_dim] ([sin | cos],
    broadcast over batch and heads), leaving the first p = num_prefix_tokens tokens (class,
    registers) as they are: x_p * cos + rot(x_p) * sin, rot = rotate_halves if rotate_half else
    rotate_pairs, computed in the promoted dtype and returned in x's (EvaAttention's arithmetic)."""
    sin, cos = rope.chunk(2, -1)
    tail = x[..., num_prefix_tokens:, :]
    rot = rotate_halves(tail) if rotate_half else rotate_pairs(tail)
    out = (tail * cos + rot * sin).to(x.dtype)
    return torch.cat([x[..., :num_prefix_tokens, :], out], dim=-2) if num_prefix_tokens else out


def keep_rope(rope: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The rope of the patch tokens patch dropout kept: `keep` [B, k] indexes the N patch tokens
    (prefix tokens excluded), as timm's apply_keep_indices_nlc and vitscale's drop_patches give it.
    [N, C] -> [B, 1, k, C]; [heads, N, C] -> [B, heads, k, C]; [depth, heads, N, C] ("mixed")
    -> [depth, B, heads, k, C] (index [i] is block i's), the shapes timm's Eva passes on."""
    out = rope.index_select(-2, keep.flatten()).unflatten(-2, tuple(keep.shape))  # [..., B, k, C]
    return out.unsqueeze(-3) if rope.ndim == 2 else out.movedim(-3, -4)


def coord_grid(
    grid_shape: Sequence[int],
    kind: str = "index",
    offset: float = 0.0,
    indexing: str = "ij",
    ref_feat_shape: Sequence[int] | None = None,
    normalize: str = "separate",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Float32 coordinates [H, W, 2] of an H x W patch grid (timm's `_build_grid`), tokens in
    row-major order. kind "index": 0..s-1 (+ offset); "pixel": s points spread over [-1, 1];
    "centered": 2 (i + 0.5 + offset) / d - 1, d = the axis length ("separate"), or the shorter /
    longer one ("min" / "max"). ref_feat_shape (EVA02's scaling to the pretraining grid): c * r / s.
    indexing "ij": channel 0 is the row, "xy": channel 0 is the column."""
    shape, ref = list(grid_shape), list(ref_feat_shape) if ref_feat_shape is not None else None
    if len(shape) != 2:
        raise ValueError(f"2-D rope needs a 2-D grid, got {shape}")
    if indexing == "xy":
        shape, ref = shape[::-1], ref[::-1] if ref is not None else None
    elif indexing != "ij":
        raise ValueError(f"grid indexing {indexing!r}: 'ij' or 'xy'")
    f32 = torch.float32
    if kind == "pixel":
        t = [torch.linspace(-1.0, 1.0, steps=s, device=device, dtype=f32) for s in shape]
    elif kind == "centered":
        if normalize not in ("separate", "min", "max"):
            raise ValueError(f"normalize_coords {normalize!r}: 'separate', 'min' or 'max'")
        pick = {"separate": None, "min": float(min(shape)), "max": float(max(shape))}[normalize]
        t = [
            (torch.arange(0.5, s, device=device, dtype=f32) + offset) / (pick or float(s))
            for s in shape
        ]
    elif kind == "index":
        t = [torch.arange(s, device=device).to(f32) + offset for s in shape]
    else:
        raise ValueError(f"grid kind {kind!r}: 'index', 'pixel' or 'centered'")
    if ref is not None:
        t = [c / s * r for c, s, r in zip(t, shape, ref)]
    grid = torch.stack(torch.meshgrid(t, indexing=indexing), dim=-1)
    return 2.0 * grid - 1.0 if kind == "centered" else grid


def check_coord_augs(
    shift: float | None, jitter: float | None, rescale: float | None
) -> tuple[float | None, float | None, float | None]:
    """The train-time coordinate augmentations as floats, refused when out of range: shift >= 0 (in
    the grid's units), jitter >= 1 and rescale >= 1 (log-uniform factors)."""
    out = tuple(None if v is None else float(v) for v in (shift, jitter, rescale))
    for name, v, low in zip(("shift_coords", "jitter_coords", "rescale_coords"), out, (0, 1, 1)):
        if v is not None and not (math.isfinite(v) and v >= low):
            raise ValueError(f"rope {name}={v}: a finite number >= {low}")
    return out  # type: ignore[return-value]


def augment_coords(
    coords: torch.Tensor, shift: float | None, jitter: float | None, rescale: float | None
) -> torch.Tensor:
    """One random transform of all coordinates [..., A] (timm's `_apply_coord_augs`, DINOv3's
    order and draws, on coords' device and dtype): + U(-shift, shift) per axis, * exp(U(-log J,
    log J)) per axis, * exp(U(-log R, log R)) shared."""
    axes, dd = coords.shape[-1], {"device": coords.device, "dtype": coords.dtype}
    if shift is not None:
        coords = coords + torch.empty(axes, **dd).uniform_(-shift, shift)
    if jitter is not None:
        top = math.log(jitter)
        coords = coords * torch.empty(axes, **dd).uniform_(-top, top).exp()
    if rescale is not None:
        top = math.log(rescale)
        coords = coords * torch.empty(1, **dd).uniform_(-top, top).exp()
    return coords


def _layout(x: torch.Tensor, rotate_half: bool) -> torch.Tensor:
    """Per-frequency values [..., D/2] -> [..., D]: [f, f] (rotate_half) or f repeated pairwise."""
    return torch.cat([x, x], dim=-1) if rotate_half else x.repeat_interleave(2, -1)


class _FrequencyBuffer(nn.Module):
    """A module whose one non-persistent frequency buffer stays at >= float32: .half() / bf16
    casts rebuild it in float32 (timm's `_apply`), the embedding is cast at the end instead."""

    _buffer_name = ""
    _always_float32 = (
        False  # float64 casts too (RopeCat: timm's fixed-size Eva computes in float32)
    )

    def _frequencies(self) -> torch.Tensor:
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Recompute the (non-persistent) frequency buffer, e.g. after `to_empty` from meta."""
        buf = getattr(self, self._buffer_name)
        with torch.no_grad():
            buf.copy_(self._frequencies())

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        buf = getattr(self, self._buffer_name)
        if torch.finfo(buf.dtype).bits < 32 or (
            self._always_float32 and buf.dtype != torch.float32
        ):
            fresh = self._frequencies().to(buf.device)
            self.register_buffer(self._buffer_name, fresh, persistent=False)
        return self


class RopeCat(_FrequencyBuffer):
    """Axial RoPE with fixed bands (timm's RotaryEmbeddingCat as Eva builds it, rope_type="cat").

    bands [head_dim / 4], non-persistent: 1 / temperature^(j / n) (n = head_dim / 4), or with
    in_pixels pi * linspace(1, max_res / 2, n) (linear_bands) or pi * 2^linspace(0, log2(max_res)
    - 1, n). Coordinates: coord_grid "index" (+ grid_offset), "pixel" with in_pixels, scaled by
    ref_feat_shape. Embedding [N, 2 * head_dim]: [sin | cos] of the angles c_a * f_j, axis a's n
    angles after axis a-1's, in the layout of `rotate_half`. Eva always passes in_pixels=False.
    """

    variant = "cat"
    _buffer_name = "bands"
    bands: torch.Tensor

    # timm's fixed-size Eva computes the rope once, in float32, and a float64 copy of the model
    # keeps those values: the bands stay float32 under .double() too, so float64 matches it
    _always_float32 = True

    def __init__(
        self,
        head_dim: int,
        temperature: float = 10000.0,
        in_pixels: bool = False,
        max_res: int = 224,
        linear_bands: bool = False,
        ref_feat_shape: Sequence[int] | None = None,
        grid_offset: float = 0.0,
        grid_indexing: str = "ij",
        rotate_half: bool = False,
        shift_coords: float | None = None,
        jitter_coords: float | None = None,
        rescale_coords: float | None = None,
    ):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"2-D rope needs head_dim divisible by 4, got {head_dim}")
        self.head_dim, self.temperature, self.in_pixels = head_dim, float(temperature), in_pixels
        self.max_res, self.linear_bands = max_res, linear_bands
        self.ref_feat_shape = tuple(ref_feat_shape) if ref_feat_shape is not None else None
        self.grid_offset, self.grid_indexing, self.rotate_half = (
            grid_offset,
            grid_indexing,
            rotate_half,
        )
        self.augs = check_coord_augs(shift_coords, jitter_coords, rescale_coords)
        self.register_buffer("bands", self._frequencies(), persistent=False)

    def _frequencies(self) -> torch.Tensor:
        """The bands [head_dim / 4] in float32, made on the CPU (timm's `_build_bands`)."""
        n = self.head_dim // 4
        if not self.in_pixels:
            return 1.0 / (self.temperature ** (torch.arange(n).to(torch.float32) / n))
        if self.linear_bands:
            bands = torch.linspace(1.0, self.max_res / 2, n, dtype=torch.float32)
        else:
            top = math.log(self.max_res, 2) - 1
            bands = 2 ** torch.linspace(0, top, n, dtype=torch.float32)
        return bands * torch.pi

    def options(self) -> dict[str, Any]:
        """The constructor's keyword arguments but head_dim (for `rope_to_timm_kwargs`)."""
        keys = ("temperature", "in_pixels", "max_res", "linear_bands", "ref_feat_shape")
        out = {k: getattr(self, k) for k in keys}
        out.update(grid_offset=self.grid_offset, grid_indexing=self.grid_indexing)
        out["rotate_half"] = self.rotate_half
        return out | dict(zip(("shift_coords", "jitter_coords", "rescale_coords"), self.augs))

    def get_embed(
        self, grid_shape: Sequence[int], dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """[H * W, 2 * head_dim] for an H x W grid: float32 coordinates times the bands (in the
        bands' dtype), sin and cos, returned in `dtype`, else float32 (the bands' dtype when
        augmenting): timm's get_embed(shape, dtype) without a cache."""
        augment = self.training and any(a is not None for a in self.augs)
        kind = "pixel" if self.in_pixels else "index"
        grid = coord_grid(
            grid_shape, kind, self.grid_offset, self.grid_indexing, self.ref_feat_shape,
            device=self.bands.device,
        )  # fmt: skip
        if augment:
            grid = augment_coords(grid, *self.augs)
        angles = grid.unsqueeze(-1) * self.bands  # [H, W, 2, n]
        dtype = dtype or (self.bands.dtype if augment else torch.float32)
        sin = _layout(angles.sin().to(dtype).flatten(-2).flatten(0, -2), self.rotate_half)
        cos = _layout(angles.cos().to(dtype).flatten(-2).flatten(0, -2), self.rotate_half)
        return torch.cat([sin, cos], -1)


def mixed_init_freqs(
    head_dim: int, depth: int, num_heads: int, temperature: float = 10.0
) -> torch.Tensor:
    """RoPE-Mixed's initial frequencies [2, depth, heads, head_dim / 2] (timm's
    init_random_2d_freqs, same draws): magnitudes m_j = 1 / temperature^(4j / head_dim), a random
    angle t per block and head; x: [m cos t, m cos(t + pi/2)], y: [m sin t, m sin(t + pi/2)]."""
    mag = 1.0 / (temperature ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim))
    angles = torch.rand(depth, num_heads, 1) * 2 * torch.pi
    fx = torch.cat([mag * torch.cos(angles), mag * torch.cos(angles + torch.pi / 2)], dim=-1)
    fy = torch.cat([mag * torch.sin(angles), mag * torch.sin(angles + torch.pi / 2)], dim=-1)
    return torch.stack([fx, fy], dim=0)


class RopeMixed(nn.Module):
    """RoPE-Mixed (timm's RotaryEmbeddingMixed, rope_type="mixed"): learned frequencies `freqs`
    [2, depth, heads, head_dim / 2] (the one state-dict entry, timm's name). Coordinates: the
    "index" grid (offset 0), x its channel 0; angles x * freqs[0] + y * freqs[1]; the interleaved
    layout always (timm refuses rotate_half). Embedding [depth, heads, N, 2 * head_dim]."""

    variant = "mixed"

    def __init__(
        self,
        head_dim: int,
        depth: int,
        num_heads: int,
        temperature: float = 10.0,
        grid_indexing: str = "xy",
        shift_coords: float | None = None,
        jitter_coords: float | None = None,
        rescale_coords: float | None = None,
    ):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"RoPE-Mixed needs head_dim divisible by 4, got {head_dim}")
        self.head_dim, self.depth, self.num_heads = head_dim, depth, num_heads
        self.temperature, self.grid_indexing, self.rotate_half = temperature, grid_indexing, False
        self.augs = check_coord_augs(shift_coords, jitter_coords, rescale_coords)
        self.freqs = nn.Parameter(mixed_init_freqs(head_dim, depth, num_heads, temperature))

    def reset_parameters(self) -> None:
        """Draw the frequencies anew, as the constructor does."""
        with torch.no_grad():
            init = mixed_init_freqs(self.head_dim, self.depth, self.num_heads, self.temperature)
            self.freqs.copy_(init)

    def no_weight_decay(self) -> set[str]:
        """The frequencies take no weight decay (timm's Eva.no_weight_decay)."""
        return {"freqs"}

    def options(self) -> dict[str, Any]:
        """The constructor's keyword arguments but head_dim, depth and num_heads."""
        out = dict(temperature=self.temperature, grid_indexing=self.grid_indexing)
        return out | dict(zip(("shift_coords", "jitter_coords", "rescale_coords"), self.augs))

    def get_embed(
        self, grid_shape: Sequence[int], dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """[depth, heads, H * W, 2 * head_dim]: angles and sin / cos in float32 (as timm's
        get_mixed_freqs, also under autocast or in a float64 module), returned in `dtype`, else in
        freqs' dtype (at least float32 when augmenting)."""
        grid = coord_grid(grid_shape, "index", 0.0, self.grid_indexing, device=self.freqs.device)
        grid = grid.reshape(-1, 2)
        if self.training and any(a is not None for a in self.augs):
            grid = augment_coords(grid, *self.augs)
            dtype = dtype or torch.promote_types(self.freqs.dtype, torch.float32)
        freqs = self.freqs.float()
        angles = grid[:, :1] * freqs[0].unsqueeze(-2) + grid[:, 1:] * freqs[1].unsqueeze(-2)
        emb = torch.cat([_layout(angles.sin(), False), _layout(angles.cos(), False)], dim=-1)
        return emb.to(dtype or self.freqs.dtype)


class RopeDinoV3(_FrequencyBuffer):
    """DINOv3's RoPE (timm's RotaryEmbeddingDinoV3, rope_type="dinov3"). periods [head_dim / 4],
    non-persistent: temperature^(2j / (head_dim / 2)), or min_period * (max_period /
    min_period)^linspace(0, 1, n) when both are given. Coordinates: coord_grid "centered" (+
    grid_offset, normalize_coords), made on the CPU (timm's numerics and its augmentation draws),
    augmented (shift / jitter / rescale) in training only. Embedding [N, 2 * head_dim]: [sin |
    cos] of 2 pi c_a / p_j in the layout of `rotate_half` (True in every timm DINOv3 model)."""

    variant = "dinov3"
    _buffer_name = "periods"
    periods: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        temperature: float | None = 100.0,
        min_period: float | None = None,
        max_period: float | None = None,
        normalize_coords: str = "separate",
        grid_offset: float = 0.0,
        grid_indexing: str = "ij",
        rotate_half: bool = True,
        shift_coords: float | None = None,
        jitter_coords: float | None = None,
        rescale_coords: float | None = None,
    ):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"2-D rope needs head_dim divisible by 4, got {head_dim}")
        self.head_dim, self.min_period, self.max_period = head_dim, min_period, max_period
        self.temperature = float(temperature) if temperature is not None else None
        self.normalize_coords, self.grid_offset = normalize_coords, grid_offset
        self.grid_indexing, self.rotate_half = grid_indexing, rotate_half
        self.augs = check_coord_augs(shift_coords, jitter_coords, rescale_coords)
        self.register_buffer("periods", self._frequencies(), persistent=False)

    def _frequencies(self) -> torch.Tensor:
        """The periods [head_dim / 4] in float32 (timm's `_compute_periods`)."""
        n = self.head_dim // 4
        if self.min_period is not None and self.max_period is not None:
            exponents = torch.linspace(0, 1, n, dtype=torch.float32)
            return self.min_period * ((self.max_period / self.min_period) ** exponents)
        if self.temperature is None:
            raise ValueError("dinov3 rope needs a temperature or both min_period and max_period")
        return self.temperature ** (
            2.0 * torch.arange(n, dtype=torch.float32) / (self.head_dim // 2)
        )

    def options(self) -> dict[str, Any]:
        """The constructor's keyword arguments but head_dim."""
        keys = ("temperature", "min_period", "max_period", "normalize_coords", "grid_offset")
        out = {k: getattr(self, k) for k in (*keys, "grid_indexing", "rotate_half")}
        return out | dict(zip(("shift_coords", "jitter_coords", "rescale_coords"), self.augs))

    def get_embed(
        self, grid_shape: Sequence[int], dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """[H * W, 2 * head_dim], computed in the periods' dtype and returned in `dtype`, else in
        the periods' dtype (timm's get_embed(shape, dtype))."""
        coords = coord_grid(
            grid_shape, "centered", self.grid_offset, self.grid_indexing,
            normalize=self.normalize_coords,
        ).flatten(0, -2)  # fmt: skip
        if self.training and any(a is not None for a in self.augs):
            coords = augment_coords(coords, *self.augs)
        coords = coords[:, :, None].to(device=self.periods.device, dtype=self.periods.dtype)
        angles = (2 * math.pi * coords / self.periods).flatten(1)  # [N, head_dim / 2]
        sin, cos = _layout(angles.sin(), self.rotate_half), _layout(angles.cos(), self.rotate_half)
        emb = torch.cat([sin, cos], dim=-1)
        return emb.to(dtype) if dtype is not None else emb


ROPE_CLASSES: dict[str, type[nn.Module]] = {
    "cat": RopeCat,
    "mixed": RopeMixed,
    "dinov3": RopeDinoV3,
}

# timm Eva's rope keyword arguments and their defaults (timm/models/eva.py, Eva.__init__)
TIMM_ROPE_DEFAULTS: dict[str, Any] = dict(
    use_rot_pos_emb=False, rope_type="cat", rope_grid_offset=0.0, rope_grid_indexing="ij",
    rope_temperature=10000.0, rope_rotate_half=False, rope_shift_coords=None,
    rope_jitter_coords=None, rope_rescale_coords=None, rope_mrope_section=None, ref_feat_shape=None,
)  # fmt: skip
_AUGS = ("shift_coords", "jitter_coords", "rescale_coords")


def build_rope(
    variant: str, head_dim: int, num_heads: int, depth: int, **options: Any
) -> nn.Module:
    """The rope module of `variant` ("cat" | "mixed" | "dinov3") with its `options` (the class's
    keyword arguments, as `rope_from_timm_kwargs` gives them); num_heads and depth matter to
    "mixed" only (one set of frequencies per block and head)."""
    if variant not in ROPE_CLASSES:
        raise ValueError(f"rope variant {variant!r}: one of {', '.join(VARIANTS)}")
    if variant == "mixed":
        return RopeMixed(head_dim, depth, num_heads, **options)
    return ROPE_CLASSES[variant](head_dim, **options)


def rope_from_timm_kwargs(kwargs: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(variant, options) for the rope timm's Eva builds from these keyword arguments (other keys
    are ignored; None without use_rot_pos_emb): what create_rope_embed receives from Eva, the
    arguments it drops for a variant dropped here too (grid offset and ref_feat_shape of "mixed",
    ref_feat_shape of "dinov3", mrope_section but for "mrope"). ValueError, one line, for what
    vitscale does not implement ("mrope", ...) or timm refuses (rotate_half with "mixed")."""
    unknown = sorted(k for k in kwargs if k.startswith("rope_") and k not in TIMM_ROPE_DEFAULTS)
    if unknown:
        raise ValueError(f"timm rope arguments vitscale does not know: {', '.join(unknown)}")
    kw = TIMM_ROPE_DEFAULTS | {k: v for k, v in kwargs.items() if k in TIMM_ROPE_DEFAULTS}
    if not kw["use_rot_pos_emb"]:
        return None
    variant = kw["rope_type"]
    if variant not in VARIANTS:
        raise ValueError(
            f"timm rope_type {variant!r}: vitscale implements {', '.join(map(repr, VARIANTS))}"
        )
    options: dict[str, Any] = dict(
        temperature=float(kw["rope_temperature"]), grid_indexing=kw["rope_grid_indexing"]
    )
    options |= {k: kw[f"rope_{k}"] for k in _AUGS}
    ref = kw["ref_feat_shape"]
    if variant == "mixed":
        if kw["rope_rotate_half"]:
            raise ValueError("timm rope_type 'mixed' takes no rope_rotate_half (interleaved only)")
        return variant, options
    options.update(grid_offset=float(kw["rope_grid_offset"]), rotate_half=kw["rope_rotate_half"])
    if variant == "cat":
        ref = (ref, ref) if isinstance(ref, int) else (tuple(ref) if ref is not None else None)
        options.update(in_pixels=False, ref_feat_shape=ref)
    return variant, options


def rope_to_timm_kwargs(variant: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """timm Eva keyword arguments that build this rope (every rope key, defaults included): the
    inverse of `rope_from_timm_kwargs`, for export. ValueError for options Eva cannot express
    (in_pixels, dinov3's normalize_coords other than 'separate' or its min / max period)."""
    if variant not in ROPE_CLASSES:
        raise ValueError(f"rope variant {variant!r}: one of {', '.join(VARIANTS)}")
    params = inspect.signature(ROPE_CLASSES[variant].__init__).parameters  # defaults of the rest
    opts = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    unknown = sorted(set(options) - set(opts))
    if unknown:
        raise ValueError(f"rope {variant!r} takes no option(s) {', '.join(unknown)}")
    opts |= dict(options)
    if variant == "cat" and opts["in_pixels"]:
        raise ValueError("timm's Eva builds its 'cat' rope with in_pixels=False only")
    if variant == "dinov3" and (
        opts["normalize_coords"] != "separate" or opts["min_period"] or opts["max_period"]
    ):
        raise ValueError("timm's Eva has no argument for dinov3's normalize_coords or periods")
    out = TIMM_ROPE_DEFAULTS | dict(use_rot_pos_emb=True, rope_type=variant)
    out.update(rope_temperature=opts["temperature"], rope_grid_indexing=opts["grid_indexing"])
    out |= {f"rope_{k}": opts[k] for k in _AUGS}
    if variant != "mixed":
        out.update(rope_grid_offset=opts["grid_offset"], rope_rotate_half=opts["rotate_half"])
    if variant == "cat":
        out["ref_feat_shape"] = opts["ref_feat_shape"]
    return out
