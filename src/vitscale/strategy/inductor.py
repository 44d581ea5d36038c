"""torch.compile's inductor knobs as config keys (issue 51), scoped to the compile they belong to.

- `compile_args(train)` (compiling.py, shared with CLIP's compiled step): torch.compile's arguments
  for train.compile_mode and the train.inductor_* keys. torch.compile takes a mode or an options dict, never both, so a knob turns
  the mode into its options (`torch._inductor.list_mode_options`) with the knobs over them. The
  options are patched into inductor's config for that compile only: they never leak into another
  model's compile (bench --peer's timm model keeps the mode alone).
- `gemm_refusal`: the CUDA GEMM backends refused on a CPU (a knob without train.compile=true, and
  the GEMM backends without max-autotune, are config.py's refusals: `inductor_refusal`).
- `knob_note`: the Triton-only knobs named in one line where the compile is a CPU one (no-ops there).
- `CompileCache`: the Mega Cache (train.compile_cache): the compile artifacts loaded before the first
  compile, saved after the first optimizer step (or at exit), so that the next run does not compile again.

All knobs default off (torch's own defaults); `vitscale tune` measures them side by side, and the
recipe's `auto` keys never turn one on.
"""

from __future__ import annotations

import atexit
import logging
from pathlib import Path

import torch

from ..config import TrainConfig, inductor_knobs, inductor_options
from ..errors import ConfigError

log = logging.getLogger(__name__)

# the knobs that only change Triton kernels: no effect in a compile for the CPU (C++ kernels)
TRITON_ONLY = ("inductor_coordinate_descent", "inductor_combo_kernels", "inductor_mix_order")


def gemm_refusal(device_type: str, gemm: str) -> str | None:
    """train.inductor_gemm names a CUDA backend: refused on any other device."""
    if gemm != "default" and device_type != "cuda":
        return (
            f"config: train.inductor_gemm={gemm} is a CUDA GEMM backend; on {device_type} use "
            "inductor_gemm=default"
        )
    return None


def known_options() -> set[str]:
    """The option names this torch's inductor config has."""
    import torch._inductor.config as inductor_config

    return set(inductor_config.get_config_copy())


def knob_refusal(train: TrainConfig, device_type: str) -> str | None:
    """What this device and this torch refuse of the knobs, in one line, or None: a CUDA GEMM
    backend on another device; an option this torch's inductor does not have (an older torch)."""
    why = gemm_refusal(device_type, train.inductor_gemm)
    opts = inductor_options(train)
    if why or not opts:
        return why
    known = known_options()
    missing = [k for k in opts if k not in known]
    if missing:
        return (
            f"config: inductor's option {missing[0]} (set by {', '.join(inductor_knobs(train))}) is "
            f"not in torch {torch.__version__}; leave that key at its default with this torch"
        )
    return None


def knob_note(train: TrainConfig, device_type: str) -> str | None:
    """One line where Triton-only knobs are set for a compile that runs on the CPU (no effect)."""
    if device_type == "cuda" or not train.compile:
        return None
    triton = [k for k in inductor_knobs(train) if k.split(".")[1].split("=")[0] in TRITON_ONLY]
    if not triton:
        return None
    return (
        f"{', '.join(triton)}: options of inductor's Triton (GPU) kernels; no effect on "
        f"{device_type}, whose compiled kernels are C++"
    )


class CompileCache:
    """train.compile_cache: torch.compiler's Mega Cache in one file. `load()` before the first
    compile (a missing file: nothing to load, the run compiles and writes it); `saved()` after the
    first optimizer step, when the forward and backward have compiled (main process only)."""

    def __init__(self, path: str, main: bool = True):
        self.path = Path(path) if path else None
        self.main, self.pending = main, bool(path) and main

    def load(self) -> None:
        if self.pending:  # a step that never calls saved() (the captured one): at exit instead
            atexit.register(self.saved)
        if self.path is None or not self.path.exists():
            return
        try:
            info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
        except Exception as e:  # noqa: BLE001 (a stale or foreign file: say so, compile anew)
            log.warning("train.compile_cache: %s not loaded (%s): compiling anew", self.path, e)
            return
        if info is None:  # torch says why in its own warning
            log.warning(
                "train.compile_cache: %s not loaded (not a compile cache of this torch): "
                "compiling anew",
                self.path,
            )
            return
        n = sum(len(v) for v in info.artifacts.values())
        log.info("train.compile_cache: %d compile artifacts loaded from %s", n, self.path)

    def saved(self) -> None:
        """Write the artifacts of this process's compiles, once."""
        if not self.pending or self.path is None:
            return
        self.pending = False
        got = torch.compiler.save_cache_artifacts()
        if got is None:
            log.warning("train.compile_cache: nothing compiled to save to %s", self.path)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_bytes(got[0])
        tmp.replace(self.path)
        log.info("train.compile_cache: compile artifacts saved to %s", self.path)


def check_cache_path(path: str) -> None:
    """train.compile_cache: a file path (its folder created when saved), never a folder."""
    if path and Path(path).is_dir():
        raise ConfigError(f"config: train.compile_cache={path} is a folder; name a file in it")
