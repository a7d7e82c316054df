"""torchao, imported quietly: on import it logs a warning for each of its CUDA kernels' libraries
that does not load (on a CPU box, every one), and torch's pytree one for each of its Enum
constants; neither is anything a user can act on, and both came with every run of float8 or
QLoRA."""

from __future__ import annotations

import importlib
import logging

NOISY = ("torchao", "torch.utils._pytree")


def import_torchao(module: str):
    """`module` (torchao or one of its modules), imported with those loggers at ERROR."""
    loggers = [logging.getLogger(name) for name in NOISY]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        importlib.import_module("torchao")  # first: a missing torchao stops here
        return importlib.import_module(module)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
