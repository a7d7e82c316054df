"""What a run ends with, on rank 0: the steps and tokens trained and in how long, the median speed,
the peak memory of every rank, the optimizer steps skipped, the checkpoints written and how to go on
from them or export them."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from trainer.distributed import gather_floats
from trainer.observe.measured_memory import peak_memory_gib


def duration(seconds: float) -> str:
    """42s, 12m05s, 3h02m."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def summary_lines(first: int, last: int, total_steps: int, tokens_per_step: int, wall_s: float,
                  speeds: list[tuple[float, float | None]], peaks: list[float], skipped: int,
                  checkpoints: list[tuple[int, Path]] | None, steady: bool = False) -> list[str]:
    """`first`..`last`: the steps this run trained; `speeds`: its logged (tokens/s, MFU); `peaks`:
    each rank's peak memory (GiB), over the steps after the first when `steady` (a GPU's allocator
    peak, not the CPU's peak RSS); `checkpoints`: those in the run's folder (None: checkpointing
    off)."""
    trained = last - first + 1
    median = (statistics.median(s for s, _ in speeds) if speeds
              else trained * tokens_per_step / wall_s)
    mfus = [m for _, m in speeds if m is not None]
    mfu = f"{100 * statistics.median(mfus):.1f}%" if mfus else "n/a"
    top = max(range(len(peaks)), key=peaks.__getitem__)
    memory = (f"{peaks[0]:.2f} GiB" if len(peaks) == 1 else
              f"{min(peaks):.2f}-{max(peaks):.2f} GiB a rank (rank {top} the most)")
    lines = [f"summary: trained steps {first}-{last} ({trained:,} steps, "
             f"{trained * tokens_per_step:,} tokens) in {duration(wall_s)}: median {median:,.0f} "
             f"tok/s, MFU {mfu}",
             "summary: peak memory "
             f"{memory}{f' from step {first + 1} on' if steady and trained > 1 else ''}; {skipped} "
             "optimizer step(s) skipped"]
    if checkpoints is None:
        lines.append("summary: no checkpoint written (checkpoint.enabled=false): these weights are "
                     "not kept")
    elif not checkpoints:
        lines.append("summary: no checkpoint saved yet")
    else:
        step, newest = checkpoints[-1]
        go_on = ("rerun the same command" if last < total_steps
                 else f"rerun with training.steps above {total_steps}")
        lines.append(f"summary: checkpoints {', '.join(p.name for _, p in checkpoints)} in "
                     f"{newest.parent}; to train on from step {step}: {go_on}; to export: python "
                     f"scripts/convert_hf.py to-hf {newest} OUT_DIR")
    return lines


def rank_peaks(device: torch.device, group) -> list[float]:
    """Every rank's peak memory (GiB) on rank 0, [] elsewhere (collective)."""
    return [row[0] for row in gather_floats([peak_memory_gib(device)], group)]
