"""The suite's layout (tests/conftest.py): tests/unit/ runs in the test process, tests/integration/
holds the tests that launch processes and is marked `integration` by folder. This checks the split."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# calls that start processes: the tests' wrappers of torchrun and the deepspeed launcher, and the
# standard library's and torch's launchers; any use of the subprocess module counts too
LAUNCHERS = {"torchrun", "ds_train", "deepspeed_launch", "spawn", "start_processes", "Popen", "Process"}
LAUNCHER_MODULES = {"subprocess"}


def launches(source: str) -> list[str]:
    """Where `source` calls, imports or names a process launcher, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in LAUNCHERS:
                found.append(f"{node.lineno}: {name}(")
        elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) in LAUNCHER_MODULES:
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in LAUNCHER_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in LAUNCHER_MODULES:
                found.append(f"{node.lineno}: from {node.module} import")
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names if a.name in LAUNCHERS]
    return sorted(found)


def test_the_scan_sees_every_launcher():
    for source in ("torchrun(out, [])", "p = ds_train(out, [])", "deepspeed_launch(out, [])",
                   "torch.multiprocessing.spawn(f, nprocs=2)", "mp.start_processes(f)", "subprocess.run(cmd)",
                   "import subprocess", "from subprocess import run", "from helpers import torchrun",
                   "x = Popen(cmd)", "multiprocessing.Process(target=f).start()"):
        assert launches(source), source
    assert launches("def test_without_torchrun():\n    sweep.subprocess_runner  # 'subprocess.run('") == []


def test_no_unit_test_launches_processes():
    offenders = {f.name: hits for f in sorted((TESTS / "unit").glob("*.py"))
                 if (hits := launches(f.read_text()))}
    assert not offenders, f"these launch processes: move the tests to tests/integration/: {offenders}"


def test_every_integration_module_has_tests():
    empty = [f.name for f in sorted((TESTS / "integration").glob("test_*.py"))
             if not any(isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
                        for n in ast.parse(f.read_text()).body)]
    assert (TESTS / "integration").is_dir() and not empty, empty


def test_module_names_are_unique_across_the_folders():
    """No __init__.py: pytest imports each test module by its basename, so two equal ones clash."""
    names = [f.name for d in ("unit", "integration") for f in (TESTS / d).glob("*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert not list(TESTS.glob("test_*.py")), "test modules go in tests/unit/ or tests/integration/"
