"""`trainer-run`: torchrun, with what its restarts and elastic membership need set, and the job's
config checked once before any rank starts. It takes torchrun's arguments
(`trainer-run --nnodes=1:4 --rdzv_backend=c10d ... train.py ...`).

torch 2.13's torchrun shares its agents' rendezvous store with the ranks unless
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. The trainer copes with a shared store across restarts (its
groups' keys carry the attempt), but torchrun's own agents do not: when a node joins a running
elastic job they fail in their own rendezvous before any rank starts (pytorch/pytorch#135712).
Users should not have to know the variable, so this sets it (a value already set is kept).

A config error found by the ranks reaches the user through torchrun, which follows it with its own
report of the failed ranks; found here first, it is one line and exit status 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from trainer.errors import ConfigError


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import main as torchrun

    argv = sys.argv[1:] if argv is None else argv
    args = get_args_parser().parse_args(argv)
    if Path(args.training_script).name == "train.py" and not (args.module or args.no_python):
        try:
            check_job_args(args.training_script_args, world_of(args.nproc_per_node, args.nnodes))
        except ConfigError as e:
            sys.stderr.write(f"config error: {e}\n")
            sys.exit(2)
    torchrun(argv)


def check_job_args(overrides: list[str], world: int | None) -> None:
    """The checks every rank would make first, on train.py's `overrides`; those that need the world
    size only when it is known before launch (not for an elastic range)."""
    if any(arg.startswith("-") for arg in overrides):
        return  # Hydra's own flags (--cfg job, --help): train.py prints, it does not run
    from trainer.models import import_modules
    from trainer.overrides import compose_job
    from trainer.rules import check_config

    job = compose_job(overrides)
    import_modules(job.imports)
    if world is not None:
        check_config(job, world)


def world_of(nproc_per_node: str, nnodes: str) -> int | None:
    """The ranks torchrun will start, when its arguments fix them (not `auto`, not MIN:MAX nodes)."""
    low, _, high = nnodes.partition(":")
    if not (nproc_per_node.isdigit() and low.isdigit() and high in ("", low)):
        return None
    return int(nproc_per_node) * int(low)


if __name__ == "__main__":
    main()
