"""Keeps the suite's token caches out of the user's home (one folder for the session, inherited by the
ranks the tests launch), and keeps the fast tier fast: a test that starts a process must be marked
`multiprocess`, or it fails saying so."""

import multiprocessing.process
import os
import subprocess
import tempfile

import pytest

os.environ.setdefault("TRAINER_CACHE", tempfile.mkdtemp(prefix="trainer-cache-"))


@pytest.fixture(autouse=True)
def _processes_only_when_marked(request, monkeypatch):
    if request.node.get_closest_marker("multiprocess"):
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.multiprocess")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
