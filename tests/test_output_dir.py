"""The output folder: one that cannot be written is a config error before training, and two jobs
on one folder cannot run at once (the second stops naming the first; a dead job's successor takes
over)."""

import os
import signal
import time

import pytest
from helpers import WarmLauncher, launch

RUN = ("model=llama_debug", "+smoke=cpu", "training.seq_len=32", "training.global_batch_size=2",
       "model.n_layers=1")


@pytest.mark.multiprocess
def test_an_unwritable_output_dir_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    result = launch(2, *RUN, output_dir=tmp_path / "file" / "run", timeout=120)
    assert result.returncode == 2
    said = f"config error: output_dir={tmp_path}/file/run cannot be written: Not a directory"
    assert said in result.stderr, result.stderr[-2000:]


@pytest.mark.multiprocess
def test_a_second_job_on_the_same_folder_stops_at_once(tmp_path):
    with open(os.devnull, "w") as null:
        first = WarmLauncher.get().start(1,
                                         [*RUN, "training.steps=100000", f"output_dir={tmp_path}"],
                                         None, null)
    try:
        lock = tmp_path / ".lock"
        deadline = time.monotonic() + 120
        while not (lock.is_file() and lock.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        holder = lock.read_text()
        assert holder.startswith("host ") and ", pid " in holder
        started = time.monotonic()
        second = launch(2, *RUN, "training.steps=2", output_dir=tmp_path, timeout=120)
        assert second.returncode == 2 and time.monotonic() - started < 60
        said = f"config error: output_dir={tmp_path} is in use by another job ({holder}): stop it"
        assert said in second.stderr, second.stderr[-2000:]
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # dies holding the lock, as a crashed job does
        first.wait(timeout=60)
    third = launch(1, *RUN, "training.steps=2", output_dir=tmp_path, timeout=120)
    assert third.returncode == 0, third.stderr[-2000:]
