"""Stopping on a signal: SIGTERM or SIGUSR1 (what Slurm sends before a time limit or a preemption,
what torchrun forwards) and the first SIGINT (Ctrl-C) ask the job to stop after the current step,
saving it when checkpointing is on; a second SIGINT stops the process at once. A SIGINT within
SAME_SIGNAL_S of the first is that one again: a signal sent to every process of the job (`pkill
-INT`, a scheduler signalling every task) reaches each rank directly and once more from its
launcher, and must stop the job once, after the step, like one Ctrl-C. The ranks agree on the
request once a step, on the host, so that every rank stops after the same step."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from trainer.distributed import gloo_group

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# A launcher forwards a signal within milliseconds (seconds on a loaded box); a person pressing
# Ctrl-C again to stop at once takes longer.
SAME_SIGNAL_S = 2.0


class StopRequest:
    def __init__(self):
        self.received: int | None = None
        self.first_interrupt: float | None = None  # when the first SIGINT came (time.monotonic)
        # Agreed on a gloo group (the default one when it
        # is gloo), so that no step waits for the device.
        self.group = None if dist.get_backend() == "gloo" else gloo_group()
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.first_interrupt is not None:
            if time.monotonic() - self.first_interrupt < SAME_SIGNAL_S:
                return  # the same SIGINT, forwarded by the launcher
            # Asked twice: stop now, as an interrupted process does, without a traceback.
            if os.environ.get("LOCAL_RANK", "0") == "0":
                sys.stderr.write("stopped at once (Ctrl-C twice); the step in progress was not "
                                 "saved\n")
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        if signum == signal.SIGINT:
            self.first_interrupt = time.monotonic()
            if os.environ.get("LOCAL_RANK", "0") == "0" and self.received is None:
                sys.stderr.write("Ctrl-C: stopping after this step (press it again to stop at "
                                 "once)\n")
        self.received = self.received or signum

    def agreed(self) -> bool:
        """Collective: whether any rank was asked to stop."""
        flag = torch.tensor([self.received is not None], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def close(self) -> None:
        # The handlers stay: a Ctrl-C while the job winds down still stops it without a traceback.
        if self.group is not None:
            dist.destroy_process_group(self.group)


def default_signals() -> None:
    """The stop signals as a process starts without a launcher: trainer-run starts torchrun with
    them ignored, which its ranks inherit; until StopRequest takes them, a Ctrl-C raises
    KeyboardInterrupt and SIGTERM or SIGUSR1 ends the process, as under plain torchrun."""
    for sig in SIGNALS:
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig,
                          signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def on_parent_death(signum: int) -> None:
    """`signum` to this process the moment its parent dies, however it dies (Linux's prctl;
    elsewhere nothing)."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signum)  # PR_SET_PDEATHSIG


def die_with_launcher() -> None:
    """Under torchrun, this rank is killed when its agent dies: torchrun starts each rank in a
    session of its own, so a SIGKILL of the launcher's process group (or an out-of-memory kill of
    torchrun) would leave the ranks training with nobody watching, holding the output folder. The
    kernel drops the folder's lock (flock) with the process, and a save it cut short is a .tmp
    folder the next run of the job clears; what the ranks trained since the last save is lost, as
    when torchrun itself stops them."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    on_parent_death(signal.SIGKILL)
    if parent == 1 or not os.path.exists(f"/proc/{parent}"):  # gone before the line above
        os._exit(1)
