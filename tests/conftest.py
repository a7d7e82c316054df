"""Keeps the suite's token and compiled-kernel caches out of the user's (one folder each for the
session, inherited by the ranks the tests launch), and keeps the fast tier fast: a test that starts
a process, in its body or in any fixture it sets up (of any scope), must be marked `multiprocess`
(or `tool`: one short command that starts no ranks), or it fails saying so. TRAINER_TEST_HIDE
(below) hides packages."""

import contextlib
import multiprocessing.process
import os
import re
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("TRAINER_CACHE", tempfile.mkdtemp(prefix="trainer-cache-"))
# Inductor's compiled kernels too: a cache left by other runs can hold kernels that corrupt the heap
# (seen: the float8 pp2 compile row aborting in malloc after runs killed mid-compile and runs with
# ATEN_CPU_CAPABILITY=avx2; which of the two, not established; a fresh cache passes).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cache-"))
# TRAINER_TEST_HIDE=torchao,torchft: those packages import as if they were not installed (None in
# sys.modules: `import` raises ModuleNotFoundError, importlib's find_spec answers None), as with
# only .[dev] installed (tests/test_extras.py runs the fast tier so).
for _name in filter(None, os.environ.get("TRAINER_TEST_HIDE", "").split(",")):
    sys.modules[_name] = None


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


# TRAINER_TEST_EXTRAS=<regex> (tests/test_extras.py, with the extras hidden): of the tests
# collected, only those that need an extra (skipped saying how to install it) or whose id matches
# run.
def pytest_collection_modifyitems(config, items):
    naming = os.environ.get("TRAINER_TEST_EXTRAS")
    if not naming:
        return
    keep, drop = [], []
    for item in items:
        guarded = any("pip install -e '.[" in str(mark.kwargs.get("reason", ""))
                      for mark in item.iter_markers("skipif"))
        (keep if guarded or re.search(naming, item.nodeid) else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
