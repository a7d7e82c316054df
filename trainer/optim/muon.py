"""Muon for the blocks' weight matrices, AdamW for every other parameter, as one optimizer: one
state, saved and resharded like AdamW's.

Muon (Keller Jordan's, as torch.optim.Muon writes it): a momentum buffer per matrix, the update
its Nesterov blend with the gradient, orthogonalised by a quintic Newton-Schulz iteration (each
singular value moved towards 1), then scaled so its RMS matches what AdamW's update would have
(Moonlight's rule, 0.2 x sqrt(max(rows, cols)): a run's AdamW learning rate and weight decay carry
over). Matrices are orthogonalised whole wherever they are sharded (trainer/optim/muon_exchange.py).
The embedding, the output head, the norms, biases and the routers take AdamW, as in Moonlight.

A skipped step (the trainer's `found_inf`, set on the device) leaves weights and momentum as they
were, without a host sync: its gradients are zeroed and its step scaled by zero.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.adam import adam

from trainer.config.schema import OptimConfig
from trainer.errors import ConfigError
from trainer.models.spec import ModelSpec
from trainer.optim.bf16_state import adamw_step, moments_in_bfloat16, round_stochastic
from trainer.optim.muon_exchange import MatrixExchange, ns_flops
from trainer.optim.spec import (
    OptimizerInputs,
    OptimizerSpec,
    SkippingOptimizer,
    register_optimizer,
)
from trainer.tensors import local_tensor

# the quintic of Keller Jordan's Muon and torch.optim.Muon
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
# optim.muon.rms_match -> the update's scale for a rows x cols matrix.
RMS_RULES: dict[str, Callable[[int, int], float]] = {
    # Moonlight: AdamW's lr carries over
    "match_rms_adamw": lambda rows, cols: 0.2 * math.sqrt(max(rows, cols)),
    # Keller Jordan's: its own lr (~0.02)
    "original": lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
}
RULE_TEXT = {"match_rms_adamw": "0.2 x sqrt(max(rows, cols)), AdamW's RMS",
             "original": "sqrt(max(1, rows / cols))"}
NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def ns_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """optim.ns_dtype: auto is bfloat16 on CUDA (as the references run it) and float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return NS_DTYPES[name]


def orthogonalize(x: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Matrices [..., rows, cols] -> Newton-Schulz's approximation of U V^T (x = U S V^T) for each,
    in x's dtype. After 5 steps the singular values lie in [0.68, 1.14] (measured on Gaussian
    matrices of aspect 3; bfloat16 [0.67, 1.15]), not at 1: the quintic is steep at 0 rather than
    convergent."""
    y = x.reshape(-1, *x.shape[-2:]).to(dtype)
    tall = y.size(-2) > y.size(-1)
    if tall:  # iterate on the wide side: X X^T is the smaller square
        y = y.mT
    y = y / y.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)  # every singular value <= 1
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = y @ y.mT
        y = torch.baddbmm(y, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return (y.mT if tall else y).reshape(x.shape).to(x.dtype)


def is_muon_matrix(name: str, p: torch.Tensor, blocks: str, excluded: tuple[str, ...]) -> bool:
    """Whether parameter `name` takes Muon: a block's weight matrix (a stack of them: experts), not
    one of the family's `excluded` patterns (the routers)."""
    in_block = f".{blocks}." in f".{name}"
    return in_block and p.ndim >= 2 and not any(fnmatch.fnmatch(name, pattern)
                                                for pattern in excluded)


class Muon(SkippingOptimizer):
    """Muon over the first param group (`muon=True`), fused AdamW over the others. State: each Muon
    matrix's `momentum_buffer`; AdamW's `step`, `exp_avg`, `exp_avg_sq` (torch.optim.AdamW's
    names). With `state_dtype` bfloat16, the momentum and moments are held in bfloat16 and written
    by bf16_state's stochastic rounding (its salt, a Muon matrix's own `step`), AdamW's update is
    bf16_state's."""

    def __init__(self, muon_params: list[nn.Parameter], adamw_groups: list[dict], *, lr: float,
                 weight_decay: float, betas: tuple[float, float], eps: float, momentum: float,
                 nesterov: bool, ns_steps: int, ns_dtype: torch.dtype, rms_match: str,
                 group_of: Callable, state_dtype: str = "float32"):
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, muon=False)
        groups = [{"params": muon_params, "muon": True}] if muon_params else []
        super().__init__([*groups, *adamw_groups], defaults)
        self.ns_dtype, self.rule = ns_dtype, RULE_TEXT[rms_match]
        self.scales = [RMS_RULES[rms_match](*p.shape[-2:]) for p in muon_params]
        self.exchange = MatrixExchange(muon_params, ns_steps, group_of)
        self.low = state_dtype == "bfloat16"
        if self.low:  # (torch's load_state_dict casts floating state to the parameter's dtype)
            self.register_load_state_dict_post_hook(moments_in_bfloat16)

    def update(self, skip: torch.Tensor | None) -> None:
        for group in self.param_groups:
            (self._muon if group["muon"] else self._adamw)(group, skip)

    def _muon(self, group: dict, skip: torch.Tensor | None) -> None:
        # Every matrix takes part each step (the exchange is a collective); no gradient counts as
        # zero. The update is made in the gradient's memory, which the step is the last to read.
        params, mu, lr = group["params"], group["momentum"], group["lr"]
        keep = 1.0 if skip is None else 1 - skip
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    p, dtype=torch.bfloat16 if self.low else p.dtype)
                if self.low:
                    state["step"] = torch.zeros((), device=local_tensor(p).device)
            held = local_tensor(state["momentum_buffer"])
            buf = held.float() if self.low else held
            grad = local_tensor(p.grad) if p.grad is not None else torch.zeros_like(buf)
            if skip is not None:
                # a non-finite gradient must not reach the buffer
                grad.masked_fill_(skip.bool(), 0.0)
            buf.lerp_(grad, keep * (1 - mu) if skip is not None else 1 - mu)
            if self.low:  # (a kept bfloat16 value rounds to itself)
                state["step"].add_(keep)
                held.copy_(round_stochastic(buf, state["step"].to(torch.int64)))
            updates.append(grad.lerp_(buf, mu) if group["nesterov"] else grad.copy_(buf))
        self.exchange.orthogonalize(updates, self._orthogonalize, updates)
        for p, update, scale in zip(params, updates, self.scales):
            weight = local_tensor(p)
            weight.mul_(1 - lr * group["weight_decay"] * keep)
            weight.add_(update.mul_(-lr * scale * keep))

    def _orthogonalize(self, matrices: torch.Tensor) -> torch.Tensor:
        return orthogonalize(matrices, self.param_groups[0]["ns_steps"], self.ns_dtype)

    def _adamw(self, group: dict, skip: torch.Tensor | None) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if self.low:
            keep = None if skip is None else ~skip.bool()
            for p in params:
                adamw_step(p, self.state[p], group, keep)
            return
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=local_tensor(p).device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam(params, [p.grad for p in params], [s["exp_avg"] for s in states],
             [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], fused=True,
             found_inf=skip, decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def describe(self) -> str:
        """What takes Muon, what AdamW, and this rank's share of the work (one start-up line)."""
        muon = (self.param_groups[0]["params"] if self.param_groups and self.param_groups[0]["muon"]
                else [])
        others = [p for g in self.param_groups if not g["muon"] for p in g["params"]]
        matrices = sum(math.prod(p.shape[:-2]) for p in muon)
        group = self.param_groups[0] if muon else self.defaults
        moved = self.exchange.elements_moved() * 4 / 2**20
        return (f"optimizer: Muon for {matrices} block matrices "
                f"({sum(p.numel() for p in muon) / 1e6:.2f}M parameters; momentum "
                f"{group['momentum']}{', Nesterov' if group['nesterov'] else ''}, "
                f"{group['ns_steps']} Newton-Schulz steps in "
                f"{str(self.ns_dtype).removeprefix('torch.')}, update RMS scaled by {self.rule}), "
                f"AdamW for the {len(others)} others ({sum(p.numel() for p in others) / 1e6:.2f}M: "
                "embedding, output, norms, biases, routers); this rank orthogonalises "
                f"{self.exchange.matrices_here()} of them, sending {moved:.2f} MiB a step each way")


@dataclass
class MuonRules:
    # The update's scale: match_rms_adamw (0.2 x sqrt(max(rows, cols)): training.lr and weight_decay
    # as for AdamW) | original (sqrt(max(1, rows / cols)):
    # Keller Jordan's Muon, its own learning rate).
    rms_match: str = "match_rms_adamw"


@dataclass
class MuonConfig(OptimConfig):
    """optim=muon: the shared keys (beta1, beta2 and eps are its AdamW's), and Muon's own: momentum
    and Nesterov, the Newton-Schulz steps and their dtype (auto: bfloat16 on CUDA, float32
    elsewhere)."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: str = "auto"
    muon: MuonRules = field(default_factory=MuonRules)


def check(cfg: MuonConfig) -> None:
    if not 0 <= cfg.momentum < 1:
        raise ConfigError(f"optim.momentum={cfg.momentum} must be in [0, 1)")
    if cfg.ns_steps < 1:
        raise ConfigError(f"optim.ns_steps={cfg.ns_steps} must be >= 1")
    for key, value, choices in (("ns_dtype", cfg.ns_dtype, ["auto", *NS_DTYPES]),
                                ("muon.rms_match", cfg.muon.rms_match, list(RMS_RULES))):
        if value not in choices:
            raise ConfigError(f"optim.{key}={value} must be one of {choices}")


def build(inputs: OptimizerInputs) -> Muon:
    cfg = inputs.cfg
    return Muon(inputs.apart, inputs.groups, lr=inputs.lr, weight_decay=inputs.weight_decay,
                betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, momentum=cfg.momentum,
                nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                ns_dtype=ns_dtype(cfg.ns_dtype, inputs.device), rms_match=cfg.muon.rms_match,
                group_of=inputs.group_of, state_dtype=cfg.state_dtype)


def takes_muon(name: str, p: torch.Tensor, spec: ModelSpec) -> bool:
    return is_muon_matrix(name, p, spec.blocks, spec.adamw_matrices)


MUON = register_optimizer(OptimizerSpec(
    name="muon", build=build, config=MuonConfig, check=check, apart=takes_muon,
    state_words=2.0, apart_state_words=1.0,  # AdamW's two moments; a Muon matrix's momentum
    state_dtypes=("float32", "bfloat16"),
    recasts_state=False,  # its bfloat16 state adds a step count to each matrix (the rounding's)
    whole_matrices=True, matrix_flops=lambda rows, cols, cfg: ns_flops(rows, cols, cfg.ns_steps),
    matrix_dtype=lambda cfg, device_kind: ns_dtype(cfg.ns_dtype, device_kind),
    step_work="the Newton-Schulz iterations and the exchange of matrix pieces",
))
