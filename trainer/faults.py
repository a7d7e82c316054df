"""Faults injected on purpose, for the tests that check the trainer survives them. Set
TRAINER_FAULTS to a comma-separated list of KIND@STEP (every rank) or KIND@STEP:RANK:

    nan_grad@5        after step 5's backward, a gradient of the rank is NaN (default rank 0)
    garbage_batch@12  step 12 trains on scrambled tokens (every rank): a loss spike

Unset (the normal case), nothing is injected and nothing is checked but a dictionary lookup.
"""

from __future__ import annotations

import os

import torch

from trainer.errors import ConfigError
from trainer.steps import local_tensor

KINDS = {"nan_grad", "garbage_batch"}


class Faults:
    def __init__(self, spec: str, rank: int):
        self.steps: dict[str, set[int]] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, where = item.partition("@")
            step, _, on_rank = where.partition(":")
            if kind not in KINDS or not step.isdigit() or not (on_rank == "" or on_rank.isdigit()):
                raise ConfigError(f"TRAINER_FAULTS={spec}: {item} is not KIND@STEP[:RANK] with KIND in {sorted(KINDS)}")
            default_rank = 0 if kind == "nan_grad" else rank
            if int(on_rank or default_rank) == rank:
                self.steps.setdefault(kind, set()).add(int(step))

    @classmethod
    def from_env(cls, rank: int) -> Faults:
        return cls(os.environ.get("TRAINER_FAULTS", ""), rank)

    def at(self, kind: str, step: int) -> bool:
        """Whether to inject `kind` at `step`: once (a step run again after a rollback runs clean)."""
        steps = self.steps.get(kind, set())
        if step in steps:
            steps.discard(step)
            return True
        return False

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
        """The step's microbatches with every token id scrambled (an affine map modulo the vocabulary):
        text the model cannot predict, made from each sequence alone, so the same in every layout."""
        return [((inputs * 40503 + 12345) % vocab_size, (labels * 40503 + 12345) % vocab_size)
                for inputs, labels in batches]
