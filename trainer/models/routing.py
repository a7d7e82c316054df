"""How an MoE layer chooses each token's experts and weights them: Mixtral's softmax over the chosen
logits by default, and DeepSeek-V3's options (sigmoid scores renormalised and scaled, group-limited
choice, a bias for aux-loss-free balancing). The keys that set them: moe_config.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """How a token's experts are chosen and weighted (the defaults are Mixtral's).

    `score`: softmax | sigmoid of the router's logits; the top_k are chosen from the scores plus
    the expert bias (when `bias`, or `bias_update_speed` > 0: it moves after each step) among the
    experts of the token's `top_groups` best groups of `n_groups` (a group's score: its two best
    experts'); the chosen experts' scores, renormalised to sum to 1 if `norm`, times `scale`, weight
    their outputs."""

    score: str = "softmax"
    norm: bool = True
    scale: float = 1.0
    n_groups: int = 1
    top_groups: int = 1
    bias_update_speed: float = 0.0
    bias: bool = False


def choose_experts(logits: torch.Tensor, r: Routing, top_k: int,
                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    """float32 router logits [tokens, n_experts] -> (scores, the chosen experts [tokens, top_k],
    their weights). `bias` [n_experts]: aux-loss-free balancing's, added for the choice only."""
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
