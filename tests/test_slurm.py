"""scripts/slurm/train.sbatch against a real Slurm: a two-node cluster on this machine
(scripts/slurm/local_cluster.sh), a job across both nodes, a preemption through Slurm's signal, and
an elastic job that loses a node."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, WarmLauncher, read_metrics

CLUSTER = REPO / "scripts" / "slurm" / "local_cluster.sh"
WARM = REPO / "tests" / "warm"
STEPS = 10
BASE = ("+recipe=llama_fsdp", "model=llama_debug", "+smoke=cpu", f"training.steps={STEPS}",
        "training.seq_len=64", "training.lr=3e-3", "checkpoint.enabled=true")
JOB = (*BASE, "checkpoint.interval=100")

pytestmark = pytest.mark.multiprocess  # every test here starts a cluster and jobs


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment for Slurm commands on a freshly started local cluster (stopped
    afterwards)."""
    env = {**os.environ, "SLURM_LOCAL_DIR": str(tmp_path_factory.mktemp("slurm")),
           "SLURM_LOCAL_PORT": "17817"}
    started = subprocess.run(["bash", str(CLUSTER), "start"], env=env, capture_output=True,
                             text=True, timeout=300)
    if started.returncode == 3:
        pytest.skip(started.stderr.strip())
    assert started.returncode == 0, started.stdout + started.stderr
    env["SLURM_CONF"] = str(Path(env["SLURM_LOCAL_DIR"]) / "slurm.conf")
    # Each node's torchrun starts two CPU ranks from this Python environment: the train.py of the
    # job's folder (WARM) is tests/warm/train.py, its ranks forked from the suite's warm launcher.
    env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}", NPROC_PER_NODE="2",
               OMP_NUM_THREADS="1", WARM_LAUNCHER=str(WarmLauncher.get().socket))
    yield env
    subprocess.run(["bash", str(CLUSTER), "stop"], env=env, capture_output=True, timeout=60)


def submit(env: dict, out: Path, *args: str, sbatch_args: tuple = ()) -> str:
    """Submits train.sbatch on both nodes; returns the job id."""
    cmd = ["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1",
           f"--chdir={WARM}", f"--output={out}/%x-%j.out", *sbatch_args,
           str(REPO / "scripts" / "slurm" / "train.sbatch"), *args, f"output_dir={out}"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "GONE")


def state(env: dict, job: str) -> str:
    """The job's state, GONE once Slurm has forgotten it."""
    result = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True,
                            text=True, timeout=30)
    if "Invalid job id" in result.stderr:
        return "GONE"
    fields = dict(f.split("=", 1) for f in result.stdout.split() if "=" in f)
    return fields.get("JobState", "UNKNOWN")


def finished(env: dict, job: str) -> bool:
    return state(env, job) in FINISHED


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def log_of(out: Path, job: str) -> str:
    return (out / f"trainer-{job}.out").read_text()


@pytest.fixture(scope="module")
def two_node_run(slurm, tmp_path_factory):
    out = tmp_path_factory.mktemp("two_nodes")
    job = submit(slurm, out, *JOB)
    try:
        wait_until(lambda: finished(slurm, job), 300, f"job {job} to finish")
    finally:
        subprocess.run(["scancel", job], env=slurm, timeout=30)
    return out, job


def test_job_spans_two_nodes(two_node_run):
    out, job = two_node_run
    log = log_of(out, job)
    assert "2 nodes x 2 ranks" in log and "dp_shard=4" in log, log[-3000:]
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), log[-3000:]
    assert records[-1]["loss"] < 0.8 * records[0]["loss"]


def test_preemption_signal_saves_requeues_and_resumes(slurm, two_node_run, tmp_path):
    out = tmp_path
    job = submit(slurm, out, *JOB)
    try:
        metrics = out / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 300,
                   "step 3")
        # What Slurm does before the time limit (--signal=B:USR1@120): signal the batch script.
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True,
                       timeout=30)
        wait_until(lambda: "requeueing" in log_of(out, job), 120, "the requeue")
        # A requeued job waits about two minutes before it may start again; let it start in a few
        # seconds (sooner, the nodes may still refuse the previous run's revoked credential).
        wait_until(lambda: state(slurm, job) == "PENDING", 60, "the job to be pending")
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"], env=slurm,
                       check=True, timeout=30)
        wait_until(lambda: finished(slurm, job), 300, f"job {job} to finish")
    finally:
        subprocess.run(["scancel", job], env=slurm, timeout=30)
    log = log_of(out, job)
    assert "stopped at step" in log and "restart 1" in log and "resumed from" in log, log[-4000:]
    records = {r["step"]: r["loss"] for r in read_metrics(out)}
    reference = {r["step"]: r["loss"] for r in read_metrics(two_node_run[0])}
    assert sorted(records) == list(range(1, STEPS + 1))
    difference = max(abs(records[s] - reference[s]) / reference[s] for s in records)
    print(f"slurm preemption: largest relative loss difference {difference:.1e}")
    assert difference <= 1e-6


def node_processes(job: str, node: int) -> list[int]:
    """The processes Slurm started for `job` on `node` (its torchrun agent and ranks), by their
    environment."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            items = environ.read_bytes().decode(errors="replace").split("\0")
            env = dict(item.split("=", 1) for item in items if "=" in item)
        except OSError:
            continue
        ours = env.get("SLURM_JOB_ID") == job and env.get("SLURM_NODEID") == str(node)
        if ours and "SLURM_STEP_ID" in env:
            found.append(int(environ.parent.name))
    return found


def test_elastic_job_goes_on_without_a_lost_node(slurm, two_node_run, tmp_path):
    """MIN_NODES=1 with --no-kill: the second node's torchrun and ranks are killed after step 4's
    checkpoint (a node lost); the first node's ranks resume from it alone, on 2 ranks, and finish
    with the two-node run's losses."""
    out = tmp_path
    env = {**slurm, "MIN_NODES": "1",
           "RDZV_CONF": "last_call_timeout=2,keep_alive_interval=2,keep_alive_max_attempt=3"}
    job = submit(env, out, *BASE, "checkpoint.interval=2", "training.micro_batch_size=2",
                 sbatch_args=("--no-kill",))
    try:
        metrics = out / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5, 300,
                   "step 5")
        lost = node_processes(job, 1)
        assert lost, "no processes of the job on the second node"
        for pid in lost:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: finished(slurm, job), 300, f"job {job} to finish")
        ended = state(slurm, job)
    finally:
        subprocess.run(["scancel", job], env=slurm, timeout=30)
    log = log_of(out, job)
    assert "elastic, 1 to 2 nodes" in log and "world changed from 4 to 2 ranks" in log, log[-4000:]
    records = {r["step"]: r for r in read_metrics(out)}
    reference = {r["step"]: r["loss"] for r in read_metrics(two_node_run[0])}
    assert sorted(records) == list(range(1, STEPS + 1)), log[-4000:]
    assert records[STEPS]["world_size"] == 2, log[-4000:]
    difference = max(abs(records[s]["loss"] - reference[s]) / reference[s] for s in records)
    print(f"slurm elastic: a node lost after step 4, finished on one (job {ended}); largest "
          f"relative loss difference {difference:.1e}")
    assert difference <= 1e-4
