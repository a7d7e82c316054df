"""Straggler detection (trainer/observe/health.py): the verdict from the ranks' phase times, and a
4-rank run where one rank computes at half speed and another reads its data slowly, injected
(TRAINER_FAULTS)."""

import pytest
from helpers import launch, read_metrics

from trainer.observe.health import slowdowns

# seconds a step
FIGURES = [[0.01, 0.30, 0.02], [0.01, 0.31, 0.02], [0.01, 0.60, 0.02], [0.31, 0.30, 0.02]]


def test_a_rank_is_as_slow_as_its_excess_over_the_median_rank_in_each_phase():
    verdicts = slowdowns(FIGURES, stages=[0, 0, 0, 0])
    assert [phase for _, phase in verdicts[2:]] == ["forward_backward", "data"]
    # the lower median rank's step: 0.33
    assert verdicts[2][0] == pytest.approx((0.33 + 0.30) / 0.33, rel=0.01)
    assert verdicts[3][0] == pytest.approx((0.33 + 0.30) / 0.33, rel=0.01)
    assert max(ratio for ratio, _ in verdicts[:2]) < 1.05


def test_ranks_are_compared_within_their_pipeline_stage_and_of_two_the_faster_is_the_measure():
    """Stage 1 (ranks 2 and 3) does twice stage 0's work: nobody is slow; of two peers, the slower
    is."""
    even = [[0.0, 0.3, 0.0], [0.0, 0.3, 0.0], [0.0, 0.6, 0.0], [0.0, 0.6, 0.0]]
    assert [ratio for ratio, _ in slowdowns(even, stages=[0, 0, 1, 1])] == [1.0] * 4
    assert slowdowns([[0.0, 0.3, 0.0], [0.0, 0.6, 0.0]], stages=[0, 0])[1][0] == pytest.approx(2.0)


@pytest.mark.multiprocess
def test_a_slow_rank_is_named_within_ten_steps_with_its_phase_and_nobody_before(tmp_path):
    """FSDP over 4 ranks, the default check (every 5 steps, a window of 10, threshold 1.25): 50
    clean steps name nobody; from step 51 rank 2 computes at half speed and rank 1's batches come
    late; both are named by step 60, each with its phase, on the console and in metrics.jsonl."""
    result = launch(4, "model=llama_debug", "+smoke=cpu", "parallel.dp_shard=4", "model.n_layers=2",
                    "training.seq_len=32", "training.global_batch_size=4", "training.steps=60",
                    output_dir=tmp_path, env={"TRAINER_FAULTS": "slow@51:2,slow_data@51:1"},
                    timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path)
    checked = [r for r in records if r["step"] % 5 == 0 and r["step"] >= 10]
    clean = [r for r in checked if r["step"] <= 50]
    ratios = [r["slowest_rank_ratio"] for r in clean]
    assert [r["slow_ranks"] for r in clean] == [[]] * len(clean), ratios
    print("slowest rank over the clean steps:", max(r["slowest_rank_ratio"] for r in clean),
          "| exchange ms:", [r["health_exchange_ms"] for r in checked])
    named = {s["rank"]: s["phase"] for s in records[-1]["slow_ranks"]}
    assert named == {2: "forward_backward", 1: "data"}, records[-1]
    first = min(r["step"] for r in checked if r["slow_ranks"])
    assert first <= 60
    for rank, phase in named.items():
        said = [line for line in result.stdout.splitlines()
                if line.startswith(f"health: rank {rank} on ")]
        assert said and f"most in {phase}" in said[0], result.stdout[-2000:]
