"""How an MoE layer chooses each token's experts and weights them: Mixtral's softmax over the chosen
logits by default, and DeepSeek-V3's options (sigmoid scores renormalised and scaled, group-limited
choice, a bias for aux-loss-free balancing), with their config rules."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.errors import ConfigError


@dataclass(frozen=True)
class Routing:
    """How a token's experts are chosen and weighted (the defaults are Mixtral's).

    `score`: softmax | sigmoid of the router's logits; the top_k are chosen from the scores plus
    the expert bias (when `bias_update_speed` > 0) among the experts of the token's `top_groups`
    best groups of `n_groups` (a group's score: its two best experts'); the chosen experts'
    scores, renormalised to sum to 1 if `norm`, times `scale`, weight their outputs."""

    score: str = "softmax"
    norm: bool = True
    scale: float = 1.0
    n_groups: int = 1
    top_groups: int = 1
    bias_update_speed: float = 0.0


def choose_experts(logits: torch.Tensor, r: Routing, top_k: int,
                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 router logits [tokens, n_experts] -> (scores, the chosen experts [tokens, top_k], their
    weights). `bias` [n_experts]: aux-loss-free balancing's, added for the choice only."""
    scores = logits.softmax(dim=-1) if r.score == "softmax" else logits.sigmoid()
    choice = scores.detach() if bias is None else scores.detach() + bias
    if r.n_groups > 1:
        grouped = choice.unflatten(-1, (r.n_groups, -1))
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        best = group_scores.topk(r.top_groups, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
        choice = grouped.masked_fill(~kept[..., None], float("-inf")).flatten(-2)
    chosen = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(-1, chosen)
    if r.norm:
        weights = weights / weights.sum(-1, keepdim=True)
    return scores, chosen, weights * r.scale if r.scale != 1.0 else weights


SCORES = ("softmax", "sigmoid")


def check_routing(cfg) -> None:
    """The routing keys' rules (ConfigError)."""
    if cfg.route_score not in SCORES:
        raise ConfigError(f"model.route_score={cfg.route_score} is unknown; choose one of {list(SCORES)}")
    if cfg.route_scale <= 0:
        raise ConfigError(f"model.route_scale={cfg.route_scale} must be > 0")
    if cfg.n_shared_experts < 0 or cfg.bias_update_speed < 0:
        key = "n_shared_experts" if cfg.n_shared_experts < 0 else "bias_update_speed"
        raise ConfigError(f"model.{key}={getattr(cfg, key)} must be >= 0")
    groups = cfg.n_expert_groups
    if groups < 1 or cfg.n_experts % groups:
        raise ConfigError(f"model.n_expert_groups={groups} must divide model.n_experts={cfg.n_experts}")
    if not 1 <= cfg.top_groups <= groups:
        raise ConfigError(f"model.top_groups={cfg.top_groups} must be between 1 and model.n_expert_groups={groups}")
    if cfg.top_k > cfg.top_groups * (cfg.n_experts // groups):
        raise ConfigError(f"model.top_k={cfg.top_k} is more than the experts of model.top_groups={cfg.top_groups} "
                          f"groups ({cfg.top_groups * (cfg.n_experts // groups)})")


# The routing transformers' Mixtral and Qwen3-MoE compute: any other has no Hugging Face form.
HF_ROUTING = {"route_score": "softmax", "route_scale": 1.0, "n_shared_experts": 0, "n_expert_groups": 1,
              "bias_update_speed": 0.0}


def check_hf_routing(cfg, architecture: str) -> None:
    for key, value in HF_ROUTING.items():
        if getattr(cfg, key) != value:
            raise ConfigError(f"model.{key}={getattr(cfg, key)}: transformers' {architecture} has no such routing "
                              f"(model.{key}={value}); this model has no Hugging Face form")
