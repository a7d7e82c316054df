"""`python tests/launch.py N train.py-overrides...`: train.py on N local ranks, forked from one
process.

What torchrun does for a local job, less its cost on this suite's two cores: torchrun's own start
(~2 s importing torch before any rank exists) and every rank importing torch and the trainer (~3 s
each, so ~6 s of a 4-rank run). Here the trainer is imported once and the ranks are forked from it,
with the environment torchrun gives them. If a rank fails, the others are killed and the launcher
exits with that rank's status, as torchrun does. Tests of launching itself (restarts, signals,
Slurm) still use torchrun.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "train.py")


def _rank(rank: int, nproc: int, port: int, overrides: list[str]) -> int:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
    )
    return run_script(TRAIN, overrides)


def run_script(script: str, args: list[str]) -> int:
    """`python script args...` in this process (torch imported already): its exit status."""
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).parent)  # as python sets it for a script
    # torch read it at import, in the warm launcher with that one's value
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main(nproc: int, overrides: list[str]) -> int:
    sys.path.insert(0, str(REPO))
    import trainer.run.job  # noqa: F401  (the import the ranks share)
    from trainer.distributed import _free_port

    port = _free_port()
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os._exit(_rank(rank, nproc, port, overrides))
        ranks[pid] = rank
    status = 0
    while ranks:
        pid, wait_status = os.wait()
        rank, code = ranks.pop(pid), os.waitstatus_to_exitcode(wait_status)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            sys.stderr.write(f"launch: rank {rank} exited with {code}; stopping the other ranks\n")
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    return status


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
