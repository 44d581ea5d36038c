"""A checkpoint's contents as one part (state.py): the writer (run_state.run_state and
Checkpoints.save) writes exactly the keys state.py names, no other module spells them, and the one
reader (state.SavedRun) answers what torch.load of the file holds, old checkpoints' defaults
included."""

import ast
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from vitscale import checkpoint as ckpt
from vitscale import state
from vitscale.errors import ConfigError, TrainingError
from vitscale.run_state import RunProgress
from vitscale.state import SavedRun

SRC = Path(__file__).resolve().parents[2] / "src" / "vitscale"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny run of one epoch (its checkpoints under RUN/checkpoints/)."""
    from vitscale.cli import main

    out = tmp_path_factory.mktemp("state") / "run"
    args = ["--out", str(out), "--set", "run.threads=1", "--set", "train.epochs=1"]
    assert main(["train", "configs/tests/tiny.toml", *args]) == 0
    return out


def written(run: Path) -> tuple[Path, dict]:
    path = ckpt.list_checkpoints(run)[-1]
    return path, torch.load(path, weights_only=False)


def test_the_writer_writes_exactly_the_keys_state_names(run):
    _, st = written(run)
    assert list(st) == list(state.KEYS)  # every key, in the order written
    assert len(set(state.KEYS)) == len(state.KEYS)
    assert st[state.VERSION] == state.FORMAT_VERSION
    assert tuple(f.name for f in fields(RunProgress)) == state.PROGRESS


# -- no module but state.py spells a checkpoint's key --------------------------------------------
# The keys scanned: those that name nothing else in src/vitscale. "step", "kind", "task",
# "version", "world_size" and "images_seen" are also the fields of log records, summaries, bench
# records, data manifests and optimizer states, so they are not scanned.
SCANNED = (
    state.CONFIG,
    state.STRATEGY,
    state.SCHEDULER,
    state.RNG,
    state.SPEC,
    state.PREPROCESS,
    state.ENGINE,
    state.TRAIN_TIME,
    state.STEADY,
    state.BEST_ACC,
    state.LAST_EVAL,
    state.EVALS,
)
# (file, key): the same words as keys of something else, each with what it is
ALLOWED = {
    # the `vitscale config` command in the CLI's command table
    ("cli.py", state.CONFIG),
    # summary.json's "strategy" (the engine's name: a file of its own, issue 62), and the saved
    # config's [strategy] section read on a resume onto another strategy (a config section's name,
    # as state.py reads it too)
    ("run_report.py", state.STRATEGY),
    ("run_state.py", state.STRATEGY),
    # the metadata of `vitscale export`'s safetensors file (a format of its own, with its own
    # readers: interop/finetune.py reads the spec back for model.init)
    ("evaluate.py", state.CONFIG),
    ("evaluate.py", state.SPEC),
    ("interop/finetune.py", state.SPEC),
    # how a caller spells its arguments in OpenCLIP's refusals (config=NAME, model.init_open_clip)
    ("interop/open_clip/convert.py", state.CONFIG),
    ("interop/open_clip/arch.py", state.CONFIG),
}
# the lab reads and writes no checkpoint: its records (bench.json, the ladder's and the
# predictions' rows) name their own config and strategy fields
ALLOWED_UNDER = {("lab/", state.CONFIG), ("lab/", state.STRATEGY)}


def key_literals(tree):
    """(line, string) of every string literal used as a key: indexed (`x["k"]`), asked of a dict
    (`.get("k")`, `.pop`, `.setdefault`), tested with `in`, or a key of a dict literal."""
    for node in ast.walk(tree):
        keys = []
        if isinstance(node, ast.Subscript):
            keys = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in ("get", "pop", "setdefault"):
                keys = [node.args[0]]
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            keys = [node.left]
        elif isinstance(node, ast.Dict):
            keys = [k for k in node.keys if k is not None]
        for k in keys:
            if isinstance(k, ast.Constant) and isinstance(k.value, str):
                yield node.lineno, k.value


def allowed(rel: str, key: str) -> bool:
    return (rel, key) in ALLOWED or any(
        rel.startswith(under) and key == k for under, k in ALLOWED_UNDER
    )


def test_no_module_but_state_spells_a_checkpoint_key():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "state.py":
            continue
        for line, value in key_literals(ast.parse(path.read_text())):
            if value in SCANNED and not allowed(rel, value):
                found.append(f"{rel}:{line} spells the checkpoint key {value!r} (use state.py's)")
    assert not found, "\n".join(found)


def test_the_scan_sees_keys_not_messages():
    src = (
        '"""state["config"] in a docstring."""\n'
        'a = st["strategy"]\nb = st.get("rng", [])\nif "engine" in st:\n'
        '    c = {"spec": 1}\nprint("config")\nd = st[CONFIG]\n'
    )
    assert sorted(v for _, v in key_literals(ast.parse(src))) == [
        "engine",
        "rng",
        "spec",
        "strategy",
    ]


# -- the one reader ------------------------------------------------------------------------------
def test_saved_run_reads_what_torch_load_reads(run):
    path, st = written(run)
    saved = SavedRun.open(run, "evaluating", "vitscale eval")  # the run folder: its newest
    assert saved.path == path and saved.run_dir == run
    assert saved.config().to_dict() == st["config"] == saved.config_dict
    assert saved.config(["train.epochs=3"]).train.epochs == 3
    assert saved.step == st["step"] > 0
    assert saved.kind == st["kind"] == "vit"
    assert saved.spec == st["spec"]
    assert saved.preprocess == st["preprocess"] and saved.preprocess is not None
    assert saved.task_state == st["task"]
    assert saved.progress == {k: st[k] for k in state.PROGRESS}
    assert saved.strategy_name == st["config"]["strategy"]["name"] == "single"
    assert saved.engine_folder is None and st["engine"] is None
    assert saved.scheduler_state == st["scheduler"]
    weights = saved.weights(use_ema=False)
    model = st["strategy"]["model"]
    assert weights.keys() == model.keys() and all(torch.equal(weights[k], model[k]) for k in model)
    rng = saved.rng_for(0, 1)
    assert torch.equal(rng["torch"], st["rng"][0]["torch"])
    assert SavedRun.open(path, "evaluating", "vitscale eval").step == saved.step  # the file


def test_what_older_checkpoints_leave_out(run):
    """Before CLIP no kind (a classifier), before the record no preprocess, before checkpoints
    named their engine folder DeepSpeed's .ds beside it, before several processes one RNG dict."""
    path, st = written(run)
    for k in (state.KIND, state.PREPROCESS, state.ENGINE, state.TASK):
        del st[k]
    st[state.RNG] = st[state.RNG][0]
    saved = SavedRun(path, st)
    assert saved.kind == "vit" and saved.preprocess is None and saved.task_state == {}
    assert saved.engine_folder is None and saved.rng_for(1, 2) is st[state.RNG]
    st[state.CONFIG]["strategy"]["name"] = "deepspeed"
    assert saved.strategy_name == "deepspeed" and saved.engine_folder == path.with_suffix(".ds")
    del st[state.CONFIG]["strategy"]
    assert saved.strategy_name == "single"


def test_ema_weights_and_refusals(run, tmp_path):
    path, st = written(run)
    model = st["strategy"]["model"]
    ema = {f"module.{k}": v + 1 for k, v in model.items()}
    st["strategy"]["ema"] = {**ema, "n_averaged": torch.tensor(3)}
    saved = SavedRun(path, st)
    got = saved.weights(use_ema=True)  # the AveragedModel prefix off, n_averaged left out
    assert got.keys() == model.keys() and all(torch.equal(got[k], model[k] + 1) for k in model)
    assert saved.weights(use_ema=False) is model
    name = next(k for k, v in model.items() if v.is_floating_point())
    model[name] = model[name] * float("nan")
    with pytest.raises(TrainingError, match=r"holds non-finite weights \(1 of .*use an earlier"):
        saved.weights(use_ema=False)
    other = tmp_path / "checkpoints" / "step_00000001.pt"
    other.parent.mkdir()
    torch.save({"weights": {}}, other)
    with pytest.raises(ConfigError, match="is not a vitscale training checkpoint"):
        SavedRun.open(other, "evaluating", "vitscale eval")
