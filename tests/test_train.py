"""train.py end to end: launched as a user launches it, read back from its outputs."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ENV, REPO, descendants, logged_steps, read_metrics, start, torchrun, wait_for
from omegaconf import OmegaConf

FIELDS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "mem_gib", "mem_tensor_gib",
          "param_mib", "elapsed_s", "eta_s", "time", "world_size", "restart"}
SHORT = ("model=llama_debug", "+smoke=cpu", "training.steps=4", "training.seq_len=32")


@pytest.mark.multiprocess
def test_torchrun_writes_metrics_config_console_lines_and_a_profile(tmp_path):
    result = torchrun(2, "+recipe=llama_fsdp", *SHORT, "metrics.peak_tflops=0.5",
                      "metrics.profile_step=3", output_dir=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert FIELDS <= record.keys()
        assert (record["tokens_per_s"] > 0 and record["mem_gib"] > record["mem_tensor_gib"] > 0
                and 0 < record["mfu"] < 1)
    assert records[-1]["loss"] < records[0]["loss"]
    # Memory: step 1's own peak, then the steady state's (the optimizer's state held through a
    # step), which the plan's prediction is held against.
    assert [r["mem_since_step"] for r in records] == [1, 2, 2, 2]
    assert records[1]["mem_tensor_gib"] > records[0]["mem_tensor_gib"]
    said = [line for line in result.stdout.splitlines() if line.startswith("plan: measured peak")]
    assert len(said) == 1 and said[0].startswith("plan: measured peak "
                                                 f"{records[1]['mem_tensor_gib']:.2f} GiB of "
                                                 "tensors on rank 0 since step 2, the steady "
                                                 "state"), said
    assert result.stdout.count(" tok/s | ") == 4  # one console line per step, rank 0 only
    assert records[-1]["eta_s"] == 0 and result.stdout.count("s left\n") == 4
    summary = [line for line in result.stdout.splitlines() if line.startswith("summary: ")]
    assert summary[0].startswith("summary: trained steps 1-4 (4 steps, 1,024 tokens) "
                                 "in ") and len(summary) == 3
    assert "GiB a rank (rank " in summary[1] and "0 optimizer step(s) skipped" in summary[1]
    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert saved.parallel.dp_shard == -1 and saved.output_dir == str(tmp_path)
    # step 3 on every rank: its trace, and its ops by time with FSDP's collectives
    for rank in (0, 1):
        trace = json.loads((tmp_path / "profile" / f"rank_{rank}.json").read_text())
        assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
        table = (tmp_path / "profile" / f"rank_{rank}.txt").read_text()
        assert table.startswith("step 3, rank "
                                f"{rank}") and "aten::mm" in table and "FSDP::all_gather" in table


@pytest.mark.multiprocess
def test_bad_layout_stops_every_rank_with_one_line(tmp_path):
    bad = ("+recipe=llama_hsdp", "model=llama_debug", "+smoke=cpu", "parallel.tp=3")
    line = "config error: parallel.tp=3 must divide model.n_heads=16"
    result = torchrun(4, *bad, output_dir=tmp_path, timeout=120)
    assert result.returncode != 0
    # Every rank stops; the first rank of the node says why, once.
    assert [x for x in result.stderr.splitlines() if x.startswith("config error:")] == [line]
    # torchrun reports the failed ranks with its own traceback; none comes from our code.
    assert 'train.py", line' not in result.stderr and "/trainer/" not in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
    # trainer-run checks the config before it starts any rank: the line, exit 2, nothing else.
    run = subprocess.run([sys.executable, "-m", "trainer.run.launcher", "--standalone",
                          "--nproc_per_node=4",
                          str(REPO / "train.py"), *bad, f"output_dir={tmp_path}"], cwd=REPO,
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stderr) == (2, line + "\n")
    # So it does for parallel=auto: the layout every rank would choose, found impossible first.
    run = subprocess.run([sys.executable, "-m", "trainer.run.launcher", "--standalone",
                          "--nproc_per_node=2",
                          str(REPO / "train.py"), *bad, "parallel=auto", f"output_dir={tmp_path}"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("config error: parallel=auto: no layout "
                                                         "of llama_debug on 2 x cpu with "
                                                         "parallel.tp=3 kept fits"), run.stderr
    assert len(run.stderr.splitlines()) == 1 and not (tmp_path / "metrics.jsonl").exists()


RANK_SIDE_ERRORS = {  # found by each rank under plain torchrun, whichever gets there first
    ("+recipe=mixtral_ep", "model=mixtral_debug", "model.n_experts=6", "parallel.ep=4"):
        "config error: parallel.ep=4 must divide model.n_experts=6",
    ("training.global_batch_size=7",):
        "config error: training.global_batch_size=7 must be divisible by dp*grad_accum_steps=2 "
        "(dp=2, grad_accum_steps=1)",
}


@pytest.mark.multiprocess
def test_an_error_every_rank_finds_is_said_once_per_node_every_time(tmp_path):
    """Whichever rank of the node finds it first says it; the others stay silent (no race with a
    wait)."""
    for n, (overrides, line) in enumerate(list(RANK_SIDE_ERRORS.items()) * 2):
        result = torchrun(2, *overrides, "+smoke=cpu", output_dir=tmp_path / str(n), timeout=120)
        said = [x for x in result.stderr.splitlines() if x.startswith("config error:")]
        assert result.returncode != 0 and said == [line], result.stderr[-2000:]


@pytest.mark.multiprocess
def test_world_of_one_without_torchrun_with_validation_and_wandb(tmp_path):
    cmd = [sys.executable, "train.py", "+recipe=llama_fsdp", *SHORT, "validation.every=2",
           "validation.steps=2", "metrics.wandb.enabled=true", f"output_dir={tmp_path}"]
    result = subprocess.run(cmd, cwd=REPO, env={**ENV, "WANDB_SILENT": "true"}, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert [("val_loss" in r) for r in records] == [False, True, False, True]
    assert records[-1]["val_loss"] < records[1]["val_loss"]
    assert list((tmp_path / "wandb").glob("offline-run-*")), "wandb wrote no offline run"


def test_precision_and_compile_rules_are_config_errors(monkeypatch):
    import pytest

    from trainer.checks.job import check_job
    from trainer.config.schema import JobConfig
    from trainer.errors import ConfigError

    def check(device="cpu", compile=False, **dtypes):
        job = JobConfig()
        job.device, job.training.seq_len, job.training.compile = device, 64, compile
        for key, value in dtypes.items():
            setattr(job.training.mixed_precision, key, value)
        check_job(job, world=2)

    check(param_dtype="bfloat16", reduce_dtype="bfloat16")
    check(device="cuda", reduce_dtype="bfloat16")  # auto: bf16 parameters on CUDA
    check(compile=True)
    with pytest.raises(ConfigError,
                       match=r"metrics.profile_step=0 must be a step of the run, "
                             r"1..training.steps=1000"):
        job = JobConfig()
        job.training.seq_len, job.metrics.profile_step = 64, 0
        check_job(job, world=2)
    with pytest.raises(ConfigError,
                       match=r"metrics.memory_snapshot_step records the CUDA allocator: "
                             r"device=cpu"):
        job = JobConfig()
        job.device, job.training.seq_len, job.metrics.memory_snapshot_step = "cpu", 64, 3
        check_job(job, world=2)
    for dtypes, message in [
        ({"param_dtype": "float8"}, r"training.mixed_precision.param_dtype=float8 must be one of"),
        ({"param_dtype": "float16"}, r"param_dtype=float16 needs loss scaling"),
        ({"reduce_dtype": "float16"}, r"reduce_dtype=float16 overflows"),
        ({"reduce_dtype": "bfloat16"},
         r"reduce_dtype=bfloat16 is narrower than the float32 parameters \(param_dtype=auto"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check(**dtypes)
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError,
                       match=r"training.compile=true cannot compile on cpu here: no C\+\+ "
                             r"compiler"):
        check(compile=True)


def test_mixture_of_experts_rules_are_config_errors():
    import dataclasses

    import pytest

    from trainer.checks.job import check_job
    from trainer.config.schema import JobConfig
    from trainer.errors import ConfigError
    from trainer.models import model_config as load_model_config

    def job_with(**settings):
        job = JobConfig()
        job.model = load_model_config("mixtral_debug")
        job.training.seq_len = 64
        for key, value in settings.items():
            section, name = key.split("__")
            setattr(getattr(job, section), name, value)
        return job

    check_job(job_with(parallel__ep=2, parallel__tp=2), world=4)
    mixtral = dataclasses.asdict(load_model_config("mixtral_debug"))
    with pytest.raises(ConfigError,
                       match=r"model.n_experts is not a key of model.family=llama; it is one of "
                             r"model.family=deepseek_v3 or mixtral or qwen3_moe"):
        load_model_config({**mixtral, "family": "llama"})
    for settings, message in [
        ({"model__top_k": 9}, r"model.top_k=9 must be between 1 and model.n_experts=8"),
        ({"model__top_k": 0}, r"model.top_k=0 must be between 1 and model.n_experts=8"),
        ({"model__capacity_factor": 0.0},
         r"model.capacity_factor=0.0 must be > 0, or null for dropless routing"),
        ({"parallel__tp": 2, "parallel__sequence_parallel": False},
         r"parallel.tp=2 with a mixture-of-experts model needs parallel.sequence_parallel=true"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_job(job_with(**settings), world=4)


def test_markers_of_launches_long_over_are_forgotten(tmp_path):
    """Outside torchrun the one-line errors' markers live in the temporary folder: old ones go."""
    import os
    import time

    sys.path.insert(0, str(REPO))
    from train import forget_old_markers

    old, new, other = (tmp_path / "trainer-said-1-aa", tmp_path / "trainer-said-2-bb",
                       tmp_path / "other")
    for path in (old, new, other):
        path.touch()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    os.utime(other, (time.time() - 3600, time.time() - 3600))
    forget_old_markers(tmp_path)
    assert not old.exists() and new.exists() and other.exists()


def running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.multiprocess
def test_no_rank_outlives_its_killed_launcher(tmp_path):
    """torchrun's process group killed (SIGKILL, as `kill -9 -- -PID` does) mid-run: torchrun
    starts each rank in a session of its own, yet no rank is left 10 s later, and the output
    folder is free for the next job."""
    out = tmp_path / "run"
    # train.py itself, not the suite's warm ranks (forked from its launcher, not from torchrun)
    process = start(2, "model=llama_debug", "+smoke=cpu", "training.steps=100000",
                    "training.seq_len=32", output_dir=out,
                    env={"PYTHONUNBUFFERED": "1"})
    ranks = []
    try:
        wait_for(lambda: logged_steps(out) >= 1, process, timeout=120)
        ranks = descendants(process.pid)
        os.killpg(process.pid, signal.SIGKILL)
        killed = time.monotonic()
        while any(map(running, ranks)) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        left = [pid for pid in ranks if running(pid)]
        assert len(ranks) == 2 and not left, (ranks, left)
        with open(out / ".lock") as lock:  # free within those seconds too (a loaded box is slower)
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() - killed < 10, "output_dir's lock still held"
                    time.sleep(0.1)
    finally:
        for pid in ranks:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
