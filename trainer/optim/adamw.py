"""AdamW: torch's fused kernel with two fp32 moments per parameter element, or (optim.state_dtype=
bfloat16) trainer/optim/bf16_state.py's, with two bfloat16 ones."""

from __future__ import annotations

import torch

from trainer.optim.bf16_state import AdamWBF16State
from trainer.optim.spec import OptimizerInputs, OptimizerSpec, register_optimizer


def build(inputs: OptimizerInputs) -> torch.optim.Optimizer:
    cfg = inputs.cfg
    if cfg.state_dtype == "bfloat16":
        return AdamWBF16State(inputs.groups, lr=inputs.lr, betas=(cfg.beta1, cfg.beta2),
                              eps=cfg.eps)
    return torch.optim.AdamW(inputs.groups, lr=inputs.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=True)


ADAMW = register_optimizer(OptimizerSpec(name="adamw", build=build,
                                                 state_dtypes=("float32", "bfloat16")))
