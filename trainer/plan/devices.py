"""The hardware a plan is made for: memory, peak compute and link bandwidths per device.

Figures are the vendors' dense (no sparsity) peaks and nominal link rates; the time model
applies its own efficiency factors to them. `cpu` is measured on this machine when asked for.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from trainer.hardware import CUDA_PEAK_TFLOPS, measure_cpu_tflops, measure_cuda_tflops


@dataclass(frozen=True)
class Efficiency:
    """Shares of the peak a transformer's matmuls sustain in a training step: on ranks that only
    compute (one rank, or pipeline stages handing on activations), on replicas that only all-reduce
    their gradients once a step, on ranks whose steps run collectives every microbatch (FSDP, TP,
    CP, EP), and the further factor tensor parallel's halved matmuls and per-op dispatch cost. A
    calibration (scripts/plan.py --calibrate) measures them on the machine."""

    alone: float
    replicated: float
    with_collectives: float
    tp: float = 1.0


# GPUs: large bf16 GEMMs with attention and element-wise work around them (not yet calibrated).
GPU_EFFICIENCY = Efficiency(0.55, 0.55, 0.55)
# The CPU's peak is a matmul timed on one thread per rank. Measured on 2 cores (llama_debug widened
# to dim 512, seq 512, steps after the counted ones): 0.70 alone; 0.55 with collectives (gloo's
# threads on the same cores, DTensor's dispatch), replicas' one all-reduce a step taken as the same.
# tp2 sustained 0.68-0.87 of FSDP's rate on an AVX2 box (four sittings) and 1.5x the plan's figure
# at 0.8 on a Zen 4 (avx512) box: 1.0 keeps both within 30%.
CPU_EFFICIENCY = Efficiency(0.70, 0.55, 0.55)


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float  # usable memory per device
    bf16_tflops: float  # dense peak
    fp32_tflops: float  # dense fp32 peak (TF32 tensor cores on GPUs)
    intra_gbps: float  # GB/s one way per device within a node (NVLink)
    inter_gbps: float  # GB/s one way per device across nodes (InfiniBand / RoCE)
    per_node: int  # devices per node
    link_efficiency: float = 0.7  # share of the nominal link rates a ring collective sustains
    fp8_tflops: float = 0.0  # dense float8 peak (0: no float8 matmuls; the CPU's are not timed)
    kind: str = "cuda"  # or "cpu"
    efficiency: Efficiency = GPU_EFFICIENCY
    # The share of a rank's time the other ranks on its cores take when it waits (CPU ranks that
    # outnumber the cores: 1 - cores / ranks): a pipeline bubble up to this share costs no time.
    lent_idle: float = 0.0
    memory_gbps: float = 0.0  # memory bandwidth per device (0: unknown, memory-bound work untimed)
    # The host, for training.offload: GB/s one way between a device and host memory (PCIe), the
    # host memory of a node (GiB), and the GB/s of state a rank's optimizer step on the host streams
    # through (its share of the node's memory bandwidth and cores; 0: unknown, untimed).
    host_gbps: float = 0.0
    host_memory_gib: float = 0.0
    host_step_gbps: float = 0.0

    def peak_tflops(self, dtype: torch.dtype) -> float:
        return self.bf16_tflops if dtype in (torch.bfloat16, torch.float16) else self.fp32_tflops


# The host of an 8-GPU node (DGX-like): 2 TB of memory, PCIe Gen5 x16 per GPU (Gen4 on A100s), and
# a rank's share of two sockets' memory bandwidth (about 600 GB/s nominal) for its optimizer step,
# taken at a third: torch's fused AdamW on CPU threads. Estimates, not measured on such a node.
HOST = {"host_memory_gib": 1900.0, "host_step_gbps": 25.0}
# Memory is what CUDA reports as total for one device, less about 1.5 GiB the context takes.
DEVICES = {
    # H100 SXM 80GB, NVLink 4, 400 Gb/s NIC per GPU
    "h100": Device("h100", 78.0, CUDA_PEAK_TFLOPS["NVIDIA H100 80GB HBM3"], 494.0, 450.0, 50.0, 8,
                   fp8_tflops=1979.0, memory_gbps=3350.0, host_gbps=64.0, **HOST),
    "h200": Device("h200", 138.0, CUDA_PEAK_TFLOPS["NVIDIA H200"], 494.0, 450.0, 50.0, 8,
                   fp8_tflops=1979.0, memory_gbps=4800.0, host_gbps=64.0, **HOST),  # H200 SXM 141GB
    # A100 SXM 80GB, NVLink 3, 200 Gb/s NIC
    "a100": Device("a100", 78.0, CUDA_PEAK_TFLOPS["NVIDIA A100-SXM4-80GB"], 156.0, 300.0, 25.0, 8,
                   memory_gbps=2039.0, host_gbps=32.0, **HOST),
    "b200": Device("b200", 178.0, CUDA_PEAK_TFLOPS["NVIDIA B200"], 1125.0, 900.0, 50.0, 8,
                   fp8_tflops=4500.0, memory_gbps=8000.0, host_gbps=64.0,
                   **HOST),  # B200 180GB, NVLink 5
}


def available_memory_gib() -> float:
    """What this machine can still give (MemAvailable), in GiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / 2**30


def measure_cpu(world: int, threads: int | None = None, size: int = 512, seconds: float = 0.1,
                repeats: int = 3) -> Device:
    """This CPU as one device per rank, each rank running `threads` threads (default: this process's
    count): a timed matmul, shared when the ranks' threads outnumber the cores; a timed gloo
    all-reduce between `world` processes; the memory shared by the ranks."""
    own_threads = torch.get_num_threads()
    threads = threads or own_threads
    ranks_per_core = max(1.0, world * threads / len(os.sched_getaffinity(0)))
    torch.set_num_threads(threads)
    try:
        bf16, fp32 = (measure_cpu_tflops(dtype, size, seconds, repeats) / ranks_per_core
                      for dtype in (torch.bfloat16, torch.float32))
    finally:
        torch.set_num_threads(own_threads)
    gbps = measure_link_gbps(world) if world > 1 else 0.0
    return cpu_device(available_memory_gib() / world, bf16, fp32, gbps, world,
                      lent_idle=1 - 1 / ranks_per_core)


def cpu_device(memory_gib: float, bf16_tflops: float, fp32_tflops: float, gbps: float, ranks: int,
               lent_idle: float = 0.0) -> Device:
    """This machine's CPU as `ranks` devices; `gbps` is what a gloo ring sustains already (timed),
    so no further link efficiency applies."""
    return Device("cpu", memory_gib, bf16_tflops, fp32_tflops, gbps, gbps, ranks,
                  link_efficiency=1.0, kind="cpu", efficiency=CPU_EFFICIENCY, lent_idle=lent_idle)


GLOO_TIMED_BYTES = 8 * 2**20  # about one block's activations in the models that run on a CPU
NCCL_TIMED_BYTES = 256 * 2**20  # large enough for a ring's bandwidth, not its latency


def measure_link_gbps(world: int, cuda: bool = False, repeats: int = 3) -> float:
    """GB/s one rank's share of a ring all-reduce moves between `world` processes on this machine
    (each sends 2 (world-1)/world of the buffer): the best of a few timed all-reduces, over gloo
    between processes forked from this one (no re-import of torch: about a second), or over NCCL
    between this node's first `world` GPUs (spawned: CUDA does not survive a fork)."""
    context = multiprocessing.get_context("spawn" if cuda else "fork")
    nbytes = NCCL_TIMED_BYTES if cuda else GLOO_TIMED_BYTES
    with tempfile.TemporaryDirectory() as tmp:
        seconds = context.Queue()
        ranks = [context.Process(target=_time_all_reduce,
                                 args=(rank, world, f"{tmp}/store", nbytes, repeats, cuda,
                                      seconds)) for rank in range(world)]
        for process in ranks:
            process.start()
        best = seconds.get(timeout=300)
        for process in ranks:
            process.join(timeout=60)
    return 2 * (world - 1) / world * nbytes / best / 1e9


def _time_all_reduce(rank: int, world: int, store_path: str, nbytes: int, repeats: int, cuda: bool,
                     out) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    # A group of its own: the caller may have a default one.
    if cuda:
        torch.cuda.set_device(rank)
        group = dist.ProcessGroupNCCL(store, rank, world)
    else:
        group = dist.ProcessGroupGloo(store, rank, world)
    buffer = torch.ones(nbytes // 4, device=f"cuda:{rank}" if cuda else "cpu")
    group.allreduce(buffer).wait()
    best = float("inf")
    for _ in range(repeats):
        group.barrier().wait()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        group.allreduce(buffer).wait()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    if rank == 0:
        out.put(best)
    group.barrier().wait()


def measure_cuda(world: int) -> Device:
    """This node's GPU as the plan sees it, timed: its table entry (or a bare one) with the bf16
    peak a large matmul sustains on it, and the link an NCCL all-reduce sustains between `world` of
    them (the nodes' network stays the table's)."""
    base = local_device(torch.device("cuda", 0), world)
    bf16 = measure_cuda_tflops(torch.bfloat16)
    intra = (measure_link_gbps(world, cuda=True) if world > 1
             else base.intra_gbps * base.link_efficiency)
    # The timed rate is what a ring sustains: the table's network rate is scaled to match.
    return replace(base, bf16_tflops=bf16, intra_gbps=intra,
                   inter_gbps=base.inter_gbps * base.link_efficiency, link_efficiency=1.0,
                   per_node=world)


def local_device(device: torch.device, local_ranks: int) -> Device:
    """The device this rank runs on, for the memory check before launch: a CUDA device's total
    memory (its compute figures from the table by name), or the CPU's available memory shared by
    the ranks of this machine (compute figures unmeasured)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = next((key for key in DEVICES if key in props.name.lower()), None)
        base = DEVICES[name] if name else Device(props.name, 0.0, 0.0, 0.0, 0.0, 0.0, 8)
        return replace(base, memory_gib=props.total_memory / 2**30,
                       host_memory_gib=available_memory_gib())
    return cpu_device(available_memory_gib() / local_ranks, 0.0, 0.0, 2.0, local_ranks)
