"""AdamW with its two moments held in bfloat16 (`optim.state_dtype=bfloat16`): 4 bytes of state a
parameter element instead of 8. The fp32 master weights are updated in fp32 as usual: each step
widens a parameter's moments to fp32, updates them and the weight there, and stores the moments
back by stochastic rounding, so an update smaller than a bfloat16 step (beta2's 1 - 0.999 of the
second moment) still moves it on average instead of being rounded away.

The rounding's random bits are a hash of the bits the value keeps and of the step, not a generator's
draw: every layout, holding any slice of a parameter, rounds each element alike, so a sharded run
equals one process at the same state precision.
"""

from __future__ import annotations

import torch

from trainer.optim.spec import SkippingOptimizer
from trainer.tensors import local_tensor

_LOW = 0xFFFF  # the 16 bits of an fp32 value that bfloat16 drops
# odd multipliers below 2**31 (products of 32-bit values stay inside int64)
_MIX = (0x5BD1E995, 0x27D4EB2D, 0x165667B1)


def hash16(key: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
    """16 random-looking bits (int64 in [0, 2**16)) of each element of `key` (int64, below 2**32)
    and `salt`: the same element's bits wherever a layout holds it."""
    h = key * _MIX[0] + salt * _MIX[1]
    h = ((h ^ (h >> 15)) & 0xFFFFFFFF) * _MIX[2]
    return (h ^ (h >> 13)) & _LOW


def round_stochastic(x: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
    """fp32 `x` to bfloat16, rounding each magnitude up with the probability of its dropped bits'
    share of a bfloat16 step; the random bits hash its kept bits and `salt` (an integer tensor)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + hash16((bits & ~_LOW) >> 16, salt)) & 0xFFFF0000
    # back to int32's range (the sign bit), then the exact bfloat16 the fp32 value now is
    return torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32).view(
        torch.float32).to(torch.bfloat16)


def moments_in_bfloat16(optimizer: torch.optim.Optimizer) -> None:
    """After a load (a bfloat16 checkpoint's or an fp32 one's), the moments (Muon's momentum too) in
    bfloat16 again."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if key in state:
                state[key] = state[key].to(torch.bfloat16)


class PerParameterAdamW(SkippingOptimizer):
    """AdamW (decoupled weight decay, torch.optim.AdamW's update) stepping one parameter at a time:
    `step_parameter(p, state, group, keep)` (keep: None, or 0 to leave weights, state and step
    count as they were: `found_inf`), `after_load(optimizer)` (torch's load_state_dict casts
    floating state to the parameter's dtype, fp32: the hook puts it back in its own)."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.register_load_state_dict_post_hook(type(self).after_load)

    def update(self, skip: torch.Tensor | None) -> None:
        keep = None if skip is None else ~skip.bool()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.step_parameter(p, self.state[p], group, keep)

    def step_parameter(self, p: torch.Tensor, state: dict, group: dict,
                       keep: torch.Tensor | None) -> None:
        raise NotImplementedError

    @staticmethod
    def after_load(optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError


class AdamWBF16State(PerParameterAdamW):
    """AdamW with the moments in bfloat16 (state names torch.optim.AdamW's: `step`, `exp_avg`,
    `exp_avg_sq`)."""

    def step_parameter(self, p, state, group, keep) -> None:
        adamw_step(p, state, group, keep)

    after_load = staticmethod(moments_in_bfloat16)


def adamw_step(p: torch.Tensor, state: dict, group: dict, keep: torch.Tensor | None) -> None:
    """One AdamW step of `p` with its moments in bfloat16 (`state`: its optimizer state, filled on
    the first); `keep`: 0 leaves everything as it was."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=local_tensor(p).device)
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
    weight, grad = local_tensor(p), local_tensor(p.grad)
    m_low, v_low = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
    step = state["step"] + (1 if keep is None else keep.float())
    # A chunk at a time: the fp32 and int64 temporaries of a large shard (an embedding's) stay
    # small.
    tensors = (weight, grad, m_low, v_low)
    chunks = (zip(*(t.view(-1).split(CHUNK) for t in tensors))
              if all(t.is_contiguous() for t in tensors) else [tensors])
    for chunk in chunks:
        _update_chunk(*chunk, group, step, keep)
    state["step"].copy_(step)


CHUNK = 1 << 22  # elements


def adamw_math(weight: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
               group: dict, step: torch.Tensor) -> torch.Tensor:
    """One AdamW step in fp32: moves the moments `m` and `v` in place and returns the new weight."""
    beta1, beta2 = group["betas"]
    lr, grad = group["lr"], grad.float()
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    # (bias corrections as device tensors: no host sync on the step count)
    denom = (v.sqrt() / (1 - beta2**step).sqrt()).add_(group["eps"])
    update = m / denom * (-lr / (1 - beta1**step))
    return weight * (1 - lr * group["weight_decay"]) + update


def _update_chunk(weight: torch.Tensor, grad: torch.Tensor, m_low: torch.Tensor,
                  v_low: torch.Tensor, group: dict, step: torch.Tensor,
                  keep: torch.Tensor | None) -> None:
    m, v = m_low.float(), v_low.float()
    new_weight = adamw_math(weight, grad, m, v, group, step)
    salt = step.to(torch.int64)
    m, v = round_stochastic(m, 2 * salt), round_stochastic(v, 2 * salt + 1)
    if keep is not None:
        new_weight = torch.where(keep, new_weight, weight)
        m, v = torch.where(keep, m, m_low), torch.where(keep, v, v_low)
    weight.copy_(new_weight)
    m_low.copy_(m)
    v_low.copy_(v)
