"""Entry point: `torchrun --nproc_per_node=N train.py +recipe=NAME [overrides]` (see README)."""

import sys

import hydra
from omegaconf import DictConfig

from trainer.config import CONFIG_DIR, check_group_choices, register_configs
from trainer.errors import ConfigError

register_configs()


def config_error(e: ConfigError) -> None:
    # One write per line: ranks share the terminal, and a single short write is not interleaved.
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


if __name__ == "__main__":
    try:
        check_group_choices(sys.argv[1:])
    except ConfigError as e:
        config_error(e)
    main()
