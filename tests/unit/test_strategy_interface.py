"""The strategy protocol is complete: every member the trainer, tasks, eval and the lab use is
declared in strategy/base.py and implemented by every strategy class."""

from pathlib import Path

import pytest

from vitscale.strategy.base import Strategy
from vitscale.strategy.ddp import DDPStrategy
from vitscale.strategy.deepspeed import DeepSpeedStrategy
from vitscale.strategy.fsdp import FSDPStrategy
from vitscale.strategy.single import SingleDevice

SRC = Path(__file__).resolve().parents[2] / "src" / "vitscale"
# attributes every strategy sets in __init__ / setup rather than on the class
INSTANCE = {"device", "model", "module", "optimizer", "rank", "world_size", "is_main", "lr"}
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
        monkeypatch.setattr(
            mod, "build_strategy", lambda cfg, real=real: Recorder(real(cfg), seen, written)
        )
    cfg = load_config(recipe, ["run.max_steps=2", "run.progress=off", "run.tensorboard=false"])
    summary = train(cfg, tmp_path / "run")
    vitscale.evaluate.evaluate_checkpoint(summary["run_dir"])
    measure(cfg, steps=1, warmup=0, trials=1, synthetic=False, split_steps=1)
    assert {
        "step",
        "backward",
        "autocast",
        "eval_module",
        "state_bytes",
    } <= seen  # the recorder saw the run
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


# -- layering: who may know an engine, a task kind or a dataset by name -----------------------------
import ast  # noqa: E402

ENGINES = {"single", "ddp", "fsdp", "deepspeed"}  # strategy.name values
TASK_KINDS = {"vit", "clip", "classification"}  # Task.kind values (and the word)
DATASETS = {
    "fashion_mnist",
    "cifar10",
    "cifar100",
    "folder",
    "synthetic",
    "openclipart",
    "csv",
    "webdataset",
}
HOMES = (
    (ENGINES, "strategy/"),
    (TASK_KINDS, "tasks/"),
    (DATASETS, "data/"),
)  # the one package that may branch
# (file, literal): the branches allowed outside their home, each with its reason
ALLOWED = {
    # config.py sits below strategy/ and checks keys together as soon as a config is read:
    # CUDA graphs replay one process's captured step (test_devices.py: refused by load_config)
    ("config.py", "single"),
    # the lab's analytical communication models are named ddp / zero12 / zero3: cost formulas
    # (comm_model.py, predict.py --strategy), not engines
    ("lab/comm_model.py", "ddp"),
    ("lab/predict.py", "ddp"),
    # a prepared shard set holds labels or captions: the writer's own kind word, not a model task
    ("data/offline/shard_writer.py", "classification"),
}


def _literals(node) -> set:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {
            e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
        }
    return set()


def _branch_literals(tree):
    """(line, literal) of every string a branch depends on: compared (==, !=, in, not in), tested
    with startswith/endswith, or a key of a dict literal indexed on the spot (`{...}[x]`,
    `{...}.get(x)`). Docstrings, messages, config choice lists and recipe tables (values such as
    {"strategy.name": "fsdp"}) are not branches."""
    for node in ast.walk(tree):
        sides = []
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in ("startswith", "endswith"):
                sides = [node.args[0]]
            elif node.func.attr == "get" and isinstance(node.func.value, ast.Dict):
                sides = [k for k in node.func.value.keys if k is not None]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
            sides = [k for k in node.value.keys if k is not None]
        for side in sides:
            for value in _literals(side):
                yield node.lineno, value


def test_no_branch_on_an_engine_task_kind_or_dataset_name_outside_its_package():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for line, value in _branch_literals(ast.parse(path.read_text())):
            for names, home in HOMES:
                if value in names and not rel.startswith(home) and (rel, value) not in ALLOWED:
                    found.append(f"{rel}:{line} branches on {value!r} (ask {home})")
    assert not found, "\n".join(found)


def test_the_scan_sees_branches_not_docstrings():
    src = (
        '"""ddp, fsdp and folder are named here."""\nif cfg.strategy.name == "fsdp" or d.name in ("folder", "csv"):\n'
        '    x = {"vit": 1, "clip": 2}[kind]\nname = "ddp"\n'
    )
    assert sorted(v for _, v in _branch_literals(ast.parse(src))) == [
        "clip",
        "csv",
        "folder",
        "fsdp",
        "vit",
    ]


def test_only_strategy_and_the_losses_collectives_use_torch_distributed():
    """Issue 34: the CLI and the lab reach the process group through strategy/ (the CLIP losses keep
    their own collectives, with the group passed in)."""
    import re

    allowed = ("strategy", "losses")
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).parts[0] in allowed:
            continue
        code = re.sub(r'"""[\s\S]*?"""|#.*', "", path.read_text())
        assert not re.search(
            r"import torch\.(distributed|multiprocessing)|from torch\.(distributed|multiprocessing)",
            code,
        ), f"{path.relative_to(SRC)} imports torch.distributed or torch.multiprocessing"
