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
    """The rerun's settings and output_dir's writability (each rank's and trainer-run's checks);
    `before_launch` also the checkpoint to resume and whether another job holds output_dir, which
    the ranks find out by verifying what they load and by taking the lock (a stat of every file of
    every checkpoint on each of 512 ranks would load a shared filesystem). Returns the line on a
    changed schedule, if any."""
    schedule_change = check_rerun(config, job.checkpoint, job.output_dir)
    if before_launch:  # (the ranks verify what they load, each its share of the files)
        check_resumable(job)
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
        damaged = []
        for _, path in reversed(checkpoint_steps(Path(job.output_dir) / "checkpoints")):
            problem = quick_problem(path)
            if problem is None:
                return  # the newest whole one: resume=auto has one to take
            if not is_not_a_checkpoint(problem):
                damaged.append((path, problem))
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

