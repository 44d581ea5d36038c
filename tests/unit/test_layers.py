"""Imports run one way: the layers README.md draws (its `<!-- layers -->` block) hold for every
import in src/vitscale, function-level ones included; config.py sits on the standard library and
errors.py; metrics.py and data/ import no strategy/; no module circle inside a package either."""

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "vitscale"


def _imports(path: Path, top: bool = False) -> set[str]:
    """Absolute names of the modules a file imports (relative imports resolved), at any depth (`top`:
    in the module's own body only, what importing it runs)."""
    package = list(path.relative_to(SRC.parent).with_suffix("").parts)[:-1]
    out = set()
    tree = ast.parse(path.read_text())
    for node in tree.body if top else ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, *([node.module] if node.module else [])])
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def test_config_imports_only_errors_and_the_standard_library():
    bad = {
        m
        for m in _imports(SRC / "config.py")
        if m.split(".")[0] not in sys.stdlib_module_names
        and m not in ("vitscale", "vitscale.errors")
        and not m.startswith("vitscale.errors.")
        and m != "tomli"
    }  # tomllib's backport, before Python 3.11
    assert not bad, (
        f"config.py imports {sorted(bad)}: it sits at the bottom (errors and the standard library only)"
    )


@pytest.mark.parametrize("where", ["metrics.py", "data"])
def test_metrics_and_data_import_no_strategy(where):
    files = [SRC / where] if where.endswith(".py") else sorted((SRC / where).rglob("*.py"))
    bad = [
        f"{p.relative_to(SRC)}: {m}"
        for p in files
        for m in sorted(_imports(p))
        if m == "vitscale.strategy" or m.startswith("vitscale.strategy.")
    ]
    assert not bad, f"{where} imports strategy/: {bad}"


def test_no_import_circle():
    """Imports run one way (cli -> lab -> loop/evaluate -> tasks -> data, losses, interop -> models;
    config and errors at the bottom), function-level imports included."""

    def name(p: Path) -> str:
        parts = p.relative_to(SRC.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    mods = {name(p): p for p in SRC.rglob("*.py")}
    graph = {m: {i for i in _imports(p) if i in mods and i != m} for m, p in mods.items()}
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for m in sorted(mods):
        if m not in index:
            visit(m)
    assert not circles, f"import circles: {circles}"


def readme_layers(text: str) -> list[list[str]]:
    """The rows of README's layers block, top first: each row's leading `name.py` / `name/` words."""
    block = text.split("<!-- layers -->", 1)[1].split("<!-- /layers -->", 1)[0]
    rows = []
    for line in block.splitlines():
        names = []
        for word in line.split():
            if not re.fullmatch(r"[a-z_]+(\.py|/)", word):
                break
            names.append(word.removesuffix(".py").removesuffix("/"))
        if names:
            rows.append(names)
    return rows


def unit_of(module: str) -> str:
    """vitscale.data.loaders.memory -> data; vitscale.loop -> loop."""
    return module.split(".")[1]


def layer_violations(rows: list[list[str]]) -> list[str]:
    rank = {name: i for i, row in enumerate(rows) for name in row}
    units = {
        p.name.removesuffix(".py")
        for p in SRC.glob("*")  # modules and packages (not configs/)
        if (p.suffix == ".py" or (p / "__init__.py").is_file())
        and p.name not in ("__init__.py", "__main__.py")
    }
    bad = [f"{u} is in no row of README's layers block" for u in sorted(units - set(rank))]
    bad += [
        f"README's layers block names {u}, which src/vitscale does not have"
        for u in sorted(set(rank) - units)
    ]
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.name == "__main__.py" and len(rel.parts) == 1:
            continue
        me = rel.parts[0].removesuffix(".py")
        for m in sorted(_imports(path)):
            if not m.startswith("vitscale.") or m.count(".") < 1:
                continue
            other = unit_of(m)
            if other != me and other in rank and me in rank and rank[other] <= rank[me]:
                bad.append(f"{rel.as_posix()} imports {m}: {other} is not below {me}")
    return bad


def test_every_import_goes_down_the_layers_the_readme_draws():
    rows = readme_layers((ROOT / "README.md").read_text())
    assert len(rows) >= 5, rows
    assert not layer_violations(rows), "\n".join(layer_violations(rows))


def test_the_layer_check_fails_on_an_upward_import():
    rows = readme_layers((ROOT / "README.md").read_text())
    swapped = [row for row in rows]
    top, bottom = (
        next(i for i, r in enumerate(rows) if "tasks" in r),
        next(i for i, r in enumerate(rows) if "data" in r),
    )
    swapped[top], swapped[bottom] = (
        rows[bottom],
        rows[top],
    )  # tasks/ below data/: tasks -> data goes up
    assert any("imports vitscale.data" in v for v in layer_violations(swapped))
    assert any("is in no row" in v for v in layer_violations([r for r in rows if "lab" not in r]))


# -- the lab's rooms ---------------------------------------------------------------------------------
LAB = SRC / "lab"
# under the commands (bench, ladder, tune, ...), top first: a room imports only rooms of lower rows
LAB_ROOMS = [["rounds"], ["timing"], ["recipes", "machine"]]
# what the CLI's parser may import besides the standard library (launch: who this process is, plain
# environment parsing; its own imports are checked light below)
LIGHT = ("vitscale.config", "vitscale.errors", "vitscale.launch")


def _light(module: str) -> bool:
    return (
        module.split(".")[0] in sys.stdlib_module_names
        or module == "vitscale"
        or any(module == m or module.startswith(m + ".") for m in LIGHT)
    )


def test_the_lab_commands_module_is_light():
    """lab/commands.py (each command's help and arguments) is all the CLI imports of the lab to build
    its parser: no torch, no other lab module, so `vitscale --help` and `vitscale config` stay fast."""
    for path in (LAB / "commands.py", LAB / "__init__.py", SRC / "launch.py"):
        bad = sorted(m for m in _imports(path) if not _light(m))
        assert not bad, (
            f"{path.relative_to(SRC)} imports {bad}: it must stay light (argparse, config, errors)"
        )
    bad = sorted(
        m
        for m in _imports(SRC / "cli.py", top=True)
        if not _light(m) and m != "vitscale.lab" and not m.startswith("vitscale.lab.commands")
    )
    assert not bad, (
        f"cli.py imports {bad} at its top: a lab command's module is imported when it runs"
    )


def test_the_lab_rooms_import_down():
    """rounds (side by side, paired statistics) -> timing (one trainer timed) -> recipes, machine:
    no room imports a command module or a room of its own row or above."""
    rank = {name: i for i, row in enumerate(LAB_ROOMS) for name in row}
    assert {p.stem for p in LAB.glob("*.py")} >= set(rank), (
        "a room named in LAB_ROOMS is missing from lab/"
    )
    bad = []
    for room, i in rank.items():
        for m in sorted(_imports(LAB / f"{room}.py")):
            if m.startswith("vitscale.lab.") and m.split(".")[2] != room:
                other = m.split(".")[2]
                if rank.get(other, -1) <= i:
                    bad.append(f"lab/{room}.py imports {m}: {other} is not a room below {room}")
    assert not bad, "\n".join(bad)


def test_models_import_only_torch_the_standard_library_and_their_own_package():
    """ARCHITECTURE.md: a model is plain torch (engines, tasks and the lab apply everything else to
    it from outside), so models/ imports nothing else of vitscale and no other third-party package."""
    bad = [
        f"{p.relative_to(SRC)}: {m}"
        for p in sorted((SRC / "models").rglob("*.py"))
        for m in sorted(_imports(p))
        if m.split(".")[0] not in sys.stdlib_module_names
        and m.split(".")[0] != "torch"
        and not (m == "vitscale.models" or m.startswith("vitscale.models."))
    ]
    assert not bad, f"models/ imports {bad}"


def test_strategy_names_no_model_class():
    """strategy/ asks a model for its shard units (`shard_units()`) instead of importing its classes."""
    bad = [
        f"{p.relative_to(SRC)}: {m}"
        for p in sorted((SRC / "strategy").rglob("*.py"))
        for m in sorted(_imports(p))
        if m == "vitscale.models" or m.startswith("vitscale.models.")
    ]
    assert not bad, f"strategy/ imports models/: {bad}"


CLASS_LINES, FUNCTION_LINES = 250, 60  # README's developer section


def test_every_class_and_function_in_src_stays_within_its_size():
    """A class is at most 250 lines and a function at most 60, counted from its `class` / `def`
    line to its last line (docstring included), over every module of src/vitscale."""
    too_long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = CLASS_LINES if isinstance(node, ast.ClassDef) else FUNCTION_LINES
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    too_long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {lines}")
    assert not too_long, "over the size limit:\n" + "\n".join(too_long)
