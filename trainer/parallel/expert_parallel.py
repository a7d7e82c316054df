"""Expert parallel: each rank of the ep group holds n_experts/ep of every MoE layer's experts, and
tokens travel to their experts' ranks and back with all-to-alls (public torch.distributed calls,
so gloo and NCCL alike).

The MoE layer hands its experts the tokens sorted by expert with a count per expert. Under expert
parallel that call becomes: exchange the counts (each rank learns how many tokens it receives for
each of its experts from each peer), send each rank its experts' tokens (variable split sizes,
dropless), run the local experts on the received tokens regrouped by expert, and send the outputs
back the same way. Backward runs the two all-to-alls in reverse.

With tensor parallel, each tp rank routes its own slice of the sequence (sequence parallel)
through the router and the experts, replicated over tp; their gradients are summed over tp once
per optimizer step, after FSDP's reduction (`sum_grads_over_tp`), so in its reduce dtype.

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
    whose gradients `sum_grads_over_tp` sums over the tp ranks. No-op for a dense model.

    The router and the experts are swapped for modules holding the same weights under the same
    names, as DTensors, whose forward runs on the local part (and, for the experts under expert
    parallel, exchanges the tokens)."""
    for layer in moe_layers(model):
        if dims.view("dp_cp_tp").size() > 1:
            layer.batch_counts = partial(_all_reduce_sum, group=dims.view("dp_cp_tp").get_group())
        if dims.tp_enabled:
            layer.router = LocalRouter(layer.router, dims.view("tp"))
        if dims.ep_enabled:
            layer.experts = DistributedExperts(layer.experts, dims.expert_mesh,
                                               [Shard(0), Replicate()], dims.view("ep").get_group())
        elif dims.tp_enabled:
            layer.experts = DistributedExperts(layer.experts, dims.view("tp"), [Replicate()])


def _distributed_parameters(module: nn.Module, source: nn.Module, mesh: DeviceMesh,
                            placements: list) -> None:
    """Registers on `module` each of `source`'s own parameters, distributed over `mesh`, by the same
    name."""
    for name, param in source.named_parameters(recurse=False):
        sharded = distribute_tensor(param, mesh, placements, src_data_rank=None)
        module.register_parameter(name, nn.Parameter(sharded))


def _all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


class LocalRouter(nn.Module):
    """A router's weight replicated over the tp mesh; each tp rank scores its own tokens with it."""

    def __init__(self, router: nn.Linear, mesh: DeviceMesh):
        super().__init__()
        self.out_features = router.out_features
        _distributed_parameters(self, router, mesh, [Replicate()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to_local())


class DistributedExperts(nn.Module):
    """A GroupedExperts' weights as DTensors on `mesh`: replicated (tensor parallel: each tp rank
    runs its own tokens), or split on the expert dimension over the ep ranks, with `group` the ep
    group the tokens travel over (expert parallel)."""

    def __init__(self, experts: nn.Module, mesh: DeviceMesh, placements: list, group=None):
        super().__init__()
        _distributed_parameters(self, experts, mesh, placements)
        self.group = group

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [tokens, dim] sorted by (global) expert, counts [n_experts] -> the experts' outputs,
        same order."""
        if self.group is None:
            return expert_swiglu(x, counts, *(w.to_local() for w in (self.w1, self.w2, self.w3)))
        return _expert_parallel_forward(self, self.group, x, counts)


def sum_grads_over_tp(parts: list[nn.Module], dims: ParallelDims) -> None:
    """Sums over the tp ranks the gradients of the MoE weights replicated over tp (each tp rank
    routed its own tokens through them): one all-reduce a step, after the last microbatch's
    backward and FSDP's reduction, on the reduced (reduce dtype) shards."""
    if not dims.tp_enabled:
        return
    grads = [p.grad.to_local() for part in parts for layer in moe_layers(part)
             for p in (*layer.router.parameters(), *layer.experts.parameters())
             if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=dims.view("tp").get_group())
    for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))


def _expert_parallel_forward(experts: nn.Module, group, x: torch.Tensor,
                             counts: torch.Tensor) -> torch.Tensor:
    ep = dist.get_world_size(group)
    # An expert's gradient sums the ep group's tokens; FSDP then averages over the ranks outside
    # the group. Dividing by ep here makes that the average over every data-parallel rank.
    w1, w2, w3 = (_ScaleGrad.apply(w.to_local(), 1 / ep)
                  for w in (experts.w1, experts.w2, experts.w3))
    local_experts = w1.shape[0]
    # received[src, e]: tokens this rank gets from rank src for its local expert e.
    sent = counts.view(ep, local_experts)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    # The one host transfer of the layer: all_to_all_single takes its split sizes as Python ints.
    send_splits, recv_splits = torch.stack([sent.sum(1), received.sum(1)]).tolist()
    tokens = _AllToAll.apply(x, recv_splits, send_splits, group)
    # Arrived grouped by source rank, then expert; the experts want them grouped by expert.
    expert_of = torch.repeat_interleave(torch.arange(local_experts, device=x.device).repeat(ep),
                                        received.flatten(), output_size=len(tokens))
    order = expert_of.argsort(stable=True)
    out = expert_swiglu(tokens[order], received.sum(0), w1, w2, w3)[order.argsort()]
    return _AllToAll.apply(out, send_splits, recv_splits, group)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward scales the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes along the first dimension; backward sends the gradients
    back along the reverse splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None
