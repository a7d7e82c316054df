"""Tensor parallel (Megatron-style) with sequence parallel and loss parallel, on the tp submesh.

Within a block, q/k/v and the SwiGLU gate/up projections are split by output (column-wise) and
the attention output and down projections by input (row-wise), so each block needs one
collective before it and one after. With sequence parallel, the norms and the residual stream
between those regions are split on the sequence dimension instead of replicated. With loss
parallel, the output projection stays split on the vocabulary and the loss is computed on the
shards (see `loss_parallel_context`).
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from trainer.models.moe import MoE


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    # Between the TP regions activations are split on the sequence (SP) or whole on every rank.
    between = Shard(1) if sequence_parallel else Replicate()
    if not sequence_parallel:
        # Norms still hold their weights as replicated DTensors on the tp mesh, so that every
        # parameter lives on one mesh (the optimizer's and clipping's foreach ops need that).
        for name, module in model.named_modules():
            if name.endswith("norm"):
                _replicate(module, tp_mesh)
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            # Loss parallel needs the logits as a DTensor to know they are split on the vocabulary.
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    # A pipeline stage may lack the embedding, the norm or the head.
    parallelize_module(model, tp_mesh, {name: style for name, style in plan.items() if getattr(model, name) is not None})
    for block in model.layers.values():
        if isinstance(block.feed_forward, MoE):
            # Each tp rank routes its own slice of the sequence (see expert_parallel.py).
            ffn_plan = {"feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(between,),
                                                           use_local_output=True)}
        else:
            ffn_plan = {
                "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=between),
            }
        plan = {
            # The second input, the positions, is the same on every tp rank and stays a plain tensor.
            "attention": PrepareModuleInput(input_layouts=(between, None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            **ffn_plan,
        }
        if sequence_parallel:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        parallelize_module(block, tp_mesh, plan)


def _replicate(module: nn.Module, mesh: DeviceMesh) -> None:
    """Replicated DTensor parameters; plain tensors in and out."""
    distribute_module(
        module,
        mesh,
        input_fn=lambda mod, inputs, mesh: tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs
        ),
        output_fn=lambda mod, output, mesh: output.to_local(),
    )


def loss_parallel_context(enabled: bool):
    """Where forward's loss and backward run: cross-entropy on vocabulary-split logits needs it."""
    return loss_parallel() if enabled else contextlib.nullcontext()
