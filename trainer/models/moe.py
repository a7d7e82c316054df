"""A sparse mixture-of-experts feed-forward layer (Mixtral, Qwen3-MoE, DeepSeek-V3 routing). Plain
PyTorch.

A router scores each token against every expert; the token goes to its `top_k` experts, weighted
by their scores (`Routing`: softmax or sigmoid scores, renormalised and scaled, optionally chosen
within the best groups of experts and with a per-expert bias that balances the load without an
auxiliary loss). Shared experts, if any, run on every token beside the routed ones. Tokens are
sorted by expert so that each expert runs once on a contiguous slice (`GroupedExperts`): that
call, given tokens in expert order and a count per expert, is the seam where expert parallelism
exchanges tokens between ranks.

Auxiliary losses (the Switch/Mixtral load-balancing loss and an optional router z-loss) never
appear in the model's output: they are attached to the layer's output so that backward gives them
the gradient they would have had if added to the training loss, wherever that loss is computed
(the last pipeline stage, for instance). Routing statistics are recorded in that backward, which
runs once per microbatch even when activation checkpointing re-runs the forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.layers import FeedForward, swiglu
from trainer.models.routing import Routing, choose_experts

# The parameters of an MoE layer that write into the residual stream (name endings).
RESIDUAL_OUTPUTS = ("experts.w2", "shared.w2.weight")


class GroupedExperts(nn.Module):
    """`n_experts` SwiGLU feed-forwards with their weights stacked on a leading expert dimension."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))  # down

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [tokens, dim] sorted by expert, `counts[e]` of them for expert e -> [tokens, dim]."""
        return expert_swiglu(x, counts, self.w1, self.w2, self.w3)


# Rows per expert group at which CUDA's bf16 grouped GEMM wants each group to start (16 bytes);
# the CPU kernel takes any offsets, and padding would only cost there.
GROUP_ALIGN = {"cuda": 8}


def expert_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor, align: int | None = None) -> torch.Tensor:
    """Each expert's SwiGLU on its contiguous slice of x, as grouped matmuls (one kernel for all
    experts), each group starting at a multiple of `align` rows (default: per device, GROUP_ALIGN).
    torch's grouped matmul takes fp32 on CPU and bf16 on CUDA, but no empty input in backward
    (torch 2.13). Other dtypes on CUDA loop over the experts, one matmul per expert and weight
    (their split sizes come from the host: a sync)."""
    if len(x) == 0:  # no tokens (an expert-parallel rank nobody routed to): zero gradients
        return swiglu(x @ w1[0].T, x @ w3[0].T) @ w2[0].T
    if x.dtype != torch.bfloat16 and x.device.type != "cpu":
        return _expert_swiglu_loop(x, counts, w1, w2, w3)
    align = GROUP_ALIGN.get(x.device.type, 1) if align is None else align
    rows = None
    if align > 1:
        x, counts, rows = _align_groups(x, counts, align)
    offsets = counts.cumsum(0).to(torch.int32)

    def matmul(a, w):  # a's slice for expert e times w[e].T
        return F.grouped_mm(a, w.transpose(1, 2), offs=offsets)

    out = matmul(swiglu(matmul(x, w1), matmul(x, w3)), w2)
    return out if rows is None else out[rows]


def _align_groups(x: torch.Tensor, counts: torch.Tensor,
                  align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x's rows moved so that each expert's group starts at a multiple of `align`, zero rows between
    -> (padded x, the padded groups' sizes, the row each row of x went to). The padded length is a
    bound known without reading the counts (len(x) + n_experts * (align - 1)); the last group takes
    what is left, so every row belongs to a group. Zero rows add nothing to any gradient."""
    n_experts = len(counts)
    size = len(x) + n_experts * (align - 1)
    sizes = (counts + align - 1) // align * align
    sizes[-1] += size - sizes.sum()
    starts = sizes.cumsum(0) - sizes
    expert = torch.repeat_interleave(torch.arange(n_experts, device=x.device), counts,
                                     output_size=len(x))
    rows = starts[expert] + _index_in_group(expert, counts)
    return x.new_zeros(size, x.shape[1]).index_copy(0, rows, x), sizes, rows


def _expert_swiglu_loop(x, counts, w1, w2, w3) -> torch.Tensor:
    out = [
        swiglu(chunk @ w1[e].T, chunk @ w3[e].T) @ w2[e].T
        for e, chunk in enumerate(x.split(counts.tolist()))
    ]
    return torch.cat(out)


class MoE(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, n_experts: int, top_k: int,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                 capacity_factor: float | None = None, routing: Routing = Routing(),
                 n_shared_experts: int = 0):
        super().__init__()
        self.top_k = top_k
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.capacity_factor = capacity_factor
        self.routing = routing
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(dim, ffn_dim, n_experts)
        # Shared experts: one SwiGLU as wide as all of them, on every token.
        self.shared = FeedForward(dim, n_shared_experts * ffn_dim) if n_shared_experts else None
        # Aux-loss-free balancing's bias: training state
        # (checkpointed), moved by update_expert_biases.
        if routing.bias or routing.bias_update_speed > 0:
            self.register_buffer("expert_bias", torch.zeros(n_experts))
        else:
            self.expert_bias = None
        # The auxiliary losses' gradient is scaled like the training loss's: by 1/microbatches when
        # the trainer averages a step's microbatches (see set_aux_loss_scale).
        self.aux_loss_scale = 1.0
        # Slots per expert over the whole batch the load-balancing loss is taken on. Here, this
        # layer's input; data parallel makes it the batch of every data-parallel rank together.
        self.batch_counts: Callable[[torch.Tensor], torch.Tensor] = _same
        # One (slots routed to each expert, load-balancing loss, dropped slots) per backward;
        # whoever reads them clears the list.
        self.routing_records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        # Before the tokens are flattened: under tensor
        # parallel the shared experts gather the sequence.
        shared = self.shared(x) if self.shared is not None else None
        x = x.reshape(-1, shape[-1])
        n_experts = self.router.out_features
        logits = self.router(x).float()
        scores, chosen, weights = choose_experts(logits, self.routing, self.top_k, self.expert_bias)

        out, routed, counts = self.dispatch(x, chosen, weights.to(x.dtype))

        # Switch/Mixtral: n_experts * sum_e (share of slots routed to e) * (mean router probability
        # of e). The shares are the whole batch's; each rank's mean probability is its share of the
        # batch mean, which the gradient averaging over ranks
        # completes. Sigmoid scores are normalised per token.
        probs = scores if self.routing.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        share = self.batch_counts(routed.float())
        balance = n_experts * (share / share.sum() * self.top_k * probs.mean(0)).sum()
        aux = (self.aux_loss_coef * balance
               + self.z_loss_coef * logits.logsumexp(dim=-1).square().mean())
        stats = (routed.detach().float(), balance.detach(), (routed - counts).sum().detach())
        out = _AttachAuxLoss.apply(out, aux, self, stats).view(shape)
        return out if shared is None else out + shared

    @torch.compiler.disable
    def dispatch(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor):
        """Sends each token to its chosen experts and sums their weighted outputs.

        -> (output, slots routed to each expert, slots each expert ran). Runs eagerly under
        torch.compile: how many tokens each expert gets (and, with expert parallel, how many each
        rank sends) changes every step, and compiled code would recompile for each new count.
        Device ops only (no host sync): on a GPU the next layer's work is queued without waiting.
        """
        n_tokens, n_experts = len(x), self.router.out_features
        # Slots: (token, choice) pairs, grouped by expert.
        slots = chosen.flatten()
        order = slots.argsort(stable=True)
        routed = torch.zeros(n_experts, dtype=torch.long, device=x.device)
        routed.scatter_add_(0, slots, torch.ones_like(slots))
        slot_weights = weights.flatten()[order]
        if self.capacity_factor is None:
            token, counts, ran = order // self.top_k, routed, routed
        else:
            capacity = self.capacity(n_tokens, n_experts)
            token, slot_weights, counts = _fill_capacity(order // self.top_k, slots[order],
                                                         slot_weights, routed, capacity)
            ran = routed.clamp(max=capacity)
        y = self.experts(x[token], counts) * slot_weights[:, None]
        return torch.zeros_like(x).index_add(0, token, y), routed, ran

    def capacity(self, n_tokens: int, n_experts: int) -> int:
        """Slots each expert takes per forward when a capacity factor is set."""
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / n_experts)


def _fill_capacity(token: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor,
                   routed: torch.Tensor,
                   capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each expert gets exactly `capacity` slots: its first ones in token order, then padding (token
    0 at weight 0, which adds exactly nothing). Slots are given in expert order with their token,
    expert and weight; returns the (token, weight) of every expert's `capacity` slots and the
    counts. Shapes depend only on the capacity, so nothing waits for the routing's counts."""
    n_experts = len(routed)
    rank_in_expert = _index_in_group(expert, routed)
    # Slots over the capacity go to one extra place past the end, cut off below.
    place = torch.where(rank_in_expert < capacity, expert * capacity + rank_in_expert,
                        n_experts * capacity)
    filled_token = token.new_zeros(n_experts * capacity + 1).scatter_(0, place, token)
    filled_weight = weight.new_zeros(n_experts * capacity + 1).scatter(0, place, weight)
    counts = torch.full((n_experts,), capacity, dtype=torch.long, device=token.device)
    return filled_token[:-1], filled_weight[:-1], counts


def _index_in_group(expert: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """For rows sorted by expert (`expert[i]` the expert of row i, `counts[e]` rows each), each
    row's index within its expert's group."""
    return torch.arange(len(expert), device=expert.device) - (counts.cumsum(0) - counts)[expert]


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the layer's output; backward gives the auxiliary loss the gradient it would get
    as a term of the training loss, and records the layer's statistics."""

    @staticmethod
    def forward(ctx, out, aux, layer, stats):
        ctx.layer, ctx.stats = layer, stats
        ctx.save_for_backward(aux)
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        ctx.layer.routing_records.append(ctx.stats)
        return grad, torch.full_like(aux, ctx.layer.aux_loss_scale), None, None


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_expert_biases(parts: list[nn.Module], microbatches: int, skip: torch.Tensor) -> None:
    """Aux-loss-free balancing, once a step: each expert's bias moves by `bias_update_speed` towards
    the even load, down for an expert that took more than its layer's mean of the step's slots, up
    for one that took fewer. The load is the whole batch's (each layer's last `microbatches`
    records, summed over the ranks that route different tokens in one all-reduce for every layer),
    so every rank moves its copy alike. Nothing moves on a skipped step (`skip` 1.0). No host
    sync."""
    layers = [layer for part in parts for layer in moe_layers(part)
              if layer.routing.bias_update_speed > 0]
    if not layers:
        return
    load = torch.stack([sum(record[0] for record in layer.routing_records[-microbatches:])
                        for layer in layers])
    load = layers[0].batch_counts(load)
    moves = torch.sign(load.mean(-1, keepdim=True) - load) * (1 - skip)
    for layer, move in zip(layers, moves):
        layer.expert_bias += layer.routing.bias_update_speed * move


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    for layer in moe_layers(model):
        layer.aux_loss_scale = scale
