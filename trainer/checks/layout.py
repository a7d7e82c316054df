"""The layout a job's parallel keys describe on a world of ranks: `-1` degrees resolved, every rule
between the degrees, the model's shape, the batch and the pipeline schedule checked, each broken
rule one `ConfigError` naming the key."""

from __future__ import annotations

import math

from trainer.config.schema import ModelConfig, ParallelConfig, TrainingConfig
from trainer.errors import ConfigError
from trainer.models import family
from trainer.models.moe_config import n_experts
from trainer.parallel.context_parallel import METHODS as CP_METHODS
from trainer.parallel.dims import ParallelDims
from trainer.parallel.pipeline import SCHEDULES as PP_SCHEDULES
from trainer.parallel.pipeline import SINGLE_STAGE, V_SHAPED, min_microbatches, stages_per_rank


def resolve_layout(parallel: ParallelConfig, model: ModelConfig, training: TrainingConfig,
                   world_size: int) -> ParallelDims:
    """The layout of `parallel` on `world_size` ranks: `-1` degrees resolved, every degree rule
    checked, and the accumulation steps derived (`dims.grad_accum_steps`: from
    `training.micro_batch_size` when it is set, else `training.grad_accum_steps`)."""
    degrees = {k: getattr(parallel, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp",
                                                 "ep")}
    for key, value in degrees.items():
        if value == 0 or value < -1 or (value == -1
                                        and key not in ("dp_replicate", "dp_shard", "ep")):
            rule = ("must be >= 1 or -1 (the rest)" if key in ("dp_replicate", "dp_shard", "ep")
                    else "must be >= 1")
            raise ConfigError(f"parallel.{key}={value} {rule}")
    if degrees["dp_replicate"] == degrees["dp_shard"] == -1:
        raise ConfigError("parallel.dp_replicate=-1 and parallel.dp_shard=-1: only one of them can "
                          "take the rest")
    _check_model_rules(degrees, parallel, model, training)

    for key in ("dp_replicate", "dp_shard"):
        if degrees[key] == -1:
            others = math.prod(v for k, v in degrees.items() if k not in (key, "ep"))
            if world_size % others:
                names = "*".join(k for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")
                                 if k != key)
                raise ConfigError(f"parallel.{key}=-1 needs the world size {world_size} to be "
                                  f"divisible by {names}={others}")
            degrees[key] = world_size // others
    product = math.prod(degrees[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    if product != world_size:
        raise ConfigError(
            f"parallel: pp*dp_replicate*dp_shard*cp*tp={product} must equal the world size "
            f"{world_size} (pp={degrees['pp']}, dp_replicate={degrees['dp_replicate']}, "
            f"dp_shard={degrees['dp_shard']}, cp={degrees['cp']}, tp={degrees['tp']}); for a job "
            "whose world size can change (an elastic launch, a restart on fewer or more nodes), "
            "set parallel.dp_shard=-1 or parallel.dp_replicate=-1"
        )
    _resolve_ep(degrees, model)

    dims = ParallelDims(world_size=world_size, moe=n_experts(model) > 0, **degrees,
                        cp_ulysses=ulysses_degree(parallel, degrees["cp"]))
    if training.micro_batch_size is not None:
        dims.grad_accum_steps = _grad_accum_steps(training, dims.dp)
    else:
        dims.grad_accum_steps = training.grad_accum_steps
    per_step = dims.dp * dims.grad_accum_steps
    if training.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size={training.global_batch_size} must be divisible by "
            f"dp*grad_accum_steps={per_step} (dp={dims.dp}, "
            f"grad_accum_steps={dims.grad_accum_steps})"
        )
    if dims.pp_enabled:
        _set_pipeline_microbatches(dims, parallel, training.global_batch_size // per_step)
    return dims


def ulysses_degree(parallel: ParallelConfig, cp: int) -> int:
    """The Ulysses part of `cp`: all of it for cp_method=ulysses, else parallel.cp_ulysses."""
    return cp if parallel.cp_method == "ulysses" else parallel.cp_ulysses


def _check_ulysses(parallel: ParallelConfig, model: ModelConfig, cp: int, tp: int) -> None:
    """Ulysses splits the heads each tp rank holds over its ranks; a hybrid's Ulysses part divides
    cp."""
    u = ulysses_degree(parallel, cp)
    if parallel.cp_method == "ulysses" and parallel.cp_ulysses not in (1, cp):
        raise ConfigError(f"parallel.cp_method=ulysses spans all parallel.cp={cp} ranks, not "
                          f"parallel.cp_ulysses={parallel.cp_ulysses}: for the hybrid set "
                          f"parallel.cp_method=ring parallel.cp_ulysses={parallel.cp_ulysses}")
    if cp % u:
        raise ConfigError(f"parallel.cp_ulysses={u} must divide parallel.cp={cp} (cp = ring ranks "
                          "x Ulysses ranks)")
    heads = model.n_heads // tp
    if u > 1 and heads % u:
        split = f"model.n_heads={model.n_heads}" + (f" / parallel.tp={tp} = {heads}" if tp > 1
                                                   else "")
        hybrid = max(d for d in range(1, u) if cp % d == 0 and heads % d == 0)
        if parallel.cp_method == "ulysses":
            near = [d for d in range(2, heads + 1) if heads % d == 0]
            degrees = [max([1, *(d for d in near if d < u)]), *(d for d in near if d > u)][:2]
            fix = (" or ".join(f"parallel.cp={d}" for d in degrees) + ", or "
                   + ("parallel.cp_method=ring" if hybrid == 1 else
                      f"the hybrid parallel.cp_method=ring parallel.cp_ulysses={hybrid}"))
        else:
            fix = f"parallel.cp_ulysses={hybrid}"
        key = "parallel.cp" if parallel.cp_method == "ulysses" else "parallel.cp_ulysses"
        raise ConfigError(f"{key}={u} must divide the attention heads it splits, {split}; "
                          f"nearest that work: {fix}")


def _set_pipeline_microbatches(dims: ParallelDims, parallel: ParallelConfig, batch: int) -> None:
    """The pipeline's stages per rank and microbatches, checked against the schedule and `batch`,
    the sequences each pipeline step runs."""
    dims.pp_stages_per_rank = stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank)
    n_stages = dims.pp * dims.pp_stages_per_rank
    dims.pp_microbatches = parallel.pp_microbatches or n_stages
    if batch % dims.pp_microbatches:
        raise ConfigError(
            f"parallel.pp_microbatches={dims.pp_microbatches} must divide the batch each "
            f"pipeline step runs, global_batch_size/(dp*grad_accum_steps)={batch}"
        )
    minimum = min_microbatches(parallel.pp_schedule, dims.pp, n_stages)
    if dims.pp_microbatches < minimum:
        raise ConfigError(
            f"parallel.pp_microbatches={dims.pp_microbatches} must be >= {minimum} for "
            f"parallel.pp_schedule={parallel.pp_schedule} with {n_stages} stages on "
            f"parallel.pp={dims.pp} ranks"
        )


def _check_model_rules(degrees: dict, parallel: ParallelConfig, model: ModelConfig,
                       training: TrainingConfig) -> None:
    tp, pp, cp = degrees["tp"], degrees["pp"], degrees["cp"]
    for key, width in family(model.family).tp_divides(model).items():
        if width % tp:
            raise ConfigError(f"parallel.tp={tp} must divide model.{key}={width}")
    if parallel.pp_schedule not in PP_SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={parallel.pp_schedule} is unknown; choose one of "
                          f"{list(PP_SCHEDULES)}")
    if pp > model.n_layers:
        raise ConfigError(f"parallel.pp={pp} must not exceed model.n_layers={model.n_layers}")
    if pp > 1:
        _check_pipeline_rules(pp, parallel, model)
    if parallel.cp_method not in CP_METHODS:  # (at cp=1 too: a misspelling is one whatever cp)
        raise ConfigError(f"parallel.cp_method={parallel.cp_method} is unknown; choose one of "
                          f"{list(CP_METHODS)}")
    if cp > 1:
        _check_ulysses(parallel, model, cp, tp)
        # Each cp rank holds two chunks of the sequence (load balancing, see context_parallel.py).
        if training.seq_len % (2 * cp):
            raise ConfigError(f"parallel.cp={cp} needs training.seq_len={training.seq_len} "
                              f"divisible by 2*cp={2 * cp}: each cp rank holds two equal chunks of "
                              "the sequence")
    if cp == 1 and parallel.cp_ulysses > 1:
        raise ConfigError(f"parallel.cp_ulysses={parallel.cp_ulysses} is the Ulysses part of "
                          f"parallel.cp={cp}: set parallel.cp to a multiple of it")
    if training.seq_len > model.max_seq_len:
        raise ConfigError(f"training.seq_len={training.seq_len} must not exceed "
                          f"model.max_seq_len={model.max_seq_len} (set training.seq_len; "
                          "+smoke=cpu sets 128 for a CPU run)")
    if tp > 1:
        if parallel.loss_parallel and model.vocab_size % tp:
            raise ConfigError(
                f"parallel.tp={tp} must divide model.vocab_size={model.vocab_size} when "
                "parallel.loss_parallel=true"
            )
        shards = tp * (2 * cp if cp > 1 else 1)
        if parallel.sequence_parallel and training.seq_len % shards:
            with_cp = f" x 2*cp={2 * cp}" if cp > 1 else ""
            raise ConfigError(
                f"parallel.tp={tp}{with_cp} must divide training.seq_len={training.seq_len} "
                f"when parallel.sequence_parallel=true"
            )
        if model.tie_embeddings:
            raise ConfigError(f"parallel.tp={tp} needs model.tie_embeddings=false: the embedding "
                              "and output are split on different dimensions")


def _grad_accum_steps(training: TrainingConfig, dp: int) -> int:
    """The accumulation steps that make up the global batch from micro_batch_size sequences per
    data-parallel rank: more of them when the world shrinks, fewer when it grows. They replace
    grad_accum_steps (a recipe's own included)."""
    micro = training.micro_batch_size
    if training.global_batch_size % (dp * micro):
        raise ConfigError(f"training.global_batch_size={training.global_batch_size} must be "
                          f"divisible by dp*micro_batch_size={dp * micro} (dp={dp}, "
                          f"micro_batch_size={micro})")
    return training.global_batch_size // (dp * micro)


def _resolve_ep(degrees: dict, model: ModelConfig) -> None:
    """ep is taken from the dp_shard x cp ranks; -1 means all of them (1 for a dense model)."""
    ep, ranks, experts = degrees["ep"], degrees["dp_shard"] * degrees["cp"], n_experts(model)
    if ep == -1:
        degrees["ep"] = ep = ranks if experts else 1
    if ep > 1 and not experts:
        raise ConfigError(f"parallel.ep={ep} needs a mixture-of-experts model (model.n_experts > "
                          "0)")
    if experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide model.n_experts={experts}")
    if ranks % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the ranks it is taken from, "
                          f"dp_shard*cp={ranks} (dp_shard={degrees['dp_shard']}, "
                          f"cp={degrees['cp']})")


def _check_pipeline_rules(pp: int, parallel: ParallelConfig, model: ModelConfig) -> None:
    per_rank = stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank)
    schedule = parallel.pp_schedule
    if schedule in SINGLE_STAGE and per_rank != 1:
        raise ConfigError(f"parallel.pp_stages_per_rank={per_rank} must be 1 for "
                          f"parallel.pp_schedule={schedule}")
    if schedule in V_SHAPED and per_rank != 2:
        raise ConfigError(f"parallel.pp_stages_per_rank={per_rank} must be 2 for "
                          f"parallel.pp_schedule={schedule}")
    if per_rank < 1:
        raise ConfigError(f"parallel.pp_stages_per_rank={per_rank} must be >= 1")
    n_stages = pp * per_rank
    if n_stages > model.n_layers:
        raise ConfigError(
            f"parallel.pp={pp} x pp_stages_per_rank={per_rank} = {n_stages} stages must not exceed "
            f"model.n_layers={model.n_layers}: every stage needs a layer"
        )
    if model.tie_embeddings:
        raise ConfigError(f"parallel.pp={pp} needs model.tie_embeddings=false: the embedding and "
                          "the output head sit on different stages")
    if parallel.pp_stage_modules is not None:
        _check_stage_modules(parallel.pp_stage_modules, n_stages, model)


def _check_stage_modules(stages: list[list[str]], n_stages: int, model: ModelConfig) -> None:
    """An explicit split must name every module once, in model order, with a layer on every
    stage."""
    spec = family(model.family)
    expected = spec.pipeline_units(model.n_layers)
    given = [name for stage in stages for name in stage]
    if len(stages) != n_stages or given != expected or any(
        not any(spec.is_block(name) for name in stage) for stage in stages
    ):
        raise ConfigError(
            f"parallel.pp_stage_modules must be {n_stages} lists that together name {expected[0]}, "
            f"{expected[1]} .. {expected[model.n_layers]}, "
            f"{', '.join(expected[model.n_layers + 1:])} once each in that order, each with a layer"
        )
