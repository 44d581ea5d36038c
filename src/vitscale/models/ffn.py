"""The per-token parts of a transformer block: norms, activations and the MLP variants (torch only).

Parameter names are timm's, so weights map one to one (interop/timm/vision_transformer.py):
- `Mlp`: fc1 -> act -> (norm) -> fc2 (timm's Mlp; `norm`: scale_mlp_norm, BEiT-3 / EVA02's inner
  norm over the hidden units);
- `SwiGLU`: fc2((act(fc1_g(x)) * fc1_x(x))) with an optional inner norm (timm's SwiGLU: AIMv2,
  EVA02, DINOv3's larger models; two up-projections, so tensor parallelism splits both column-wise);
- `PackedSwiGLU`: the same with the two up-projections in one fc1, [gate; x] (timm's SwiGLUPacked =
  GluMlp(gate_last=False): DINOv2 giant).
`make_norm` builds the norm a spec names: LayerNorm (weight and bias) or RMSNorm (weight only:
x / sqrt(mean(x^2) + eps) * weight, timm's RmsNorm and torch's nn.RMSNorm alike).
"""

from __future__ import annotations

import torch
from torch import nn

NORMS = ("layernorm", "rmsnorm")
MLPS = ("mlp", "swiglu", "swiglu_packed")


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """LayerNorm or RMSNorm over the last dimension (NORMS)."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    raise ValueError(f"unknown norm '{kind}' (expected one of {', '.join(NORMS)})")


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): the activation OpenAI's CLIP models were trained with (OpenCLIP's
    `*-quickgelu` configurations)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class GELUTanh(nn.GELU):
    """GELU with the tanh approximation (timm's gelu_tanh: the SigLIP models)."""

    def __init__(self):
        super().__init__(approximate="tanh")


ACTIVATIONS = {"gelu": nn.GELU, "gelu_tanh": GELUTanh, "quick_gelu": QuickGELU, "silu": nn.SiLU}


def activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation '{name}' (expected one of {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]()


class _FeedForward(nn.Module):
    """What the MLPs share: up-projection(s) (the subclass's, registered first, so parameters keep
    timm's order), then act, dropout, the optional norm over the hidden units, fc2 and dropout."""

    def _down(self, hidden: int, dim: int, act: str, norm, bias: bool, dropout: float) -> None:
        self.act = activation(act)
        self.norm = norm if norm is not None else nn.Identity()
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.drop = nn.Dropout(dropout)

    @property
    def hidden(self) -> int:
        """The width fc2 reads (a packed SwiGLU's gated half)."""
        return self.fc2.in_features

    def up(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.norm(self.drop(self.up(x)))))


class Mlp(_FeedForward):
    """fc1 -> act -> dropout -> (norm over the hidden units) -> fc2 -> dropout. [..., D] -> [..., D]"""

    def __init__(self, dim, hidden, dropout=0.0, act="gelu", norm=None, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self._down(hidden, dim, act, norm, bias, dropout)

    def up(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc1(x))


class SwiGLU(_FeedForward):
    """fc2(norm(act(fc1_g(x)) * fc1_x(x))): a gated MLP with two up-projections of `hidden` units
    each (timm's SwiGLU; act is SiLU in every published model)."""

    def __init__(self, dim, hidden, dropout=0.0, act="silu", norm=None, bias=True):
        super().__init__()
        self.fc1_g = nn.Linear(dim, hidden, bias=bias)
        self.fc1_x = nn.Linear(dim, hidden, bias=bias)
        self._down(hidden, dim, act, norm, bias, dropout)

    def up(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc1_g(x)) * self.fc1_x(x)


class PackedSwiGLU(_FeedForward):
    """SwiGLU with both up-projections in one fc1 of 2 x hidden outputs, the gate first:
    fc2(norm(act(g) * x)) with [g, x] = fc1(x).chunk(2) (timm's SwiGLUPacked; `hidden` here is the
    gated width, half of fc1's outputs). Under tensor parallelism fc1 is split as two blocks
    (`colwise_glu`), so each rank holds the gate and value rows of its own units."""

    def __init__(self, dim, hidden, dropout=0.0, act="silu", norm=None, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * hidden, bias=bias)
        self._down(hidden, dim, act, norm, bias, dropout)

    def up(self, x: torch.Tensor) -> torch.Tensor:
        g, v = self.fc1(x).chunk(2, dim=-1)
        return self.act(g) * v


def make_mlp(
    kind: str,
    dim: int,
    hidden: int,
    *,
    dropout: float = 0.0,
    act: str = "gelu",
    norm: nn.Module | None = None,
    bias: bool = True,
) -> nn.Module:
    """The MLP a spec names (MLPS). `hidden`: timm's hidden_features = int(dim * mlp_ratio); the
    packed SwiGLU gates half of it (timm's GluMlp), the split one all of it."""
    if kind == "mlp":
        return Mlp(dim, hidden, dropout, act, norm, bias)
    if kind == "swiglu":
        return SwiGLU(dim, hidden, dropout, act, norm, bias)
    if kind == "swiglu_packed":
        if hidden % 2:
            raise ValueError(f"a packed SwiGLU needs an even hidden width (got {hidden})")
        return PackedSwiGLU(dim, hidden // 2, dropout, act, norm, bias)
    raise ValueError(f"unknown MLP '{kind}' (expected one of {', '.join(MLPS)})")


def mlp_tp_plan(mlp: nn.Module) -> dict[str, str]:
    """Tensor parallelism's plan of an MLP: up-projections column-wise, fc2 row-wise."""
    if isinstance(mlp, SwiGLU):
        return {"mlp.fc1_g": "colwise", "mlp.fc1_x": "colwise", "mlp.fc2": "rowwise"}
    if isinstance(mlp, PackedSwiGLU):
        return {"mlp.fc1": "colwise_glu", "mlp.fc2": "rowwise"}
    return {"mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
