"""Bytes each rank holds at its peak, term by term.

The parameters' terms come from the real module tree (layout.py); a block's activations are counted
by its family (its spec's memory terms, from the model's shapes, tensor by tensor, as the code saves
them for backward). Two moments compete for the
peak: the start of backward (every saved activation, the head's and loss's gradients and a chunk of
logits) and the optimizer step (every gradient, plus the temporaries of the fused AdamW update).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.models.costs import FP32, Costs, Shapes
from trainer.models.nf4 import DEQUANTIZE_BYTES, NF4_BYTES
from trainer.optim.adamw import ADAMW
from trainer.optim.muon_exchange import ROUND_ELEMENTS
from trainer.optim.spec import OptimizerSpec
from trainer.parallel.pipeline import SINGLE_STAGE, V_SHAPED, ZERO_BUBBLE
from trainer.plan.layout import StageHoldings

__all__ = ["RankMemory", "rank_memory"]


@dataclass
class RankMemory:
    """Bytes on one rank (one pipeline position), each term as held at the peak."""

    pp_rank: int
    params: float  # sharded fp32 parameters
    grads: float  # sharded fp32 gradients
    optimizer: float  # the optimizer's state (AdamW's two moments; a Muon matrix's momentum buffer)
    gathered: float  # parameters FSDP holds unsharded (compute dtype)
    activations: float  # saved for backward, at the start of backward
    buffers: float  # communication and transient buffers
    peak: float  # the larger of the two moments, on the device
    # in host memory, not in `peak` nor the terms above but params, grads and optimizer under
    # training.offload=optimizer
    host: float = 0.0
    offload: str = "none"  # training.offload, as it applies on the device planned for

    def largest(self) -> tuple[str, float]:
        """The largest term on the device."""
        terms = {k: getattr(self, k) for k in TERMS
                 if not (self.offload == "optimizer" and k in HOST_TERMS)}
        name = max(terms, key=terms.get)
        return name, terms[name]


# A rank's memory terms, in the order a plan reports them (its peak after them).
TERMS = ("params", "grads", "optimizer", "gathered", "activations", "buffers")
# The terms training.offload=optimizer keeps on the host.
HOST_TERMS = ("params", "grads", "optimizer")


def gathered_bytes_per_element(param_bytes: int, float8_share: float, float8: str | None) -> float:
    """What FSDP gathers per parameter: tensorwise float8 gathers the float8 layers' weights in one
    byte."""
    return param_bytes - (param_bytes - 1) * float8_share * (float8 == "tensorwise")


def checkpointed_layer_bytes(s: Shapes) -> float:
    """Bytes a fully checkpointed block keeps: its input."""
    return s.stream_tokens * s.model.dim * s.act_bytes


def loss_bytes(s: Shapes, in_flight: int = 1) -> float:
    """The last stage's head and loss (LMHead) at their peak, the final norm's input included.

    Chunked: the gradients of the head's input and weight, computed in forward and held to backward
    (the weight's in fp32), for each microbatch whose backward has not run; and the larger of what
    forward computes a chunk in (its logits in fp32, their gradient in the compute dtype) and what
    backward scales the gradients in. Plain (no chunks): the logits, their float copy, log-softmax's
    output and the gradient it returns, and the head's input.
    """
    dim, vocab = s.model.dim, s.model.vocab_size
    vocab = vocab // s.tp if s.loss_parallel and s.tp > 1 else vocab
    norm_input = s.stream_tokens * dim * s.act_bytes
    if s.loss_chunk is None and not (s.loss_parallel and s.tp > 1):
        logits = s.tokens * vocab
        copies = logits * (s.act_bytes + (FP32 if s.act_bytes != FP32 else 0) + 2 * FP32)
        return norm_input + copies + s.tokens * dim * s.act_bytes
    chunk = min(s.loss_chunk or s.tokens, s.tokens)
    held = s.tokens * dim * s.act_bytes + vocab * dim * FP32
    forward = chunk * vocab * (FP32 + (s.act_bytes if s.act_bytes != FP32 else 0))
    backward = vocab * dim * s.act_bytes + 2 * s.tokens * dim * FP32
    return norm_input + in_flight * held + max(forward, backward)


def microbatches_in_flight(schedule: str | None, pp: int, pp_rank: int, per_rank: int,
                           n_microbatches: int) -> int:
    """Stage-microbatches whose activations one pipeline rank holds at once, at most.

    gpipe runs every forward first; 1F1B-style schedules hold as many as the stages still ahead
    (their warm-up); the interleaved and V-shaped ones warm up over each of their stages.
    """
    if schedule is None:
        return 1
    total = n_microbatches * per_rank
    if schedule == "gpipe":
        return total
    if schedule in SINGLE_STAGE:
        return min(total, pp - pp_rank)
    if schedule in V_SHAPED:
        return min(total, 2 * (pp - pp_rank))
    return min(total, (per_rank - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)


def saved_activations(costs: Costs, s: Shapes, blocks: list[int], n_stages: int, in_flight: int,
                      activation_checkpoint: str, checkpointed_share: float, selective_policy: str,
                      schedule: str | None) -> float:
    """The bytes the blocks keep for backward at its start: `in_flight` stage-microbatches'
    forwards, each of a stage of the rank (which holds `blocks` over its `n_stages` stages), under
    the checkpointing mode."""
    saved = [costs.activation_bytes(s, i) for i in blocks]
    if activation_checkpoint == "none":
        return in_flight * sum(saved) / n_stages
    if schedule in ZERO_BUBBLE:  # (full; selective is refused with these schedules)
        # Measured (torch 2.13): a zero-bubble schedule's split backward recomputes a checkpointed
        # stage for the input gradients and again for the deferred weight gradients, holding both:
        # about twice the activations of the same schedule without checkpointing.
        return (1 + checkpointed_share) * in_flight * sum(saved) / n_stages
    if activation_checkpoint == "selective":  # a block's recompute adds what it did not keep
        kept = [costs.selective_bytes(s, i, selective_policy) for i in blocks]
        share = 1.0
        recomputed = max((a - k for a, k in zip(saved, kept)), default=0.0)
    else:
        kept, share = [checkpointed_layer_bytes(s)] * len(blocks), checkpointed_share
        recomputed = max(saved, default=0.0)
    per_stage = (share * sum(kept) + (1 - share) * sum(saved)) / n_stages
    return in_flight * per_stage + recomputed  # one block recomputed at a time


def offloaded_activations(saved: float, costs: Costs, s: Shapes, blocks: list[int]) -> float:
    """Of the `saved` bytes, those training.offload=activations holds on the host: all but three
    blocks' (the one backward is at, the one fetched ahead of it, and the one whose tensors are
    still going, as its backward frees them or forward's copies end; measured on the CPU: two
    blocks' kept is 16% under the count)."""
    largest = sorted((costs.activation_bytes(s, i) for i in blocks), reverse=True)[:3]
    return max(0.0, saved - sum(largest))


def gathered_at_backward(units: list, per_element: dict, schedule: str | None) -> float:
    """Bytes of gathered parameters held at the start of backward (`units` largest first)."""
    if schedule is not None:
        # Under pipeline parallel a stage keeps its parameters gathered from forward to backward.
        return sum(u.gathered * per_element[u.name] for u in units)
    # The head (and a root holding tied weights) stays gathered, and a block computes while the next
    # is gathered. The embedding was resharded after forward.
    kept = sum(u.gathered * per_element[u.name] for u in units if u.name in ("head", "root"))
    blocks = [u.gathered * per_element[u.name] for u in units
              if u.name not in ("embedding", "head", "root")]
    return kept + sum(blocks[:2])


def rank_memory(pp_rank: int, stages: list[StageHoldings], costs: Costs, s: Shapes, *,
                activation_checkpoint: str, checkpointed_share: float, schedule: str | None,
                pp: int, n_microbatches: int, grad_accum: int, param_bytes: int, has_loss: bool,
                selective_policy: str = "half_mm", float8: str | None = None,
                float8_share: float = 0.0, optimizer: OptimizerSpec = ADAMW,
                state_bytes: float = FP32, offload: str = "none") -> RankMemory:
    """`float8`: the float8 recipe (None: off); `float8_share`: the share of a block's parameters in
    float8 linear layers (the experts' grouped GEMMs are not); `optimizer`: the job's (its state per
    element, and whether it updates the matrices it treats apart whole); `state_bytes`: a state
    word's (optim.state_dtype's); `offload`: what training.offload holds in host memory here
    (optimizer: the sharded parameters, their gradients and the optimizer's state; activations: what
    the blocks save, but the two blocks backward is at)."""
    sharded = sum(u.sharded for stage in stages for u in stage.units)
    trained = sum(u.trained for stage in stages for u in stage.units)  # (LoRA: the adapters)
    quantized = sum(u.quantized for stage in stages for u in stage.units)  # (QLoRA's base)
    # fp32 masters of what trains; a frozen base (LoRA's) held in the compute dtype, or in 4 bits
    params = trained * FP32 + (sharded - trained - quantized) * param_bytes + quantized * NF4_BYTES
    grads = trained * FP32
    apart = (sum(u.apart for stage in stages for u in stage.units) if optimizer.apart is not None
             else 0)
    words = optimizer.state_words * (trained - apart) + optimizer.apart_state_words * apart
    states = words * state_bytes
    units = sorted((u for stage in stages for u in stage.units), key=lambda u: -u.gathered)
    edges = ("embedding", "head", "root")
    in_float8 = {u.name: float8_share if u.name not in edges and not u.name.endswith(".experts")
                 else 0.0
                 for u in units}
    per_element = {u.name: gathered_bytes_per_element(param_bytes, in_float8[u.name], float8)
                   - (param_bytes - NF4_BYTES) * u.quantized_gathered / max(u.gathered, 1)
                   for u in units}
    gathered = gathered_at_backward(units, per_element, schedule)
    blocks = [i for stage in stages for i in stage.blocks]
    in_flight = microbatches_in_flight(schedule, pp, pp_rank, len(stages), n_microbatches)
    saved = saved_activations(costs, s, blocks, len(stages), in_flight, activation_checkpoint,
                              checkpointed_share, selective_policy, schedule)
    # gpipe runs every forward before any backward; the other schedules run the loss stage's
    # backward right after its forward.
    loss_in_flight = n_microbatches if schedule == "gpipe" else 1
    host = offloaded_activations(saved, costs, s, blocks) if offload == "activations" else 0.0
    activations = saved - host + (loss_bytes(s, loss_in_flight) if has_loss else 0)

    buffers = backward_buffers(units, stages, blocks, costs, s, activation_checkpoint, float8,
                               in_float8, schedule, in_flight)
    held_grads = grads if (grad_accum > 1 or schedule is not None) else 0
    sharded_state, optimizer_step, host_state = sharded_state_bytes(params, grads, states, units,
                                                                    offload)
    start_of_backward = sharded_state + gathered + activations + buffers + held_grads
    # An update in place, tensor by tensor (the fused AdamW's) holds no temporary worth counting.
    # One that updates each matrix apart whole (Muon: the update takes the gradients' place) holds
    # the matrices this rank updates in one round of the exchange (about as many elements as it
    # holds, at most ROUND_ELEMENTS or the largest matrix) received, gathered, in the iteration and
    # sent back: four copies at most.
    if apart and optimizer.whole_matrices:
        largest = max(u.apart_largest for stage in stages for u in stage.units)
        optimizer_step += 4 * min(apart, max(ROUND_ELEMENTS, largest)) * FP32
    return RankMemory(pp_rank, params, grads, states, gathered, activations, buffers,
                      max(start_of_backward, optimizer_step),
                      host=host + host_state, offload=offload)


def sharded_state_bytes(params: float, grads: float, states: float, units: list,
                        offload: str) -> tuple[float, float, float]:
    """The sharded parameters, gradients and optimizer state: (their bytes on the device at the
    start of backward, at the optimizer step, on the host). Under training.offload=optimizer the
    device holds a unit's fp32 shard copied in to be gathered and its reduced gradient before it is
    copied out (the gradients accumulating, unsharded until the last microbatch, stay)."""
    if offload != "optimizer":
        return params + states, params + states + grads, 0.0
    return 2 * max((u.sharded for u in units), default=0) * FP32, 0.0, params + grads + states


def backward_buffers(units: list, stages: list[StageHoldings], blocks: list[int], costs: Costs,
                     s: Shapes, activation_checkpoint: str, float8: str | None, in_float8: dict,
                     schedule: str | None, in_flight: int) -> float:
    """What backward holds beside the saved activations: a unit's gradients, float8 weight copies,
    a pipeline's stage inputs and their gradients."""
    largest_unit = max((u.trained_gathered for u in units), default=0)
    # Backward: a unit's unsharded gradients and the reduce-scatter's copy of them. Without
    # checkpointing they appear as the block's backward frees what it saved, so only what exceeds a
    # block's activations adds to the peak; with it, they are still held while the next block's
    # forward is recomputed.
    buffers = 2 * largest_unit * FP32
    if activation_checkpoint == "none":
        buffers = max(0.0,
                      buffers - min((costs.activation_bytes(s, i) for i in blocks), default=0.0))
    if float8 is not None:
        # The float8 copies of the computing unit's weights (gathered in high precision, then cast;
        # under tensorwise a transposed copy for backward), one byte an element.
        buffers += max((u.gathered * in_float8[u.name] for u in units), default=0)
    # QLoRA: the largest 4-bit matrix dequantized, its codes as indices and its values (about
    # three copies of them at once)
    buffers += max((u.quantized_largest for u in units), default=0) * (DEQUANTIZE_BYTES
                                                                      + 3 * s.act_bytes)
    if schedule is not None:
        # Stage inputs received and their gradients, for each stage-microbatch in flight; the first
        # stage's input is token ids.
        receiving = sum(1 for stage in stages if stage.stage != 0) / len(stages)
        buffers += 2 * receiving * in_flight * s.tokens * s.model.dim * s.act_bytes
    return buffers
