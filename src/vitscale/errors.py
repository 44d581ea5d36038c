"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (config, data, files). Printed as one line, exit code 2."""


class DataError(UserError):
    """A dataset is missing, truncated or corrupt."""


class ConfigError(UserError):
    """A configuration that does not validate."""


class TrainingError(UserError):
    """Training stopped for a reason the user must act on (e.g. a NaN loss)."""
