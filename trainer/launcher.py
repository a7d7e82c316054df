"""`trainer-run`: torchrun, with what its restarts and elastic membership need set. It takes
torchrun's arguments (`trainer-run --nnodes=1:4 --rdzv_backend=c10d ... train.py ...`).

torch 2.13's torchrun shares its agents' rendezvous store with the ranks unless
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. The trainer copes with a shared store across restarts (its
groups' keys carry the attempt), but torchrun's own agents do not: when a node joins a running
elastic job they fail in their own rendezvous before any rank starts (pytorch/pytorch#135712).
Users should not have to know the variable, so this sets it (a value already set is kept).
"""

from __future__ import annotations

import os


def main() -> None:
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
