import difflib


class ConfigError(ValueError):
    """A user mistake in the configuration: printed as one `config error:` line, no traceback."""


class TrainingStopped(RuntimeError):
    """Training cannot go on: printed as one `training stopped:` line on every rank; nothing more is
    saved."""


def unknown_choice(group: str, name: str, known: list[str]) -> ConfigError:
    """`group=name is not a known group`, with the nearest known name where one is close (a
    misspelling), else every one."""
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    given = "+recipe" if group == "recipe" else group  # (a recipe is added to the defaults)
    hint = f"did you mean {given}={near[0]}?" if near else f"choose one of {known}"
    return ConfigError(f"{group}={name} is not a known {group}; {hint}")
