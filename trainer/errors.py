class ConfigError(ValueError):
    """A user mistake in the configuration: printed as one `config error:` line, no traceback."""
