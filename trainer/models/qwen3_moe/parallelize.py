"""Qwen3-MoE's tensor-parallel plan: the shared blocks' (trainer/models/tp_plans.py), with the q/k
norms."""

from __future__ import annotations

from trainer.config.schema import ModelConfig
from trainer.models.tp_plans import attention_plan, edge_plan, moe_plan, qk_norm_plan


def tp_plan(cfg: ModelConfig, sequence_parallel: bool, loss_parallel: bool) -> dict:
    return {**edge_plan(sequence_parallel, loss_parallel), **attention_plan(sequence_parallel),
            **qk_norm_plan(), **moe_plan(sequence_parallel)}
