"""Straggler detection. A job with collectives is as fast as its slowest rank, so every rank times
its own work each step, in three phases: `data` (the step's start until its batch is ready: host
wall time), `forward_backward` and `optimizer`. On a CPU those two are the process's CPU time, which
a rank waiting for another in a gloo collective does not spend: its own work, its waits left out. On
a GPU they are CUDA events on the compute stream, read only at the exchange (no synchronisation per
step); there a rank's waits inside NCCL collectives are counted in, so where ranks step in lockstep
(FSDP, TP) a slow GPU shows in its optimizer step, the work it does alone.

Every `metrics.health_every` steps, once `metrics.slow_rank_window` steps are timed, rank 0 gathers
each rank's median of the window per phase (three numbers a rank, one small gloo gather, nothing on
the device) and compares ranks that do the same work (those of one pipeline stage): a rank's
slowdown is the median rank's step plus this rank's excess in each phase, over the median rank's
step. Above `metrics.slow_rank_threshold` the rank is named, with its host and the phase of its
largest excess, once when it becomes slow and once when it is back; `metrics.jsonl` has
`slow_ranks` and `slowest_rank_ratio`."""

from __future__ import annotations

import math
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.distributed import gather_floats
from trainer.step_parts import StepPart

PHASES = ("data", "forward_backward", "optimizer")


@dataclass(frozen=True)
class SlowRank:
    rank: int
    host: str
    phase: str  # the phase of its largest excess over its peers' median
    ratio: float  # its step over the median rank's, were nobody waiting for anybody

    def as_record(self) -> dict:
        return {"rank": self.rank, "host": self.host, "phase": self.phase,
                "ratio": round(self.ratio, 3)}


def slowdowns(figures: list[list[float]], stages: list[int]) -> list[tuple[float, str]]:
    """Per rank, (its slowdown, the phase of its largest excess) from each rank's phase seconds,
    against the ranks of its stage. The lower median: with two peers, the faster one is the measure.
    A rank without figures (NaN) is 1.0 and no one's peer."""
    known = [all(math.isfinite(x) for x in own) for own in figures]
    result = []
    for rank, own in enumerate(figures):
        peers = [figures[r] for r, stage in enumerate(stages) if stage == stages[rank] and known[r]]
        if not known[rank]:
            result.append((1.0, PHASES[0]))
            continue
        medians = [statistics.median_low(p[i] for p in peers) for i in range(len(PHASES))]
        step = sum(medians)  # the median rank's step
        excess = [max(0.0, own[i] - medians[i]) for i in range(len(PHASES))]
        worst = max(range(len(PHASES)), key=lambda i: excess[i])
        result.append(((step + sum(excess)) / step if step > 0 else 1.0, PHASES[worst]))
    return result


class PhaseClock:
    """This rank's forward-backward and optimizer time of a step: CPU time here, or CUDA events."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.process_time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def done(self, mark) -> bool:
        """Whether the device has passed `mark` (the host runs ahead of a GPU)."""
        return not self.cuda or mark.query()

    def seconds(self, start, end) -> float:
        """Between two marks the device has passed (`done`)."""
        return start.elapsed_time(end) / 1000 if self.cuda else end - start


class RankHealth(StepPart):
    def __init__(self, every: int, window: int, threshold: float, device: torch.device, stage: int,
                 group, log: Callable[[str], None]):
        self.every, self.threshold, self.group, self.log = every, threshold, group, log
        self.clock = PhaseClock(device)
        self.steps: deque = deque(maxlen=window)  # (step, data seconds, four marks)
        self.rank = dist.get_rank()
        # Who is where, once (rank 0 names ranks by host and compares each with its stage's).
        where = [None] * dist.get_world_size()
        dist.all_gather_object(where, (socket.gethostname(), stage), group=group)
        self.hosts, self.stages = [h for h, _ in where], [s for _, s in where]
        self.slow: dict[int, SlowRank] = {}
        self.ratio: float | None = None
        self.exchange_ms: float | None = None

    def start_step(self, step: int) -> None:
        self.started = time.perf_counter()

    def before_forward(self, step: int) -> None:
        self.data_s = time.perf_counter() - self.started
        self.marks = [self.clock.mark()]

    def after_backward(self, step: int) -> None:
        self.marks.append(self.clock.mark())

    def before_optimizer_step(self, step: int, skipped: torch.Tensor, microbatches: int) -> None:
        self.marks.append(self.clock.mark())

    def after_step(self, step: int) -> None:
        self.marks.append(self.clock.mark())
        self.steps.append((step, self.data_s, self.marks))
        if step % self.every == 0 and len(self.steps) == self.steps.maxlen:
            self.exchange()

    def own_figures(self) -> list[float]:
        """This rank's median over the window of each phase, in seconds: of the steps the device has
        finished (on a GPU, the newest may be in flight: they are left out rather than waited
        for)."""
        done = [entry for entry in self.steps if self.clock.done(entry[2][3])]
        if not done:  # nothing to say this time (NaN: left out of the comparison)
            return [math.nan] * len(PHASES)
        seconds = self.clock.seconds
        rows = [(data, seconds(m[0], m[1]), seconds(m[2], m[3])) for _, data, m in done]
        return [statistics.median(row[i] for row in rows) for i in range(len(PHASES))]

    def exchange(self) -> None:
        """Collective (a gloo gather to rank 0): every rank's figures; rank 0 judges and says."""
        started = time.perf_counter()
        figures = gather_floats(self.own_figures(), self.group)
        self.exchange_ms = (time.perf_counter() - started) * 1000
        if self.rank == 0:
            self.judge(figures)

    def judge(self, figures: list[list[float]]) -> None:
        first, last = self.steps[0][0], self.steps[-1][0]
        verdicts = slowdowns(figures, self.stages)
        self.ratio = max(ratio for ratio, _ in verdicts)
        slow = {rank: SlowRank(rank, self.hosts[rank], phase, ratio)
                for rank, (ratio, phase) in enumerate(verdicts) if ratio > self.threshold}
        for rank, s in slow.items():
            if rank not in self.slow:
                seconds = figures[rank][PHASES.index(s.phase)]
                self.log(f"health: rank {rank} on {s.host} is slow: its step {s.ratio:.2f}x the "
                         f"median rank's over steps {first}-{last}, most in {s.phase} "
                         f"({seconds * 1000:.1f} ms a step)")
        for rank in self.slow.keys() - slow.keys():
            self.log(f"health: rank {rank} on {self.hosts[rank]} is back within {self.threshold}x "
                     f"of the median (steps {first}-{last})")
        self.slow = slow

    def record(self) -> dict:
        if self.rank != 0 or self.ratio is None:
            return {}
        return {"slow_ranks": [s.as_record() for s in self.slow.values()],
                "slowest_rank_ratio": round(self.ratio, 3),
                "health_exchange_ms": round(self.exchange_ms, 3)}
