"""What a mixture-of-experts model needs around each step, as one step part: the tp sum of the
gradients of the weights every tp rank routes its own tokens through, the aux-loss-free bias update,
and the routing statistics of the logged record."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.models import ModelSpec
from trainer.models.moe import moe_layers, update_expert_biases
from trainer.parallel.dims import ParallelDims
from trainer.parallel.expert_parallel import sum_grads_over_tp
from trainer.step_parts import StepPart


class MoEUpkeep(StepPart):
    def __init__(self, model_parts: list, spec: ModelSpec, dims: ParallelDims, layers: list[int],
                 n_experts: int, device):
        self.model_parts, self.spec, self.dims = model_parts, spec, dims
        self.stats = MoEStats(layers, n_experts, device, dims.ep)

    def after_backward(self, step: int) -> None:
        sum_grads_over_tp(self.model_parts, self.dims)

    def before_optimizer_step(self, step: int, skipped: torch.Tensor, microbatches: int) -> None:
        update_expert_biases(self.model_parts, microbatches, skip=skipped)
        self.stats.collect(self.model_parts, self.spec, microbatches)

    def record(self) -> dict:
        return self.stats.report(layer_copies=self.dims.world_size // self.dims.pp)


class MoEStats:
    """The MoE layers' routing statistics on this rank, summed over steps until reported."""

    def __init__(self, layers: list[int], n_experts: int, device, ep: int = 1):
        # the blocks with an MoE layer, by index
        self.rows = {layer: row for row, layer in enumerate(layers)}
        # slots routed per (MoE layer, expert)
        self.load = torch.zeros(len(layers), n_experts, device=device)
        self.ep = ep  # expert-parallel ranks, each holding a contiguous block of the experts
        self.totals = torch.zeros(2, device=device)  # load-balancing loss, dropped slots
        self.steps = 0

    def collect(self, parts: list, spec: ModelSpec, microbatches: int) -> None:
        """Takes each layer's records of the step just run: its last `microbatches` ones (a pipeline
        schedule's first step also runs backward once more, on placeholder data, to infer
        shapes)."""
        for part in parts:
            for index, block in spec.block_modules(part).items():
                for layer in moe_layers(block):
                    for routed, balance, dropped in layer.routing_records[-microbatches:]:
                        self.load[self.rows[int(index)]] += routed
                        self.totals += torch.stack([balance / microbatches, dropped])
                    layer.routing_records.clear()
        self.steps += 1

    def report(self, layer_copies: int) -> dict:
        """For the whole job since the last report (all-reduces over the world; call on every rank):

        aux_loss: the load-balancing loss, averaged over layers, microbatches and ranks (no
        coefficient); expert_load_{min,max,mean}: slots routed to one expert of one layer per step,
        over every (layer, expert); expert_load_ep: the slots each expert-parallel rank's experts
        took over all layers, relative to an even share (1.0 each when balanced; the largest is the
        straggler); dropped_tokens: slots dropped per step over the capacity (0 when dropless).
        `layer_copies` ranks hold each layer. Every rank routes its own tokens (tensor parallel
        with MoE requires sequence parallel), so the counts sum over ranks as they are.
        """
        stats = torch.cat([self.load.flatten(), self.totals])
        dist.all_reduce(stats)
        load = stats[:-2] / self.steps
        by_rank = load.view(len(self.load), self.ep, -1).sum((0, 2))
        record = {
            "aux_loss": stats[-2].item() / (layer_copies * len(self.load) * self.steps),
            "expert_load_min": load.min().item(),
            "expert_load_max": load.max().item(),
            "expert_load_mean": load.mean().item(),
            "expert_load_ep": (by_rank / by_rank.mean()).tolist(),
            "dropped_tokens": stats[-1].item() / self.steps,
        }
        self.load.zero_()
        self.totals.zero_()
        self.steps = 0
        return record
