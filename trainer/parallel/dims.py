"""The parallel layout: degrees, their rules, and the one DeviceMesh every parallelism slices."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.errors import ConfigError
from trainer.parallel.context_parallel import METHODS as CP_METHODS
from trainer.parallel.pipeline import (
    SCHEDULES as PP_SCHEDULES,
    SINGLE_STAGE,
    V_SHAPED,
    check_stage_modules,
    min_microbatches,
    stages_per_rank,
)

# Outermost first: tp is innermost so its ranks are neighbours (inside one node).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Flattened views: name -> the mesh dimensions it joins.
FLAT_VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),  # data loading: each dp rank reads its own batch slice
    "dp_shard_cp": ("dp_shard", "cp"),  # FSDP shards over cp ranks too
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),  # loss and metric averaging
}


def _flatten(mesh: DeviceMesh, name: str) -> DeviceMesh:
    # DeviceMesh has no public way to join dimensions into one named view in torch 2.13;
    # `_flatten` is what torchtitan and torch's own tests use. Kept here so one line changes if it moves.
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
    moe: bool = False  # a mixture-of-experts model: the expert views below exist
    _mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    _views: dict[str, DeviceMesh] = field(default_factory=dict, repr=False, compare=False)
    _hsdp_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    _expert_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    _expert_fsdp_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_config(cls, parallel, model, training, world_size: int) -> ParallelDims:
        """Resolves `-1` degrees and checks every rule of SPEC §7 that involves a degree.

        The rules against the model shape come first: they name the key the user most likely got wrong.
        """
        degrees = {k: getattr(parallel, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")}
        for key, value in degrees.items():
            if value == 0 or value < -1 or (value == -1 and key not in ("dp_shard", "ep")):
                rule = "must be >= 1 or -1 (the rest)" if key in ("dp_shard", "ep") else "must be >= 1"
                raise ConfigError(f"parallel.{key}={value} {rule}")
        _check_model_rules(degrees, parallel, model, training)

        others = degrees["dp_replicate"] * degrees["cp"] * degrees["tp"] * degrees["pp"]
        if degrees["dp_shard"] == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallel.dp_shard=-1 needs the world size {world_size} to be divisible by "
                    f"pp*dp_replicate*cp*tp={others}"
                )
            degrees["dp_shard"] = world_size // others
        product = others * degrees["dp_shard"]
        if product != world_size:
            raise ConfigError(
                f"parallel: pp*dp_replicate*dp_shard*cp*tp={product} must equal the world size {world_size} "
                f"(pp={degrees['pp']}, dp_replicate={degrees['dp_replicate']}, dp_shard={degrees['dp_shard']}, "
                f"cp={degrees['cp']}, tp={degrees['tp']})"
            )
        _resolve_ep(degrees, model)

        dims = cls(world_size=world_size, moe=model.n_experts > 0, **degrees)
        per_step = dims.dp * training.grad_accum_steps
        if training.global_batch_size % per_step:
            raise ConfigError(
                f"training.global_batch_size={training.global_batch_size} must be divisible by "
                f"dp*grad_accum_steps={per_step} (dp={dims.dp}, grad_accum_steps={training.grad_accum_steps})"
            )
        if dims.pp_enabled:
            dims.pp_stages_per_rank = stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank)
            n_stages = dims.pp * dims.pp_stages_per_rank
            dims.pp_microbatches = parallel.pp_microbatches or n_stages
            batch = training.global_batch_size // per_step
            if batch % dims.pp_microbatches:
                raise ConfigError(
                    f"parallel.pp_microbatches={dims.pp_microbatches} must divide the batch each pipeline step runs, "
                    f"global_batch_size/(dp*grad_accum_steps)={batch}"
                )
            minimum = min_microbatches(parallel.pp_schedule, dims.pp, n_stages)
            if dims.pp_microbatches < minimum:
                raise ConfigError(
                    f"parallel.pp_microbatches={dims.pp_microbatches} must be >= {minimum} for "
                    f"parallel.pp_schedule={parallel.pp_schedule} with {n_stages} stages on parallel.pp={dims.pp} ranks"
                )
        return dims

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
        if self.dp_replicate_enabled:
            # HSDP shards over dp_shard x cp within each replica: dp_cp split into (replicas, shards).
            shape = (self.dp_replicate, self.dp_shard * self.cp)
            self._hsdp_mesh = _unflatten(self._views["dp_cp"], shape, ("dp_replicate", "dp_shard_cp"))
        if self.moe:
            # Experts: ep groups of neighbouring dp_shard x cp ranks (one group per tp rank: each tp
            # rank routes its own slice of the sequence), FSDP over the data-parallel ranks outside.
            flat = _flatten(self._mesh["dp_replicate", "dp_shard", "cp", "tp"], "dp_cp_tp")
            shape = (self.dp_replicate, self.dp_shard * self.cp // self.ep, self.ep, self.tp)
            experts = _unflatten(flat, shape, ("dp_replicate", "dp_shard_mod_ep", "ep", "expert_tp"))
            self._views |= {"dp_cp_tp": flat, "ep": experts["ep"]}
            self._expert_mesh = experts["ep", "expert_tp"]
            self._expert_fsdp_mesh = experts["dp_replicate", "dp_shard_mod_ep"] if self.dp_replicate_enabled \
                else experts["dp_shard_mod_ep"]
        return self._mesh

    def view(self, name: str) -> DeviceMesh:
        """A 1-D submesh: one of MESH_DIMS or one of the flattened FLAT_VIEWS (and, for a
        mixture-of-experts model, `ep` and `dp_cp_tp`, the ranks a microbatch's tokens are spread over)."""
        return self._views[name] if name in self._views else self.mesh[name]

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


def _check_model_rules(degrees: dict, parallel, model, training) -> None:
    tp, pp, cp = degrees["tp"], degrees["pp"], degrees["cp"]
    for key in ("n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(model, key) % tp:
            raise ConfigError(f"parallel.tp={tp} must divide model.{key}={getattr(model, key)}")
    if parallel.pp_schedule not in PP_SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={parallel.pp_schedule} is unknown; choose one of {list(PP_SCHEDULES)}")
    if pp > model.n_layers:
        raise ConfigError(f"parallel.pp={pp} must not exceed model.n_layers={model.n_layers}")
    if pp > 1:
        _check_pipeline_rules(pp, parallel, model)
    if cp > 1:
        if parallel.cp_method not in CP_METHODS:
            raise ConfigError(f"parallel.cp_method={parallel.cp_method} is unknown; choose one of {list(CP_METHODS)}")
        # Each cp rank holds two chunks of the sequence (load balancing, see context_parallel.py).
        if training.seq_len % (2 * cp):
            raise ConfigError(f"parallel.cp={cp} needs training.seq_len={training.seq_len} divisible by 2*cp={2 * cp}: "
                              f"each cp rank holds two equal chunks of the sequence")
    if training.seq_len > model.max_seq_len:
        raise ConfigError(f"training.seq_len={training.seq_len} must not exceed model.max_seq_len={model.max_seq_len} "
                          f"(set training.seq_len; +smoke=cpu sets 128 for a CPU run)")
    if training.grad_accum_steps < 1:
        raise ConfigError(f"training.grad_accum_steps={training.grad_accum_steps} must be >= 1")
    if tp > 1:
        if parallel.loss_parallel and model.vocab_size % tp:
            raise ConfigError(
                f"parallel.tp={tp} must divide model.vocab_size={model.vocab_size} when parallel.loss_parallel=true"
            )
        shards = tp * (2 * cp if cp > 1 else 1)
        if parallel.sequence_parallel and training.seq_len % shards:
            with_cp = f" x 2*cp={2 * cp}" if cp > 1 else ""
            raise ConfigError(
                f"parallel.tp={tp}{with_cp} must divide training.seq_len={training.seq_len} "
                f"when parallel.sequence_parallel=true"
            )
        if model.tie_embeddings:
            raise ConfigError(f"parallel.tp={tp} needs model.tie_embeddings=false: the embedding and output "
                              f"are split on different dimensions")


def _resolve_ep(degrees: dict, model) -> None:
    """ep is taken from the dp_shard x cp ranks; -1 means all of them (1 for a dense model)."""
    ep, ranks = degrees["ep"], degrees["dp_shard"] * degrees["cp"]
    if ep == -1:
        degrees["ep"] = ep = ranks if model.n_experts else 1
    if ep > 1 and not model.n_experts:
        raise ConfigError(f"parallel.ep={ep} needs a mixture-of-experts model (model.n_experts > 0)")
    if model.n_experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide model.n_experts={model.n_experts}")
    if ranks % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the ranks it is taken from, dp_shard*cp={ranks} "
                          f"(dp_shard={degrees['dp_shard']}, cp={degrees['cp']})")


def _check_pipeline_rules(pp: int, parallel, model) -> None:
    per_rank = stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank)
    schedule = parallel.pp_schedule
    if schedule in SINGLE_STAGE and per_rank != 1:
        raise ConfigError(f"parallel.pp_stages_per_rank={per_rank} must be 1 for parallel.pp_schedule={schedule}")
    if schedule in V_SHAPED and per_rank != 2:
        raise ConfigError(f"parallel.pp_stages_per_rank={per_rank} must be 2 for parallel.pp_schedule={schedule}")
    if per_rank < 1:
        raise ConfigError(f"parallel.pp_stages_per_rank={per_rank} must be >= 1")
    n_stages = pp * per_rank
    if n_stages > model.n_layers:
        raise ConfigError(
            f"parallel.pp={pp} x pp_stages_per_rank={per_rank} = {n_stages} stages must not exceed "
            f"model.n_layers={model.n_layers}: every stage needs a layer"
        )
    if model.tie_embeddings:
        raise ConfigError(f"parallel.pp={pp} needs model.tie_embeddings=false: the embedding and the output "
                          f"head sit on different stages")
    if parallel.pp_microbatches is not None and parallel.pp_microbatches < 1:
        raise ConfigError(f"parallel.pp_microbatches={parallel.pp_microbatches} must be >= 1")
    if parallel.pp_stage_modules is not None:
        check_stage_modules(parallel.pp_stage_modules, n_stages, model.n_layers)
