"""Fixtures shared by the test modules (plain helpers: tests/helpers.py).

tests/unit/: fast tests in one process; tests/integration/: tests that launch processes (torchrun,
the deepspeed launcher, the CLI in a subprocess, multiprocessing spawn), all marked `integration`
here, so `pytest -m "not integration"` is the fast set for development (a slow unit test may carry
the mark by hand: test_data_stream.py's training runs).
Test module basenames are unique across the two folders (no __init__.py: pytest's default import
mode puts this folder on sys.path, which is how `from helpers import ...` resolves)."""
from pathlib import Path

import pytest
import torch

from helpers import BASE, TINY, sets, write_shards
from vitscale.cli import main


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    """The tiny recipe trained in this process: what the multi-process runs must reproduce."""
    out = tmp_path_factory.mktemp("single") / "run"
    assert main(["train", TINY, "--out", str(out), *sets(BASE)]) == 0
    return out


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
    write_shards(root / "train", n_shards=4, per=6)               # 24 samples
    write_shards(root / "test", n_shards=2, per=4, start=100)     # 8 held-out samples
    return root


INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: launches processes (torchrun, deepspeed, the CLI in a "
                                       "subprocess); deselect with -m 'not integration' for the fast set")


def pytest_collection_modifyitems(config, items):
    """Every test under tests/integration/ is an integration test (tests/unit/test_suite_layout.py
    checks that the unit tests launch no processes)."""
    for item in items:
        if INTEGRATION in item.path.resolve().parents:
            item.add_marker(pytest.mark.integration)
