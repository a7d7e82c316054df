"""Entry point: `torchrun --nproc_per_node=N train.py +recipe=NAME [overrides]` (see README)."""

import hashlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from trainer.checks.overrides import check_overrides, compose_job, renamed
from trainer.config.files import CONFIG_DIR, register_configs
from trainer.errors import ConfigError
from trainer.run.stop import default_signals, die_with_launcher

register_configs()


def config_error(e: ConfigError) -> None:
    """Says `e` in one line, once per node however many of its ranks find it, and exits 2."""
    line = f"config error: {e}\n"
    if first_to_say(line):
        sys.stderr.write(line)
        sys.stderr.flush()
    else:  # another rank of this node has said it: wait for the launcher's stop, quietly
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        time.sleep(1)
    sys.exit(2)


def first_to_say(line: str) -> bool:
    """Whether this rank is the first of its node's ranks (of this launch and restart) to say
    `line`: the first creates a file named after it in a folder they share (torchrun's folder for
    this attempt, else the temporary folder). A line only one rank finds (its data shard, say) is
    its own."""
    if "LOCAL_RANK" not in os.environ:
        return True
    digest = hashlib.sha256(line.encode()).hexdigest()[:16]
    # <attempt folder>/<local rank>/error.json
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        marker = Path(error_file).parent.parent / f"said-{digest}"
    else:
        marker = Path(tempfile.gettempdir()) / f"trainer-said-{os.getppid()}-{digest}"
        forget_old_markers(marker.parent)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # no folder to share: every rank says it
        pass
    return True


def forget_old_markers(folder: Path, age_s: float = 600) -> None:
    """Removes the markers of launches long over (torchrun's own folder goes with its attempt; the
    temporary folder's markers would stay)."""
    now = time.time()
    for old in folder.glob("trainer-said-*"):
        try:
            if now - old.stat().st_mtime > age_s:
                old.unlink()
        except OSError:  # another rank removed it first
            pass


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from trainer.run.job import run

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
    default_signals()
    die_with_launcher()
    sys.argv[1:], notices = renamed(sys.argv[1:])
    if notices and os.environ.get("LOCAL_RANK", "0") == "0":
        print("\n".join(notices), flush=True)
    try:
        # Hydra's flags (--cfg job) print, they do not run
        if any(arg.startswith("-") for arg in sys.argv[1:]):
            check_overrides(sys.argv[1:])
        else:
            # the overrides checked, every file parsed, every value of its type
            compose_job(sys.argv[1:])
    except ConfigError as e:
        config_error(e)
    main()
