"""The strategy protocol is complete: every member the trainer, tasks, eval and the lab use is
declared in strategy/base.py and implemented by every strategy class."""
from pathlib import Path

import pytest

from vitscale.strategy.base import Strategy
from vitscale.strategy.ddp import DDPStrategy
from vitscale.strategy.deepspeed import DeepSpeedStrategy
from vitscale.strategy.fsdp import FSDPStrategy
from vitscale.strategy.single import SingleDevice

SRC = Path(__file__).resolve().parents[1] / "src" / "vitscale"
# attributes every strategy sets in __init__ / setup rather than on the class
INSTANCE = {"device", "model", "module", "optimizer", "rank", "world_size", "is_main"}
MEMBERS = sorted({n for n in [*vars(Strategy), *Strategy.__annotations__] if not n.startswith("_")})


@pytest.mark.parametrize("cls", [SingleDevice, DDPStrategy, FSDPStrategy, DeepSpeedStrategy])
def test_every_strategy_implements_the_protocol(cls):
    missing = [m for m in MEMBERS if m not in INSTANCE and not hasattr(cls, m)]
    assert not missing, f"{cls.__name__} lacks {missing}"


class Recorder:
    """Wraps a strategy and records every member read or set from outside it."""

    def __init__(self, inner, seen: set, written: set):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_seen", seen)
        object.__setattr__(self, "_written", written)

    def __getattr__(self, name):
        self._seen.add(name)
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        self._written.add(name)
        setattr(self._inner, name, value)


@pytest.mark.parametrize("recipe", ["configs/tests/tiny.toml", "configs/tests/clip_tiny.toml"])
def test_the_trainer_tasks_eval_and_lab_use_only_declared_members(tmp_path, monkeypatch, recipe):
    """A short run, `vitscale eval` of it and a bench with its step split, through a recording
    strategy: what they touch is declared in the protocol, and nothing sets a strategy's attributes."""
    import vitscale.evaluate
    import vitscale.loop
    from vitscale.config import load_config
    from vitscale.lab.bench import measure
    from vitscale.loop import train
    seen, written = set(), set()
    for mod in (vitscale.loop, vitscale.evaluate):
        real = mod.build_strategy
        monkeypatch.setattr(mod, "build_strategy", lambda cfg, real=real: Recorder(real(cfg), seen, written))
    cfg = load_config(recipe, ["run.max_steps=2", "run.progress=off", "run.tensorboard=false"])
    summary = train(cfg, tmp_path / "run")
    vitscale.evaluate.evaluate_checkpoint(summary["run_dir"])
    measure(cfg, steps=1, warmup=0, trials=1, synthetic=False, split_steps=1)
    assert {"step", "backward", "autocast", "eval_module", "state_bytes"} <= seen  # the recorder saw the run
    undeclared = sorted(seen - set(MEMBERS) - INSTANCE)
    assert not undeclared, f"used but not declared in strategy/base.py: {undeclared}"
    assert not written, f"strategy attributes set from outside: {sorted(written)}"


def test_no_module_outside_strategy_names_an_engine_internal():
    for path in SRC.rglob("*.py"):
        if "strategy" in path.parts:
            continue
        text = path.read_text()
        for internal in ("ds_tensor", "deepspeed.", "fully_shard", "DistributedDataParallel"):
            assert internal not in text, f"{path.relative_to(SRC)} names {internal}"
