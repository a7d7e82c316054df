"""Every rule a job's configuration must satisfy, checked without a process group.

`check_job` is the one entry: train.py runs it on every rank before joining the process group,
scripts/plan.py before planning, and the layout search on each candidate it enumerates. Rules on
the model's shape come before the degree rules: they name the key the user most likely got wrong.
Rules that need the data (the tokenizer's vocabulary) stay with the data; the rules between the
parallel degrees are trainer/checks/layout.py's.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch

from trainer.checkpoint.folders import MANIFEST
from trainer.checkpoint.hf import is_hf_dir
from trainer.checks.layout import resolve_layout
from trainer.checks.peft import check_peft, check_peft_checkpoints, check_qlora
from trainer.checks.ranges import check_ranges
from trainer.config.schema import (
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
from trainer.data.tokenizer import is_bytes
from trainer.errors import ConfigError
from trainer.faults.tolerance import check_available, group_view
from trainer.float8 import check_float8, check_float8_layers
from trainer.models import build_model, family
from trainer.models.moe_config import MoEConfig, n_experts
from trainer.optim.f8_state import check_tp_grid, rowwise_inputs
from trainer.parallel.dims import ParallelDims
from trainer.parallel.pipeline import ZERO_BUBBLE
from trainer.tensors import DTYPES, param_dtype


def check_config(job: JobConfig, world: int) -> ParallelDims:
    """Every rule on the config alone (no device, data or process group needed): what each rank
    checks first, and trainer-run before it starts any. Returns the layout."""
    dims = check_job(job, world)
    check_checkpoint(job.checkpoint)
    check_peft_checkpoints(job)
    check_data(job.data)
    if job.training.spike.action == "rollback" and not job.checkpoint.enabled:
        raise ConfigError("training.spike.action=rollback needs checkpoint.enabled=true (a "
                          "checkpoint to go back to)")
    return dims


def check_job(job: JobConfig, world: int, ranges: bool = True) -> ParallelDims:
    """Checks `job` for a world of `world` ranks; returns its layout, with what the config leaves to
    derive (every `-1`, the accumulation steps) resolved. `job` is left as it is. `ranges=False`
    skips the keys' ranges (the search checks them once for all its candidates)."""
    if ranges:
        check_ranges(job)
    check_model(job.model)
    adapted = check_peft(job)
    if job.fault_tolerance.enabled:
        check_fault_tolerance(job.fault_tolerance, job.parallel, job.training, job.model)
        check_available(job.fault_tolerance)
    group = group_view(job)  # under fault tolerance, one replica group is the job's world
    dims = resolve_layout(group.parallel, job.model, group.training, world)
    check_qlora(job, dims, adapted)
    if n_experts(job.model) and dims.tp_enabled and not job.parallel.sequence_parallel:
        raise ConfigError(f"parallel.tp={dims.tp} with a mixture-of-experts model needs "
                          "parallel.sequence_parallel=true: each tp rank routes its own slice of "
                          "the sequence")
    check_precision_and_compile(job.training, job.device)
    if job.training.float8.enabled and not job.training.float8.skip_unaligned:
        check_float8_layers(build_model(job.model, device="meta"), job.training.float8)
    if job.optim.state_dtype == "float8" and dims.tp_enabled:
        check_tp_grid(_rowwise_inputs(job), dims.tp)
    schedule = job.parallel.pp_schedule
    if (job.training.activation_checkpoint == "selective" and dims.pp_enabled
        and schedule in ZERO_BUBBLE):
        # torch (2.13) frees what selective checkpointing saved at a block's first backward; these
        # schedules run it twice (input gradients, then the deferred weight gradients).
        raise ConfigError("training.activation_checkpoint=selective cannot be combined with "
                          f"parallel.pp_schedule={schedule}: its split backward recomputes each "
                          "block twice; use full or none")
    for key in ("profile_step", "memory_snapshot_step"):
        step = getattr(job.metrics, key)
        if step is not None and not 1 <= step <= job.training.steps:
            raise ConfigError(f"metrics.{key}={step} must be a step of the run, "
                              f"1..training.steps={job.training.steps}")
    on_cuda = job.device == "cuda" or (job.device == "auto" and torch.cuda.is_available())
    if job.metrics.memory_snapshot_step is not None and not on_cuda:
        raise ConfigError("metrics.memory_snapshot_step records the CUDA allocator: "
                          f"device={job.device} has none (on the CPU, metrics.jsonl's "
                          "mem_tensor_gib counts the live tensors)")
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
        raise ConfigError(f"validation.path={job.validation.path} needs files of your own in "
                          "data.path (it is read like data.path, with data.source and "
                          "data.tokenizer)")
    return dims


# model config and tp flags -> rowwise_inputs: built once per model (the search checks many
# layouts of one)
_ROWWISE: dict[str, set[int]] = {}


def _rowwise_inputs(job: JobConfig) -> set[int]:
    flags = (job.parallel.sequence_parallel, job.parallel.loss_parallel)
    key = repr((job.model, flags))
    if key not in _ROWWISE:
        plan = family(job.model.family).tp_plan(job.model, *flags)
        _ROWWISE[key] = rowwise_inputs(build_model(job.model, device="meta"), plan)
    return _ROWWISE[key]


def check_fault_tolerance(ft: FaultToleranceConfig, parallel: ParallelConfig,
                          training: TrainingConfig, model: ModelConfig) -> None:
    """The fault_tolerance keys against the layout and what replica groups cannot share."""
    groups = parallel.dp_replicate
    if groups < 2:
        raise ConfigError("fault_tolerance.enabled=true needs parallel.dp_replicate >= 2 replica "
                          "groups to replicate over (each a job of its own); "
                          f"parallel.dp_replicate={groups}")
    if not 0 <= ft.replica_group < groups:
        raise ConfigError(f"fault_tolerance.replica_group={ft.replica_group} must be one of the "
                          f"parallel.dp_replicate={groups} groups: 0..{groups - 1}")
    if not 1 <= ft.min_replicas <= groups:
        raise ConfigError(f"fault_tolerance.min_replicas={ft.min_replicas} must be between 1 and "
                          f"the parallel.dp_replicate={groups} groups")
    if training.spike.threshold is not None and training.spike.action == "rollback":
        raise ConfigError("training.spike.action=rollback cannot be combined with "
                          "fault_tolerance.enabled=true: the replica groups hold different "
                          "checkpoints and would roll back apart; use skip")
    if isinstance(model, MoEConfig) and model.bias_update_speed > 0:
        raise ConfigError(f"model.bias_update_speed={model.bias_update_speed} cannot be combined "
                          "with fault_tolerance.enabled=true: each replica group measures its own "
                          "expert load, and their biases would move apart; set "
                          "model.bias_update_speed=0")
    if training.global_batch_size % groups:
        raise ConfigError(f"training.global_batch_size={training.global_batch_size} must be "
                          f"divisible by the parallel.dp_replicate={groups} replica groups")


def check_model(model: ModelConfig) -> None:
    """The family's own rules on its keys, and the rotary scaling's."""
    family(model.family).check(model)
    scaling = model.rope_scaling
    if scaling is None:
        return
    if scaling.type not in ("llama3", "yarn"):
        raise ConfigError(f"model.rope_scaling.type={scaling.type} is not supported; use llama3 or "
                          "yarn, or rope_scaling=null")
    if scaling.type == "yarn" and not 0 < scaling.beta_slow <= scaling.beta_fast:
        raise ConfigError(f"model.rope_scaling: beta_slow={scaling.beta_slow} must be > 0 and at "
                          f"most beta_fast={scaling.beta_fast}")
    if scaling.type == "llama3" and not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
        raise ConfigError(f"model.rope_scaling: low_freq_factor={scaling.low_freq_factor} must be "
                          f"> 0 and below high_freq_factor={scaling.high_freq_factor}")


def check_precision_and_compile(training: TrainingConfig, device: str) -> None:
    """The dtypes and compile against the device the job will run on (`auto`: CUDA if there is
    one)."""
    mp = training.mixed_precision
    device = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if mp.param_dtype == "float16":
        raise ConfigError("training.mixed_precision.param_dtype=float16 needs loss scaling, which "
                          "this trainer does not do (gradients underflow); use bfloat16")
    if mp.reduce_dtype == "float16":
        raise ConfigError("training.mixed_precision.reduce_dtype=float16 overflows when gradients "
                          "are summed over ranks; use float32 (or bfloat16 with bfloat16 "
                          "parameters)")
    if DTYPES[mp.reduce_dtype] == torch.bfloat16 and param_dtype(mp, device) == torch.float32:
        raise ConfigError("training.mixed_precision.reduce_dtype=bfloat16 is narrower than the "
                          f"float32 parameters (param_dtype={mp.param_dtype} on {device}): "
                          "gradients would lose precision in the sum; use float32")
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
    return (None if any(c and shutil.which(c) for c in compilers)
            else "no C++ compiler (g++, clang++) on PATH")


def check_checkpoint(cfg: CheckpointConfig) -> None:
    if cfg.resume not in ("auto", "none") and not Path(cfg.resume).is_dir():
        raise ConfigError(f"checkpoint.resume={cfg.resume} is not a directory; use auto, none or a "
                          "checkpoint's path")
    if cfg.initial is not None:
        initial = Path(cfg.initial)
        if not initial.is_dir():
            raise ConfigError(f"checkpoint.initial={initial} is not a directory (a checkpoint or a "
                              "Hugging Face model)")
        if not (is_hf_dir(initial) or (initial / MANIFEST).is_file()):
            raise ConfigError(f"checkpoint.initial={initial} is neither a Hugging Face model "
                              "(config.json and *.safetensors) nor a checkpoint of this trainer "
                              f"({MANIFEST})")


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
            raise ConfigError(f"data.mix[{i}].weight={source.weight} must be > 0 (leave the source "
                              "out instead)")
        try:
            _check_source(mix_source(data, source))
        except ConfigError as e:
            raise ConfigError(f"data.mix[{i}]: {e}") from None


def _check_source(data: DataConfig) -> None:
    if data.source not in SOURCES:
        raise ConfigError(f"data.source={data.source} is unknown; choose one of {list(SOURCES)}")
    if data.source == "embedded" and not is_bytes(data.tokenizer):
        raise ConfigError(f"data.tokenizer={data.tokenizer} needs another data.source (the "
                          "embedded text is bytes)")
    what = {"binary": "a token file", "hub": "a Hugging Face dataset"}.get(data.source)
    if what and not data.path:
        raise ConfigError(f"data.path=None must name {what} for data.source={data.source}")
    if data.format not in FORMATS:
        raise ConfigError(f"data.format={data.format} is unknown; choose one of {list(FORMATS)}")
    if data.overlong not in OVERLONG:
        raise ConfigError(f"data.overlong={data.overlong} is unknown; choose one of "
                          f"{list(OVERLONG)}")
    if data.format != "text" and data.source not in ("json", "parquet", "hub"):
        given = "a token file" if data.source == "binary" else f"data.source={data.source}"
        raise ConfigError(f"data.format={data.format} reads rows (data.source=json, parquet or "
                          f"hub), not {given}")
