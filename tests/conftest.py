"""Fixtures shared by the test modules (plain helpers: tests/helpers.py).

Markers: `integration` = tests that launch processes (torchrun, the deepspeed launcher, the CLI
in a subprocess); `pytest -m "not integration"` is the fast set for development."""
import pytest
import torch

from helpers import BASE, TINY, sets
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


# modules whose tests all run several processes (or DeepSpeed's engine); elsewhere a test is an
# integration test when its own code launches processes
INTEGRATION_MODULES = {"test_distributed", "test_deepspeed", "test_launchers", "test_multinode", "test_failures",
                       "test_checkpoints_dist", "test_clip_losses_dist", "test_gpu_session"}
LAUNCHES = ("torchrun(", "subprocess.", "ds_train(", "deepspeed_launch(", "spawn(")


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: launches processes (torchrun, deepspeed, the CLI in a "
                                       "subprocess); deselect with -m 'not integration' for the fast set")


def pytest_collection_modifyitems(config, items):
    import inspect
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        fn = getattr(item, "function", None)
        try:
            source = inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):
            source = ""
        if module in INTEGRATION_MODULES or any(k in source for k in LAUNCHES):
            item.add_marker(pytest.mark.integration)
