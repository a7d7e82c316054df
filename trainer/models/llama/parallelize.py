"""Llama's tensor-parallel plan (Megatron-style), as data.

Within a block, q/k/v and the SwiGLU gate/up projections are split by output (column-wise) and the
attention output and down projections by input (row-wise), so each block needs one collective
before it and one after. With sequence parallel the norms and the residual stream between those
regions are split on the sequence dimension instead of replicated. With loss parallel the output
projection is split on the vocabulary and the loss is computed on the shards.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from trainer.parallel.tensor_parallel import LMHeadParallel, ReplicateParameters


def edge_plan(sequence_parallel: bool, loss_parallel: bool) -> dict:
    """The embedding, the final norm and the output head; the norms of every block."""
    between = Shard(1) if sequence_parallel else Replicate()
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
    between = Shard(1) if sequence_parallel else Replicate()
    return {
        # The second input, the positions, is the same on every tp rank and stays a plain tensor.
        "layers.*.attention": PrepareModuleInput(input_layouts=(between, None),
                                                 desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=between),
    }


def tp_plan(sequence_parallel: bool, loss_parallel: bool) -> dict:
    between = Shard(1) if sequence_parallel else Replicate()
    return {
        **edge_plan(sequence_parallel, loss_parallel),
        **attention_plan(sequence_parallel),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=between),
    }
