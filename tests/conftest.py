"""Keeps the suite's token and compiled-kernel caches out of the user's (one folder each for the session,
inherited by the ranks the tests launch), and keeps the fast tier fast: a test that starts a process, in its body or in
any fixture it sets up (of any scope), must be marked `multiprocess` (or `tool`: one short command that starts no
ranks), or it fails saying so. TRAINER_TEST_HIDE (below) hides packages.

Under pytest-xdist (`-n 2`, the README's command) each worker takes whole modules (`--dist loadscope`: a module's
reference runs once), the longest first, and a test marked `alone` (one that times the machine) runs with the other
worker paused: a shared lock every test holds, taken exclusively by `alone` ones."""

import contextlib
import fcntl
import multiprocessing.process
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TRAINER_CACHE", tempfile.mkdtemp(prefix="trainer-cache-"))
# Inductor's compiled kernels too: a cache left by other runs can hold kernels that corrupt the heap (seen:
# the float8 pp2 compile row aborting in malloc after runs killed mid-compile and runs with
# ATEN_CPU_CAPABILITY=avx2; which of the two, not established; a fresh cache passes).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cache-"))
# TRAINER_TEST_HIDE=torchao,torchft: those packages import as if they were not installed (None in sys.modules:
# `import` raises ModuleNotFoundError, importlib's find_spec answers None), as with only .[dev] installed
# (tests/test_extras.py runs the fast tier so).
for _name in filter(None, os.environ.get("TRAINER_TEST_HIDE", "").split(",")):
    sys.modules[_name] = None

# The workers' shared lock (set by the first process to load this file, inherited by the workers).
os.environ.setdefault("TRAINER_TEST_LOCKS", tempfile.mkdtemp(prefix="trainer-test-locks-"))

# Modules by their measured time on 2 cores (seconds, serially), so the longest start first and the
# workers end together; the others follow in their own order.
MODULE_SECONDS = {"test_parity": 690, "test_plan": 330, "test_elastic": 210, "test_float8": 200,
                  "test_checkpoint": 160, "test_slurm": 120, "test_fault_tolerance": 100, "test_data": 60,
                  "test_hf": 70, "test_train": 70, "test_gpu_check": 45}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -MODULE_SECONDS.get(Path(str(item.fspath)).stem, 0))


class _Turns:
    """A readers-writer lock between the suite's processes: every test holds `shared` while it
    runs; an `alone` test holds it exclusively, and holds `gate` meanwhile so that no new test
    starts while it waits for the running ones (two flock files)."""

    def __init__(self, folder: Path):
        self.gate, self.shared = (open(folder / name, "a") for name in ("gate", "shared"))
        self.alone: bool | None = None  # what this process holds: None (nothing), False, True

    def take(self, alone: bool) -> None:
        if self.alone == alone:
            return
        self.release()
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        if alone:
            fcntl.flock(self.shared, fcntl.LOCK_EX)  # the gate stays shut until release()
        else:
            fcntl.flock(self.shared, fcntl.LOCK_SH)
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        self.alone = alone

    def release(self) -> None:
        if self.alone is not None:
            fcntl.flock(self.shared, fcntl.LOCK_UN)
            if self.alone:
                fcntl.flock(self.gate, fcntl.LOCK_UN)
        self.alone = None


_turns = _Turns(Path(os.environ["TRAINER_TEST_LOCKS"]))


def _alone(item) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Set-up (module fixtures included), the test and tear-down under the lock; a run of `alone`
    tests keeps it exclusive from the first to the last."""
    _turns.take(_alone(item))
    try:
        return (yield)
    finally:
        if not (_alone(item) and _alone(nextitem)):
            _turns.release()


@contextlib.contextmanager
def _no_processes(item):
    if item.get_closest_marker("multiprocess") or item.get_closest_marker("tool"):
        yield
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{item.nodeid} starts a process: mark it @pytest.mark.multiprocess")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refuse)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        yield


# Set-up (where module- and session-scoped fixtures run), the test and tear-down, each guarded.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _no_processes(item):
        return (yield)
