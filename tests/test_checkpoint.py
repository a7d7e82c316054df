"""Checkpoints: exact resume, resume under another layout, atomic publishing and damage
detection, seed checkpoints, and preemption by signal (restarts of killed ranks:
test_elastic.py)."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    by_step,
    descendants,
    failure_report,
    finish,
    launch,
    logged_steps,
    loss_difference,
    read_metrics,
    run_script,
    spawn,
    start,
    train_metrics,
    wait_for,
)
from reference import cross_entropy

from trainer import build_model, load_weights
from trainer.checkpoint import CheckpointError, folders, verify
from trainer.checkpoint.ownership import SAVE_MARKER
from trainer.checks.job import check_config
from trainer.checks.overrides import compose_job
from trainer.config.schema import JobConfig
from trainer.data import BatchLoader, build_dataset
from trainer.errors import ConfigError
from trainer.run.stop import SAME_SIGNAL_S

STEPS = 10
COMMON = (
    "+smoke=cpu", f"training.steps={STEPS}", "training.seq_len=64", "training.global_batch_size=8",
    "training.lr=3e-3", "training.warmup_steps=2", "checkpoint.enabled=true",
)
LLAMA = ("model=llama_debug", *COMMON)
MIXTRAL = ("model=mixtral_debug", *COMMON)
EXACT = 1e-6  # the same layout resumed
RESHARDED = 1e-4  # another layout: the parity tolerance


def largest_difference(records: list[dict], reference: list[dict], first_step: int) -> float:
    """The largest relative loss difference over the steps from `first_step` on; checks they all
    ran."""
    return loss_difference(records, reference, range(first_step, STEPS + 1))


def run(nproc: int, *overrides: str, output_dir: Path, timeout: float = 300) -> list[dict]:
    return train_metrics(nproc, *overrides, output_dir=output_dir, timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[dict]]:
    """An uninterrupted 2-rank FSDP run saving at steps 5 and 10: its output directory and
    metrics."""
    out = tmp_path_factory.mktemp("reference")
    return out, run(2, "+recipe=llama_fsdp", *LLAMA, "checkpoint.interval=5", output_dir=out)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_repeats_the_uninterrupted_run(mode, reference, tmp_path):
    saved = tmp_path / "saved"
    if mode == "sync":
        saved, records = reference
    else:  # saving overlapped with training changes nothing, and its checkpoints resume the same
        records = run(2, "+recipe=llama_fsdp", *LLAMA, "checkpoint.interval=5",
                      "checkpoint.async_save=true", output_dir=saved)
        assert largest_difference(records, reference[1], 1) == 0
    resumed = run(2, "+recipe=llama_fsdp", *LLAMA, f"checkpoint.resume={saved}/checkpoints/step_5",
                  output_dir=tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(6, STEPS + 1))
    difference = largest_difference(resumed, records, 6)
    print(f"exact resume ({mode}): largest relative loss difference {difference:.1e}")
    assert difference <= EXACT
    norms = zip(resumed, records[5:])
    assert max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in norms) <= EXACT


# name -> the layouts a checkpoint passes through, in runs of RESHARD_STEPS: the first saves at step
# 3, the next resumes from it and saves at step 4, the one after resumes from that; each is held
# against the first run.
RESHARDING = {
    "llama_fsdp4_to_tp2_pp4_to_fsdp4": [(4, ("+recipe=llama_fsdp", *LLAMA)),
                                        (8, ("+recipe=llama_tp2_pp4", *LLAMA)),
                                        (4, ("+recipe=llama_fsdp", *LLAMA))],
    "mixtral_ep4_to_fsdp2": [(4, ("+recipe=mixtral_ep", *MIXTRAL)),
                             (2, ("+recipe=mixtral_ep", "parallel.ep=1", *MIXTRAL))],
    "mixtral_fsdp2_to_ep2_tp2": [(2, ("+recipe=mixtral_ep", "parallel.ep=1", *MIXTRAL)),
                                 (4, ("+recipe=mixtral_ep2_tp2", *MIXTRAL))],
    # Ring context parallel to Ulysses (FSDP over dp_shard x cp in both: the data's layout in a
    # step is the method's own).
    "llama_cp2_ring_to_cp2_ulysses": [(2, ("+recipe=llama_cp2", *LLAMA)),
                                      (2, ("+recipe=llama_cp2", *LLAMA,
                                           "parallel.cp_method=ulysses"))],
    # Muon's momentum buffers: sharded like the weights under FSDP, split by tensor parallel after.
    "llama_muon_fsdp2_to_tp2": [(2, ("+recipe=llama_fsdp", *LLAMA, "optim=muon")),
                                (2, ("+recipe=llama_tp2", *LLAMA, "optim=muon"))],
}
RESHARD_STEPS, SAVED_AT = 6, (3, 4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", RESHARDING)
def test_resume_under_another_layout(case, tmp_path):
    (ranks, overrides), *resuming = RESHARDING[case]
    steps = f"training.steps={RESHARD_STEPS}"
    records = run(ranks, *overrides, steps, f"checkpoint.interval={SAVED_AT[0]}",
                  output_dir=tmp_path / "0")
    for i, ((ranks, overrides), step) in enumerate(zip(resuming, SAVED_AT), start=1):
        interval = SAVED_AT[i] if i < len(SAVED_AT) else RESHARD_STEPS
        resumed = run(ranks, *overrides, steps,
                      f"checkpoint.resume={tmp_path}/{i - 1}/checkpoints/step_{step}",
                      f"checkpoint.interval={interval}", output_dir=tmp_path / str(i))
        difference = loss_difference(resumed, records, range(step + 1, RESHARD_STEPS + 1))
        print(f"{case}, run {i} from step {step}: largest relative loss difference "
              f"{difference:.1e}")
        assert difference <= RESHARDED


@pytest.mark.multiprocess
def test_resume_auto_takes_the_newest_complete_checkpoint(tmp_path):
    """keep_last prunes; a damaged checkpoint is refused by name and skipped (then set aside) by
    resume=auto; a save that never finished (.tmp) is never a candidate, and is removed only if it
    carries this trainer's marker."""
    out = tmp_path / "run"
    records = run(1, "+recipe=llama_fsdp", *LLAMA, "checkpoint.interval=3",
                  "checkpoint.keep_last=2", output_dir=out)
    folder = out / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step_10", "step_9"]
    data = next((folder / "step_10").glob("*.distcp"))
    with open(data, "r+b") as f:  # one flipped byte in the middle of the file
        f.seek(data.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    for step in (11, 12):
        (folder / f"step_{step}.tmp").mkdir()
        (folder / f"step_{step}.tmp" / ".metadata").write_bytes(b"partial")
    (folder / "step_11.tmp" / SAVE_MARKER).write_text("a run")  # a save of ours, cut short

    named = launch(1, "+recipe=llama_fsdp", *LLAMA, f"checkpoint.resume={folder / 'step_10'}",
                   output_dir=tmp_path / "named")
    assert named.returncode != 0
    said = (f"config error: checkpoint.resume={folder / 'step_10'} cannot be loaded: {data.name} "
            "is damaged")
    assert said in named.stderr
    assert "/trainer/" not in named.stderr  # no traceback from our code

    auto = launch(1, "+recipe=llama_fsdp", *LLAMA, output_dir=out)
    assert auto.returncode == 0, failure_report(auto)
    assert f"skipping {folder / 'step_10'}: {data.name} is damaged" in auto.stdout
    assert f"resumed from {folder / 'step_9'} at step 9" in auto.stdout
    assert by_step(read_metrics(out))[10]["loss"] == records[-1]["loss"]
    assert verify(folder / "step_10") is None  # saved again, whole
    (damaged,) = folder.glob("step_10.damaged-*")
    assert verify(damaged) is not None  # kept, as it was
    assert not (folder / "step_11.tmp").exists()
    assert (folder / "step_12.tmp" / ".metadata").read_bytes() == b"partial"  # not ours: kept
    assert "left step_12.tmp" in auto.stdout


def _resume_with_a_stale_listing(rank, world, folder):
    if rank == 1:  # this rank's filesystem has not seen the newest checkpoint yet
        stale = folders.checkpoint_steps(folder)[:-1]
        folders.checkpoint_steps = lambda _: stale
    chosen = folders.find_resume(folder, rank, world, print)
    assert chosen == folder / "step_4", f"rank {rank} chose {chosen}"


@pytest.mark.multiprocess
def test_every_rank_resumes_the_checkpoint_rank_0_chose(tmp_path):
    for step in (2, 4):
        (tmp_path / f"step_{step}.tmp").mkdir()
        (tmp_path / f"step_{step}.tmp" / "shard.distcp").write_bytes(bytes(range(step)))
        folders.publish(tmp_path / f"step_{step}.tmp", tmp_path / f"step_{step}", step, 0, 1)
    spawn(_resume_with_a_stale_listing, 2, tmp_path, timeout=60)


@pytest.mark.multiprocess
def test_seed_checkpoint_is_the_starting_point(tmp_path):
    seed = tmp_path / "seed"
    result = run_script(REPO / "scripts" / "seed_checkpoint.py", seed, "--model", "llama_debug",
                        "--seed", "3")
    assert result.returncode == 0, result.stderr
    model = build_model("llama_debug")
    load_weights(model, seed)
    expected = build_model("llama_debug", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 expected.state_dict().values()))

    # A two-rank run (seed 0 for its data) starts from those weights, not its own.
    records = run(2, "+recipe=llama_tp2", *LLAMA, "training.steps=1", f"checkpoint.initial={seed}",
                  "checkpoint.enabled=false", output_dir=tmp_path / "run")
    job = JobConfig()
    loader = BatchLoader(build_dataset(job.data, 64, 0), 8, dp_rank=0, dp_size=1, grad_accum=1,
                         seed=0)
    ((inputs, labels),) = loader.microbatches(0)
    with torch.no_grad():
        loss = cross_entropy(expected(inputs), labels).item()
    assert abs(records[0]["loss"] - loss) / loss <= 1e-5


@pytest.mark.multiprocess
@pytest.mark.parametrize("sig, launcher",
                         [("SIGTERM", "torch.distributed.run"), ("SIGINT", "trainer.run.launcher"),
                          ("SIGINT", "torch.distributed.run")])
def test_signal_saves_and_stops_then_resume_continues(reference, tmp_path, sig, launcher):
    """SIGTERM to torchrun (forwarded to the ranks, as on a Slurm preemption), or SIGINT to every
    process of the job at once (`pkill -INT -f train.py`, a scheduler signalling every task: each
    rank gets it directly and again from its launcher) under trainer-run and under torchrun: every
    rank ends the step, a checkpoint is saved, the ranks exit (trainer-run with 0 and no traceback,
    also when a second Ctrl-C comes 0.1 s after the first);
    resume=auto then finishes the SIGTERM run on the uninterrupted curve."""
    out = tmp_path / "run"
    process = start(2, "+recipe=llama_fsdp", *LLAMA, "checkpoint.interval=100", output_dir=out,
                    launcher=launcher)
    wait_for(lambda: logged_steps(out) >= 3, process)
    if sig == "SIGTERM":
        process.send_signal(signal.SIGTERM)
    else:
        for pid in [process.pid, *descendants(process.pid)]:
            os.kill(pid, signal.SIGINT)
        if launcher == "trainer.run.launcher":  # and a second Ctrl-C at once: the first again
            time.sleep(0.1)
            process.send_signal(signal.SIGINT)
    code = finish(process)
    log = (tmp_path / "run.log").read_text()
    stopped = logged_steps(out)
    assert stopped < STEPS and f"stopped at step {stopped} on a signal ({sig})" in log, log[-3000:]
    assert "exitcode" not in log and "/trainer/" not in log, log[-3000:]
    assert "Error executing job" not in log, log[-3000:]
    if launcher == "trainer.run.launcher":
        assert code == 0 and "Traceback" not in log and "SignalException" not in log, log[-3000:]
    if sig == "SIGINT":
        assert log.count("Ctrl-C: stopping after this "
                         "step") == 1 and "Ctrl-C twice" not in log, log[-3000:]
    assert verify(out / "checkpoints" / f"step_{stopped}") is None
    if sig == "SIGINT":  # (the same save as SIGTERM's, whose resume follows: suite time)
        return

    resumed = launch(2, "+recipe=llama_fsdp", *LLAMA, "checkpoint.interval=100", output_dir=out)
    assert resumed.returncode == 0, failure_report(resumed)
    difference = largest_difference(read_metrics(out), reference[1], 1)
    print(f"preemption: stopped at step {stopped}, largest relative loss difference "
          f"{difference:.1e}")
    assert difference <= EXACT


@pytest.mark.multiprocess
def test_ctrl_c_twice_stops_at_once_without_a_traceback(tmp_path):
    """Under trainer-run the second Ctrl-C does not wait for the step: torchrun and the rank end at
    once, saving nothing, exit status 130."""
    out = tmp_path / "run"
    process = start(1, *LLAMA, "training.steps=1000", "training.seq_len=512",
                    "checkpoint.interval=1000", output_dir=out, launcher="trainer.run.launcher")
    log = tmp_path / "run.log"
    wait_for(lambda: logged_steps(out) >= 1, process)
    os.killpg(process.pid, signal.SIGINT)
    # Two signals sent together are one to the process, and so is a second within SAME_SIGNAL_S of
    # the first (a launcher's forward of it): a person's
    # second press comes after the first one's line, later.
    wait_for(lambda: "Ctrl-C: stopping" in log.read_text(), process)
    time.sleep(SAME_SIGNAL_S)
    os.killpg(process.pid, signal.SIGINT)
    code = finish(process, timeout=30)
    text = log.read_text()
    assert code == 130, text[-3000:]  # as a shell reports a process ended by Ctrl-C
    assert "Ctrl-C: stopping after this step" in text and "stopped at once (Ctrl-C twice)" in text
    assert "Traceback" not in text and not list((out / "checkpoints").glob("step_*"))


@pytest.mark.parametrize("override, message", [
    ("checkpoint.interval=0", "config error: checkpoint.interval=0 must be >= 1"),
    ("checkpoint.keep_last=-1", "config error: checkpoint.keep_last=-1 must be >= 0"),
    ("checkpoint.async_save=maybe",
     "config error: checkpoint.async_save=maybe must be true or false"),
    ("checkpoint.resume=/no/such/dir",
     "config error: checkpoint.resume=/no/such/dir is not a directory"),
    ("checkpoint.initial=/no/such/dir",
     "config error: checkpoint.initial=/no/such/dir is not a directory"),
])
def test_bad_checkpoint_settings_are_config_errors(override, message):
    """Composed and checked as every rank does first (test_bad_input holds the line and exit 2)."""
    with pytest.raises(ConfigError) as error:
        check_config(compose_job(["+smoke=cpu", override]), 1)
    assert f"config error: {error.value}".startswith(message)


def test_weights_without_the_moe_bias_load_into_a_model_that_balances_with_one(tmp_path):
    """A converted (weights-only) Qwen3-MoE checkpoint starts a run with aux-loss-free balancing on:
    the weights load, the bias it lacks stays at zero. A weight it lacks is still an error."""
    from trainer.checkpoint.state import save_weights
    from trainer.models import model_config

    plain = build_model("qwen3_moe_debug", seed=3)
    save_weights(plain.config, dict(plain.state_dict()), tmp_path / "weights")
    cfg = model_config({**vars(model_config("qwen3_moe_debug")), "bias_update_speed": 0.01})
    balanced = build_model(cfg)
    load_weights(balanced, tmp_path / "weights")
    for name, tensor in plain.state_dict().items():
        assert torch.equal(balanced.state_dict()[name], tensor), name
    assert balanced.layers["0"].feed_forward.expert_bias.abs().max() == 0
    partial = {k: v for k, v in plain.state_dict().items()
               if k != "layers.3.attention.q_norm.weight"}
    save_weights(plain.config, partial, tmp_path / "partial")
    with pytest.raises(CheckpointError, match="q_norm"):
        load_weights(balanced, tmp_path / "partial")
