"""Expert parallel: each rank of the ep group holds n_experts/ep of every MoE layer's experts, and
tokens travel to their experts' ranks and back with all-to-alls (public torch.distributed calls,
so gloo and NCCL alike).

The MoE layer hands its experts the tokens sorted by expert with a count per expert. Under expert
parallel that call becomes: exchange the counts (each rank learns how many tokens it receives for
each of its experts from each peer), send each rank its experts' tokens (variable split sizes,
dropless), run the local experts on the received tokens regrouped by expert, and send the outputs
back the same way. Backward runs the two all-to-alls in reverse.

With tensor parallel, each tp rank routes its own slice of the sequence (sequence parallel)
through the router and the experts, replicated over tp; their gradients are summed over tp.

Expert weights are DTensors split on the expert dimension over the ep mesh. FSDP shards them
further over the data-parallel ranks outside the ep group and averages their gradients over those
ranks; with the ep group's own share (1/ep, applied in backward) that is the average over every
data-parallel rank, as for the dense weights.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from trainer.models.moe import expert_swiglu, moe_layers
from trainer.parallel.dims import ParallelDims


def parallelize_moe(model: nn.Module, dims: ParallelDims) -> None:
    """Expert parallel over `ep`, and tensor parallel for the MoE layers: each tp rank routes its
    own slice of the sequence (sequence parallel) through router and experts replicated over tp,
    whose gradients are summed over the tp ranks. No-op for a dense model."""
    layers = moe_layers(model)
    if not layers:
        return
    tp_group = dims.view("tp").get_group() if dims.tp_enabled else None
    for layer in layers:
        if dims.view("dp_cp_tp").size() > 1:
            layer.batch_counts = partial(_all_reduce_sum, group=dims.view("dp_cp_tp").get_group())
        if dims.tp_enabled:
            _distribute(layer.router, dims.view("tp"), [Replicate()])
            layer.router.forward = partial(_router_forward, layer.router, tp_group)
        if dims.ep_enabled:
            _distribute(layer.experts, dims.expert_mesh, [Shard(0), Replicate()])
            layer.experts.forward = partial(_expert_parallel_forward, layer.experts, dims.view("ep").get_group(),
                                            tp_group)
        elif dims.tp_enabled:
            _distribute(layer.experts, dims.view("tp"), [Replicate()])
            layer.experts.forward = partial(_local_forward, layer.experts, tp_group)


def _distribute(module: nn.Module, mesh: DeviceMesh, placements: list) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, placements, src_data_rank=None)))


def _all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def _router_forward(router: nn.Linear, tp_group, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, _ReduceGrad.apply(router.weight.to_local(), 1.0, tp_group))


def _local_forward(experts: nn.Module, tp_group, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return expert_swiglu(x, counts, *_local_weights(experts, 1.0, tp_group))


def _local_weights(experts: nn.Module, grad_scale: float, tp_group) -> list[torch.Tensor]:
    return [_ReduceGrad.apply(w.to_local(), grad_scale, tp_group) for w in (experts.w1, experts.w2, experts.w3)]


def _expert_parallel_forward(experts: nn.Module, group, tp_group, x: torch.Tensor,
                             counts: torch.Tensor) -> torch.Tensor:
    """x [tokens, dim] sorted by (global) expert, counts [n_experts] -> the experts' outputs, same order."""
    ep = dist.get_world_size(group)
    # An expert's gradient sums the ep group's tokens; FSDP then averages over the ranks outside
    # the group. Dividing by ep here makes that the average over every data-parallel rank.
    w1, w2, w3 = _local_weights(experts, 1 / ep, tp_group)
    local_experts = w1.shape[0]
    # received[src, e]: tokens this rank gets from rank src for its local expert e.
    sent = counts.view(ep, local_experts)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    send_splits, recv_splits = sent.sum(1).tolist(), received.sum(1).tolist()
    tokens = _AllToAll.apply(x, recv_splits, send_splits, group)
    # Arrived grouped by source rank, then expert; the experts want them grouped by expert.
    expert_of = torch.repeat_interleave(torch.arange(local_experts, device=x.device).repeat(ep), received.flatten())
    order = expert_of.argsort(stable=True)
    out = expert_swiglu(tokens[order], received.sum(0), w1, w2, w3)[order.argsort()]
    return _AllToAll.apply(out, send_splits, recv_splits, group)


class _ReduceGrad(torch.autograd.Function):
    """Identity forward; backward scales the gradient and sums it over `group` (None: no sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float, group) -> torch.Tensor:
        ctx.scale, ctx.group = scale, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad * ctx.scale
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes along the first dimension; backward sends the gradients
    back along the reverse splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None
