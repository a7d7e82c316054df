class ConfigError(ValueError):
    """A user mistake in the configuration: printed as one `config error:` line, no traceback."""


class TrainingStopped(RuntimeError):
    """Training cannot go on: printed as one `training stopped:` line on every rank; nothing more is
    saved."""
