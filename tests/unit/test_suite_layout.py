"""The suite's layout (tests/conftest.py): tests/unit/ runs in the test process, tests/integration/
holds the tests that launch processes and is marked `integration` by folder. This checks the split."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# calls that start processes: the tests' wrappers of torchrun and the deepspeed launcher, and the
# standard library's and torch's launchers; any use of the subprocess module counts too
LAUNCHERS = {
    "torchrun",
    "ds_train",
    "deepspeed_launch",
    "spawn",
    "start_processes",
    "Popen",
    "Process",
}
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
        elif (
            isinstance(node, ast.Attribute) and getattr(node.value, "id", None) in LAUNCHER_MODULES
        ):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] in LAUNCHER_MODULES
            ]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in LAUNCHER_MODULES:
                found.append(f"{node.lineno}: from {node.module} import")
            found += [
                f"{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if a.name in LAUNCHERS
            ]
    return sorted(found)


def test_the_scan_sees_every_launcher():
    for source in (
        "torchrun(out, [])",
        "p = ds_train(out, [])",
        "deepspeed_launch(out, [])",
        "torch.multiprocessing.spawn(f, nprocs=2)",
        "mp.start_processes(f)",
        "subprocess.run(cmd)",
        "import subprocess",
        "from subprocess import run",
        "from helpers import torchrun",
        "x = Popen(cmd)",
        "multiprocessing.Process(target=f).start()",
    ):
        assert launches(source), source
    assert (
        launches("def test_without_torchrun():\n    sweep.subprocess_runner  # 'subprocess.run('")
        == []
    )


def test_no_unit_test_launches_processes():
    offenders = {
        f.name: hits
        for f in sorted((TESTS / "unit").glob("*.py"))
        if (hits := launches(f.read_text()))
    }
    assert not offenders, (
        f"these launch processes: move the tests to tests/integration/: {offenders}"
    )


def test_every_integration_module_has_tests():
    empty = [
        f.name
        for f in sorted((TESTS / "integration").glob("test_*.py"))
        if not any(
            isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
            for n in ast.parse(f.read_text()).body
        )
    ]
    assert (TESTS / "integration").is_dir() and not empty, empty


def test_module_names_are_unique_across_the_folders():
    """No __init__.py: pytest imports each test module by its basename, so two equal ones clash."""
    names = [f.name for d in ("unit", "integration") for f in (TESTS / d).glob("*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert not list(TESTS.glob("test_*.py")), "test modules go in tests/unit/ or tests/integration/"


# -- the tiers (tests/tiers.py, issue 40) ---------------------------------------------------------
def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_every_slow_entry_names_a_test_that_exists(request):
    """A stale entry would silently move nothing (or a renamed test would silently be fast)."""
    from tiers import KEEP_FAST, SLOW

    root = TESTS.parent
    missing = [
        i
        for i in [*SLOW, *KEEP_FAST.values()]
        if not (root / i.split("::")[0]).is_file()
        or i.split("::")[1].split("[")[0] not in _functions(root / i.split("::")[0])
    ]
    assert not missing, f"tests/tiers.py names tests that do not exist: {missing}"
    # where this session collected a listed test's module whole, a parametrized id must be one of its items
    collected = {item.nodeid for item in request.session.items}
    files = {i.split("::")[0] for i in collected}
    stale = [
        i
        for i in [*SLOW, *KEEP_FAST.values()]
        if "[" in i
        and i.split("::")[0] in files
        and i not in collected
        and request.config.getoption("--full")
    ]
    assert not stale, f"tests/tiers.py names parametrizations that do not exist: {stale}"


def test_every_engine_task_format_and_failure_mode_keeps_a_fast_test():
    from tiers import KEEP_FAST, is_slow

    for need in (
        "single",
        "ddp",
        "fsdp",
        "zero2",
        "clip",
        "kill -9 resume",
        "timm zoo",
        "open_clip zoo",
        "webdataset",
        "csv",
    ):
        assert need in KEEP_FAST, f"tests/tiers.py: no fast test named for {need}"
    slow = {k: v for k, v in KEEP_FAST.items() if is_slow(v)}
    assert not slow, f"these must stay in the fast tier: {slow}"


def test_the_readme_names_both_tiers():
    readme = (TESTS.parent / "README.md").read_text()
    ci = (TESTS.parent / ".ci" / "run").read_text()
    assert (
        ".venv/bin/python -m pytest --cov " in readme.splitlines()[4] + " "
    )  # the second command: the fast tier
    assert "pytest --cov --full" in readme and "-m slow" in ci and "pytest --cov\n" in ci
