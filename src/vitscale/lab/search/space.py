"""The space `vitscale search` samples: a small TOML file of recipe keys, one table per config
section, each key a range or a list of choices (docs/search.md):

    [optim]
    lr = { low = 3e-4, high = 3e-3, log = true }   # a float range, sampled on a log scale
    warmup_epochs = { low = 0.0, high = 0.5 }       # a float range
    [model]
    depth = { low = 4, high = 8 }                   # an int range (the key is an integer)
    dim = { choices = [128, 192, 256] }             # choices (any type the key takes)
    stem = ["patch", "conv"]                        # a plain list = choices

Ranges take `log` (true: log scale, low > 0) and `step` (a grid); every key, choice and bound is
checked against the recipe schema, and a bad one is a one-line error naming it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ...config import SECTIONS, Config, set_value
from ...errors import ConfigError

SPACES = Path(__file__).resolve().parents[2] / "configs" / "search"
DEFAULT_SPACE = SPACES / "vit_default.toml"
RANGE_FIELDS = {"low", "high", "log", "step"}


@dataclass
class Dim:
    """One searched key: `choices`, or a range low..high (int for integer keys), log or not, stepped or not."""

    key: str
    kind: str  # "choice", "int" or "float"
    choices: tuple = ()
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: float | None = None

    def suggest(self, trial):
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(
                self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log
            )
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)

    def describe(self) -> str:
        if self.kind == "choice":
            return f"{self.key} in {list(self.choices)}"
        scale = ", log" if self.log else (f", step {self.step:g}" if self.step else "")
        return f"{self.key} {self.kind} {self.low:g}..{self.high:g}{scale}"

    def as_dict(self) -> dict:
        return {
            "key": self.key,
            "kind": self.kind,
            "choices": list(self.choices),
            "low": self.low,
            "high": self.high,
            "log": self.log,
            "step": self.step,
        }


def resolve_space(path: str | None) -> Path:
    """A space file by path, or by name among the shipped ones (configs/search/NAME.toml); None = the default."""
    if not path:
        return DEFAULT_SPACE
    p = Path(path)
    for cand in (p, SPACES / p.name, SPACES / f"{p.name}.toml"):
        if cand.is_file():
            return cand
    raise ConfigError(f"search space file not found: {path}")


def load_space(path: str | Path | None) -> list[Dim]:
    """The space in a file (see the module doc); ConfigError (one line) on anything wrong."""
    src = resolve_space(str(path) if path else None)
    try:
        data = tomllib.loads(src.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{src}: not valid TOML ({e})") from None
    return parse_space(data, str(src))


def parse_space(data: dict, source: str = "space") -> list[Dim]:
    dims = []
    for sec, keys in data.items():
        if not isinstance(keys, dict):
            raise ConfigError(
                f"{source}: '{sec}' must be a table of keys ([section] then key = range or choices)"
            )
        for key, spec in keys.items():
            dims.append(parse_dim(f"{sec}.{key}", spec, source))
    if not dims:
        raise ConfigError(f"{source}: the space has no keys")
    return dims


def parse_dim(key: str, spec, source: str) -> Dim:
    """One key's range or choices, checked against the schema (the key exists, every value validates)."""
    typ = key_type(key, source)
    if isinstance(spec, list):
        spec = {"choices": spec}
    if not isinstance(spec, dict):
        raise ConfigError(
            f"{source}: {key} must be {{ low = .., high = .. }}, {{ choices = [..] }} or a list, "
            f"got {spec!r}"
        )
    if "choices" in spec:
        extra = set(spec) - {"choices"}
        if extra or not isinstance(spec["choices"], list) or not spec["choices"]:
            raise ConfigError(
                f"{source}: {key}: choices must be a non-empty list, alone "
                f"(got {', '.join(sorted(extra)) or repr(spec['choices'])})"
            )
        return Dim(
            key, "choice", choices=tuple(check_value(key, v, source) for v in spec["choices"])
        )
    unknown = set(spec) - RANGE_FIELDS
    if unknown or not {"low", "high"} <= set(spec):
        raise ConfigError(
            f"{source}: {key}: a range needs low and high (and optionally log, step); "
            f"got {', '.join(sorted(spec)) or 'nothing'}"
        )
    if typ not in (int, float):
        raise ConfigError(f"{source}: {key} is not a number: give choices = [..]")
    low, high = (check_value(key, spec[b], source) for b in ("low", "high"))
    log, step = spec.get("log", False), spec.get("step")
    if not isinstance(log, bool):
        raise ConfigError(f"{source}: {key}: log must be true or false, got {log!r}")
    if not low < high:
        raise ConfigError(f"{source}: {key}: low ({low}) must be below high ({high})")
    if log and (low <= 0 or step):
        raise ConfigError(f"{source}: {key}: a log range needs low > 0 and no step")
    if step is not None and (
        isinstance(step, bool)
        or not isinstance(step, (int, float))
        or step <= 0
        or (typ is int and step != int(step))
    ):
        raise ConfigError(
            f"{source}: {key}: step must be a positive {'integer' if typ is int else 'number'}, "
            f"got {step!r}"
        )
    return Dim(key, "int" if typ is int else "float", low=low, high=high, log=log, step=step)


def key_type(key: str, source: str) -> type:
    """The schema type of `section.key`; ConfigError naming the key (and the closest) if there is none."""
    sec, _, name = key.partition(".")
    section = getattr(Config(), sec, None) if sec in SECTIONS else None
    if section is None or name not in {f.name for f in fields(section)}:
        try:
            # the schema's own message: unknown section/key, did you mean
            set_value(Config(), key, None)
        except ConfigError as e:
            raise ConfigError(str(e).replace("config:", f"{source}:", 1)) from None
    return get_type_hints(type(section))[name]


def check_value(key: str, value, source: str):
    """`value` as the schema takes it for `key` (ConfigError naming the key if it does not)."""
    cfg = Config()
    sec, name = key.split(".")
    try:
        set_value(cfg, key, value)
    except ConfigError as e:
        raise ConfigError(str(e).replace("config:", f"{source}:", 1)) from None
    return getattr(getattr(cfg, sec), name)
