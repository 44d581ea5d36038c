"""The suite's layout (tests/conftest.py): tests/unit/ runs in the test process, tests/integration/
holds the tests that launch processes and is marked `integration` by folder. This checks the split."""

import ast
from pathlib import Path

import pytest

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
        ".venv/bin/python -m pytest -n 2 --cov " in readme.splitlines()[4] + " "
    )  # the second command: the fast tier
    assert "pytest -n 2 --cov --full" in readme and "-m slow" in ci and "pytest -n 2 --cov\n" in ci


@pytest.fixture(scope="module")
def pytester_free_collect():
    """{node id: its xdist_group names} of the whole suite, collected by a nested pytest (the slow
    tier included, no worker started)."""

    class Seen:
        groups: dict = {}

        def pytest_collection_finish(self, session):
            Seen.groups = {
                i.nodeid: [a for m in i.iter_markers("xdist_group") for a in m.args]
                for i in session.items
            }

    rc = pytest.main(
        [
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:cov",
            "--full",
            "-n",
            "0",
            str(TESTS / "integration"),
            str(TESTS / "unit" / "test_layers.py"),
        ],
        plugins=[Seen()],
    )
    assert rc == 0
    return Seen.groups


def test_the_launching_tests_share_one_xdist_group(pytester_free_collect):
    """Under the README's `pytest -n 2` (pyproject's addopts: --dist loadgroup) every test that
    starts ranks is in conftest's one xdist group, so one worker runs them one at a time and two
    tests' process groups never overlap (docs/testing.md); the unit tests and the integration
    modules of one-process runs (conftest.ONE_PROCESS, which start no ranks) are in none."""
    from conftest import LAUNCHES, ONE_PROCESS

    groups = pytester_free_collect
    one = tuple(f"tests/integration/{m}.py::" for m in ONE_PROCESS)
    ranks = {k: v for k, v in groups.items() if k.startswith("tests/integration/")}
    free = {k: v for k, v in groups.items() if k.startswith(("tests/unit/", *one))}
    ranks = {k: v for k, v in ranks.items() if k not in free}
    assert len(ranks) > 50 and len(free) > len(one), (len(ranks), len(free))
    assert all(v == [LAUNCHES] for v in ranks.values()), [
        k for k, v in ranks.items() if v != [LAUNCHES]
    ][:5]
    assert not any(free.values()), [k for k, v in free.items() if v][:5]
    for m in ONE_PROCESS:  # each starts processes, never ranks
        text = (TESTS / "integration" / f"{m}.py").read_text()
        assert launches(text), m
        assert not any(w in text for w in ("torchrun", "ds_train", "nproc", "spawn(")), m
