"""Entry point: `torchrun --nproc_per_node=N train.py +recipe=NAME [overrides]` (see README)."""

import os
import sys

import hydra
from omegaconf import DictConfig

from trainer.config import CONFIG_DIR, register_configs
from trainer.errors import ConfigError
from trainer.overrides import check_overrides

register_configs()


def config_error(e: ConfigError) -> None:
    # Every rank finds the same error: the first of each node says it, so a user reads it once.
    if os.environ.get("LOCAL_RANK", "0") == "0":
        sys.stderr.write(f"config error: {e}\n")
        sys.stderr.flush()
    sys.exit(2)


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from trainer.train import run

    try:
        run(cfg)
    except ConfigError as e:
        config_error(e)
    except KeyboardInterrupt:
        # Ctrl-C before the step loop (which stops cleanly on it) began: nothing to save yet.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            sys.stderr.write("stopped (Ctrl-C) before training began; nothing was saved\n")
        sys.exit(130)


if __name__ == "__main__":
    try:
        check_overrides(sys.argv[1:])
    except ConfigError as e:
        config_error(e)
    main()
