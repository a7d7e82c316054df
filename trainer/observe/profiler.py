"""One optimizer step under torch's profiler, on every rank (`metrics.profile_step`).

Each rank writes `output_dir/profile/rank_R.json`, a Chrome trace (chrome://tracing or
https://ui.perfetto.dev), and `rank_R.txt`, its ops by self time: where the step's time went,
collectives and their waits included. Side by side, the two ranks of a slow collective tell
which of them arrived late.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from trainer.step_parts import StepPart


class StepProfiler(StepPart):
    def __init__(self, step: int | None, output_dir: str, rank: int, device: torch.device):
        self.step, self.rank = step, rank
        self.folder = Path(output_dir) / "profile"
        self.cuda = device.type == "cuda"
        self.running: profile | None = None

    def start_step(self, step: int) -> None:
        """Called as `step` starts."""
        if step == self.step:
            activities = ([ProfilerActivity.CPU, ProfilerActivity.CUDA] if self.cuda
                          else [ProfilerActivity.CPU])
            self.running = profile(activities=activities, record_shapes=True)
            self.running.start()

    def after_step(self, step: int) -> None:
        """Called once `step`'s optimizer update is done: writes what was recorded."""
        if self.running is None:  # begun at this step, or not at all
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.running.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.running.export_chrome_trace(str(self.folder / f"rank_{self.rank}.json"))
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = self.running.key_averages().table(sort_by=sort, row_limit=60,
                                                  max_name_column_width=70)
        (self.folder / f"rank_{self.rank}.txt").write_text(f"step {step}, rank "
                                                           f"{self.rank}\n{table}\n")
        self.running = None
