"""User-facing errors: the CLI prints them as one line and exits with code 2."""

from __future__ import annotations

import difflib


class UserError(Exception):
    """Bad input from the user (config, data, files). Printed as one line, exit code 2."""


class DataError(UserError):
    """A dataset is missing, truncated or corrupt."""


class ConfigError(UserError):
    """A configuration that does not validate."""


class TrainingError(UserError):
    """Training stopped for a reason the user must act on (e.g. a NaN loss)."""


def did_you_mean(name: str, options) -> str:
    """' (did you mean 'X'?)' for the closest of `options`, '' when there are none."""
    m = difflib.get_close_matches(name, list(options), n=1, cutoff=0.0)
    return f" (did you mean '{m[0]}'?)" if m else ""


class SaveError(TrainingError):
    """A checkpoint could not be written (a full disk, a quota, a folder gone read-only): the same
    one line on every rank (the ranks agree on it), nothing half-written left behind."""
