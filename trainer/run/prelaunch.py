"""What a job's ranks check first about its output folder and the checkpoint it resumes, checked
before any rank starts too (trainer-run's check, where a mistake is one line and exit status 2): a
rerun at other settings (another model, other adapters), a checkpoint named by checkpoint.resume
that cannot be loaded, every checkpoint of resume=auto damaged, an output_dir that cannot be
written, or one in use by another job.

Before launch the checkpoints' files are read for their sizes only: the CRC32 of every byte is the
ranks' work, each reading its share."""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.folders import (
    MANIFEST,
    CheckpointError,
    all_damaged,
    checkpoint_steps,
    is_not_a_checkpoint,
    quick_problem,
)
from trainer.checkpoint.rerun import check_rerun
from trainer.checkpoint.state import check_same_shape, saved_config
from trainer.config.schema import JobConfig
from trainer.run.output import check_not_in_use, check_writable


def check_output(job: JobConfig, config: dict, before_launch: bool = False) -> str | None:
    """The checks above on `job` (`config`: the config as it runs); `before_launch` also whether
    another job holds output_dir (the ranks find that out by taking its lock). Returns the line
    on a changed schedule, if any."""
    schedule_change = check_rerun(config, job.checkpoint, job.output_dir)
    check_resumable(job)
    if before_launch:
        check_not_in_use(job.output_dir)
    check_writable(job.output_dir)
    return schedule_change


def check_resumable(job: JobConfig) -> None:
    """checkpoint.resume=PATH: a checkpoint that is whole, of this model's shape; resume=auto: not
    every checkpoint in output_dir damaged."""
    cfg = job.checkpoint
    if cfg.resume not in ("auto", "none"):
        path = named_step(Path(cfg.resume))
        problem = quick_problem(path)
        if problem is not None:
            raise CheckpointError(f"checkpoint.resume={cfg.resume} cannot be loaded: {problem}")
        check_same_shape(job.model, saved_config(path), f"checkpoint.resume={path}")
    elif cfg.resume == "auto" and cfg.enabled:
        found = [(path, quick_problem(path))
                 for _, path in checkpoint_steps(Path(job.output_dir) / "checkpoints")]
        if found and all(problem is not None for _, problem in found):
            damaged = [(p, why) for p, why in found if not is_not_a_checkpoint(why)]
            if damaged:
                raise all_damaged(damaged)


def named_step(path: Path) -> Path:
    """checkpoint.resume's checkpoint: `path`, or a run's folder's newest whole step."""
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = checkpoint_steps(folder)
    if (path / MANIFEST).is_file() or not steps:
        return path
    for _, step in reversed(steps):
        if quick_problem(step) is None:
            return step
    raise CheckpointError(f"checkpoint.resume={path} is a run's folder with no complete "
                          f"checkpoint in {folder}")

