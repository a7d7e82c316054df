"""Launching ranks from tests: whole jobs forked from one process (tests/launch.py) or by torchrun
(where launching is what is tested), torch.multiprocessing for small checks.

Every launch has a deadline: a hung collective fails the test instead of hanging the suite.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from warm_run import WarmRun

from trainer.run.launcher import children

REPO = Path(__file__).resolve().parent.parent
TRAIN, WARM_TRAIN = str(REPO / "train.py"), str(REPO / "tests" / "warm" / "train.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}


def needs(module: str, extra: str) -> pytest.MarkDecorator:
    """Skips a test whose optional extra is not installed, saying how to install it."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"needs {module}: pip install -e '.[{extra}]'")


NEEDS_TORCHAO = needs("torchao", "float8")
NEEDS_TORCHFT = needs("torchft", "ft")


def torchrun_command(nproc: int, *overrides: str, output_dir: Path, launcher_args: tuple = (),
                     rendezvous: tuple = ("--standalone",), launcher: str = "torch.distributed.run",
                     script: str = TRAIN) -> list[str]:
    """torchrun (or `launcher`, a module taking its arguments) running train.py (or `script`) on
    `nproc` local ranks."""
    return [
        sys.executable, "-m", launcher, *rendezvous, f"--nproc_per_node={nproc}", *launcher_args,
        script, *overrides, f"output_dir={output_dir}",
    ]


def torchrun(nproc: int, *overrides: str, output_dir: Path, timeout: float = 300,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs train.py on `nproc` local gloo ranks (`env` adds to their environment); output goes to
    `output_dir`."""
    script, env = warm_train(env)
    cmd = torchrun_command(nproc, *overrides, output_dir=output_dir, script=script)
    return subprocess.run(cmd, cwd=REPO, env={**ENV, **env}, capture_output=True, text=True,
                          timeout=timeout)


def warm_train(env: dict | None) -> tuple[str, dict]:
    """The train.py for torchrun to start, and `env` for its run: tests/warm/train.py (the ranks
    forked from the warm launcher) unless `env` sets what is read at start-up."""
    if set(env or {}) <= WARM_ENV:
        return WARM_TRAIN, {**(env or {}), "WARM_LAUNCHER": str(WarmLauncher.get().socket)}
    return TRAIN, env or {}


def run_script(script: Path, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python script args...` (output captured), forked from the warm launcher
    (tests/warm/run.py)."""
    env = {**os.environ, "WARM_LAUNCHER": str(WarmLauncher.get().socket)}
    return subprocess.run([sys.executable, str(REPO / "tests" / "warm" / "run.py"), str(script),
                           *map(str, args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def launch(nproc: int, *overrides: str, output_dir: Path, timeout: float = 300,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Like torchrun(), with the ranks forked from one process (tests/launch.py), itself forked from
    the suite's warm launcher (tests/launch_server.py) unless `env` sets what is read at
    start-up."""
    cmd = [sys.executable, str(REPO / "tests" / "launch.py"), str(nproc), *overrides,
           f"output_dir={output_dir}"]
    # as torchrun leaves it: every core to one rank
    if nproc == 1 and "OMP_NUM_THREADS" not in (env or {}):
        env = {**(env or {}), "OMP_NUM_THREADS": str(os.cpu_count())}
    if set(env or {}) <= WARM_ENV:
        return WarmLauncher.get().run(cmd, nproc, [*overrides, f"output_dir={output_dir}"], env,
                                      timeout)
    return subprocess.run(cmd, cwd=REPO, env={**ENV, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


# The settings a warm launcher's runs may change: read after start-up (tests/launch.py sets the
# ranks' thread count from OMP_NUM_THREADS).
WARM_ENV = {"TRAINER_FAULTS", "OMP_NUM_THREADS"}


class WarmLauncher:
    """tests/launch_server.py, started on the suite's first run and stopped at its end."""

    running: WarmLauncher | None = None

    @classmethod
    def get(cls) -> WarmLauncher:
        if cls.running is None or cls.running.server.poll() is not None:
            cls.running = cls()
        return cls.running

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="warm-launcher-"))
        self.socket = self.folder / "socket"
        self.server = subprocess.Popen([sys.executable, str(REPO / "tests" / "launch_server.py"),
                                        str(self.socket)],
                                       cwd=REPO, env=ENV, stdin=subprocess.DEVNULL,
                                       start_new_session=True,
                                       stdout=open(self.folder / "server.log", "w"),
                                       stderr=subprocess.STDOUT)
        atexit.register(self.close)
        deadline = time.monotonic() + 120
        while not self.socket.exists():
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the warm launcher did not start: "
                                   f"{(self.folder / 'server.log').read_text()}")
            time.sleep(0.05)

    def start(self, nproc: int, overrides: list[str], env: dict | None, stdout,
              stderr=subprocess.STDOUT) -> WarmRun:
        """`python tests/launch.py nproc overrides...`, forked, writing to the open files `stdout`
        and `stderr` (or stdout): a handle like subprocess.Popen's. Its ranks are in its session."""
        request = {"nproc": nproc, "overrides": overrides, "env": {**ENV, **(env or {})},
                   "cwd": str(REPO)}
        err = stdout if stderr == subprocess.STDOUT else stderr
        with open(os.devnull) as null:
            return WarmRun(str(self.socket), request,
                           (null.fileno(), stdout.fileno(), err.fileno()),
                           ["tests/launch.py", str(nproc), *overrides])

    def run(self, cmd: list[str], nproc: int, overrides: list[str], env: dict | None,
            timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryFile("w+", errors="replace") as out, \
                tempfile.TemporaryFile("w+", errors="replace") as err:
            run, code = self.start(nproc, overrides, env, out, err), None
            try:
                code = run.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            finally:
                if code is None:  # timed out, or the test was interrupted: the run and its ranks go
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(run.pid, signal.SIGKILL)
                run.close()
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        if code is None:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, code, stdout, stderr)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.server.pid, signal.SIGKILL)
        self.server.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def train_metrics(nproc: int, *overrides: str, output_dir: Path, timeout: float = 300,
                  env: dict | None = None) -> list[dict]:
    """The metrics.jsonl records of a run that must succeed."""
    result = launch(nproc, *overrides, output_dir=output_dir, timeout=timeout, env=env)
    assert result.returncode == 0, f"run failed:\n{failure_report(result)}"
    # torch's warning that an FSDP unit returned a view: the embedding's output is copied in every
    # layout, and the head returns its loss.
    assert "returned a view tensor" not in result.stderr, result.stderr[-3000:]
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
    return [json.loads(line)
            for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def by_step(records: list[dict]) -> dict[int, dict]:
    """The last record of each step (a restarted run logs the steps after its checkpoint again)."""
    return {r["step"]: r for r in records}


def loss_difference(records: list[dict], reference: list[dict], steps) -> float:
    """The largest relative loss difference from `reference` over `steps`; checks they all ran."""
    got, expected = by_step(records), by_step(reference)
    assert all(s in got for s in steps), f"steps {sorted(got)} miss some of {list(steps)}"
    return max(abs(got[s]["loss"] - expected[s]["loss"]) / expected[s]["loss"] for s in steps)


def free_port() -> int:
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
        # free FSDP's cyclic state before the groups go (see trainer.distributed.shutdown)
        gc.collect()
        dist.destroy_process_group()


# The ranks of spawn() start from a server process that has imported torch and the trainer once for
# the whole suite (seconds less per rank than a fresh interpreter's imports).
mp.set_forkserver_preload(["torch", "torch.distributed", "trainer", "trainer.run.job"])


def spawn(fn, world_size: int, *args, timeout: float = 180) -> None:
    """Runs fn(rank, world_size, *args) on `world_size` gloo ranks; fn must be module-level."""
    context = mp.start_processes(
        _entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=False,
        start_method="forkserver"
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{world_size} ranks did not finish within {timeout}s")


def start(nproc: int, *overrides: str, output_dir: Path, log: Path | None = None,
          env: dict | None = None, **launch) -> subprocess.Popen:
    """Starts torchrun (torchrun_command's `launch` arguments) in the background; its output goes
    to `log` (default: beside output_dir, named after it)."""
    log = open(log or output_dir.parent / f"{output_dir.name}.log", "w")
    script, env = warm_train(env)
    return subprocess.Popen(torchrun_command(nproc, *overrides, output_dir=output_dir,
                                             script=script, **launch),
                            cwd=REPO, env={**ENV, **env}, stdout=log, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def wait_for(condition, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            kill(process)
            raise AssertionError("the run ended, or never got there")
        time.sleep(0.05)


def finish(process: subprocess.Popen, timeout: float = 180) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(process)
        raise


def kill(process: subprocess.Popen) -> None:
    """Kills the launcher, torchrun and its ranks (each in a session of its own: found by parent
    pid)."""
    for pid in descendants(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # gone meanwhile
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: children first, then theirs."""
    found = children(pid)
    return found + [d for child in found for d in descendants(child)]


def logged_steps(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0
