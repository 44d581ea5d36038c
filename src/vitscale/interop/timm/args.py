"""Reading timm's model arguments as the generated table (timm/archs.py) writes them: layer classes
and partials as text ("timm.layers.norm.LayerNorm(eps=1e-05)"), the norms and MLPs they mean in
vitscale's ViTSpec, and timm's mlp_ratio for a hidden width. Shared by the vision_transformer /
deit reader (vision_transformer.py) and the eva one (eva.py)."""

from __future__ import annotations

import re


def parse_layer(v) -> tuple[str, dict]:
    """("LayerNorm", {"eps": 1e-05}) from "timm.layers.norm.LayerNorm(eps=1e-05)" (timm/archs.py's
    text for a partial), ("gelu_tanh", {}) from a plain name; ("", {}) for None."""
    if v is None:
        return "", {}
    m = re.fullmatch(r"([\w.]+)\((.*)\)", str(v))
    name, inner = (m.group(1), m.group(2)) if m else (str(v), "")
    kwargs = {}
    for part in filter(None, (p.strip() for p in inner.split(","))):
        k, _, val = part.partition("=")
        try:
            kwargs[k.strip()] = float(val)
        except ValueError:
            kwargs[k.strip()] = val.strip()
    return name, kwargs


def short_name(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def norm_eps(value) -> float | None:
    """The LayerNorm eps a timm norm_layer argument means; None for another norm."""
    name, kw = parse_layer(value)
    if name and short_name(name).lower() != "layernorm":
        return None
    # torch's nn.LayerNorm; timm's LayerNorm, "layernorm"
    default = 1e-5 if name.startswith("torch.") else 1e-6
    return float(kw.get("eps", default))


def mlp_ratio_for(dim: int, hidden: int, ratio: float | None = None) -> float:
    """timm's mlp_ratio for `hidden` = int(dim * mlp_ratio) (the given one when it gives `hidden`)."""
    if ratio is not None and int(dim * ratio) == hidden:
        return float(ratio)
    return hidden / dim if int(dim * (hidden / dim)) == hidden else (hidden + 0.5) / dim


def norm_kind(value) -> tuple[str, float] | None:
    """("layernorm" | "rmsnorm", eps) of a timm norm_layer argument; None for another norm."""
    name, kw = parse_layer(value)
    short = short_name(name).replace("_", "").lower()
    if short in ("", "layernorm"):
        eps = norm_eps(value)
        return None if eps is None else ("layernorm", eps)
    if short == "rmsnorm":
        return "rmsnorm", float(kw.get("eps", 1e-6))  # timm's RmsNorm default
    return None


def mlp_kind(value) -> str | None:
    """vitscale's ViTSpec.mlp for a timm mlp_layer argument; None for an MLP it lacks. The gate's
    activation is the model's act_layer (timm's Block passes it to the MLP)."""
    name, kw = parse_layer(value)
    short = short_name(name)
    if short == "GluMlp" and str(kw.get("gate_last")) == "False":  # timm's SwiGLUPacked
        return "swiglu_packed"
    return {"": "mlp", "Mlp": "mlp", "SwiGLU": "swiglu", "SwiGLUPacked": "swiglu_packed"}.get(short)
