"""Throughput, MFU and memory figures, written to metrics.jsonl and the console."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from trainer.hardware import cuda_peak_tflops, measure_cpu_tflops
from trainer.models import family
from trainer.observe.summary import duration
from trainer.safe_write import move_aside


def flops_per_token(model, seq_len: int, frozen_base: bool = False) -> float:
    """Training FLOPs per token of the model config `model` (its family's count). With a frozen base
    (LoRA) no weight's gradient is computed: its matmuls are 4 FLOPs a weight and token, not 6 (the
    adapters' own, a rank's worth, left out)."""
    counted = family(model.family).costs.flops(model, seq_len)
    return counted.total - ((counted.blocks + counted.head) / 3 if frozen_base else 0.0)


def peak_tflops(device: torch.device, setting) -> float | None:
    """Peak TFLOP/s of one device: the user's number, a timed matmul ("auto" on the CPU), the CUDA
    table, or None (with a warning for a CUDA device the table does not name)."""
    if isinstance(setting, (int, float)):
        return float(setting)
    if device.type == "cuda":
        return cuda_peak_tflops(torch.cuda.get_device_name(device))
    if setting == "auto":
        return measure_cpu_tflops()
    return None


class Throughput:
    """Tokens per second and MFU of the whole job over the steps since `reset`."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak_tflops: float | None,
                 world_size: int, step: int, final_step: int):
        self.tokens_per_step, self.flops = tokens_per_step, flops_per_token
        self.peak, self.world_size = peak_tflops, world_size
        self.final_step = final_step  # the time left is counted to it
        self.start = time.perf_counter()
        self.reset(step)

    def reset(self, step: int) -> None:
        self.last_step, self.last_time = step, time.perf_counter()

    def report(self, step: int) -> dict:
        now = time.perf_counter()
        tokens_per_s = self.tokens_per_step * (step - self.last_step) / (now - self.last_time)
        mfu = (None if self.peak is None
               else tokens_per_s * self.flops / (self.peak * 1e12 * self.world_size))
        # The time left, at the rate since the last report.
        eta = (self.final_step - step) * (now - self.last_time) / (step - self.last_step)
        return {"tokens_per_s": tokens_per_s, "mfu": mfu, "elapsed_s": now - self.start,
                "eta_s": eta}


class MetricsLogger:
    """Rank 0's record of training: one JSON line and one console line per logged step."""

    def __init__(self, output_dir: str, enabled: bool, wandb_cfg=None, config: dict | None = None,
                 start_step: int | None = 0, tensorboard: bool = False):
        """A run resumed at `start_step` keeps the file's rows up to it (each step is in the file
        once), and TensorBoard hides its later steps; a fresh run into a folder that has one moves
        it aside. None: the step is not known yet (a replica group's, until its first quorum):
        `begin(step)` says it."""
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        # this run's logged tokens/s and MFU, for its summary
        self.speeds: list[tuple[float, float | None]] = []
        self.tensorboard = Path(output_dir) / "tensorboard" if enabled and tensorboard else None
        self.writer = None
        if start_step is not None:
            self.begin(start_step)
        self.wandb = None
        if enabled and wandb_cfg is not None and wandb_cfg.enabled:
            import wandb

            self.wandb = wandb.init(
                project=wandb_cfg.project, mode=wandb_cfg.mode, dir=output_dir, config=config,
                reinit="finish_previous"
            )

    def begin(self, step: int) -> None:
        if self.enabled and self.path.exists():
            self._keep_until(step)
        if self.tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            # an earlier run's curves, kept aside
            if step == 0 and any(self.tensorboard.glob("events.*")):
                _move_aside(self.tensorboard, "events")
            # A resumed run's events after its step (written before it stopped) are purged from the
            # curves: each step shows once.
            self.writer = SummaryWriter(str(self.tensorboard),
                                        purge_step=step + 1 if step else None)

    def _keep_until(self, step: int) -> None:
        if step == 0:
            _move_aside(self.path, "rows")
            return
        rows = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in rows if _step_of(line) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(self.path)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.speeds.append((record["tokens_per_s"], record["mfu"]))
        if self.writer is not None:
            for key, value in record.items():
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if key not in ("step", "time") and number:
                    self.writer.add_scalar(key, value, record["step"], walltime=record["time"])
            self.writer.flush()
        print(format_record(record), flush=True)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if v is not None and k != "step"},
                           step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.writer is not None:
            self.writer.close()


def _move_aside(path: Path, what: str) -> None:
    """Renames an earlier run's `path` beside itself (NAME.before-DATE), saying so."""
    aside = move_aside(path, "before")
    print(f"metrics: {path} held an earlier run's {what}; moved it to {aside.name}", flush=True)


def _step_of(line: str) -> float:
    """The step of a metrics.jsonl row; infinite for a line cut short by a killed job (dropped)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def format_record(r: dict) -> str:
    mfu = "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
    parts = [
        f"step {r['step']:>5}",
        f"loss {r['loss']:.4f}",
        f"grad_norm {r['grad_norm']:.3f}",
        f"lr {r['lr']:.2e}",
        f"{r['tokens_per_s']:,.0f} tok/s",
        f"mfu {mfu}",
        f"mem {r['mem_gib']:.2f} GiB",
        f"{r['elapsed_s']:.1f}s",
    ]
    if "eta_s" in r:
        parts.append(f"{duration(r['eta_s'])} left")
    if "val_loss" in r:
        parts.insert(2, f"val_loss {r['val_loss']:.4f}")
    if "aux_loss" in r:
        experts = f"{r['expert_load_min']:,.0f}-{r['expert_load_max']:,.0f}"
        parts.insert(-3, f"aux {r['aux_loss']:.3f} | experts {experts} tok")
    return " | ".join(parts)
