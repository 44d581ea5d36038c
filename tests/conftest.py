"""Fixtures shared by the test modules (plain helpers: tests/helpers.py).

tests/unit/: fast tests in one process; tests/integration/: tests that launch processes (torchrun,
the deepspeed launcher, the CLI in a subprocess, multiprocessing spawn), all marked `integration`
here, so `pytest -m "not integration"` is the fast set for development (a slow unit test may carry
the mark by hand: test_data_stream.py's training runs).

Two tiers (issue 40, docs/testing.md): `pytest` runs the fast tier, every test but those tests/tiers.py
lists as slow by their measured time; `pytest --full` runs everything (CI runs the slow tier after
the fast one: `pytest -m slow`). A test named on the command line (`pytest path::test`) always runs,
and so does everything under an explicit `-m` expression.
Test module basenames are unique across the two folders (no __init__.py: pytest's default import
mode puts this folder on sys.path, which is how `from helpers import ...` resolves)."""

from pathlib import Path

import pytest
import torch
from helpers import BASE, ENGINES, KILL_RUN, TINY, sets, torchrun, write_shards
from tiers import is_slow

from vitscale.cli import main


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    """The tiny recipe trained in this process: what the multi-process runs must reproduce."""
    out = tmp_path_factory.mktemp("single") / "run"
    assert main(["train", TINY, "--out", str(out), *sets(BASE)]) == 0
    return out


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """`uninterrupted(engine, nproc)`: the run of KILL_RUN on an engine, trained once per session and
    shared by the kill -9 and the stop-signal tests (each compares its resumed run's weights with it)."""
    runs = {}

    def get(engine: str, nproc: int) -> Path:
        if engine not in runs:
            out = tmp_path_factory.mktemp(f"uninterrupted_{engine}") / "run"
            p = torchrun(out, ENGINES[engine] + KILL_RUN, nproc=nproc)
            assert p.returncode == 0, p.stderr[-3000:]
            runs[engine] = out
        return runs[engine]

    return get


@pytest.fixture
def fixed_peak_and_threads(monkeypatch):
    """A fixed CPU matmul peak (MFU without a 1 s measurement) and torch's thread count restored."""
    from vitscale import metrics

    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda *a, **k: 1e11)
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Webdataset shards: train/ (4 x 6 samples) and test/ (2 x 4 held out), see helpers.write_shards."""
    root = tmp_path_factory.mktemp("wds")
    write_shards(root / "train", n_shards=4, per=6)  # 24 samples
    write_shards(root / "test", n_shards=2, per=4, start=100)  # 8 held-out samples
    return root


INTEGRATION = Path(__file__).resolve().parent / "integration"
# under `pytest -n 2` (pyproject's addopts say --dist loadgroup) every integration test that starts
# ranks (torchrun, the deepspeed launcher, spawned process groups) is in this one xdist group: one
# worker runs them one after another, so two tests' process groups never share the machine at once
# (docs/testing.md: a gloo rank aborted once when two workers launched side by side), while the
# other worker runs the rest. ONE_PROCESS: the integration modules whose processes are each a
# whole one-process run (the CLI in a subprocess), free to run beside them
LAUNCHES = "launches"
ONE_PROCESS = (
    "test_cli_process",
    "test_compile_cache",
    "test_gpu_session",
    "test_search_processes",
)


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="vitscale: run the slow tier too (the whole suite, as "
        "CI does); without it the slow tests of tests/tiers.py are deselected",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "integration: launches processes (torchrun, deepspeed, the CLI in a "
        "subprocess); deselect with -m 'not integration' for the fast set",
    )
    config.addinivalue_line(
        "markers",
        "slow: the slow tier (tests/tiers.py, by measured time); `pytest` leaves "
        "it out, `pytest --full` or `-m slow` runs it",
    )


def pytest_collection_modifyitems(config, items):
    """Every test under tests/integration/ is an integration test (tests/unit/test_suite_layout.py
    checks that the unit tests launch no processes); the slow tier (tiers.py) is marked `slow` and,
    unless --full, an explicit -m, or the test named by its node id, deselected."""
    for item in items:
        if INTEGRATION in item.path.resolve().parents:
            item.add_marker(pytest.mark.integration)
            if item.path.stem not in ONE_PROCESS:
                item.add_marker(pytest.mark.xdist_group(LAUNCHES))
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    if config.getoption("--full") or config.getoption("markexpr"):
        return
    named = {
        a.split("[")[0] for a in config.args if "::" in a
    }  # a test named by its id (any parametrization)
    keep, drop = [], []
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        (drop if slow and item.nodeid.split("[")[0] not in named else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
        config._vitscale_slow_left_out = len(drop)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = getattr(config, "_vitscale_slow_left_out", 0)
    if n:
        terminalreporter.write_line(
            f"vitscale: the fast tier ran; {n} slow tests left out (run everything with "
            "`pytest --full`: docs/testing.md)"
        )
