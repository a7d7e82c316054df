"""What each rank holds of the model, read from the real parallelized module tree.

The model is built on the meta device by the function training builds it with
(trainer/parallel/build.py), on a mesh of the job's real world size made by torch's `fake`
process-group backend (one process plays rank 0 of any world). Each parameter's local shard then has
the shape training would give it, so the plan cannot drift from the code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from trainer.config.schema import JobConfig, OptimConfig
from trainer.models import ModelSpec, family
from trainer.models.moe import moe_layers
from trainer.models.nf4 import is_nf4
from trainer.optim.spec import optimizer_of
from trainer.parallel.build import build_options, build_part, one_block
from trainer.parallel.dims import ParallelDims
from trainer.parallel.fsdp import edge_units
from trainer.parallel.pipeline import stage_ids

# The mesh dimensions FSDP shards parameters over (dp_replicate only replicates them).
FSDP_DIMS = ("dp_shard_cp", "dp_shard_mod_ep")


@dataclass
class Unit:
    """One FSDP unit on one rank: its parameters' elements as held (sharded) and as gathered."""

    name: str
    sharded: int
    gathered: int
    # The elements among `sharded` the job's optimizer treats apart (Muon's matrices), the largest
    # such matrix whole, and this rank's share of the optimizer's work on them in a step (each
    # matrix's FLOPs times the share of it held here: an optimizer updating whole matrices deals
    # them out in that proportion).
    apart: int = 0
    apart_largest: int = 0
    apart_flops: float = 0.0
    # elements of those this rank sends to the matrices' owners (and receives back)
    apart_moved: float = 0.0
    # The elements that take gradients and optimizer state, held and gathered: all of them but a
    # frozen base's (LoRA's).
    trained: int = 0
    trained_gathered: int = 0
    # The elements held in 4 bits (QLoRA's base), held and gathered, and the largest such matrix
    # (dequantized whole in its layer's forward and backward).
    quantized: int = 0
    quantized_gathered: int = 0
    quantized_largest: int = 0


@dataclass
class StageHoldings:
    stage: int
    modules: list[str]  # the family's pipeline units (embedding, blocks, head) this stage holds
    units: list[Unit]
    blocks: list[int]  # the indices of the blocks among them

    @property
    def layers(self) -> int:
        return len(self.blocks)


@contextlib.contextmanager
def fake_world(world_size: int):
    """A process group of `world_size` ranks in this one process (rank 0), for building meshes
    and sharding meta tensors; nothing is communicated."""
    # torch's fake backend ships with its test utilities; FakeStore is the store it pairs with.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


_CACHE: dict[str, list[list[StageHoldings]]] = {}


def holdings(job: JobConfig, dims: ParallelDims) -> list[list[StageHoldings]]:
    """For each pipeline rank, the stages it holds and their FSDP units (a fake world of one
    replica's size: HSDP's replicas hold the same shards, so a layout's holdings serve it with any
    number of them; and cp folded into dp_shard: FSDP shards over dp_shard x cp as one, and cp
    splits no parameter)."""
    fsdp = dims.dp_shard * dims.cp
    parallel = dataclasses.replace(job.parallel, pp_microbatches=None, dp_replicate=1,
                                   dp_shard=fsdp, cp=1, cp_method="ring", cp_ulysses=1)
    replica = dataclasses.replace(dims, dp_replicate=1, dp_shard=fsdp, cp=1, cp_ulysses=1,
                                  world_size=dims.world_size // dims.dp_replicate)
    # What a rank holds depends on the model and the layout, not on batch or microbatches.
    key = repr((job.model, job.optim, job.peft, parallel, replica.shape, replica.ep,
                job.data.document_mask))
    if key not in _CACHE:
        if len(_CACHE) > 1024:
            _CACHE.clear()
        _CACHE[key] = _holdings(dataclasses.replace(job, parallel=parallel), replica)
    return _CACHE[key]


def _holdings(job: JobConfig, dims: ParallelDims) -> list[list[StageHoldings]]:
    spec = family(job.model.family)
    dims = dataclasses.replace(dims)  # a mesh of its own, in the fake world
    with fake_world(dims.world_size):
        dims.build_mesh("cpu")
        options = build_options(job, dims, "cpu")
        by_stage = {}
        # Blocks of one kind are alike: a model of the kind's first block stands for each of them.
        first: dict = {}
        for index in range(job.model.n_layers):
            first.setdefault(spec.block_kind(job.model, index), index)
        # A stage's stand-in depends on its block's kind
        # and its other modules: stages alike share one.
        built: dict = {}
        for stage, modules in enumerate(options.stage_modules):
            blocks = [int(name.rsplit(".", 1)[1]) for name in modules if spec.is_block(name)]
            kinds = ({spec.block_kind(job.model, index) for index in blocks}
                     or {spec.block_kind(job.model, 0)})
            others = tuple(name for name in modules if not spec.is_block(name))
            per_kind, edges = {}, []
            for kind in kinds:
                if (kind, others) not in built:
                    one, kept = one_block(options, modules, first[kind])
                    units = _units(build_part(one, dims, kept, "meta"), spec, dims.ep_enabled,
                                   job.optim)
                    built[kind, others] = ([(u, spec.block_name(first[kind])) for u in units
                                            if spec.is_block(u.name)],
                                           [u for u in units if not spec.is_block(u.name)])
                per_kind[kind], edges = built[kind, others]
            units = [dataclasses.replace(u,
                                         name=u.name.replace(stand_in, spec.block_name(index), 1))
                     for index in blocks
                     for u, stand_in in per_kind[spec.block_kind(job.model, index)]]
            by_stage[stage] = StageHoldings(stage, modules, units + edges, blocks)
    return [[by_stage[s] for s in stage_ids(r, dims.pp, dims.pp_stages_per_rank,
                                            job.parallel.pp_schedule)]
            for r in range(dims.pp)]


def _units(model: torch.nn.Module, spec: ModelSpec, experts_apart: bool,
           optim: OptimConfig) -> list[Unit]:
    """The FSDP units of a parallelized model (see apply_fsdp): each block (with expert parallel,
    its experts apart), the embedding, the head, then the root's own parameters."""
    optimizer = optimizer_of(optim)
    units = []
    claimed = set()
    embedding, head = edge_units(spec.part(model, spec.embedding), spec.head_modules(model))
    for name, modules in (("embedding", [embedding] if embedding is not None else []),
                          ("head", head)):
        if modules:
            params = [p for m in modules for p in m.parameters()]
            units.append(_unit(name, params))
            claimed |= {id(p) for p in params}
    for index, block in spec.block_modules(model).items():
        named = {id(p): f"{spec.block_name(index)}.{n}" for n, p in block.named_parameters()}

        def apart(p, named=named) -> bool:
            return optimizer.apart is not None and optimizer.apart(named[id(p)], p, spec)

        def flops(rows: int, cols: int) -> float:
            return optimizer.matrix_flops(rows, cols, optim) if optimizer.matrix_flops else 0.0

        for layer in moe_layers(block) if experts_apart else []:
            units.append(_unit(f"{spec.block_name(index)}.experts", layer.experts.parameters(),
                               apart, flops))
            claimed |= {id(p) for p in layer.experts.parameters()}
        units.append(_unit(spec.block_name(index),
                           (p for p in block.parameters() if id(p) not in claimed), apart, flops))
        claimed |= {id(p) for p in block.parameters()}
    units.append(_unit("root", (p for p in model.parameters() if id(p) not in claimed)))
    return units


def _unit(name: str, params, apart=lambda p: False, flops=lambda rows, cols: 0.0) -> Unit:
    unit = Unit(name, 0, 0)
    for p in params:
        local = p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        unit.sharded += local
        unit.gathered += local * _fsdp_factor(p)
        if p.requires_grad:
            unit.trained += local
            unit.trained_gathered += local * _fsdp_factor(p)
        if is_nf4(p.to_local() if isinstance(p, DTensor) else p):
            unit.quantized += local
            unit.quantized_gathered += local * _fsdp_factor(p)
            unit.quantized_largest = max(unit.quantized_largest, p.numel())
        if apart(p):
            rows, cols = p.shape[-2:]
            unit.apart += local
            unit.apart_largest = max(unit.apart_largest, rows * cols)
            held = math.prod((p.to_local() if isinstance(p, DTensor) else p).shape[-2:])
            unit.apart_flops += flops(rows, cols) * local / (rows * cols)
            # a matrix split n ways: (n - 1) / n
            unit.apart_moved += local * (1 - held / (rows * cols))
    return unit


def _fsdp_factor(p: torch.Tensor) -> int:
    """How many ranks FSDP splits this parameter over (1 if none)."""
    if not isinstance(p, DTensor):
        return 1
    mesh, factor = p.device_mesh, 1
    for name, placement in zip(mesh.mesh_dim_names or (), p.placements):
        # Shard, or FSDP's strided shard over TP's
        if name in FSDP_DIMS and not isinstance(placement, Replicate):
            factor *= mesh.size(mesh.mesh_dim_names.index(name))
    return factor
