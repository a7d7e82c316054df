"""Entry point: `torchrun --nproc_per_node=N train.py +recipe=NAME [overrides]` (see README)."""

import os
import signal
import sys
import time

import hydra
from omegaconf import DictConfig

from trainer.config_files import CONFIG_DIR, register_configs
from trainer.errors import ConfigError
from trainer.overrides import check_overrides

register_configs()


SPEAK_AFTER_S = 3  # how long a node's other ranks wait for its first rank to report an error


def config_error(e: ConfigError) -> None:
    # Most errors every rank finds: the first of each node says it at once, and the launcher stops
    # the others while they wait, so a user reads it once. An error only this rank found (its data
    # shard, say) it says itself once the wait is over. Exiting before the first rank has spoken
    # would let the launcher kill that rank first, and nobody would say anything.
    if os.environ.get("LOCAL_RANK", "0") != "0":
        for sig in (signal.SIGTERM, signal.SIGINT):  # the launcher's stop, or a Ctrl-C, ends the wait quietly
            signal.signal(sig, signal.SIG_DFL)
        time.sleep(SPEAK_AFTER_S)
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
