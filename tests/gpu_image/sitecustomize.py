"""The GPU image simulated (tests/integration/test_gpu_session.py), with this folder on PYTHONPATH:
- VITSCALE_BLOCK_IMPORTS="deepspeed webdataset ...": importing one of these top-level names fails
  as if it were not installed (find_spec too, so open_clip's vocabulary file is not found either);
- VITSCALE_FAKE_TORCH_VERSION="2.11.0+cu130": torch.__version__ reads that once torch is imported
  (the image's torch; the project's constraints pin another, which the image does not have)."""

import os
import sys

BLOCKED = set(os.environ.get("VITSCALE_BLOCK_IMPORTS", "").split())
FAKE_TORCH_VERSION = os.environ.get("VITSCALE_FAKE_TORCH_VERSION", "")


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {name!r} (blocked: simulating the GPU image)", name=name
            )
        return None


class _TorchVersion:
    """Finds torch with the other finders and sets its __version__ right after the module ran."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        import importlib.util

        sys.meta_path.remove(self)  # once: torch is imported once per process
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            from torch.torch_version import TorchVersion

            module.__version__ = TorchVersion(FAKE_TORCH_VERSION)

        spec.loader.exec_module = exec_module
        return spec


if BLOCKED:
    sys.meta_path.insert(0, _Blocker())
if FAKE_TORCH_VERSION:
    sys.meta_path.insert(0, _TorchVersion())
