"""The output folder: writable, held by one job at a time, and nothing in it overwritten.

Rank 0 holds an exclusive lock (flock) on output_dir/.lock for the job's life, with its host, pid
and start time written in it. A second job on the same folder finds the lock taken and stops at
once, naming the first; the kernel drops a dead job's lock with its process, so a restarted job
(torchrun --max-restarts, a requeued Slurm job) takes the folder over without anyone cleaning up.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf

from trainer.errors import ConfigError
from trainer.safe_write import move_aside, temporary_beside

LOCK_NAME = ".lock"


def save_config(output_dir: Path, config: dict, log) -> None:
    """Writes output_dir/config.yaml (rank 0): one there that says something else (an earlier run's,
    or a file of the user's) is moved aside first, kept as config.before-DATE.yaml."""
    path = output_dir / "config.yaml"
    tmp = temporary_beside(path)
    OmegaConf.save(OmegaConf.create(config), tmp)
    if path.is_file() and path.read_bytes() == tmp.read_bytes():
        tmp.unlink()
        return
    if path.exists() or path.is_symlink():
        log(f"output: {path} held another config; moved it to {move_aside(path, 'before').name}")
    tmp.rename(path)


def check_writable(output_dir: str) -> None:
    """A config error unless this rank can create files in output_dir (made if missing)."""
    folder = Path(output_dir)
    probe = folder / f".write_test.{socket.gethostname()}.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"output_dir={output_dir} cannot be written: {e.strerror or e}") from None


class OutputLock:
    """Collective: rank 0 claims output_dir for this job, and every rank learns whether it could."""

    def __init__(self, output_dir: str, rank: int):
        self.file = None
        error = None
        if rank == 0:
            error = self._claim(Path(output_dir) / LOCK_NAME, output_dir)
        if dist.is_initialized() and dist.get_world_size() > 1:
            shared = [error]
            dist.broadcast_object_list(shared, src=0)
            error = shared[0]
        if error is not None:
            self.release()
            raise ConfigError(error)

    def _claim(self, path: Path, output_dir: str) -> str | None:
        self.file = open(path, "a+")  # noqa: SIM115 (held open, and locked, until the job ends)
        if not _locked(self.file):
            return _in_use(self.file, output_dir)
        self.file.seek(0)
        self.file.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        self.file.write(f"host {socket.gethostname()}, pid {os.getpid()}, started {started}")
        self.file.flush()
        return None

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # closing drops the lock; the file stays, naming the last holder
            self.file = None


def check_not_in_use(output_dir: str) -> None:
    """Before launch: a config error when another job holds output_dir (its lock is only tried)."""
    path = Path(output_dir) / LOCK_NAME
    if not path.is_file():
        return
    with open(path) as file:
        if not _locked(file, shared=True):
            raise ConfigError(_in_use(file, output_dir))


def _locked(file, shared: bool = False) -> bool:
    """Whether this process could lock `file` (exclusively, or shared: a mere try)."""
    try:
        fcntl.flock(file, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _in_use(file, output_dir: str) -> str:
    file.seek(0)
    holder = file.read().strip() or "a job that has not written its name yet"
    return (f"output_dir={output_dir} is in use by another job ({holder}): stop it, or choose "
            "another output_dir")
