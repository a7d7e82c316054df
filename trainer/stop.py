"""Stopping on a signal: SIGTERM or SIGUSR1 (what Slurm sends before a time limit or a preemption,
what torchrun forwards) and the first SIGINT (Ctrl-C) ask the job to stop after the current step,
saving it when checkpointing is on; a second SIGINT stops the process at once. The ranks agree on
the request once a step, on the host, so that every rank stops after the same step."""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist

from trainer.distributed import gloo_group

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    def __init__(self):
        self.received: int | None = None
        # Agreed on a gloo group (the default one when it is gloo), so that no step waits for the device.
        self.group = None if dist.get_backend() == "gloo" else gloo_group()
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            # Asked twice: stop now, as an interrupted process does, without a traceback.
            if os.environ.get("LOCAL_RANK", "0") == "0":
                sys.stderr.write("stopped at once (Ctrl-C twice); the step in progress was not saved\n")
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        if signum == signal.SIGINT and os.environ.get("LOCAL_RANK", "0") == "0" and self.received is None:
            sys.stderr.write("Ctrl-C: stopping after this step (press it again to stop at once)\n")
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
