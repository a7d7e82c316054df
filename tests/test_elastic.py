"""Restarts and elastic membership under torchrun, as users launch it. Every launch form restarts
killed ranks and resumes exactly; an elastic job (two torchrun agents on this machine as two nodes)
shrinks when a node dies and grows when one joins, keeping the global batch and the data order.
One run covers several faults: each restart is seconds of start-up on this machine."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    ENV,
    REPO,
    descendants,
    finish,
    free_port,
    kill,
    logged_steps,
    loss_difference,
    read_metrics,
    start,
    train_metrics,
    wait_for,
)
from test_plan import job_of

from trainer.checks.job import check_job
from trainer.observe.describe import describe_layout
from trainer.plan.auto import auto_device, choose_layout

JOB = ("+recipe=llama_fsdp", "model=llama_debug", "+smoke=cpu", "training.seq_len=64",
       "training.global_batch_size=8", "training.lr=3e-3", "training.warmup_steps=2",
       "checkpoint.enabled=true", "checkpoint.interval=2")
STEPS = 10  # of a restarted job
ELASTIC_STEPS = 14  # of the elastic job
# The shrunk job waits at this step until the joining node stops it, and saves it: without the wait
# it could finish before the join (seen with 16 and with 20 steps). Past any step the first 4-rank
# start reaches before its node is killed (about 6).
PAUSE_STEP = 10
ELASTIC = (f"training.steps={ELASTIC_STEPS}", "parallel=auto")
EXACT = 1e-6  # the same world, resumed
RESHARDED = 1e-4  # another world size: the parity tolerance
# Rendezvous settings for the tests' elastic agents: a dead agent is found after 2 s x 3 missed
# heartbeats (torch's default is 5 s x 3), and a round
# closes 1 s after its minimum is met (not 30 s).
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=2,keep_alive_max_attempt=3"


def uninterrupted(nproc: int, steps: int, out: Path, *overrides: str) -> list[dict]:
    return train_metrics(nproc, *JOB, f"training.steps={steps}", *overrides, output_dir=out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return uninterrupted(2, STEPS, tmp_path_factory.mktemp("reference"))


def resumed_steps(log: str) -> list[int]:
    return [int(line.split("/step_")[1].split()[0]) for line in log.splitlines()
            if "resumed from" in line]


def kill_to_first_step(out: Path, records: list[dict]) -> list[float]:
    """Seconds from each injected kill (its marker is written just before) to the first step logged
    after it."""
    kills = sorted(p.stat().st_mtime for p in (out / "faults").iterdir()
                   if p.name.startswith("kill"))
    return [min(r["time"] for r in records if r["time"] > t) - t for t in kills]


# Static rendezvous (`--master_port`) and c10d share
# torchrun's store with the ranks across restarts;
# --standalone also starts a rank that hangs (the watchdog stops every rank); c10d saves in the
# background. The four faults of --standalone, split between the other two forms (suite time): ranks
# killed mid-step under --master_port, mid-save (mid background save) under c10d.
# form -> (torchrun's arguments, overrides, faults
# ({other}: a non-zero rank), the checkpoints resumed from)
FORMS = {
    "master_port": (("--master_addr=127.0.0.1", "--master_port={port}"), (),
                    "kill@5:{other},kill@8:0", [4, 6]),
    "standalone": (("--standalone",), ("distributed.step_timeout_s=5",),
                   "kill_save@4:0,kill@5:{other},kill_save@6:{other},kill@8:0,hang@9:{other}",
                   [2, 4, 4, 6, 8]),
    "c10d": (("--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=restarts"),
             ("checkpoint.async_save=true",), "kill_save@4:0,kill_save@6:{other}", [2, 4]),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("form", FORMS)
def test_torchrun_restarts_killed_ranks_with_every_launch_form(form, reference, tmp_path):
    """Rank 0 and a random other rank killed mid-save (step 4, step 6) and mid-step (step 5, step 8)
    (each form its share of these), with no environment variable set: each time torchrun restarts
    the job, which resumes from the newest complete checkpoint and reproduces the uninterrupted
    run's losses."""
    rendezvous, extra, faults, expected = FORMS[form]
    port = 29400 + random.randrange(500)
    rendezvous = tuple(arg.format(port=port) for arg in rendezvous)
    other = random.randrange(1, 2)  # a non-zero rank of 2
    faults = faults.format(other=other)
    out = tmp_path / "run"
    process = start(2, *JOB, f"training.steps={STEPS}", *extra, output_dir=out,
                    rendezvous=rendezvous, launcher_args=("--max-restarts=5",),
                    env={"TRAINER_FAULTS": faults})
    code = finish(process, timeout=300)
    log = (tmp_path / "run.log").read_text()
    assert code == 0, log[-4000:]
    assert resumed_steps(log) == expected, log[-4000:]
    for n in range(1, len(expected) + 1):
        assert f"checkpoint: restart {n} of at most 5: resumed from" in log
    records = read_metrics(out)
    assert [r["restart"] for r in records] == sorted(r["restart"] for r in records)
    assert {r["world_size"] for r in records} == {2}
    difference = loss_difference(records, reference, range(1, STEPS + 1))
    delays = kill_to_first_step(out, records)
    print(f"{form}: ranks 0 and {other} killed mid-save and mid-step: resumed from steps "
          f"{resumed_steps(log)}, largest relative loss difference {difference:.1e}, kill to the "
          f"first step after it {min(delays):.1f}-{max(delays):.1f}s")
    assert difference <= EXACT


def agent(node: int, out: Path, port: int, tmp_path: Path) -> subprocess.Popen:
    """One elastic node: trainer-run (torchrun's arguments, no environment variable) with 2 ranks,
    the layout chosen at each start (parallel=auto). Node 1 hosts the rendezvous store (on one
    machine every agent would otherwise take the endpoint for its own)."""
    return start(2, *JOB, *ELASTIC, output_dir=out,
                 log=tmp_path / f"node{node}.log", launcher="trainer.run.launcher",
                 rendezvous=("--nnodes=1:2", "--rdzv_backend=c10d",
                             f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=elastic",
                             f"--rdzv_conf=is_host={int(node == 1)},{RDZV_CONF}"),
                 launcher_args=("--max-restarts=3",), env={"TRAINER_FAULTS": f"pause@{PAUSE_STEP}"})


@pytest.mark.multiprocess
def test_an_elastic_job_shrinks_when_a_node_dies_and_grows_when_one_joins(tmp_path):
    """Two nodes of 2 ranks, in the layout parallel=auto chose for 4; node 2 and its ranks are
    killed (SIGKILL) after step 4's checkpoint: the job chooses again for 2 ranks and goes on alone
    from step 4 in that layout, up to step 10, where it waits (an injected pause). A new node then
    joins: torchrun stops the ranks, which save step 10, and the job goes on at 4 ranks from it, in
    the first layout. Every step's loss is the uninterrupted 4-rank FSDP run's (the same global
    batches, in order)."""
    expected = uninterrupted(4, ELASTIC_STEPS, tmp_path / "reference",
                             "training.micro_batch_size=2")
    out, port = tmp_path / "run", 29900 + random.randrange(90)
    first, second = agent(1, out, port, tmp_path), agent(2, out, port, tmp_path)
    third = None
    try:
        wait_for(lambda: logged_steps(out) >= 5, first, timeout=180)
        # a node lost: its launcher, agent and ranks at once
        for pid in [second.pid, *descendants(second.pid)]:
            os.kill(pid, signal.SIGKILL)
        killed = time.time()
        wait_for(lambda: any(r["world_size"] == 2 for r in read_metrics(out)), first, timeout=120)
        third = agent(3, out, port, tmp_path)
        assert finish(first, timeout=240) == 0, (tmp_path / "node1.log").read_text()[-4000:]
        assert finish(third, timeout=60) == 0, (tmp_path / "node3.log").read_text()[-4000:]
    finally:
        for process in (first, second, third):
            if process is not None and process.poll() is None:
                kill(process)
    # Node 1 held rank 0 of the shrunk job; the grown job's rank 0 may be on node 1 or node 3.
    log = (tmp_path / "node1.log").read_text() + (tmp_path / "node3.log").read_text()
    records = read_metrics(out)
    worlds = [(r["step"], r["world_size"]) for r in records]
    # Each start's choice, as the search makes it for that world (2 ranks a node).
    job, node = job_of(*JOB, *ELASTIC), auto_device(torch.device("cpu"), 2)
    chosen = {world: choose_layout(job, world, node, {}) for world in (4, 2)}
    # Rank 0 of the first start may be on either node.
    logs = "".join((tmp_path / f"node{n}.log").read_text() for n in (1, 2, 3))
    said = [line for line in logs.splitlines() if line.startswith("parallel=auto: ")]
    assert sorted(said) == sorted(chosen[world][2].splitlines()[0] for world in (4, 2, 4)), said
    shrunk_to = check_job(chosen[2][0], 2)
    assert log.count(f"world changed from 4 to 2 ranks: {describe_layout(shrunk_to)}, "
                     f"grad_accum_steps={shrunk_to.grad_accum_steps}, the global batch of 8 "
                     "sequences kept") == 1, log[-4000:]
    assert log.count("world changed from 2 to 4 ranks") == 1, log[-4000:]
    stopped = int(log.split("checkpoint: stopped at step ")[1].split()[0])
    resumed = resumed_steps(log)
    # Shrunk: from step 4's checkpoint; grown: from the step the join stopped, no step lost.
    assert stopped == PAUSE_STEP and resumed == [4, stopped], log[-4000:]
    changes = [w for i, (_, w) in enumerate(worlds) if i == 0 or worlds[i - 1][1] != w]
    assert changes == [4, 2, 4], worlds
    shrunk = [s for s, w in worlds if w == 2]
    assert shrunk[0] == 5 and shrunk[-1] == stopped and worlds[-1] == (ELASTIC_STEPS, 4), worlds
    difference = loss_difference(records, expected, range(1, ELASTIC_STEPS + 1))
    first_shrunk = min(r["time"] for r in records if r["world_size"] == 2)
    killed_after = max(r["step"] for r in records if r["time"] < killed)
    print(f"elastic: node 2 killed after step {killed_after}: resumed on 2 ranks from step 4, "
          f"{first_shrunk - killed:.1f}s from the kill to the first step; node 3 joined: stopped "
          f"and saved at step {stopped}, resumed on 4 ranks from it; largest relative loss "
          f"difference {difference:.1e}")
    assert difference <= RESHARDED



@pytest.mark.multiprocess
def test_a_rank_that_cannot_form_its_group_stops_within_the_timeout_with_one_line(tmp_path):
    """Rank 0 of 2 told to use torchrun's store where none listens (the peer never comes): the rank
    stops after distributed.timeout_s with one line, never hangs."""
    env = {**ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RESTART_COUNT": "1"}
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "model=llama_debug",
                             "+smoke=cpu",
                             "distributed.timeout_s=3", f"output_dir={tmp_path}"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    stopped = [line for line in result.stderr.splitlines() if line.startswith("training stopped:")]
    assert result.returncode == 1 and len(stopped) == 1, result.stderr[-3000:]
    assert stopped[0].startswith("training stopped: rank 0 could not join the job's process group "
                                 "(restart 1, distributed.timeout_s=3): "), stopped
    assert "Traceback" not in result.stderr
    print(f"no store to join: stopped after {took:.1f}s (start-up included): {stopped[0][:160]}")
