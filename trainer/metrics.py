"""Throughput, MFU and memory figures, written to metrics.jsonl and the console (SPEC §6)."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch

# Dense bf16 peak per device in TFLOP/s, by a substring of torch.cuda.get_device_name().
CUDA_PEAK_TFLOPS = {
    "B200": 2250.0,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "RTX 4090": 165.0,
    "V100": 125.0,
}


def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight that multiplies (all but the embedding lookup) plus
    attention's score and value products (12 * layers * dim * seq_len; causal masking not discounted)."""
    head_dim = model.dim // model.n_heads
    attention = model.dim * head_dim * (2 * model.n_heads + 2 * model.n_kv_heads)
    ffn = 3 * model.dim * model.ffn_dim
    if model.n_experts:
        ffn *= model.top_k
        ffn += model.dim * model.n_experts  # router
    matmul_weights = model.n_layers * (attention + ffn) + model.dim * model.vocab_size
    return 6 * matmul_weights + 12 * model.n_layers * model.dim * seq_len


def measure_cpu_tflops(size: int = 1024, seconds: float = 0.5) -> float:
    """What this process sustains on an fp32 matmul: the CPU's peak for `peak_tflops=auto`."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        runs += 1
    return 2 * size**3 * runs / (time.perf_counter() - start) / 1e12


def peak_tflops(device: torch.device, setting) -> float | None:
    """Peak TFLOP/s of one device: the user's number, a timed matmul ("auto"), the CUDA table, or None."""
    if isinstance(setting, (int, float)):
        return float(setting)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((peak for key, peak in CUDA_PEAK_TFLOPS.items() if key in name), None)
    if setting == "auto":
        return measure_cpu_tflops()
    return None


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # Peak resident set size of this process (kilobytes on Linux).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLogger:
    """Rank 0's record of training: one JSON line and one console line per logged step."""

    def __init__(self, output_dir: str, enabled: bool, wandb_cfg=None, config: dict | None = None):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.wandb = None
        if enabled and wandb_cfg is not None and wandb_cfg.enabled:
            import wandb

            self.wandb = wandb.init(
                project=wandb_cfg.project, mode=wandb_cfg.mode, dir=output_dir, config=config, reinit="finish_previous"
            )

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(format_record(record), flush=True)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if v is not None and k != "step"}, step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


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
    if "val_loss" in r:
        parts.insert(2, f"val_loss {r['val_loss']:.4f}")
    return " | ".join(parts)
