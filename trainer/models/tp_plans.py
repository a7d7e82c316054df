"""Tensor-parallel plans (Megatron-style) for the shared building blocks, as data, and the styles
they need beside torch's: the output head's (`LMHeadParallel`), a norm's (or a low-rank
projection's) outside sequence parallel (`ReplicateParameters`), and a tensor every rank's heads
share (`SumGradients`). A family's plan (its parallelize.py) is the union of the pieces its blocks
use.

Within a block, q/k/v and the SwiGLU gate/up projections are split by output (column-wise) and the
attention output and down projections by input (row-wise), so each block needs one collective
before it and one after. With sequence parallel the norms and the residual stream between those
regions are split on the sequence dimension instead of replicated. With loss parallel the output
projection is split on the vocabulary and the loss is computed on the shards (trainer.models.head).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def between_blocks(sequence_parallel: bool) -> Placement:
    """How the residual stream lies between the tensor-parallel regions."""
    return Shard(1) if sequence_parallel else Replicate()


def edge_plan(sequence_parallel: bool, loss_parallel: bool) -> dict:
    """The embedding, the final norm and the output head; the norms of every block."""
    between = between_blocks(sequence_parallel)
    # Without sequence parallel the norms still hold their weights as replicated DTensors on the tp
    # mesh, so that every parameter lives on one mesh (the optimizer's and clipping's foreach ops).
    norm = SequenceParallel() if sequence_parallel else ReplicateParameters()
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "norm": norm,
        "output": LMHeadParallel(between, vocab_parallel=loss_parallel),
        "layers.*.attention_norm": norm,
        "layers.*.ffn_norm": norm,
    }


def attention_plan(sequence_parallel: bool) -> dict:
    """Grouped-query attention: q/k/v split on the heads, the output projection reduced back."""
    between = between_blocks(sequence_parallel)
    return {
        # The second input, the positions, is the same on every tp rank and stays a plain tensor.
        "layers.*.attention": PrepareModuleInput(input_layouts=(between, None),
                                                 desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=between),
    }


def qk_norm_plan() -> dict:
    """Under tensor parallel each rank holds its share of the heads: the q/k norms take their input
    as split on the heads dimension (2 of [batch, seq, heads, head_dim]), so their replicated
    weight's gradient is summed over the tp ranks."""
    return {f"layers.*.attention.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True)
            for norm in ("q_norm", "k_norm")}


def feed_forward_plan(sequence_parallel: bool, path: str = "layers.*.feed_forward") -> dict:
    """A SwiGLU feed-forward at `path`: the sequence gathered, gate and up column-wise, down
    row-wise and reduced (reduce-scattered under sequence parallel) back."""
    between = between_blocks(sequence_parallel)
    return {
        path: PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        f"{path}.w1": ColwiseParallel(),
        f"{path}.w3": ColwiseParallel(),
        f"{path}.w2": RowwiseParallel(output_layouts=between),
    }


def moe_plan(sequence_parallel: bool, path: str = "layers.*.feed_forward") -> dict:
    """An MoE layer at `path`: each tp rank routes its own slice of the sequence (see
    trainer/parallel/expert_parallel.py); its shared experts, if any, are a feed-forward on every
    token."""
    between = between_blocks(sequence_parallel)
    return {
        path: PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(between,),
                                 use_local_output=True),
        **feed_forward_plan(sequence_parallel, f"{path}.shared"),
    }


class SumGradients(ParallelStyle):
    """A module without parameters whose output (the same on every tp rank) each rank's share of the
    heads uses (MLA's rotary key): in backward its gradient is summed over the tp ranks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def output_fn(mod, output, mesh):
            # A replicated tensor whose gradient is a partial
            # sum on each rank: all-reduced in backward.
            shared = DTensor.from_local(output, mesh, [Replicate()], run_check=False)
            return shared.to_local(grad_placements=[Partial()])

        return distribute_module(module, device_mesh, output_fn=output_fn)


class ReplicateParameters(ParallelStyle):
    """The module's parameters become DTensors replicated on the mesh; its inputs and outputs stay
    plain tensors (a norm outside sequence parallel)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            input_fn=lambda mod, inputs, mesh: tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs
            ),
            output_fn=lambda mod, output, mesh: output.to_local(),
        )


class LMHeadParallel(ParallelStyle):
    """The output head with its loss (an LMHead) on the tp mesh. Its input, the hidden states laid
    out as `input_layout` (Shard(1) under sequence parallel), is gathered whole on every rank. With
    `vocab_parallel` its weight is split on the vocabulary (each rank computes its shard's logits;
    the input's gradient is a partial sum, reduced by the layout), else replicated (each rank
    computes the whole loss)."""

    def __init__(self, input_layout: Placement, vocab_parallel: bool):
        super().__init__()
        self.input_layout, self.vocab_parallel = input_layout, vocab_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        placement = Shard(0) if self.vocab_parallel else Replicate()

        def partition(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key,
                                       nn.Parameter(distribute_tensor(param, mesh, [placement])))

        def gather_input(mod, inputs, mesh):
            h, *rest = inputs
            if not isinstance(h, DTensor):  # (sequence parallel's norm hands on a DTensor)
                h = DTensor.from_local(h, mesh, [self.input_layout], run_check=False)
            h = h.redistribute(mesh, [Replicate()])
            grad = Partial() if self.vocab_parallel else Replicate()
            return (h.to_local(grad_placements=[grad]), *rest)

        return distribute_module(module, device_mesh, partition, gather_input)
