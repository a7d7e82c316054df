"""DeepSeek-V3's tensor-parallel plan: MLA's low-rank down projections and latent norms replicated,
its up projections split on the heads (column-wise) and the output projection row-wise; the dense
blocks' feed-forward and the MoE blocks' layer as the shared blocks'
(trainer/models/tp_plans.py)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from trainer.models.deepseek_v3.model import DeepseekV3Config
from trainer.models.tp_plans import (
    ReplicateParameters,
    SumGradients,
    between_blocks,
    edge_plan,
    feed_forward_plan,
    moe_plan,
)


def tp_plan(cfg: DeepseekV3Config, sequence_parallel: bool, loss_parallel: bool) -> dict:
    between = between_blocks(sequence_parallel)
    attention = {
        # The input gathered whole on every rank, as a plain
        # tensor: the replicated projections take it so.
        "layers.*.attention": PrepareModuleInput(input_layouts=(between, None),
                                                 desired_input_layouts=(Replicate(), None),
                                                 use_local_output=True),
        **{f"layers.*.attention.{name}": ColwiseParallel() for name in ("wq", "wq_b", "wkv_b")},
        **{f"layers.*.attention.{name}": ReplicateParameters()
           for name in ("wq_a", "q_norm", "wkv_a", "kv_norm")},
        "layers.*.attention.rope_key": SumGradients(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=between),
    }
    blocks = {}
    for i in range(cfg.n_layers):
        plan = feed_forward_plan if i < cfg.n_dense_layers else moe_plan
        blocks |= plan(sequence_parallel, f"layers.{i}.feed_forward")
    return {**edge_plan(sequence_parallel, loss_parallel), **attention, **blocks}


def tp_divides(cfg: DeepseekV3Config) -> dict[str, int]:
    """Heads, the dense blocks' feed-forward, the shared experts (each ffn_dim wide)."""
    return {"n_heads": cfg.n_heads, "dense_ffn_dim": cfg.dense_ffn_dim, "ffn_dim": cfg.ffn_dim}
