"""The plan of a job before it runs: bytes per rank at the peak, and seconds per step.

    plan = make_plan(job, dims, get_device("h100"))
    plan.fits, plan.ranks[0].peak, plan.tokens_per_s

`layout.py` reads what each rank holds from the real parallelized module tree (a fake world of
the job's size), `memory.py` adds activations and buffers and finds the peak, `time.py` turns
FLOPs and bytes into seconds at the device's figures (`devices.py`: the table; `profiles.py`: a
machine's, measured by `calibrate.py`). `search.py` enumerates layouts and ranks them by the plan;
`auto.py` takes its first at launch (parallel=auto).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from trainer.config.schema import JobConfig
from trainer.errors import ConfigError
from trainer.models import family
from trainer.models.costs import FP32, Shapes
from trainer.models.moe_config import n_experts
from trainer.models.nf4 import DEQUANTIZE_TRAFFIC, NF4_BYTES
from trainer.observe.metrics import flops_per_token
from trainer.optim.spec import STATE_BYTES, optimizer_of
from trainer.parallel.dims import ParallelDims
from trainer.parallel.pipeline import ZERO_BUBBLE
from trainer.plan.devices import Device
from trainer.plan.layout import holdings
from trainer.plan.memory import TERMS, RankMemory, gathered_bytes_per_element, rank_memory
from trainer.plan.time import HostTraffic, StepTime, step_time
from trainer.tensors import DTYPES

GIB = 2**30
# The memory a plan leaves free: fragmentation, the CUDA context's growth, NCCL's buffers.
MARGIN = 0.10


@dataclass
class Plan:
    world_size: int
    device: Device
    dims: ParallelDims
    ranks: list[RankMemory]
    time: StepTime
    tokens_per_step: int
    flops_per_token: float
    peak_tflops: float
    host_memory_gib: float = 0.0  # a node's, for what training.offload puts there (0: unknown)

    @property
    def peak(self) -> float:
        return max(r.peak for r in self.ranks)

    @property
    def host_per_node(self) -> float:
        """Bytes training.offload puts in a node's host memory (its ranks' share each)."""
        return max(r.host for r in self.ranks) * min(self.world_size, self.device.per_node)

    @property
    def host_fits(self) -> bool:
        return not self.host_memory_gib or (self.host_per_node
                                             <= self.host_memory_gib * GIB * (1 - MARGIN))

    @property
    def fits(self) -> bool:
        return self.peak <= self.device.memory_gib * GIB * (1 - MARGIN) and self.host_fits

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.time.step_s if self.time.step_s > 0 else float("nan")

    @property
    def mfu(self) -> float:
        if self.peak_tflops <= 0:
            return float("nan")
        peak = self.peak_tflops * 1e12 * self.world_size
        return self.tokens_per_s * self.flops_per_token / peak

    def to_json(self) -> dict:
        d = self.dims
        return {
            "world_size": self.world_size,
            "device": self.device.name,
            "device_memory_gib": self.device.memory_gib,
            "layout": {k: getattr(d, k) for k in ("pp", "dp_replicate", "dp_shard", "cp",
                                                  "cp_ulysses", "tp", "ep")},
            "fits": self.fits,
            "peak_gib": self.peak / GIB,
            "host_per_node_gib": self.host_per_node / GIB,
            "step_time_s": self.time.step_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "time": asdict(self.time),
            "ranks": [
                {"pp_rank": r.pp_rank,
                 **{f"{k}_gib": getattr(r, k) / GIB for k in (*TERMS, "peak", "host")}}
                for r in self.ranks
            ],
        }

    def check_fits(self, option: str | None = None) -> None:
        """A `config error:` naming the largest term when the peak exceeds the device's memory, and
        `option` (search.fitting_option's advice) first where one fits."""
        if not self.fits:
            suffix = "" if not self.host_fits else " (or plan.check=false to run anyway)"
            raise ConfigError(f"plan: {self.misfit(option)}{suffix}")

    def misfit(self, option: str | None = None) -> str:
        """Why the job does not fit, and what would make it fit (`option` first, where given)."""
        if not self.host_fits:
            return (f"training.offload={self.ranks[0].offload} puts "
                    f"{self.host_per_node / GIB:.1f} GiB in "
                    f"each node's host memory, more than "
                    f"{self.host_memory_gib * (1 - MARGIN):.1f} usable of "
                    f"plan.host_memory_gib={self.host_memory_gib:g}; shard over more nodes "
                    "(parallel.dp_shard), set training.offload=none, or raise "
                    "plan.host_memory_gib where the host has more")
        rank = max(self.ranks, key=lambda r: r.peak)
        name, value = rank.largest()
        usable = self.device.memory_gib * (1 - MARGIN)
        where = f" on pipeline rank {rank.pp_rank}" if self.dims.pp_enabled else ""
        return (f"the job needs {rank.peak / GIB:.1f} GiB per rank{where}, more than the "
                f"{usable:.1f} GiB usable of {self.device.memory_gib:.1f} on {self.device.name} "
                f"(largest term: {name} {value / GIB:.1f} GiB); "
                f"{option + ', or ' if option else ''}{_advice(name)}")


def _advice(term: str) -> str:
    if term == "activations":
        return ("set training.activation_checkpoint=selective or full, raise "
                "training.grad_accum_steps or parallel.tp/cp, or lower training.seq_len")
    if term in ("params", "grads", "optimizer"):
        return "shard over more ranks (parallel.dp_shard, tp or pp) or use a smaller model"
    return "raise parallel.tp or parallel.pp, or shard over more ranks"


# What float8 GEMMs sustain of their peak, relative to what bf16 GEMMs sustain of theirs: the casts,
# the scales' reductions and the layouts _scaled_mm needs. From torchtitan's float8 tensorwise runs
# on one H100 (1.12x its bf16 tokens/s at the Llama 3.2 1B shape, 1.18x at Llama 3 8B's layers),
# where the linear layers are about 80% of the FLOPs: 1 / (0.2 + 0.8 / (2 x 0.6)) = 1.15x.
FLOAT8_EFFICIENCY = 0.6


def make_plan(job: JobConfig, dims: ParallelDims, device: Device, expert_load: float = 1.0) -> Plan:
    """The plan of `job` laid out as `dims` on `device`s (run `check_job` first). `expert_load`: the
    slots the experts of the planned rank take, over an even share (a measured expert_load_ep)."""
    m, t, p = job.model, job.training, job.parallel
    name = t.mixed_precision.param_dtype
    dtype = DTYPES[name] if name != "auto" else (torch.float32 if device.kind == "cpu"
                                                 else torch.bfloat16)
    act_bytes = torch.finfo(dtype).bits // 8
    per_microbatch = t.global_batch_size // (dims.dp * dims.grad_accum_steps * dims.pp_microbatches)
    shapes = Shapes(
        model=m, tokens=per_microbatch * t.seq_len // dims.cp, tp=dims.tp, cp=dims.cp,
        sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel, cp_method=p.cp_method,
        cp_ulysses=dims.cp_ulysses, act_bytes=act_bytes, expert_load=expert_load,
        loss_chunk=t.loss_chunk_tokens, experts_apart=dims.ep_enabled,
    )
    schedule = p.pp_schedule if dims.pp_enabled else None
    f8 = t.float8.recipe if t.float8.enabled else None
    # Full checkpointing applies to every Nth block: the share of blocks it recomputes.
    share = (-(-m.n_layers // t.activation_checkpoint_every) / m.n_layers
             if t.activation_checkpoint == "full" else 0.0)
    n_stages = dims.pp * dims.pp_stages_per_rank
    stages_by_rank = holdings(job, dims)
    costs = family(m.family).costs
    ranks = [rank_memory(
        pp_rank, stages, costs, shapes, activation_checkpoint=t.activation_checkpoint,
        checkpointed_share=share, schedule=schedule, pp=dims.pp,
        n_microbatches=dims.grad_accum_steps * dims.pp_microbatches,
        grad_accum=dims.grad_accum_steps, param_bytes=act_bytes,
        has_loss=any(s.stage == n_stages - 1 for s in stages), selective_policy=t.selective_policy,
        float8=f8, float8_share=costs.float8_params(m), optimizer=optimizer_of(job.optim),
        state_bytes=STATE_BYTES[job.optim.state_dtype], offload=offload_on(job, device),
    ) for pp_rank, stages in enumerate(stages_by_rank)]
    # The busiest pipeline rank sets the pace.
    busiest = max(stages_by_rank, key=lambda stages: sum(s.layers for s in stages))
    timing = plan_step_time(job, dims, device, dtype, shapes, share, busiest)
    flops = flops_per_token(m, t.seq_len, frozen_base=job.peft.method is not None)
    return Plan(dims.world_size, device, dims, ranks, timing, t.global_batch_size * t.seq_len,
                flops, device.peak_tflops(dtype),
                host_memory_gib=job.plan.host_memory_gib or device.host_memory_gib)


def host_traffic(job: JobConfig, offload: str, units: list, stages: list, shapes: Shapes,
                 microbatches: int) -> HostTraffic | None:
    """What `offload` moves a step for a rank holding `stages` (their FSDP `units`). optimizer:
    the units' fp32 shards, the gradients of those that train, and the host step's reads (weight,
    gradient, state) and writes (weight, state); activations: what every block saves, out in forward
    and back in backward, for each of the `microbatches` each stage runs."""
    if offload == "activations":
        costs = family(job.model.family).costs
        saved = sum(costs.activation_bytes(shapes, i) for stage in stages for i in stage.blocks)
        return HostTraffic(weights=0.0, grads=0.0, step=0.0, activations=2 * saved * microbatches)
    if offload != "optimizer":
        return None
    trained = sum(u.trained for u in units)
    state = optimizer_of(job.optim).state_words * STATE_BYTES[job.optim.state_dtype]
    return HostTraffic(weights=sum(u.sharded for u in units) * FP32, grads=trained * FP32,
                       step=trained * (3 * FP32 + 2 * state))


def offload_on(job: JobConfig, device: Device) -> str:
    """training.offload as it moves bytes on `device`: on the CPU, where the host is the device, the
    optimizer's moves nothing (FSDP's host copies are the tensors themselves; the activations'
    copies the memory count sets apart)."""
    offload = job.training.offload
    return "none" if offload == "optimizer" and device.kind == "cpu" else offload


def plan_step_time(job: JobConfig, dims: ParallelDims, device: Device, dtype: torch.dtype,
                   shapes: Shapes, share: float, busiest: list) -> StepTime:
    """The step time of the pipeline rank holding `busiest` (its stages); `share`: the blocks full
    checkpointing recomputes."""
    m, t, costs = job.model, job.training, family(job.model.family).costs
    schedule = job.parallel.pp_schedule if dims.pp_enabled else None
    f8 = t.float8.recipe if t.float8.enabled else None
    counted = costs.flops(m, t.seq_len)
    flops = flops_per_token(m, t.seq_len, frozen_base=job.peft.method is not None)
    tokens_per_step = t.global_batch_size * t.seq_len
    n_microbatches = dims.grad_accum_steps * dims.pp_microbatches  # a step's, on each stage
    # Full checkpointing runs a block's forward again (4/3 of the work: forward 1, backward 2); a
    # zero-bubble schedule's split backward runs it twice more (5/3, see memory.py). Selective
    # checkpointing recomputes element-wise work, not counted in the FLOPs, and under half_mm some
    # matmuls.
    extra = (2 if schedule in ZERO_BUBBLE else 1) * share
    if t.activation_checkpoint == "selective" and t.selective_policy == "half_mm":
        # Every second matmul of a block runs again: about half of the blocks' matmul forward.
        extra += 0.5 * counted.blocks / flops
    flops_per_rank = flops * tokens_per_step / dims.world_size * (3 + extra) / 3
    units = [u for s in busiest for u in s.units]
    stream = shapes.tokens * m.dim * shapes.act_bytes
    peak_tflops = device.peak_tflops(dtype)
    compute_tflops = peak_tflops
    if f8 is not None and not t.float8.emulate and device.fp8_tflops:
        # The blocks' linear layers at the float8 rate, the rest (attention's scores, the head) not.
        in_float8 = counted.float8 / flops
        compute_tflops = 1 / ((1 - in_float8) / peak_tflops
                              + in_float8 / (device.fp8_tflops * FLOAT8_EFFICIENCY))
    gathered_per_element = gathered_bytes_per_element(shapes.act_bytes, costs.float8_params(m), f8)
    optimizer = optimizer_of(job.optim)
    quantized = sum(u.quantized_gathered for u in units)  # (QLoRA's base, gathered in 4 bits)
    timed = step_time(
        flops_per_rank=flops_per_rank, device=device, dtype_peak_tflops=compute_tflops, dims=dims,
        gathered_bytes=sum(u.gathered for u in units) * gathered_per_element
        - quantized * (shapes.act_bytes - NF4_BYTES),
        grad_bytes=sum(u.trained_gathered for u in units) * FP32,
        sharded_grad_bytes=sum(u.trained for u in units) * FP32,
        act_stream_bytes=stream, kv_bytes=costs.context_bytes(shapes),
        ulysses_bytes=costs.ulysses_bytes(shapes), expert_bytes=costs.expert_bytes(shapes),
        layers_per_rank=sum(s.layers for s in busiest) / len(busiest),
        microbatches_per_rank=n_microbatches * len(busiest),
        recompute=share, selective=t.activation_checkpoint == "selective", schedule=schedule,
        per_rank_stages=dims.pp_stages_per_rank,
        # Under pipeline parallel a step's accumulation steps are microbatches of one schedule run.
        n_microbatches=n_microbatches, moe=n_experts(m) > 0,
        optimizer_flops=sum(u.apart_flops for u in units),
        optimizer_tflops=device.peak_tflops(optimizer.matrix_dtype(job.optim, device.kind)),
        exchanged_bytes=sum(u.apart_moved for u in units) * FP32 if optimizer.whole_matrices
        else 0.0,
        # QLoRA: each 4-bit weight dequantized in forward, backward and a recomputed forward
        memory_bound_bytes=quantized * DEQUANTIZE_TRAFFIC * (2 + share) * n_microbatches,
        host=host_traffic(job, offload_on(job, device), units, busiest, shapes, n_microbatches),
    )
    # Attention's share of the compute (its kernels run again only where full checkpointing runs
    # the whole block again).
    attention = counted.attention * (3 + (2 if schedule in ZERO_BUBBLE else 1) * share)
    return replace(timed, attention_s=timed.compute_s * attention / (flops * (3 + extra)))
