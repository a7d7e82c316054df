"""AdamW (torch's fused kernel): two fp32 moments per parameter element."""

from __future__ import annotations

import torch

from trainer.optim.spec import OptimizerInputs, OptimizerSpec, register_optimizer


def build(inputs: OptimizerInputs) -> torch.optim.Optimizer:
    cfg = inputs.cfg
    return torch.optim.AdamW(inputs.groups, lr=inputs.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=True)


ADAMW = register_optimizer(OptimizerSpec(name="adamw", build=build))
