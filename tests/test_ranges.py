"""Values no key can take (trainer/checks/ranges.py): each one config error line, before anything is
built."""

import pytest

from trainer.checks.job import check_job
from trainer.checks.ranges import RANGES, value_of
from trainer.config.schema import JobConfig
from trainer.errors import ConfigError


def job_with(key: str, value) -> JobConfig:
    job = JobConfig()
    job.training.seq_len = 64
    section, name = key.split(".")
    setattr(getattr(job, section), name, value)
    return job


@pytest.mark.parametrize("key, value, message", [
    ("training.lr", -1.0, r"training.lr=-1.0 must be >= 0"),
    ("training.warmup_steps", -5, r"training.warmup_steps=-5 must be >= 0"),
    ("training.weight_decay", -0.1, r"training.weight_decay=-0.1 must be >= 0"),
    ("training.max_norm", 0.0, r"training.max_norm=0.0 must be > 0"),
    ("training.steps", 0, r"training.steps=0 must be >= 1"),
    ("optim.beta2", 1.0, r"optim.beta2=1.0 must be in \[0, 1\)"),
    ("optim.eps", 0.0, r"optim.eps=0.0 must be > 0"),
    ("optim.min_lr_ratio", 2.0, r"optim.min_lr_ratio=2.0 must be in \[0, 1\]"),
    ("validation.steps", 0, r"validation.steps=0 must be >= 1"),
    ("model.dim", 0, r"model.dim=0 must be >= 1"),
    ("model.n_heads", 3, r"model.n_heads=3 must divide model.dim=256"),
    ("model.n_kv_heads", 3, r"model.n_kv_heads=3 must divide model.n_heads=16"),
    ("model.norm_eps", -1e-5, r"model.norm_eps=-1e-05 must be > 0"),
])
def test_a_value_out_of_range_is_one_config_error(key, value, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        check_job(job_with(key, value), world=1)


def test_the_defaults_are_in_range():
    check_job(job_with("training.seq_len", 64), world=1)
    for key in RANGES:  # every row names a key of the schema (a misspelt one raises AttributeError)
        value_of(JobConfig(), key)
