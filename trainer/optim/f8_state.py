"""AdamW with its two moments in 8 bits (`optim.state_dtype=float8`): a little over a byte of state
a moment and parameter element instead of 4. Each moment is held blockwise, as the microscaling
formats hold a tensor: 32 consecutive elements of a row share one power-of-two scale (its exponent
in an int8), and each element is a byte, an 8-bit float of its value over that scale: 8.25 bits an
element. The first moment's bytes are e4m3 (a sign, 4 exponent bits, 3 of mantissa); the second
moment is held as its square root, never negative, so its bytes spend the sign bit on a fourth bit
of mantissa, and its range below a block's largest (2**19 of the root) spans 2**38 of it.

Rounding into the bytes is stochastic, as into bf16_state's bfloat16: a step of the second moment
(1 - beta2 of it) is far below a byte's step (1/16 to 1/32 of the value), and rounding to nearest
would freeze it. The random bits hash the value's bits and the step, so every layout rounds each
element alike.

The moments of a tensor of two or more dimensions whose last dimension is a multiple of 32 are held
so: its blocks never straddle rows, and a shard of whole rows, or of the last dimension cut at
multiples of 32, holds whole blocks (a layout cutting it elsewhere is refused before launch). The
others' (norm weights, biases) stay in fp32.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import RowwiseParallel

from trainer.errors import ConfigError
from trainer.optim.bf16_state import CHUNK, PerParameterAdamW, adamw_math, hash16
from trainer.tensors import local_tensor

BLOCK = 32  # elements of a row sharing a scale
# Fewer warmup steps at a high lr: the first moment's rounding can turn one of the first steps'
# gradient spikes into a loss spike (docs/memory.md); the run says so at start-up.
SAFE_WARMUP_STEPS = 10
# A block's values over 2**exponent are below 2**TOP_BITS; each is a small float in a byte: 4
# exponent bits (binades from 2**MIN_EXP up, and one of evenly spaced values below), then the
# mantissa's bits below the leading one: 3 behind a sign bit (the first moment: e4m3), 4 where the
# value is never negative (the second's root).
TOP_BITS = 8
MIN_EXP = TOP_BITS - 15
LARGEST = {True: 15 * 2.0**4, False: 31 * 2.0**3}  # the largest code's value, by signedness
# state keys: each moment's codes, its blocks' exponents, and whether its codes hold a sign
MOMENTS = (("exp_avg_codes", "exp_avg_exps", True),
           ("exp_avg_sq_root_codes", "exp_avg_sq_root_exps", False))


def warmup_note(state_dtype: str, warmup_steps: int) -> str | None:
    """The start-up line of float8 state with fewer than SAFE_WARMUP_STEPS warmup steps."""
    if state_dtype != "float8" or warmup_steps >= SAFE_WARMUP_STEPS:
        return None
    return (f"note: optim.state_dtype=float8 with training.warmup_steps={warmup_steps}: its "
            "rounding can turn an early gradient spike into a loss spike (docs/memory.md); warm "
            f"up for {SAFE_WARMUP_STEPS} steps or more")


def held_in_blocks(p: torch.Tensor) -> bool:
    """Whether `p`'s moments are held in bytes (by its whole shape: alike in every layout)."""
    return p.ndim >= 2 and p.shape[-1] % BLOCK == 0


def to_code(x: torch.Tensor, salt: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 `x` (|x| below LARGEST[signed]) as a byte's code (int64), its magnitude rounded up with
    the probability of its distance past the code below over the codes' step there. Unsigned codes
    round a value above zero to one above zero (a root of 0 would leave the update unbounded)."""
    mantissa = 3 if signed else 4
    magnitude = x.abs()
    _, exponent = torch.frexp(magnitude)  # magnitude in [2**(exponent - 1), 2**exponent)
    binade = torch.where(magnitude > 0, exponent - 1, MIN_EXP).clamp_(min=MIN_EXP)
    units = torch.ldexp(magnitude, mantissa - binade)  # in steps of the code's spacing
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    steps = (units + hash16(bits, salt).float() / 2.0**16).floor_().to(torch.int64)
    if not signed:
        steps = torch.where(magnitude > 0, steps.clamp(min=1), steps)
    # (a step rounded up into the next binade is that binade's first code: the sum carries over)
    code = ((binade - MIN_EXP) << mantissa) + steps
    return code | ((x < 0).to(torch.int64) << 7) if signed else code


def from_code(code: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 values of `code` (int64) over their block's scale."""
    mantissa = 3 if signed else 4
    magnitude_code = code & 0x7F if signed else code
    above = ((magnitude_code >> mantissa) - 1).clamp_(min=0)  # binades above the first
    value = torch.ldexp((magnitude_code - (above << mantissa)).float(),
                        above + (MIN_EXP - mantissa))
    return torch.where(code >= 128, -value, value) if signed else value


def encode(x: torch.Tensor, salt: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 `x` (a multiple of BLOCK long) as (uint8 codes, int8 block exponents)."""
    blocks = x.view(-1, BLOCK)
    # (the largest value below the largest code's, so that rounding up stays inside the codes)
    _, top = torch.frexp(blocks.abs().amax(dim=1) * (2**TOP_BITS / LARGEST[signed]))
    exponents = (top - TOP_BITS).clamp_(-127, 127)
    codes = to_code(torch.ldexp(blocks, -exponents[:, None]), salt, signed)
    return codes.to(torch.uint8).view(-1), exponents.to(torch.int8)


def decode(codes: torch.Tensor, exponents: torch.Tensor, signed: bool) -> torch.Tensor:
    """The flat fp32 values of `codes` and their blocks' `exponents`."""
    blocks = from_code(codes.view(-1, BLOCK).to(torch.int64), signed)
    return torch.ldexp(blocks, exponents.to(torch.int64)[:, None]).view(-1)


def _blocks_like(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An int8 per block of `p`'s rows, sharded as `p` is (a DTensor of p's mesh and placements)."""
    local = local_tensor(p)
    t = torch.zeros(*local.shape[:-1], local.shape[-1] // BLOCK, dtype=torch.int8, device=device)
    if not isinstance(p, DTensor):
        return t
    shape = torch.Size((*p.shape[:-1], p.shape[-1] // BLOCK))
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _grid_cut(width: int, cut: int) -> ConfigError:
    return ConfigError(f"optim.state_dtype=float8 holds blocks of {BLOCK} elements of a row; this "
                       f"layout cuts a parameter's last dimension {width} into {cut}: choose a "
                       f"parallel.tp that divides it into multiples of {BLOCK}")


def _check_grid(p: torch.Tensor) -> None:
    """At the build, every parameter as laid out (the experts' own sharding included)."""
    local = local_tensor(p)
    if local.shape[-1] % BLOCK:
        raise _grid_cut(p.shape[-1], local.shape[-1])


def rowwise_inputs(model: nn.Module, plan: dict) -> set[int]:
    """The input widths of `model`'s linear layers that tensor parallel's `plan` cuts by input
    (RowwiseParallel: the weight's last dimension) and whose moments are held in blocks."""
    return {module.in_features for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and held_in_blocks(module.weight)
            and any(isinstance(style, RowwiseParallel) and fnmatch(name, path)
                    for path, style in plan.items())}


def check_tp_grid(widths: set[int], tp: int) -> None:
    """Before launch: each of those `widths` (rowwise_inputs) leaves whole blocks on every tp
    rank."""
    for width in sorted(widths):
        if width // tp % BLOCK:
            raise _grid_cut(width, width // tp)


def _codes_back(optimizer: torch.optim.Optimizer) -> None:
    """After a load, the codes and exponents in their own dtypes again (torch's load_state_dict
    casts every state tensor to its parameter's dtype; the values are exact in fp32)."""
    for state in optimizer.state.values():
        for codes, exponents, _ in MOMENTS:
            if codes in state:
                state[codes], state[exponents] = (state[codes].to(torch.uint8),
                                                  state[exponents].to(torch.int8))


class AdamWF8State(PerParameterAdamW):
    """AdamW with the moments in blockwise bytes where held_in_blocks (state: `step` and MOMENTS'
    keys), fp32 elsewhere (`exp_avg`, `exp_avg_sq`)."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float):
        super().__init__(groups, lr=lr, betas=betas, eps=eps)
        for group in self.param_groups:
            for p in group["params"]:
                if held_in_blocks(p):
                    _check_grid(p)

    after_load = staticmethod(_codes_back)

    def step_parameter(self, p, state, group, keep) -> None:
        device = local_tensor(p).device
        blocked = held_in_blocks(p)
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            for codes, exponents, _ in MOMENTS if blocked else ():
                state[codes] = torch.zeros_like(p, dtype=torch.uint8)
                state[exponents] = _blocks_like(p, device)
            for key in () if blocked else ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step = state["step"] + (1 if keep is None else keep.float())
        weight = local_tensor(p)
        flat = weight.view(-1) if weight.is_contiguous() else weight.reshape(-1).clone()
        grad = local_tensor(p.grad).reshape(-1)
        if blocked:
            held = [local_tensor(state[key]).view(-1) for *keys, _ in MOMENTS for key in keys]
            _update_blocks(flat, grad, *held, group, step, keep)
        else:
            m, v = (local_tensor(state[key]).view(-1) for key in ("exp_avg", "exp_avg_sq"))
            _update_fp32(flat, grad, m, v, group, step, keep)
        if flat.data_ptr() != weight.data_ptr():
            weight.copy_(flat.view_as(weight))
        state["step"].copy_(step)


def _update_fp32(weight, grad, m, v, group, step, keep) -> None:
    new_m, new_v = m.clone(), v.clone()
    new_weight = adamw_math(weight, grad, new_m, new_v, group, step)
    for old, new in ((weight, new_weight), (m, new_m), (v, new_v)):
        old.copy_(new if keep is None else torch.where(keep, new, old))


def _update_blocks(weight, grad, m_codes, m_exps, r_codes, r_exps, group, step, keep) -> None:
    """A chunk at a time (whole blocks): the fp32 and int64 temporaries stay small."""
    salt = step.to(torch.int64)
    chunks = zip(weight.split(CHUNK), grad.split(CHUNK), m_codes.split(CHUNK),
                 m_exps.split(CHUNK // BLOCK), r_codes.split(CHUNK), r_exps.split(CHUNK // BLOCK))
    for w, g, mc, me, rc, re in chunks:
        m, root = decode(mc, me, signed=True), decode(rc, re, signed=False)
        v = root * root
        new_weight = adamw_math(w, g, m, v, group, step)
        held = (*encode(m, 2 * salt, signed=True), *encode(v.sqrt_(), 2 * salt + 1, signed=False))
        if keep is not None:
            new_weight = torch.where(keep, new_weight, w)
            held = tuple(torch.where(keep, new, old) for new, old in zip(held, (mc, me, rc, re)))
        w.copy_(new_weight)
        for old, new in zip((mc, me, rc, re), held):
            old.copy_(new)
