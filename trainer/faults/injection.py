"""Faults injected on purpose, for the tests that check the trainer survives them. Set
TRAINER_FAULTS to a comma-separated list of KIND@STEP or KIND@STEP:RANK (default: rank 0):

    nan_grad@5        after step 5's backward, a gradient of the rank is NaN
    garbage_batch@12  step 12 trains on scrambled tokens (every rank unless one is named): a loss
                      spike
    hang@4:1          rank 1 sleeps at the start of step 4's forward, while the others wait for it
    pause@10          rank 0 waits at the start of step 10's forward until the job is asked to stop
                      (a signal: a preemption, a node joining an elastic job; at most 10 minutes),
                      then trains the step, which the job saves
    kill@6:1          rank 1 is killed (SIGKILL) after step 6's backward, before the optimizer step
    kill_save@4:1     rank 1 is killed while step 4's checkpoint is being saved: its shards written,
                      the checkpoint not yet published
    slow@20:2         from step 20 on, rank 2 computes at half speed: before each forward it keeps
                      the CPU busy for as long as its last forward and backward took (a slow device)
    slow_data@20:1    from step 20 on, rank 1's batches come late by as long as its last forward and
                      backward took (a slow filesystem)

Each fault but the slowdowns fires once per job: a file under output_dir/faults records it, so that
a job restarted by its launcher, or a step run again after a rollback, runs clean.
`FaultInjection` is a step part (`start_step`, `before_forward`, `after_backward`) that also gives
the data its `corrupt` and the checkpointer its `kill_save`; unset (the normal case), the loop holds
no such part and nothing is injected.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from trainer.errors import ConfigError
from trainer.models.head import IGNORE_INDEX
from trainer.step_parts import StepPart
from trainer.tensors import local_tensor

KINDS = {"nan_grad", "garbage_batch", "hang", "pause", "kill", "kill_save", "slow", "slow_data"}
PAUSE_S = 600  # the longest a `pause` waits for the stop


class FaultInjection(StepPart):
    def __init__(self, spec: str, rank: int, output_dir: str, parameters=(), stop=None):
        # stop: the run's StopRequest, what a `pause` waits for
        self.rank, self.fired, self.parameters, self.stop = (rank, Path(output_dir, "faults"),
                                                             parameters, stop)
        self.steps: dict[str, set[int]] = {}
        # this rank's last forward and backward, CPU seconds (what `slow` adds again)
        self.compute_s = 0.0
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, where = item.partition("@")
            step, _, on_rank = where.partition(":")
            if kind not in KINDS or not step.isdigit() or not (on_rank == "" or on_rank.isdigit()):
                raise ConfigError(f"TRAINER_FAULTS={spec}: {item} is not KIND@STEP[:RANK] with "
                                  f"KIND in {sorted(KINDS)}")
            default_rank = rank if kind == "garbage_batch" else 0
            if int(on_rank or default_rank) == rank:
                self.steps.setdefault(kind, set()).add(int(step))

    @classmethod
    def from_env(cls, rank: int, output_dir: str, parameters, stop) -> FaultInjection | None:
        """The faults TRAINER_FAULTS asks of this rank; None when it is unset."""
        spec = os.environ.get("TRAINER_FAULTS", "")
        return cls(spec, rank, output_dir, parameters, stop) if spec else None

    def at(self, kind: str, step: int) -> bool:
        """Whether to inject `kind` at `step`: the first time this job gets there."""
        steps = self.steps.get(kind, set())
        if step not in steps:
            return False
        steps.discard(step)
        marker = self.fired / f"{kind}@{step}.rank{self.rank}"
        if marker.exists():
            return False
        self.fired.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return True

    def hang_or_kill(self, kind: str, step: int) -> None:
        """Sleeps for good (`hang`) or kills this process (`kill`, `kill_save`) if due at `step`."""
        if self.at(kind, step):
            if kind == "hang":
                while True:
                    time.sleep(3600)
            os.kill(os.getpid(), signal.SIGKILL)

    def slowed(self, kind: str, step: int) -> bool:
        """Whether a slowdown of `kind` holds at `step` (from its step on, every time)."""
        return any(step >= start for start in self.steps.get(kind, ()))

    def start_step(self, step: int) -> None:
        if self.slowed("slow_data", step):
            time.sleep(self.compute_s)

    def before_forward(self, step: int) -> None:
        self.hang_or_kill("hang", step)
        if self.at("pause", step):
            deadline = time.monotonic() + PAUSE_S
            while self.stop.received is None and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.slowed("slow", step):
            end = time.process_time() + self.compute_s
            while time.process_time() < end:  # busy, as a slow device's rank is: its CPU time grows
                pass
        self.forward_started = time.process_time()

    def after_backward(self, step: int) -> None:
        self.compute_s = time.process_time() - self.forward_started
        self.hang_or_kill("kill", step)
        if self.at("nan_grad", step):
            self.poison(self.parameters)

    def corrupt(self, step: int, batches: list, vocab_size: int) -> list:
        """The step's batches, scrambled if `garbage_batch` is due."""
        return self.garbage(batches, vocab_size) if self.at("garbage_batch", step) else batches

    @staticmethod
    @torch.no_grad()
    def poison(parameters) -> None:
        """Sets one element of this rank's first local gradient to NaN."""
        for p in parameters:
            if p.grad is not None:
                grad = local_tensor(p.grad)
                if grad.numel():
                    grad.view(-1)[0] = float("nan")
                    return

    @staticmethod
    def garbage(batches: list, vocab_size: int) -> list:
        """The step's microbatches with every token id scrambled (an affine map modulo the
        vocabulary): text the model cannot predict, made from each sequence alone, so the same in
        every layout."""
        def scrambled(ids):
            return torch.where(ids == IGNORE_INDEX, ids, (ids * 40503 + 12345) % vocab_size)

        return [(scrambled(inputs), scrambled(labels), *rest) for inputs, labels, *rest in batches]
