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

Signals: torchrun runs in a session of its own, so a Ctrl-C at the terminal reaches this process
alone. The first Ctrl-C (or SIGTERM, SIGUSR1) goes to the ranks, which finish their step, save it
and exit 0, and so does torchrun; torchrun itself, signalled, would stop its ranks within its
shutdown timeout and exit 1 with a traceback, so it starts with those three signals ignored (and
handling only SIGHUP and SIGQUIT: its --signals-to-handle): a signal sent to every process of the
job reaches the ranks directly and from here, and ends the job as one Ctrl-C does. A second Ctrl-C
stops everything at once: torchrun first (so it restarts nothing), then the ranks; exit status 130.
One within SAME_SIGNAL_S of the first is the first again, here as in the ranks, which finish their
step and its save: the job exits as it would after one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer.errors import ConfigError
from trainer.run.stop import SAME_SIGNAL_S, on_parent_death

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # (trainer.run.stop's)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.run import get_args_parser

    argv = sys.argv[1:] if argv is None else argv
    args = get_args_parser().parse_args(argv)
    if Path(args.training_script).name == "train.py" and not (args.module or args.no_python):
        try:
            local = int(args.nproc_per_node) if args.nproc_per_node.isdigit() else 1
            check_job_args(args.training_script_args, world_of(args.nproc_per_node, args.nnodes),
                           local, one_node=args.nnodes in ("1", "1:1"))
        except ConfigError as e:
            sys.stderr.write(f"config error: {e}\n")
            sys.exit(2)
    sys.exit(run_torchrun(argv))


def run_torchrun(argv: list[str]) -> int:
    """torchrun with `argv` in a session of its own, the signals this process gets passed to its
    ranks; torchrun's exit status, or 130 after a second Ctrl-C."""
    # torchrun's --signals-to-handle (PET_ is its flags'
    # environment prefix; older torch reads the second)
    env = {**os.environ, "PET_SIGNALS_TO_HANDLE": "SIGHUP,SIGQUIT",
           "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGHUP,SIGQUIT"}
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv],
                             start_new_session=True, preexec_fn=_agent_signals, env=env)
    interrupts, first_interrupt = 0, None

    def forward(signum, frame) -> None:
        nonlocal interrupts, first_interrupt
        if signum == signal.SIGINT:
            if first_interrupt is not None and time.monotonic() - first_interrupt < SAME_SIGNAL_S:
                return  # the first again, as the ranks take it: they finish the step and its save
            first_interrupt = first_interrupt or time.monotonic()
            interrupts += 1
        ranks = children(agent.pid)
        if interrupts >= 2 or not ranks:  # at once (or no rank yet): torchrun first, then its ranks
            _signal(agent.pid, signal.SIGKILL if ranks else signal.SIGHUP)
        for pid in ranks:
            _signal(pid, signum)
        if interrupts >= 2:
            _wait_gone(ranks, timeout=10.0)
            os._exit(130)

    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
    return agent.wait()


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc; elsewhere none are found)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _agent_signals() -> None:
    """In torchrun's process, before it starts: the stop signals ignored (this process passes them
    to the ranks, which take them again: trainer.run.stop.default_signals), and SIGHUP when this
    process dies, however it dies (Linux's prctl; elsewhere nothing), so torchrun stops its ranks
    rather than outliving its launcher."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    on_parent_death(signal.SIGHUP)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # gone meanwhile
        pass


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.1)


def check_job_args(overrides: list[str], world: int | None, local_ranks: int = 1,
                   one_node: bool = False) -> None:
    """The checks every rank would make first, on train.py's `overrides`; those that need the world
    size only when it is known before launch (not for an elastic range). Under parallel=auto, the
    layout every rank would choose (`local_ranks` of them on each node), and its checks. Then the
    output folder's and the resumed checkpoint's (trainer.run.prelaunch); whether another job
    holds output_dir only on `one_node`: of a job on several, a node that starts late would find
    the folder held by this job's own first rank. Then the data's (its files read, tokenized into
    the cache the ranks read)."""
    if any(arg.startswith("-") for arg in overrides):
        return  # Hydra's own flags (--cfg job, --help): train.py prints, it does not run
    from trainer.checks.job import check_config
    from trainer.checks.overrides import compose
    from trainer.run.job import check_data, in_own_process, job_and_config, read_first
    from trainer.run.prelaunch import check_output

    job, config = job_and_config(compose(overrides))
    if world is not None:
        # in a process of its own: a GPU's figures would start CUDA in this long-lived one
        if job.parallel.auto:
            from trainer.plan.search import apply_overrides

            job = apply_overrides(job, in_own_process(_auto_layout, job, world, local_ranks,
                                                      overrides))
        check_config(job, world)
    check_output(job, config, before_launch=one_node)
    if read_first(job):
        in_own_process(check_data, job)


def _auto_layout(job, world: int, local_ranks: int, overrides: list[str]) -> dict:
    """The overrides of the layout parallel=auto's ranks will choose."""
    from trainer.distributed import resolve_device
    from trainer.plan.auto import auto_device, choose_layout, pinned_keys

    device = auto_device(resolve_device(job.device), local_ranks, job.plan.device)
    return choose_layout(job, world, device, pinned_keys(overrides))[1]


def world_of(nproc_per_node: str, nnodes: str) -> int | None:
    """The ranks torchrun will start, when its arguments fix them (not `auto`, not MIN:MAX
    nodes)."""
    low, _, high = nnodes.partition(":")
    if not (nproc_per_node.isdigit() and low.isdigit() and high in ("", low)):
        return None
    return int(nproc_per_node) * int(low)


if __name__ == "__main__":
    main()
