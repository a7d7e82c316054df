"""AdamW: torch's fused kernel with two fp32 moments per parameter element, or (optim.state_dtype=
bfloat16) trainer/optim/bf16_state.py's, with two bfloat16 ones, or (float8) f8_state.py's, with two
blockwise float8 ones."""

from __future__ import annotations

import torch

from trainer.optim.bf16_state import AdamWBF16State
from trainer.optim.f8_state import AdamWF8State
from trainer.optim.spec import OptimizerInputs, OptimizerSpec, register_optimizer


def build(inputs: OptimizerInputs) -> torch.optim.Optimizer:
    cfg = inputs.cfg
    own = {"bfloat16": AdamWBF16State, "float8": AdamWF8State}.get(cfg.state_dtype)
    if own is not None:
        return own(inputs.groups, lr=inputs.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    return torch.optim.AdamW(inputs.groups, lr=inputs.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=True)


ADAMW = register_optimizer(OptimizerSpec(name="adamw", build=build,
                                                 state_dtypes=("float32", "bfloat16", "float8")))
