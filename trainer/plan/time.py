"""Seconds per optimizer step: compute at the device's peak times an efficiency, the bytes each
mesh dimension moves over the link it spans, and the pipeline's bubble."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.parallel.pipeline import SINGLE_STAGE, V_SHAPED
from trainer.plan.devices import Device

# The matmuls' share of the peak is the device's (devices.py: Efficiency). Mixture-of-experts blocks
# also sort, gather and scatter their tokens, work the FLOPs leave out: measured on CPU (ep2, dim
# 512, seq 512) 0.8 of a dense model's rate on an AVX2 box, 0.95-1.0 on a Zen 4 (avx512) box (plan
# 16-23% under the measurement at 0.8, two sittings):
# 0.9 keeps both within 15%. Not measured on GPUs: 0.8.
MOE_EFFICIENCY = {"cuda": 0.8, "cpu": 0.9}


@dataclass
class StepTime:
    compute_s: float
    fsdp_s: float  # all-gathers and reduce-scatters (overlapped with compute)
    tp_s: float  # tensor/sequence-parallel collectives (exposed)
    cp_s: float  # the ring's K/V passes (half hidden behind the blocks' attention)
    ep_s: float  # expert all-to-alls (exposed)
    pp_s: float  # stage-to-stage sends (exposed)
    # Muon's Newton-Schulz iterations and its exchange of matrices; the optimizer's step on the host
    # under training.offload (exposed)
    optimizer_s: float
    bubble: float  # the pipeline's idle share of the step
    step_s: float
    attention_s: float = 0.0  # of compute_s, attention's kernels (scores and values)
    host_s: float = 0.0  # training.offload's copies over the host link (beside FSDP's, overlapped)


@dataclass(frozen=True)
class HostTraffic:
    """training.offload's bytes a step: the weights' fp32 shards each gather copies in and the
    reduced gradients copied out over the host link (on FSDP's streams, beside its collectives),
    what the optimizer's step on the host reads and writes, and the activations' copies."""

    weights: float
    grads: float
    step: float
    activations: float = 0.0  # training.offload=activations: out and back, a step

    def seconds(self, device: Device, gathers: int) -> tuple[float, float]:
        """(the link's seconds a step, the host step's); none where the host is the device."""
        if device.kind == "cpu":
            return 0.0, 0.0
        link = device.host_gbps * device.link_efficiency * 1e9
        return ((self.weights * gathers + self.grads + self.activations) / link,
                self.step / (device.host_step_gbps * 1e9))


def spans_nodes(inner: int, size: int, per_node: int) -> bool:
    """Whether a group of `size` ranks, `inner` ranks apart, leaves one node."""
    return inner * size > per_node


def link_gbps(device: Device, inner: int, size: int) -> float:
    gbps = device.inter_gbps if spans_nodes(inner, size, device.per_node) else device.intra_gbps
    return gbps * device.link_efficiency


def ring_seconds(nbytes: float, ranks: int, gbps: float) -> float:
    """A ring all-gather or reduce-scatter of `nbytes` (the whole, gathered size) over `ranks`."""
    return 0.0 if ranks <= 1 else nbytes * (ranks - 1) / ranks / (gbps * 1e9)


def layout_share(device: Device, dims) -> float:
    """The share of its peak a device computes at in this layout: alone, beside replicas only, or
    beside collectives."""
    if dims.world_size == dims.pp:
        return device.efficiency.alone
    if dims.world_size == dims.pp * dims.dp_replicate:
        return device.efficiency.replicated
    return device.efficiency.with_collectives


def optimizer_seconds(device: Device, flops: float, tflops: float, share: float,
                      exchanged_bytes: float, ranks: int) -> float:
    """The optimizer's own work a step: its FLOPs at `share` of `tflops` (nan where the device's
    peak is unknown, as for compute), and each rank's pieces sent to their owners and back (two
    all-to-alls over the `ranks` sharing them)."""
    seconds = 0.0
    if flops:
        seconds = flops / (tflops * 1e12 * share) if tflops > 0 else float("nan")
    if exchanged_bytes:
        seconds += 2 * exchanged_bytes / (link_gbps(device, 1, ranks) * 1e9)
    return seconds


def step_time(*, flops_per_rank: float, device: Device, dtype_peak_tflops: float, dims,
              gathered_bytes: float, grad_bytes: float, sharded_grad_bytes: float,
              act_stream_bytes: float, kv_bytes: float, expert_bytes: float, layers_per_rank: float,
              ulysses_bytes: float = 0.0, microbatches_per_rank: int, recompute: float,
              selective: bool, schedule: str | None, per_rank_stages: int, n_microbatches: int,
              moe: bool = False,
              optimizer_flops: float = 0.0, optimizer_tflops: float = 0.0,
              exchanged_bytes: float = 0.0, memory_bound_bytes: float = 0.0,
              host: HostTraffic | None = None) -> StepTime:
    """`*_bytes` are per microbatch and per layer where that is how they move (see plan.py);
    `recompute`: the share of blocks whose forward runs again in backward. The optimizer's own work:
    this rank's FLOPs (Muon's Newton-Schulz), at `optimizer_tflops`, and the matrix pieces it sends
    to their owners and back over FSDP x tp. `memory_bound_bytes`: the memory traffic beside the
    FLOPs (QLoRA's dequantization). `host`: training.offload's traffic."""
    tp, cp, dp_shard, dp_rep = dims.tp, dims.cp, dims.dp_shard, dims.dp_replicate
    share = layout_share(device, dims)
    moe_share = MOE_EFFICIENCY[device.kind] if moe else 1.0
    tp_share = device.efficiency.tp if tp > 1 else 1.0
    peak = dtype_peak_tflops * 1e12 * share * moe_share * tp_share
    compute = flops_per_rank / peak if peak > 0 else float("nan")  # nan: the peak is unknown
    if device.memory_gbps:
        compute += memory_bound_bytes / (device.memory_gbps * 1e9)

    fsdp_ranks = dp_shard * cp
    fsdp_link = link_gbps(device, tp, fsdp_ranks)
    # Gathered for forward and again for backward, every microbatch; under pipeline parallel once a
    # step (a stage keeps its parameters gathered through the schedule run). Gradients are
    # reduce-scattered once a step, after the last microbatch.
    gathers = 1 if schedule is not None else 2 * microbatches_per_rank
    fsdp = ring_seconds(gathered_bytes, fsdp_ranks, fsdp_link) * gathers
    fsdp += ring_seconds(grad_bytes, fsdp_ranks, fsdp_link)
    if dp_rep > 1:  # HSDP: the shards' gradients all-reduced across replicas
        fsdp += 2 * ring_seconds(sharded_grad_bytes, dp_rep,
                                 link_gbps(device, tp * cp * dp_shard, dp_rep))

    passes = microbatches_per_rank * layers_per_rank
    # Sequence parallel: 2 all-gathers + 2 reduce-scatters per block forward, as many backward,
    # and the forward's again when the block is recomputed (only the all-gathers under selective
    # checkpointing, which keeps what was reduce-scattered).
    tp_ops = (8 + 4 * recompute + (2 if selective else 0)) * passes
    tp_s = ring_seconds(act_stream_bytes, tp, link_gbps(device, 1, tp)) * tp_ops
    cp_s = cp_seconds(device, dims, kv_bytes, ulysses_bytes, passes, 2 + recompute)
    ep = dims.ep
    # Tokens to their experts and back, forward and backward.
    ep_s = ring_seconds(expert_bytes, ep, link_gbps(device, tp, ep)) * 4 * passes if ep > 1 else 0.0
    pp_s = 0.0
    bubble = 0.0
    if schedule is not None:
        pp_link = link_gbps(device, tp * cp * dp_shard * dp_rep, dims.pp)
        pp_s = 2 * act_stream_bytes * microbatches_per_rank * per_rank_stages / (pp_link * 1e9)
        bubble = max(0.0,
                     pipeline_bubble(schedule, dims.pp, per_rank_stages, n_microbatches)
                     - device.lent_idle)
    optimizer_s = optimizer_seconds(device, optimizer_flops, optimizer_tflops, share,
                                    exchanged_bytes, fsdp_ranks * tp)
    host_s, host_step_s = host.seconds(device, gathers) if host else (0.0, 0.0)
    optimizer_s += host_step_s  # (exposed: the device waits for the host's step)
    exposed = max(compute, fsdp + host_s) + tp_s + cp_s + ep_s + pp_s + optimizer_s
    return StepTime(compute, fsdp, tp_s, cp_s, ep_s, pp_s, optimizer_s, bubble,
                    exposed / (1 - bubble), host_s=host_s)


def cp_seconds(device: Device, dims, kv_bytes: float, ulysses_bytes: float, passes: float,
               rounds: float) -> float:
    """Context parallel's transfers in `passes` block passes. The ring (or all-gather): K/V go round
    once forward and with their gradients once backward. Ulysses (the inner cp ranks): its
    all-to-alls `rounds` times (forward, backward, and the share of blocks whose forward full
    checkpointing recomputes; selective checkpointing keeps their outputs)."""
    ring, ulysses = dims.cp // dims.cp_ulysses, dims.cp_ulysses
    seconds = 0.0
    if ring > 1:
        link = link_gbps(device, dims.tp * ulysses, ring)
        seconds += 3 * (ring - 1) * kv_bytes * passes / (link * 1e9) / 2
    if ulysses > 1:
        seconds += ulysses_bytes * rounds * passes / (link_gbps(device, dims.tp, ulysses) * 1e9)
    return seconds


def pipeline_bubble(schedule: str, pp: int, per_rank: int, n_microbatches: int) -> float:
    """Idle share of a pipeline step: (pp-1) stage-times of warm-up and drain against the
    microbatches' work; interleaving divides it by the stages per rank, and the zero-bubble
    schedules fill most of it with deferred weight gradients."""
    idle = (pp - 1) / (n_microbatches * (1 if schedule in SINGLE_STAGE else per_rank))
    if schedule in V_SHAPED or schedule == "interleaved_zb":
        idle /= 3
    return idle / (1 + idle)
