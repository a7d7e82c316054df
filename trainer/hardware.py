"""Peak compute of the devices this trainer runs on: the one table of CUDA devices' dense bf16 peaks
(MFU and the plan's device list read it), and timed matmuls: the CPU's, and a GPU's for the plan's
calibration."""

from __future__ import annotations

import time
import warnings

import torch

# Dense bf16 tensor-core peak in TFLOP/s, by the exact name torch.cuda.get_device_name() reports
# (the product sheets' figures without sparsity). A name not here gets no guess: a near match
# (an L40 is not an L4, an H100 NVL is not an SXM part) would give a wrong MFU.
CUDA_PEAK_TFLOPS = {
    "NVIDIA B200": 2250.0,
    "NVIDIA GB200": 2500.0,
    "NVIDIA H200": 989.0,
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA GH200 480GB": 989.0,
    "NVIDIA GH200 144G HBM3e": 989.0,
    "NVIDIA H100 80GB HBM3": 989.0,  # SXM5
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H800": 989.0,
    "NVIDIA H800 PCIe": 756.0,
    "NVIDIA H20": 148.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A800-SXM4-80GB": 312.0,
    "NVIDIA A800 80GB PCIe": 312.0,
    "NVIDIA L40S": 362.0,
    "NVIDIA L40": 181.0,
    "NVIDIA L4": 121.0,
    "NVIDIA GeForce RTX 4090": 165.0,
}


def measure_cpu_tflops(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.5,
                       repeats: int = 1) -> float:
    """What this process sustains on a matmul: the CPU's peak for `peak_tflops=auto` and the plan.
    The best of `repeats` timed bursts, since a shared machine only ever slows one down."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best = 0.0
    for _ in range(repeats):
        runs, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            runs += 1
        best = max(best, 2 * size**3 * runs / (time.perf_counter() - start) / 1e12)
    return best


def measure_cuda_tflops(dtype: torch.dtype = torch.bfloat16, size: int = 8192,
                        iterations: int = 20) -> float:
    """What the current CUDA device sustains on a large matmul (the plan's calibration)."""
    a, b = (torch.randn(size, size, dtype=dtype, device="cuda") for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iterations):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * iterations / (time.perf_counter() - start) / 1e12


def cuda_peak_tflops(name: str) -> float | None:
    peak = CUDA_PEAK_TFLOPS.get(name.strip())
    if peak is None:
        warnings.warn(f"no peak FLOP/s known for the device {name!r}: mfu is null; set "
                      "metrics.peak_tflops to its dense bf16 TFLOP/s to have it", stacklevel=2)
    return peak
