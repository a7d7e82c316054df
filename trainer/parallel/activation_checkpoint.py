"""Activation checkpointing: what a block keeps for backward and what it recomputes.

- `full`: the block keeps only its input and runs its whole forward again in backward; with
  `every=N`, only every Nth block (the first, the N+1th, ...) is checkpointed, the others keep all.
- `selective`: every block keeps the outputs of its attention, its reduce-scatters and Ulysses'
  all-to-alls (the most expensive work, and collectives not worth repeating) and recomputes the
  cheap element-wise ops (norms, rotary embedding, SiLU, products) in backward. Of its matmuls,
  policy `ops` keeps every output; `half_mm` every second one (the first, third, ... of the block,
  counted alike in forward and in the recompute), recomputing the others: less memory for a sixth
  more matmul work.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

MODES = ("none", "full", "selective")
POLICIES = ("half_mm", "ops")

_aten = torch.ops.aten
MATMULS = (_aten.mm.default, _aten._scaled_mm.default)  # (the second: float8's)
SAVED_OPS = {
    *MATMULS,
    _aten.addmm.default,
    _aten._grouped_mm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_to_all_single.default,  # Ulysses'
}


def _keep_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _half_mm_contexts():
    """A fresh policy for one checkpointed call: every second matmul is recomputed."""
    seen = {False: 0, True: 0}  # matmuls met in forward, and in the recompute

    def keep(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in MATMULS:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _keep_expensive(ctx, op)

    return create_selective_checkpoint_contexts(keep)


def apply_activation_checkpoint(blocks: nn.ModuleDict, mode: str, every: int = 1,
                                regions: Callable[[nn.Module], list[nn.Module]] | None = None,
                                policy: str = "half_mm") -> None:
    """Checkpoints the blocks (keyed by their index in the whole model, so a pipeline stage
    checkpoints the same blocks as one rank holding them all).

    `regions` (the family's, given when each block's experts are an FSDP unit of their own under
    expert parallel): the parts of a block checkpointed each on its own under `selective`. The
    experts' FSDP hooks gather and free parameters inside the block, a different number of times in
    the recompute than in forward, which torch's (2.13) selective checkpointing takes for a replay
    mismatch; checkpointed apart, the unit's hooks run outside, and the rest (norms, router) keeps
    what it saves.
    """
    if mode == "none":
        return
    options = {}
    if mode == "selective":
        options["context_fn"] = (_half_mm_contexts if policy == "half_mm"
                                 else partial(create_selective_checkpoint_contexts,
                                              _keep_expensive))
    for name, block in blocks.items():
        if mode == "full" and int(name) % every:
            continue
        for module in regions(block) if mode == "selective" and regions is not None else [block]:
            _checkpoint_forward(module, options)


def _checkpoint_forward(module: nn.Module, options: dict) -> None:
    # Wrapping the bound forward (rather than the module) keeps every parameter name unchanged,
    # so initialisation and checkpoints see the same names with and without it; and a module's
    # own hooks (FSDP's) run outside the checkpointed region.
    forward = module.forward
    module.forward = lambda *args, _forward=forward, **kwargs: checkpoint(
        _forward, *args, use_reentrant=False, **options, **kwargs
    )
