"""The parallel layout: degrees and the one DeviceMesh every parallelism slices (their rules:
trainer/checks/layout.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.distributed import set_timeouts

# Outermost first: tp is innermost so its ranks are neighbours (inside one node).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Flattened views: name -> the mesh dimensions it joins.
FLAT_VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),  # data loading: each dp rank reads its own batch slice
    "dp_shard_cp": ("dp_shard", "cp"),  # FSDP shards over cp ranks too
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),  # loss and metric averaging
}
# Muon gathers a matrix FSDP and tensor parallel both split over the ranks holding its pieces.
FSDP_TP_VIEW = ("dp_shard_cp_tp", ("dp_shard", "cp", "tp"))


def _flatten(mesh: DeviceMesh, name: str) -> DeviceMesh:
    # DeviceMesh has no public way to join dimensions into one named view in torch 2.13;
    # `_flatten` is what torchtitan and torch's own tests
    # use. Kept here so one line changes if it moves.
    return mesh._flatten(name)


def _unflatten(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    # Nor a public way to split a 1-D view into named dimensions; torch 2.13 deprecates slicing a
    # flattened view together with a root dimension, which is what HSDP over cp ranks needs.
    return mesh._unflatten(0, sizes, names)


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    # Derived from the schedule and the batch (see pipeline.py); 1 without pipeline parallel.
    pp_stages_per_rank: int = 1
    pp_microbatches: int = 1
    # The Ulysses part of cp (cp = cp_ring * cp_ulysses; the Ulysses ranks neighbours).
    cp_ulysses: int = 1
    # Forward-backward passes per optimizer step on each data-parallel rank:
    # training.grad_accum_steps, or derived from training.micro_batch_size and the global batch.
    grad_accum_steps: int = 1
    moe: bool = False  # a mixture-of-experts model: the expert views below exist
    _mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    _views: dict[str, DeviceMesh] = field(default_factory=dict, repr=False, compare=False)
    _hsdp_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    _expert_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    _expert_fsdp_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def cp_ring(self) -> int:
        return self.cp // self.cp_ulysses

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh(device_type) before using the mesh")
        return self._mesh

    def build_mesh(self, device_type: str) -> DeviceMesh:
        # Size-1 dimensions stay in the mesh so every view exists whatever the layout.
        self._mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        # torch wants flattened views kept by whoever made them, not sliced again from the root.
        self._views = {name: _flatten(self._mesh[dims], name) for name, dims in FLAT_VIEWS.items()}
        if 1 < self.cp_ulysses < self.cp:
            # The hybrid: cp split into (ring, Ulysses), Ulysses inner (its ranks neighbours).
            split = _unflatten(self._mesh["cp"], (self.cp_ring, self.cp_ulysses),
                               ("cp_ring", "cp_ulysses"))
            self._views |= {"cp_ring": split["cp_ring"], "cp_ulysses": split["cp_ulysses"]}
        if self.tp_enabled and self.dp_shard * self.cp > 1:
            name, dims = FSDP_TP_VIEW
            self._views[name] = _flatten(self._mesh[dims], name)
        if self.dp_replicate_enabled:
            # HSDP shards over dp_shard x cp within each
            # replica: dp_cp split into (replicas, shards).
            shape = (self.dp_replicate, self.dp_shard * self.cp)
            self._hsdp_mesh = _unflatten(self._views["dp_cp"], shape,
                                         ("dp_replicate", "dp_shard_cp"))
        if self.moe:
            # Experts: ep groups of neighbouring dp_shard x cp ranks (one group per tp rank: each tp
            # rank routes its own slice of the sequence), FSDP over the data-parallel ranks outside.
            flat = _flatten(self._mesh["dp_replicate", "dp_shard", "cp", "tp"], "dp_cp_tp")
            shape = (self.dp_replicate, self.dp_shard * self.cp // self.ep, self.ep, self.tp)
            experts = _unflatten(flat, shape,
                                 ("dp_replicate", "dp_shard_mod_ep", "ep", "expert_tp"))
            self._views |= {"dp_cp_tp": flat, "ep": experts["ep"]}
            self._expert_mesh = experts["ep", "expert_tp"]
            self._expert_fsdp_mesh = (experts["dp_replicate", "dp_shard_mod_ep"]
                                      if self.dp_replicate_enabled else experts["dp_shard_mod_ep"])
        extra = (self._hsdp_mesh, self._expert_mesh, self._expert_fsdp_mesh)
        set_timeouts([self._mesh, *self._views.values(),
                      *(mesh for mesh in extra if mesh is not None)])
        return self._mesh

    def group_names(self) -> dict[str, str]:
        """The mesh dimensions and views each process group of more than one rank serves, by the
        group's name: e.g. {"1": "dp_shard/dp/dp_shard_cp/dp_cp"}."""
        names: dict[str, list[str]] = {}
        for name in (*MESH_DIMS, *self._views):
            view = self.view(name)
            if view.size() > 1:
                names.setdefault(view.get_group().group_name, []).append(name)
        return {group: "/".join(views) for group, views in names.items()}

    def view(self, name: str) -> DeviceMesh:
        """A 1-D submesh: one of MESH_DIMS or one of the flattened FLAT_VIEWS (and, for a
        mixture-of-experts model, `ep` and `dp_cp_tp`, the ranks a microbatch's tokens are spread
        over)."""
        return self._views[name] if name in self._views else self.mesh[name]

    def group_spanning(self, ranks: tuple[int, ...]):
        """The process group of exactly `ranks` (global ranks, this one among them) among the mesh's
        dimensions and views; None if there is none."""
        for name in (*MESH_DIMS, *self._views):
            group = self.view(name).get_group()
            if set(dist.get_process_group_ranks(group)) == set(ranks):
                return group
        return None

    def cp_meshes(self) -> tuple[DeviceMesh | None, DeviceMesh | None]:
        """The (ring, Ulysses) meshes of context parallel's attention, None where that part has
        one rank."""
        if self.cp_ring == 1 or self.cp_ulysses == 1:
            whole = self.view("cp")
            return (None, whole) if self.cp_ring == 1 else (whole, None)
        return self.view("cp_ring"), self.view("cp_ulysses")

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: 1-D over dp_shard x cp, or 2-D (replicate, shard) for HSDP."""
        if not self.dp_replicate_enabled:
            return self.view("dp_shard_cp")
        return self._hsdp_mesh

    @property
    def expert_mesh(self) -> DeviceMesh:
        """The 2-D (ep, tp) mesh expert weights live on: split over ep, replicated over tp."""
        return self._expert_mesh

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards expert weights over under expert parallel: the data-parallel ranks
        outside an ep group (2-D with the replicas for HSDP)."""
        return self._expert_fsdp_mesh

