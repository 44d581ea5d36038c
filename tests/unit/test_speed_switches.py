"""The switches issue 32 adds for a faster step, on a CPU: each is the same function within the
kernels' rounding, does what it names, and is refused in one line where it cannot run. Whether
each wins is measured on a GPU (`vitscale tune` tries them; docs/performance.md)."""
from __future__ import annotations

import pytest
import torch

from vitscale.config import load_config
from vitscale.errors import ConfigError
from vitscale.loop import Trainer

TINY = "configs/tests/tiny.toml"


def _trainer(tmp_path, name, *sets):
    return Trainer(load_config(TINY, ["model.attention=sdpa", "run.eval_every=0", *sets]), tmp_path / name)


@pytest.mark.parametrize("backend, flash, math", [("math", False, True), ("flash", True, False), ("auto", True, True)])
def test_sdpa_backend_restricts_attention_to_its_kernel_during_forward(tmp_path, backend, flash, math):
    """train.sdpa_backend: inside every training forward only the named kernel is enabled (torch's
    sdpa_kernel flags), and the loss is the one torch's own choice gives, within fp32 rounding."""
    seen = []
    losses = {}
    for b in ("auto", backend):
        tr = _trainer(tmp_path, b + str(len(losses)), f"train.sdpa_backend={b}")
        try:
            tr.strategy.module.register_forward_pre_hook(lambda m, a: seen.append(
                (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())))
            torch.manual_seed(0)
            batch = next(tr.data.train.iterate(0))
            losses[b], _ = tr.train_step(batch)
        finally:
            tr.close()
    assert seen[-1] == (flash, math)
    # the same forward: only the summation order inside attention differs (tolerance: a few ulps of
    # the fp32 loss, ~log(4) for 4 classes)
    torch.testing.assert_close(losses[backend], losses["auto"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sets, words", [
    (["train.sdpa_backend=cudnn"], "a CUDA kernel"),
    (["train.sdpa_backend=efficient"], "a CUDA kernel"),
])
def test_sdpa_backend_refusals_on_a_cpu(tmp_path, sets, words):
    with pytest.raises(ConfigError) as e:
        _trainer(tmp_path, "r", *sets)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_sdpa_backend_needs_fused_attention():
    with pytest.raises(ConfigError, match="needs model.attention=sdpa"):
        load_config(TINY, ["model.attention=explicit", "train.sdpa_backend=flash"])
