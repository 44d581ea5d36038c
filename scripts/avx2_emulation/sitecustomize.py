# Timing on an AVX-512 BF16 CPU as if it had AVX2 only (docs/testing.md, docs/performance.md):
#   ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=scripts/avx2_emulation vitscale ...
# The environment variables cap the kernels (a bf16 matmul then runs at ~2 GFLOP/s, as on a real
# AVX2 CPU); this file makes vitscale read /proc/cpuinfo's flags as without bf16
# (strategy.devices.cpu_has_bf16 answers False for /proc/cpuinfo; other files are read as they are).
# For timing only: torch.compile's generated code computes NaN under the capped ISA.
import importlib.abc
import importlib.machinery
import sys


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vitscale.strategy.devices":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        orig = spec.loader.exec_module

        def exec_module(module):
            orig(module)
            real = module.cpu_has_bf16
            module.cpu_has_bf16 = lambda cpuinfo="/proc/cpuinfo": (
                False if cpuinfo == "/proc/cpuinfo" else real(cpuinfo)
            )

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
