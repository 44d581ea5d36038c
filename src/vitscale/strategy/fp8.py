"""train.fp8: torchao's float8 training on the transformer blocks' Linear layers (issue 32).

The blocks' attention and MLP projections compute their matmuls in float8 (e4m3, with dynamic
scales per tensor or per row: torchao's "tensorwise" and "rowwise" recipes), everything else as
train.precision says (bf16). The weights stay in their dtype and keep their names, so checkpoints,
EMA, export and evaluation do not change. fp8 is a speed switch: it is offered only where it was
not measured slower than bf16: precision.FP8_MEASURED holds the ratios measured (fp8 step over
bf16 step, same process, paired rounds); a model as wide as or narrower than a width measured
slower is refused in one line naming the ratio (the task checks it from the config before anything
is built, this module again on the model), and a width never measured is announced in one line.
"""

from __future__ import annotations

import logging
from typing import cast

from torch import nn

from ..errors import ConfigError
from ..optim import block_index
from ..precision import FP8_MEASURED, fp8_slower

log = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (sm_89) and Hopper (sm_90) on


def fp8_refusal(recipe: str, device_type: str, capability: tuple | None) -> str | None:
    """Why train.fp8=`recipe` cannot run on this device (a CUDA capability below 8.9, or not a
    GPU), or None."""
    if recipe == "none":
        return None
    if device_type != "cuda":
        return (
            f"config: train.fp8={recipe} needs a GPU with float8 tensor cores (compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+: H100, L40S, RTX 4090), not {device_type}"
        )
    if capability is not None and tuple(capability) < MIN_CAPABILITY:
        return (
            f"config: train.fp8={recipe} needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ "
            f"(float8 tensor cores); this GPU has {capability[0]}.{capability[1]}"
        )
    return None


def fp8_layers(model: nn.Module) -> list[str]:
    """The Linear layers float8 training converts: those inside the transformer blocks whose
    dimensions float8 matmuls take (multiples of 16). Heads, stems and embeddings stay as they are."""
    return [
        name
        for name, m in model.named_modules()
        if type(m) is nn.Linear
        and block_index(name + ".") is not None
        and m.in_features % 16 == 0
        and m.out_features % 16 == 0
    ]


def convert_fp8(model: nn.Module, recipe: str) -> list[str]:
    """Swap the blocks' Linear layers for torchao's Float8Linear (same parameters, same names);
    returns their names. One-line ConfigError without torchao, without a layer to convert, or at a
    width measured slower than bf16; a width never measured is announced in one line."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # noqa: BLE001 - a torchao built for another torch fails in assorted ways
        raise ConfigError(
            f"config: train.fp8={recipe} needs torchao's float8 training (pip install torchao; "
            f"for the GPU image: scripts/gpu_wheels.sh): {type(e).__name__}: "
            f"{(str(e).splitlines() or [''])[0][:120]}"
        ) from None
    names = fp8_layers(model)
    if not names:
        raise ConfigError(
            f"config: train.fp8={recipe}: the model has no transformer-block Linear layer with "
            "dimensions divisible by 16 to compute in float8"
        )
    modules = dict(model.named_modules())
    width = min(cast(nn.Linear, modules[n]).in_features for n in names)  # fp8_layers: Linear only
    refusal = fp8_slower(recipe, width)
    if refusal:
        raise ConfigError(refusal)
    if (recipe, width) not in FP8_MEASURED:
        log.warning(
            "train.fp8=%s at model width %d: not measured against bf16 on a GPU yet; compare with "
            "`vitscale bench CONFIG --synthetic --beside train.fp8=%s`",
            recipe,
            width,
            recipe,
        )
    chosen = set(names)
    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda m, fqn: fqn in chosen,
    )
    return names
