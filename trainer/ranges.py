"""The values a key can take at all, whatever else is set: one table, one `config error:` line naming
the key, its value and the range."""

from __future__ import annotations

from operator import attrgetter

from trainer.config import head_dim
from trainer.errors import ConfigError


def _positive(v) -> bool:
    return v > 0


def _at_least_one(v) -> bool:
    return v >= 1


def _not_negative(v) -> bool:
    return v >= 0


# key -> (what the rule says, the test)
RANGES = {
    **{f"model.{key}": ("must be >= 1", _at_least_one)
       for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len")},
    "model.head_dim": ("must be >= 1, or null (dim / n_heads)", _at_least_one),
    "model.norm_eps": ("must be > 0", _positive),
    "model.rope_theta": ("must be > 0", _positive),
    "model.n_experts": ("must be >= 0 (0: a dense model)", _not_negative),
    "model.aux_loss_coef": ("must be >= 0", _not_negative),
    "model.z_loss_coef": ("must be >= 0", _not_negative),
    **{f"training.{key}": ("must be >= 1", _at_least_one) for key in ("steps", "seq_len", "global_batch_size")},
    "training.lr": ("must be >= 0", _not_negative),
    "training.loss_chunk_tokens": ("must be >= 1, or null (no chunks)", _at_least_one),
    "training.warmup_steps": ("must be >= 0", _not_negative),
    "training.weight_decay": ("must be >= 0", _not_negative),
    "training.max_norm": ("must be > 0 (the gradient norm clipped to)", _positive),
    "optim.beta1": ("must be in [0, 1)", lambda v: 0 <= v < 1),
    "optim.beta2": ("must be in [0, 1)", lambda v: 0 <= v < 1),
    "optim.eps": ("must be > 0", _positive),
    "optim.min_lr_ratio": ("must be in [0, 1]", lambda v: 0 <= v <= 1),
    "validation.every": ("must be >= 0 (0: no validation)", _not_negative),
    "validation.steps": ("must be >= 1", _at_least_one),
}


def check_ranges(job) -> None:
    for key, (rule, ok) in RANGES.items():
        value = attrgetter(key)(job)
        if value is not None and not ok(value):
            raise ConfigError(f"{key}={value} {rule}")
    m = job.model
    if m.head_dim is None and m.dim % m.n_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must divide model.dim={m.dim} (the heads split it; or set "
                          f"model.head_dim)")
    if head_dim(m) % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} (a head's width: {head_dim(m)}) must be even: the rotary "
                          f"embedding turns pairs of dimensions")
    if not m.n_experts:
        for key, dense in (("n_shared_experts", 0), ("n_expert_groups", 1), ("bias_update_speed", 0.0)):
            if getattr(m, key) != dense:
                raise ConfigError(f"model.{key}={getattr(m, key)} needs a mixture-of-experts model "
                                  f"(model.n_experts > 0)")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} "
                          f"(each key/value head serves a group of query heads)")
