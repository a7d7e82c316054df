"""Guards on each step: a non-finite loss or gradient norm is skipped or stops the job, a loss spike
is skipped or rolled back past, and no checkpoint holds NaN. Faults are injected with
TRAINER_FAULTS."""

import math

import pytest
import torch
from helpers import launch, read_metrics, spawn

from trainer.config.schema import SpikeConfig, TrainingConfig
from trainer.errors import TrainingStopped
from trainer.faults.guards import StepGuard, check_finite

SMALL = ("model=llama_debug", "+smoke=cpu", "training.seq_len=32", "training.global_batch_size=4",
         "training.lr=3e-3", "model.n_layers=2")


def guard(**training) -> StepGuard:
    spike = training.pop("spike", SpikeConfig())
    return StepGuard(TrainingConfig(spike=spike, **training), torch.device("cpu"))


def run(g: StepGuard, values, first: int = 1) -> list[int]:
    """The steps skipped for these (loss, grad norm) pairs, of steps first, first + 1, ..."""
    return [s for s, (loss, norm) in enumerate(values, first)
            if g.check(s, torch.tensor(loss), torch.tensor(norm)).item() == 1.0]


def test_non_finite_steps_are_skipped_and_counted():
    g = guard(max_skipped_steps=3)
    nan, inf = math.nan, math.inf
    assert (run(g, [(2.0, 1.0), (nan, 1.0), (2.0, inf), (2.0, 1.0), (2.0, nan), (1.9, 1.0)])
            == [2, 3, 5])
    fields, said = g.report()
    assert fields == {"skipped_steps": 3}
    assert said == ("3 optimizer step(s) skipped, the last at step 5: loss 2, gradient norm nan "
                    "(3 in all: 3 non-finite, 0 loss spikes)")
    assert g.report() == ({"skipped_steps": 3}, "")  # said once
    run(g, [(nan, nan)] * 3, first=7)  # three in a row reach training.max_skipped_steps
    with pytest.raises(TrainingStopped,
                       match=r"3 steps in a row skipped \(training.max_skipped_steps=3\), the last "
                             r"at step 9: loss nan, gradient norm nan"):
        g.report()


def test_stop_freezes_every_step_after_the_first_non_finite_one():
    g = guard(on_nonfinite="stop")
    # frozen until the host looks
    assert run(g, [(2.0, 1.0), (2.0, math.inf), (2.0, 1.0), (1.8, 1.0)]) == [2, 3, 4]
    with pytest.raises(TrainingStopped,
                       match=r"step 2: loss 2, gradient norm inf \(training.on_nonfinite=stop\)"):
        g.check_stop()


def test_a_spike_is_skipped_after_the_warm_up_and_kept_out_of_the_statistics():
    g = guard(spike=SpikeConfig(threshold=4.0, warmup_steps=3, decay=0.5))
    # 9.0 at step 2: in the warm-up
    losses = [3.0, 9.0, 3.0, 3.1, 2.9, 3.0, 3.05, 2.95, 3.0, 3.0, 9.0, 3.0, 9.0]
    assert run(g, [(loss, 1.0) for loss in losses[:-1]]) == [11]
    assert not g.spiked()
    assert run(g, [(losses[-1], 1.0)], first=13) == [13] and g.spiked()
    assert g.report()[1].endswith("(2 in all: 0 non-finite, 2 loss spikes)")
    assert g.seen.item() == 11 and abs(g.mean.item() - 3.0) < 0.01


def _check_finite(rank, world):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    check_finite([model], optimizer, step=5)  # all finite: nothing said
    if rank == 1:
        optimizer.state[model.weight]["exp_avg_sq"][0, 0] = math.inf
    with pytest.raises(TrainingStopped,
                       match="step 5: not saved: parameters or optimizer state hold NaN or "
                             "infinite "
                                              + (r"values \(first: weight \(exp_avg_sq\)\)"
                                                 if rank == 1
                                                 else r"values \(first: on another rank\)")):
        check_finite([model], optimizer, step=5)


@pytest.mark.multiprocess
def test_a_checkpoint_with_non_finite_state_is_refused_on_every_rank():
    spawn(_check_finite, 2, timeout=120)


@pytest.mark.multiprocess
def test_nan_is_skipped_or_stops_and_never_saved(tmp_path):
    """A NaN gradient at step 3 of a 2-rank FSDP run: skipped (the run goes on, finite, and says
    so), or with on_nonfinite=stop the job ends at the next log, non-zero, with no checkpoint after
    step 2."""
    common = ("+recipe=llama_fsdp", *SMALL, "training.steps=6", "checkpoint.enabled=true",
              "checkpoint.interval=2")
    env = {"TRAINER_FAULTS": "nan_grad@3:1"}
    result = launch(2, *common, "metrics.log_every=2", output_dir=tmp_path / "skip", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "guard: 1 optimizer step(s) skipped, the last at step 3: loss " in result.stdout
    records = read_metrics(tmp_path / "skip")
    assert ([r["skipped_steps"] for r in records] == [0, 1, 1]
            and all(math.isfinite(r["loss"]) for r in records))
    result = launch(2, *common, "metrics.log_every=4", "training.on_nonfinite=stop",
                    output_dir=tmp_path / "stop", env=env)
    assert result.returncode == 1
    assert "training stopped: step 3: loss " in result.stderr, result.stderr[-3000:]
    assert "gradient norm nan (training.on_nonfinite=stop)" in result.stderr, result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "stop" / "checkpoints").iterdir()) == ["step_2"]


@pytest.mark.multiprocess
def test_spike_rolls_back_past_the_bad_batch(tmp_path):
    """A batch of scrambled tokens at step 12 (a spike against the falling loss): the step is
    skipped, the newest checkpoint (step 10) reloaded, and training reads on after that batch."""
    result = launch(2, "+recipe=llama_fsdp", *SMALL, "training.steps=14", "checkpoint.enabled=true",
                    "checkpoint.interval=10", "training.spike.threshold=3",
                    "training.spike.warmup_steps=5", "training.spike.decay=0.7",
                    "training.spike.action=rollback", output_dir=tmp_path,
                    env={"TRAINER_FAULTS": "garbage_batch@12"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("spike: step 12 skipped; rolled back to step 10, reading on from sequence "
            "48" in result.stdout)
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == [*range(1, 12), 11, 12, 13, 14], steps
