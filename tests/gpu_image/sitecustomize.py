"""The GPU image's missing packages, simulated: with this folder on PYTHONPATH, importing a name
listed in VITSCALE_BLOCK_IMPORTS fails as if it were not installed (tests/test_gpu_session.py)."""
import os
import sys

BLOCKED = set(os.environ.get("VITSCALE_BLOCK_IMPORTS", "").split())


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: simulating the GPU image)", name=name)
        return None


if BLOCKED:
    sys.meta_path.insert(0, _Blocker())
