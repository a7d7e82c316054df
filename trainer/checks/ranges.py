"""The values a key can take at all, whatever else is set: one table, one `config error:` line
naming the key, its value and the range."""

from __future__ import annotations

from trainer.config.schema import JobConfig
from trainer.errors import ConfigError
from trainer.float8 import RECIPES as FLOAT8_RECIPES
from trainer.optim.spec import check_state_dtype, optimizer_of
from trainer.parallel.activation_checkpoint import MODES as AC_MODES
from trainer.parallel.activation_checkpoint import POLICIES as SELECTIVE_POLICIES
from trainer.parallel.offload import OFFLOADS
from trainer.tensors import DTYPES


def _positive(value: float) -> bool:
    return value > 0


def _at_least_one(value: float) -> bool:
    return value >= 1


def _not_negative(value: float) -> bool:
    return value >= 0


def _one_of(choices) -> tuple:
    return f"must be one of {list(choices)}", lambda value: value in choices


# key -> (what the rule says, the test); a null value (where the schema allows one) passes.
RANGES = {
    **{f"model.{key}": ("must be >= 1", _at_least_one)
       for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim",
                   "max_seq_len")},
    "model.norm_eps": ("must be > 0", _positive),
    "model.rope_theta": ("must be > 0", _positive),
    "model.rope_scaling.factor": ("must be >= 1", _at_least_one),
    "model.rope_scaling.original_max_seq_len": ("must be >= 1", _at_least_one),
    "parallel.pp_microbatches": ("must be >= 1", _at_least_one),
    "parallel.cp_ulysses": ("must be >= 1", _at_least_one),
    **{f"training.{key}": ("must be >= 1", _at_least_one)
       for key in ("steps", "seq_len", "global_batch_size")},
    "training.lr": ("must be >= 0", _not_negative),
    "training.loss_chunk_tokens": ("must be >= 1, or null (no chunks)", _at_least_one),
    "training.warmup_steps": ("must be >= 0", _not_negative),
    "training.weight_decay": ("must be >= 0", _not_negative),
    "training.max_norm": ("must be > 0 (the gradient norm clipped to)", _positive),
    "training.grad_accum_steps": ("must be >= 1", _at_least_one),
    "training.micro_batch_size": ("must be >= 1 (or null: from grad_accum_steps)", _at_least_one),
    "training.activation_checkpoint": _one_of(AC_MODES),
    "training.activation_checkpoint_every": ("must be >= 1", _at_least_one),
    "training.selective_policy": _one_of(SELECTIVE_POLICIES),
    "training.offload": _one_of(OFFLOADS),
    "training.mixed_precision.param_dtype": _one_of(("auto", *DTYPES)),
    "training.mixed_precision.reduce_dtype": _one_of(tuple(DTYPES)),
    "training.float8.recipe": _one_of(FLOAT8_RECIPES),
    "training.on_nonfinite": ("must be skip or stop", lambda value: value in ("skip", "stop")),
    "training.max_skipped_steps": ("must be >= 0 (0: no limit)", _not_negative),
    "training.spike.threshold": ("must be null (off) or > 0 standard deviations", _positive),
    "training.spike.action": ("must be skip or "
                              "rollback", lambda value: value in ("skip", "rollback")),
    "training.spike.decay": ("must be between 0 and 1", lambda value: 0 < value < 1),
    "training.spike.warmup_steps": ("must be >= 1", _at_least_one),
    "device": ("is unknown; choose auto, cpu or "
               "cuda", lambda value: value in ("auto", "cpu", "cuda")),
    "optim.beta1": ("must be in [0, 1)", lambda value: 0 <= value < 1),
    "optim.beta2": ("must be in [0, 1)", lambda value: 0 <= value < 1),
    "optim.eps": ("must be > 0", _positive),
    "optim.min_lr_ratio": ("must be in [0, 1]", lambda value: 0 <= value <= 1),
    "validation.every": ("must be >= 0 (0: no validation)", _not_negative),
    "validation.steps": ("must be >= 1", _at_least_one),
    "metrics.log_every": ("must be >= 1", _at_least_one),
    "metrics.health_every": ("must be >= 1, or null (no straggler check)", _at_least_one),
    "metrics.slow_rank_window": ("must be >= 1 steps", _at_least_one),
    "metrics.slow_rank_threshold": ("must be > 1 (a multiple of the median rank's step)",
                                    lambda value: value > 1),
    "distributed.timeout_s": ("must be > 0 seconds", _positive),
    "distributed.step_timeout_s": ("must be null (no watchdog) or > 0 seconds", _positive),
    "fault_tolerance.timeout_s": ("must be > 0 seconds", _positive),
    "fault_tolerance.quorum_timeout_s": ("must be > 0 seconds", _positive),
    "plan.host_memory_gib": ("must be > 0 GiB, or null (the machine's)", _positive),
    "checkpoint.interval": ("must be >= 1", _at_least_one),
    "checkpoint.keep_last": ("must be >= 0 (0 keeps every checkpoint)", _not_negative),
}


def value_of(job: JobConfig, key: str):
    """The value of a dotted key; None inside a section that is null (model.rope_scaling)."""
    value = job
    for name in key.split("."):
        value = None if value is None else getattr(value, name)
    return value


def check_ranges(job: JobConfig) -> None:
    """The table's keys, then the optimizer's (the state dtypes it takes, its spec's rules), then
    what the offload takes."""
    for key, (rule, ok) in RANGES.items():
        value = value_of(job, key)
        if value is not None and not ok(value):
            raise ConfigError(f"{key}={value} {rule}")
    check_state_dtype(job.optim)
    optimizer_of(job.optim).check(job.optim)
    check_offload(job)


def check_offload(job: JobConfig) -> None:
    """training.offload with what it does not compose with: under `optimizer`, what runs its own
    collectives on the device's copies of the weights, gradients or state; under `activations`,
    checkpointing (a checkpointed block keeps almost nothing to move) and compiled blocks (the
    offload's hooks run eagerly)."""
    t = job.training
    copies = "its collectives run on the device's copies of the weights, gradients or state"
    others = {
        "optimizer": {"training.float8.enabled=true": (t.float8.enabled, copies),
                      "peft.base_dtype=nf4": (job.peft.method is not None
                                              and job.peft.base_dtype == "nf4", copies),
                      "fault_tolerance.enabled=true": (job.fault_tolerance.enabled, copies),
                      f"optim.name={job.optim.name}": (optimizer_of(job.optim).whole_matrices,
                                                       copies)},
        "activations": {f"training.activation_checkpoint={t.activation_checkpoint}": (
                            t.activation_checkpoint != "none",
                            "a checkpointed block keeps only what it recomputes from"),
                        "training.compile=true": (t.compile, "its hooks run eagerly")},
    }.get(t.offload, {})
    for key, (on, why) in others.items():
        if on:
            raise ConfigError(f"training.offload={t.offload} cannot be combined with {key}: {why}; "
                              "drop one of the two")
