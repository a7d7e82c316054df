"""Faults a long run meets, injected on purpose (TRAINER_FAULTS): a rank stuck while the others wait
in a collective, a rank paused until the job is asked to stop, and a disk that fills during a save.
(Ranks killed mid-step and mid-save, and torchrun restarting them, are in test_elastic.py.)"""

import re
import signal
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import launch, read_metrics

from trainer import build_model
from trainer.faults.injection import FaultInjection
from trainer.models import model_config as load_model_config

SMALL = ("+recipe=llama_fsdp", "model=llama_debug", "+smoke=cpu", "training.seq_len=32",
         "training.global_batch_size=4", "model.n_layers=2")


@pytest.mark.multiprocess
def test_a_stuck_rank_turns_into_a_report_from_every_rank_and_an_exit(tmp_path):
    """Rank 1 sleeps at the start of step 3 while rank 0 waits for it in the step's first collective
    (the all-reduce of its supervised-token count): within the step timeout both ranks print where
    they are, save it, and exit with the watchdog's status."""
    started = time.monotonic()
    result = launch(2, *SMALL, "training.steps=6", "distributed.step_timeout_s=3",
                    "distributed.timeout_s=120", output_dir=tmp_path,
                    env={"TRAINER_FAULTS": "hang@3:1"}, timeout=120)
    took = time.monotonic() - started
    assert result.returncode == 3, result.stderr[-3000:]
    report = result.stderr
    # The waiting rank names the collective it is in, on which mesh dimensions; the sleeping one
    # shows in its stack what it does instead.
    assert ("watchdog: rank 0: step 3, phase counting the supervised tokens: no progress for "
            in report), report[-3000:]
    assert "(distributed.step_timeout_s=3)" in report
    assert ("watchdog: rank 0: last collective on dp_shard/dp/dp_shard_cp/dp_cp: all_reduce "
            "#" in report)
    assert "watchdog: rank 1: step 3, phase forward: no progress for " in report
    assert "in hang_or_kill" in report.split("watchdog: rank 1: Python stacks:")[1]
    for rank in (0, 1):
        assert (f"watchdog: rank {rank}: report in {tmp_path}/watchdog/rank_{rank}.txt; "
                "exiting with status 3" in report)
        assert (tmp_path / "flight_recorder" / f"rank_{rank}").stat().st_size > 0
    print(f"stuck rank: every rank out {took:.0f}s after the launch (step timeout 3 s, PG timeout "
          "120 s)")
    assert took < 90


def checkpoint_bytes(n_layers: int) -> int:
    """About what one checkpoint of the small model takes: fp32 weights and AdamW's two moments."""
    cfg = load_model_config("llama_debug")
    cfg.n_layers = n_layers
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(cfg).parameters())
    return 12 * params


@pytest.mark.multiprocess
def test_a_disk_that_fills_during_a_save_stops_the_job_and_keeps_the_last_checkpoint(tmp_path):
    """checkpoints/ on a tmpfs with room for one checkpoint and a half: step 2's save fits, step 4's
    runs out of space. The job stops with one line naming the step and the error; step 2 stays the
    newest checkpoint and nothing of step 4 is left behind."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    size = int(1.5 * checkpoint_bytes(2))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): "
                    f"{mounted.stderr.strip()}")
    try:
        result = launch(2, *SMALL, "training.steps=6", "checkpoint.enabled=true",
                        "checkpoint.interval=2", "metrics.log_every=1", output_dir=tmp_path,
                        timeout=120)
        saved = sorted(p.name for p in folder.iterdir())
    finally:
        subprocess.run(["umount", str(folder)], check=True)
    assert result.returncode == 1, result.stderr[-3000:]
    # The write that finds the disk full fails with ENOSPC, or short inside torch.save's zip writer.
    stopped = re.search(r"training stopped: step 4: checkpoint not saved \((.*); (\d+\.\d) MiB "
                        r"free on its disk\); "
                        rf"the newest checkpoint is still {re.escape(str(folder))}/step_2\n",
                        result.stderr)
    assert stopped and float(stopped[2]) < 0.5 * size / 2**20, result.stderr[-3000:]
    assert saved == ["step_2"]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_a_paused_rank_waits_for_the_stop_once_per_job(tmp_path):
    stop = SimpleNamespace(received=None)
    faults = FaultInjection("pause@3", 0, str(tmp_path), stop=stop)
    started = time.monotonic()
    faults.before_forward(2)  # another step: no wait
    assert time.monotonic() - started < 0.1
    threading.Timer(0.3, lambda: setattr(stop, "received", signal.SIGTERM)).start()
    faults.before_forward(3)
    assert 0.3 <= time.monotonic() - started < 10
    # The job started again (its launcher's restart, a grown world): the step runs through.
    started = time.monotonic()
    injection = FaultInjection("pause@3", 0, str(tmp_path), stop=SimpleNamespace(received=None))
    injection.before_forward(3)
    assert time.monotonic() - started < 0.1
