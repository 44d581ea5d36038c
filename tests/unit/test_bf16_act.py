"""train.precision=bf16_act (issue 51): bf16 norms and residual stream, fp32 parameters and optimizer
state. Checked against the same model in float64, within a bound derived from bf16's precision, and
against autocast's bf16 for what the mode changes (the stream's dtype) and what it keeps (the
parameters, their gradients and the optimizer state in fp32, the state dict's names)."""

import copy

import pytest
import torch
from torch import nn

from vitscale.config import OptimConfig, TrainConfig, load_config
from vitscale.errors import ConfigError
from vitscale.models import VisionTransformer, ViTSpec
from vitscale.strategy import check_engine
from vitscale.strategy.lowprec import LowPrecisionLayerNorm
from vitscale.strategy.single import SingleDevice

# bf16's unit roundoff: 8 significant bits, so a rounding is off by at most 2^-8 relative
U_BF16 = 2.0**-8
DEPTH = 4


def tiny_vit() -> nn.Module:
    torch.manual_seed(0)
    spec = ViTSpec(
        image_size=32, patch_size=8, in_chans=3, num_classes=10, dim=64, depth=DEPTH, heads=4
    )
    return VisionTransformer(spec)


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def step(model: nn.Module, precision: str):
    """Loss and flat gradient of one forward/backward under `precision` (SingleDevice), the
    strategy, and the dtypes the blocks' outputs had."""
    s = SingleDevice(TrainConfig(precision=precision), OptimConfig(), torch.device("cpu"))
    s.setup(model)
    dtypes = []
    hooks = [b.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype)) for b in model.blocks]
    x, y = batch()
    with s.autocast():
        loss = nn.functional.cross_entropy(s.model(x), y)
    s.backward(loss)
    for h in hooks:
        h.remove()
    grad = torch.cat([p.grad.flatten().double() for p in model.parameters()])
    return loss.detach().double(), grad, s, set(dtypes)


def test_bf16_act_against_float64_within_bf16s_bound():
    base = tiny_vit()
    ref = copy.deepcopy(base).double()
    x, y = batch()
    ref_loss = nn.functional.cross_entropy(ref(x.double()), y)
    ref_loss.backward()
    ref_grad = torch.cat([p.grad.flatten() for p in ref.parameters()])
    loss, grad, _, dtypes = step(copy.deepcopy(base), "bf16_act")
    assert dtypes == {torch.bfloat16}  # the residual stream is bf16 from the first block on
    # to first order each block rounds the stream twice (after each residual add), each rounding
    # at most U_BF16 relative, and the errors add along the DEPTH blocks a value or gradient passes
    bound = 2 * DEPTH * U_BF16
    assert abs(loss - ref_loss.detach()) / ref_loss.abs() < bound
    assert (grad - ref_grad).norm() / ref_grad.norm() < bound
    # autocast's bf16 (norms and stream fp32) is within the same bound, and keeps an fp32 stream
    loss16, grad16, _, dtypes16 = step(copy.deepcopy(base), "bf16")
    assert dtypes16 == {torch.float32}
    assert (grad16 - ref_grad).norm() / ref_grad.norm() < bound


def test_parameters_gradients_and_optimizer_state_stay_fp32():
    model = tiny_vit()
    names = list(tiny_vit().state_dict())
    _, _, s, _ = step(model, "bf16_act")
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    s.step()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    state = [v for st in s.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    assert state and {v.dtype for v in state if v.ndim} == {torch.float32}
    assert s.master is None  # no copies: the optimizer updates the fp32 parameters themselves
    # the same parameters under the same names: checkpoints and exports do not see the mode
    assert list(model.state_dict()) == names
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert norms and all(type(m) is LowPrecisionLayerNorm for m in norms)


def test_outside_autocast_the_model_computes_as_written():
    """Evaluation without autocast: the converted norms and the stream hooks do nothing."""
    base = tiny_vit().eval()
    model = copy.deepcopy(base)
    SingleDevice(TrainConfig(precision="bf16_act"), OptimConfig(), torch.device("cpu")).place(model)
    x, _ = batch()
    with torch.no_grad():
        assert torch.equal(model(x), base(x))


def test_low_precision_layer_norm_against_float64():
    torch.manual_seed(0)
    ln = nn.LayerNorm(64)
    nn.init.normal_(ln.weight)
    nn.init.normal_(ln.bias)
    x = torch.randn(4, 7, 64) * 3 + 1
    ref = nn.functional.layer_norm(x.double(), (64,), ln.weight.double(), ln.bias.double(), ln.eps)
    low = copy.deepcopy(ln)
    low.__class__ = LowPrecisionLayerNorm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = low(x)
    assert out.dtype == torch.bfloat16
    # input, weight and bias each rounded once (U_BF16), the statistics in fp32, the output rounded
    # once: |error| <= 4 U_BF16 (|w| |x_hat| + |b|) to first order, elementwise
    scale = ref.abs() + ln.weight.double().abs() * 3 + ln.bias.double().abs()
    assert ((out.double() - ref).abs() <= 4 * U_BF16 * scale).all()


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_refused_where_the_engine_owns_precision(engine):
    cfg = load_config(
        "configs/tests/tiny.toml", ["train.precision=bf16_act", f"strategy.name={engine}"]
    )
    with pytest.raises(
        ConfigError, match=f"strategy.name={engine} does not support train.precision=bf16_act"
    ):
        check_engine(cfg, 2)
