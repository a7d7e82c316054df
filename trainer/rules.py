"""Every rule a job's configuration must satisfy, checked without a process group.

`check_job` is the one entry: train.py runs it on every rank before joining the process group,
scripts/plan.py before planning, and the layout search on each candidate it enumerates. Rules on
the model's shape come before the degree rules: they name the key the user most likely got wrong.
Rules that need the data (the tokenizer's vocabulary) stay with the data.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
from pathlib import Path

import torch

from trainer.checkpoint.folders import MANIFEST
from trainer.checkpoint.hf import is_hf_dir
from trainer.config import (
    CheckpointConfig,
    DataConfig,
    FaultToleranceConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
)
from trainer.data import SOURCES, mix_source
from trainer.data.chat import FORMATS, OVERLONG
from trainer.errors import ConfigError
from trainer.fault_tolerance import check_available, group_view
from trainer.float8 import check_float8, check_float8_layers
from trainer.models import build_model, family
from trainer.models.moe_config import MoEConfig, n_experts
from trainer.parallel.context_parallel import METHODS as CP_METHODS
from trainer.parallel.dims import ParallelDims
from trainer.parallel.pipeline import SCHEDULES as PP_SCHEDULES
from trainer.parallel.pipeline import SINGLE_STAGE, V_SHAPED, ZERO_BUBBLE, min_microbatches, stages_per_rank
from trainer.ranges import check_ranges
from trainer.tensors import DTYPES, param_dtype
from trainer.tokenizer import is_bytes


def check_config(job: JobConfig, world: int) -> ParallelDims:
    """Every rule on the config alone (no device, data or process group needed): what each rank checks
    first, and trainer-run before it starts any. Returns the layout."""
    dims = check_job(job, world)
    check_checkpoint(job.checkpoint)
    check_data(job.data)
    if job.training.spike.action == "rollback" and not job.checkpoint.enabled:
        raise ConfigError("training.spike.action=rollback needs checkpoint.enabled=true (a checkpoint to go back to)")
    return dims


def check_job(job: JobConfig, world: int, ranges: bool = True) -> ParallelDims:
    """Checks `job` for a world of `world` ranks; returns its layout, with what the config leaves to
    derive (every `-1`, the accumulation steps) resolved. `job` is left as it is. `ranges=False` skips
    the keys' ranges (the search checks them once for all its candidates)."""
    if ranges:
        check_ranges(job)
    check_model(job.model)
    if job.fault_tolerance.enabled:
        check_fault_tolerance(job.fault_tolerance, job.parallel, job.training, job.model)
        check_available(job.fault_tolerance)
    group = group_view(job)  # under fault tolerance, one replica group is the job's world
    dims = resolve_layout(group.parallel, job.model, group.training, world)
    if n_experts(job.model) and dims.tp_enabled and not job.parallel.sequence_parallel:
        raise ConfigError(f"parallel.tp={dims.tp} with a mixture-of-experts model needs "
                          "parallel.sequence_parallel=true: each tp rank routes its own slice of the sequence")
    check_precision_and_compile(job.training, job.device)
    if job.training.float8.enabled and not job.training.float8.skip_unaligned:
        check_float8_layers(build_model(job.model, device="meta"), job.training.float8)
    schedule = job.parallel.pp_schedule
    if job.training.activation_checkpoint == "selective" and dims.pp_enabled and schedule in ZERO_BUBBLE:
        # torch (2.13) frees what selective checkpointing saved at a block's first backward; these
        # schedules run it twice (input gradients, then the deferred weight gradients).
        raise ConfigError(f"training.activation_checkpoint=selective cannot be combined with parallel.pp_schedule="
                          f"{schedule}: its split backward recomputes each block twice; use full or none")
    profile_step = job.metrics.profile_step
    if profile_step is not None and not 1 <= profile_step <= job.training.steps:
        raise ConfigError(f"metrics.profile_step={profile_step} must be a step of the run, "
                          f"1..training.steps={job.training.steps}")
    if job.metrics.tensorboard.enabled and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("metrics.tensorboard.enabled=true needs the tensorboard package: "
                          "pip install -e \".[tensorboard]\"")
    peak = job.metrics.peak_tflops
    if not (peak is None or peak == "auto" or (isinstance(peak, (int, float)) and peak > 0)):
        raise ConfigError(f"metrics.peak_tflops={peak} must be null, a positive number or auto")
    if job.validation.path is not None and job.data.mix:
        raise ConfigError(f"validation.path={job.validation.path} cannot be combined with data.mix "
                          f"(each source's held-out windows are mixed for validation)")
    if job.validation.path is not None and job.data.source == "embedded":
        raise ConfigError(f"validation.path={job.validation.path} needs files of your own in data.path "
                          f"(it is read like data.path, with data.source and data.tokenizer)")
    return dims


def check_fault_tolerance(ft: FaultToleranceConfig, parallel: ParallelConfig, training: TrainingConfig,
                          model: ModelConfig) -> None:
    """The fault_tolerance keys against the layout and what replica groups cannot share."""
    groups = parallel.dp_replicate
    if groups < 2:
        raise ConfigError(f"fault_tolerance.enabled=true needs parallel.dp_replicate >= 2 replica groups to replicate "
                          f"over (each a job of its own); parallel.dp_replicate={groups}")
    if not 0 <= ft.replica_group < groups:
        raise ConfigError(f"fault_tolerance.replica_group={ft.replica_group} must be one of the "
                          f"parallel.dp_replicate={groups} groups: 0..{groups - 1}")
    if not 1 <= ft.min_replicas <= groups:
        raise ConfigError(f"fault_tolerance.min_replicas={ft.min_replicas} must be between 1 and the "
                          f"parallel.dp_replicate={groups} groups")
    if training.spike.threshold is not None and training.spike.action == "rollback":
        raise ConfigError("training.spike.action=rollback cannot be combined with fault_tolerance.enabled=true: the "
                          "replica groups hold different checkpoints and would roll back apart; use skip")
    if isinstance(model, MoEConfig) and model.bias_update_speed > 0:
        raise ConfigError(f"model.bias_update_speed={model.bias_update_speed} cannot be combined with "
                          f"fault_tolerance.enabled=true: each replica group measures its own expert load, and their "
                          f"biases would move apart; set model.bias_update_speed=0")
    if training.global_batch_size % groups:
        raise ConfigError(f"training.global_batch_size={training.global_batch_size} must be divisible by the "
                          f"parallel.dp_replicate={groups} replica groups")


def check_model(model: ModelConfig) -> None:
    """The family's own rules on its keys, and the rotary scaling's."""
    family(model.family).check(model)
    scaling = model.rope_scaling
    if scaling is None:
        return
    if scaling.type not in ("llama3", "yarn"):
        raise ConfigError(f"model.rope_scaling.type={scaling.type} is not supported; use llama3 or yarn, or "
                          f"rope_scaling=null")
    if scaling.type == "yarn" and not 0 < scaling.beta_slow <= scaling.beta_fast:
        raise ConfigError(f"model.rope_scaling: beta_slow={scaling.beta_slow} must be > 0 and at most "
                          f"beta_fast={scaling.beta_fast}")
    if scaling.type == "llama3" and not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
        raise ConfigError(f"model.rope_scaling: low_freq_factor={scaling.low_freq_factor} must be > 0 and below "
                          f"high_freq_factor={scaling.high_freq_factor}")


def check_precision_and_compile(training: TrainingConfig, device: str) -> None:
    """The dtypes and compile against the device the job will run on (`auto`: CUDA if there is one)."""
    mp = training.mixed_precision
    device = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if mp.param_dtype == "float16":
        raise ConfigError("training.mixed_precision.param_dtype=float16 needs loss scaling, which this trainer does "
                          "not do (gradients underflow); use bfloat16")
    if mp.reduce_dtype == "float16":
        raise ConfigError("training.mixed_precision.reduce_dtype=float16 overflows when gradients are summed over "
                          "ranks; use float32 (or bfloat16 with bfloat16 parameters)")
    if DTYPES[mp.reduce_dtype] == torch.bfloat16 and param_dtype(mp, device) == torch.float32:
        raise ConfigError(f"training.mixed_precision.reduce_dtype=bfloat16 is narrower than the float32 parameters "
                          f"(param_dtype={mp.param_dtype} on {device}): gradients would lose precision in the sum; "
                          f"use float32")
    if training.compile and (missing := compile_missing(device)):
        raise ConfigError(f"training.compile=true cannot compile on {device} here: {missing}; "
                          f"use training.compile=false")
    check_float8(training.float8, device, training.compile)


def compile_missing(device: str) -> str | None:
    """What inductor lacks to compile for `device` (None if nothing): Triton kernels on CUDA, a C++
    compiler on the CPU."""
    if torch.device(device).type == "cuda":
        return None if importlib.util.find_spec("triton") else "the triton package is not installed"
    compilers = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    return None if any(c and shutil.which(c) for c in compilers) else "no C++ compiler (g++, clang++) on PATH"


def resolve_layout(parallel: ParallelConfig, model: ModelConfig, training: TrainingConfig,
                   world_size: int) -> ParallelDims:
    """The layout of `parallel` on `world_size` ranks: `-1` degrees resolved, every degree rule
    checked, and the accumulation steps derived (`dims.grad_accum_steps`: from `training.micro_batch_size`
    when it is set, else `training.grad_accum_steps`)."""
    degrees = {k: getattr(parallel, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")}
    for key, value in degrees.items():
        if value == 0 or value < -1 or (value == -1 and key not in ("dp_replicate", "dp_shard", "ep")):
            rule = "must be >= 1 or -1 (the rest)" if key in ("dp_replicate", "dp_shard", "ep") else "must be >= 1"
            raise ConfigError(f"parallel.{key}={value} {rule}")
    if degrees["dp_replicate"] == degrees["dp_shard"] == -1:
        raise ConfigError("parallel.dp_replicate=-1 and parallel.dp_shard=-1: only one of them can take the rest")
    _check_model_rules(degrees, parallel, model, training)

    for key in ("dp_replicate", "dp_shard"):
        if degrees[key] == -1:
            others = math.prod(v for k, v in degrees.items() if k not in (key, "ep"))
            if world_size % others:
                names = "*".join(k for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if k != key)
                raise ConfigError(f"parallel.{key}=-1 needs the world size {world_size} to be divisible by "
                                  f"{names}={others}")
            degrees[key] = world_size // others
    product = math.prod(degrees[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    if product != world_size:
        raise ConfigError(
            f"parallel: pp*dp_replicate*dp_shard*cp*tp={product} must equal the world size {world_size} "
            f"(pp={degrees['pp']}, dp_replicate={degrees['dp_replicate']}, dp_shard={degrees['dp_shard']}, "
            f"cp={degrees['cp']}, tp={degrees['tp']}); for a job whose world size can change (an elastic "
            f"launch, a restart on fewer or more nodes), set parallel.dp_shard=-1 or parallel.dp_replicate=-1"
        )
    _resolve_ep(degrees, model)

    dims = ParallelDims(world_size=world_size, moe=n_experts(model) > 0, **degrees)
    if training.micro_batch_size is not None:
        dims.grad_accum_steps = _grad_accum_steps(training, dims.dp)
    else:
        dims.grad_accum_steps = training.grad_accum_steps
    per_step = dims.dp * dims.grad_accum_steps
    if training.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size={training.global_batch_size} must be divisible by "
            f"dp*grad_accum_steps={per_step} (dp={dims.dp}, grad_accum_steps={dims.grad_accum_steps})"
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


def _check_model_rules(degrees: dict, parallel: ParallelConfig, model: ModelConfig, training: TrainingConfig) -> None:
    tp, pp, cp = degrees["tp"], degrees["pp"], degrees["cp"]
    for key, width in family(model.family).tp_divides(model).items():
        if width % tp:
            raise ConfigError(f"parallel.tp={tp} must divide model.{key}={width}")
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


def _grad_accum_steps(training: TrainingConfig, dp: int) -> int:
    """The accumulation steps that make up the global batch from micro_batch_size sequences per
    data-parallel rank: more of them when the world shrinks, fewer when it grows. They replace
    grad_accum_steps (a recipe's own included)."""
    micro = training.micro_batch_size
    if training.global_batch_size % (dp * micro):
        raise ConfigError(f"training.global_batch_size={training.global_batch_size} must be divisible by "
                          f"dp*micro_batch_size={dp * micro} (dp={dp}, micro_batch_size={micro})")
    return training.global_batch_size // (dp * micro)


def _resolve_ep(degrees: dict, model: ModelConfig) -> None:
    """ep is taken from the dp_shard x cp ranks; -1 means all of them (1 for a dense model)."""
    ep, ranks, experts = degrees["ep"], degrees["dp_shard"] * degrees["cp"], n_experts(model)
    if ep == -1:
        degrees["ep"] = ep = ranks if experts else 1
    if ep > 1 and not experts:
        raise ConfigError(f"parallel.ep={ep} needs a mixture-of-experts model (model.n_experts > 0)")
    if experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide model.n_experts={experts}")
    if ranks % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the ranks it is taken from, dp_shard*cp={ranks} "
                          f"(dp_shard={degrees['dp_shard']}, cp={degrees['cp']})")


def _check_pipeline_rules(pp: int, parallel: ParallelConfig, model: ModelConfig) -> None:
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
    if parallel.pp_stage_modules is not None:
        _check_stage_modules(parallel.pp_stage_modules, n_stages, model)


def _check_stage_modules(stages: list[list[str]], n_stages: int, model: ModelConfig) -> None:
    """An explicit split must name every module once, in model order, with a layer on every stage."""
    spec = family(model.family)
    expected = spec.pipeline_units(model.n_layers)
    given = [name for stage in stages for name in stage]
    if len(stages) != n_stages or given != expected or any(
        not any(spec.is_block(name) for name in stage) for stage in stages
    ):
        raise ConfigError(
            f"parallel.pp_stage_modules must be {n_stages} lists that together name {expected[0]}, "
            f"{expected[1]} .. {expected[model.n_layers]}, {', '.join(expected[model.n_layers + 1:])} once each "
            f"in that order, each with a layer"
        )


def check_checkpoint(cfg: CheckpointConfig) -> None:
    if cfg.resume not in ("auto", "none") and not Path(cfg.resume).is_dir():
        raise ConfigError(f"checkpoint.resume={cfg.resume} is not a directory; use auto, none or a checkpoint's path")
    if cfg.initial is not None:
        initial = Path(cfg.initial)
        if not initial.is_dir():
            raise ConfigError(f"checkpoint.initial={initial} is not a directory (a checkpoint or a Hugging Face model)")
        if not (is_hf_dir(initial) or (initial / MANIFEST).is_file()):
            raise ConfigError(f"checkpoint.initial={initial} is neither a Hugging Face model (config.json and "
                              f"*.safetensors) nor a checkpoint of this trainer ({MANIFEST})")


def check_data(data: DataConfig) -> None:
    """data's keys against each other; each of data.mix's sources is checked as data itself."""
    if not data.mix:
        _check_source(data)
        return
    if data.path is not None:
        raise ConfigError(f"data.path={data.path} and data.mix exclude each other: "
                          f"give each source its path in data.mix")
    for i, source in enumerate(data.mix):
        if not source.weight > 0:
            raise ConfigError(f"data.mix[{i}].weight={source.weight} must be > 0 (leave the source out instead)")
        try:
            _check_source(mix_source(data, source))
        except ConfigError as e:
            raise ConfigError(f"data.mix[{i}]: {e}") from None


def _check_source(data: DataConfig) -> None:
    if data.source not in SOURCES:
        raise ConfigError(f"data.source={data.source} is unknown; choose one of {list(SOURCES)}")
    if data.source == "embedded" and not is_bytes(data.tokenizer):
        raise ConfigError(f"data.tokenizer={data.tokenizer} needs another data.source (the embedded text is bytes)")
    what = {"binary": "a token file", "hub": "a Hugging Face dataset"}.get(data.source)
    if what and not data.path:
        raise ConfigError(f"data.path=None must name {what} for data.source={data.source}")
    if data.format not in FORMATS:
        raise ConfigError(f"data.format={data.format} is unknown; choose one of {list(FORMATS)}")
    if data.overlong not in OVERLONG:
        raise ConfigError(f"data.overlong={data.overlong} is unknown; choose one of {list(OVERLONG)}")
    if data.format != "text" and data.source not in ("json", "parquet", "hub"):
        given = "a token file" if data.source == "binary" else f"data.source={data.source}"
        raise ConfigError(f"data.format={data.format} reads rows (data.source=json, parquet or hub), not {given}")
