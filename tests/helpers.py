"""Launching ranks from tests: whole jobs forked from one process (tests/launch.py) or by torchrun
(where launching is what is tested), torch.multiprocessing for small checks.

Every launch has a deadline: a hung collective fails the test instead of hanging the suite.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}


def torchrun_command(nproc: int, *overrides: str, output_dir: Path, launcher_args: tuple = ()) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *launcher_args,
        str(REPO / "train.py"), *overrides, f"output_dir={output_dir}",
    ]


def torchrun(nproc: int, *overrides: str, output_dir: Path, timeout: float = 300,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs train.py on `nproc` local gloo ranks (`env` adds to their environment); output goes to `output_dir`."""
    cmd = torchrun_command(nproc, *overrides, output_dir=output_dir)
    return subprocess.run(cmd, cwd=REPO, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)


def launch(nproc: int, *overrides: str, output_dir: Path, timeout: float = 300,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Like torchrun(), with the ranks forked from one process (tests/launch.py): seconds less per run."""
    cmd = [sys.executable, str(REPO / "tests" / "launch.py"), str(nproc), *overrides, f"output_dir={output_dir}"]
    return subprocess.run(cmd, cwd=REPO, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)


def train_metrics(nproc: int, *overrides: str, output_dir: Path, timeout: float = 300,
                  env: dict | None = None) -> list[dict]:
    """The metrics.jsonl records of a run that must succeed."""
    result = launch(nproc, *overrides, output_dir=output_dir, timeout=timeout, env=env)
    assert result.returncode == 0, f"run failed:\n{failure_report(result)}"
    if "training.compile=true" in overrides:
        # What could not be compiled runs eagerly without a word: the blocks must really compile.
        graphs = int(result.stdout.split("compile: ")[1].split()[0])
        assert graphs >= 1, f"nothing was compiled:\n{result.stdout[-2000:]}"
    return read_metrics(output_dir)


def failure_report(result: subprocess.CompletedProcess) -> str:
    """The ranks' own errors first (torchrun's summary of them is long and says little)."""
    lines = (result.stdout + result.stderr).splitlines()
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return "\n".join(errors[:40]) + "\n--- stderr tail ---\n" + result.stderr[-3000:]


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    dist.init_process_group("gloo")
    try:
        fn(rank, world_size, *args)
    finally:
        gc.collect()  # free FSDP's cyclic state before the groups go (see trainer.distributed.shutdown)
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args, timeout: float = 180) -> None:
    """Runs fn(rank, world_size, *args) on `world_size` gloo ranks; fn must be module-level."""
    context = mp.start_processes(
        _entry, args=(fn, world_size, _free_port(), args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{world_size} ranks did not finish within {timeout}s")
