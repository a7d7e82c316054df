"""scripts/compare_runs.py: two runs' curves step by step, a verdict by their precision's
tolerance."""

import json
import sys

import pytest
import yaml
from helpers import REPO

from trainer.observe.compare import TOLERANCES, compare, read_run

sys.path.insert(0, str(REPO / "scripts"))
import compare_runs  # noqa: E402

LOSSES = [7.6, 6.7, 6.1, 5.8, 5.5]


def write_run(path, losses, param_dtype="float32", n_experts=None, tp=1):
    path.mkdir()
    rows = [{"step": i + 1, "loss": loss, "grad_norm": 10.0 / (i + 1)}
            for i, loss in enumerate(losses)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = {"name": "m"} if n_experts is None else {"name": "m", "n_experts": n_experts}
    config = {"device": "cpu", "model": model, "parallel": {"tp": tp, "pp": 1},
              "training": {"mixed_precision": {"param_dtype": param_dtype}}}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def run(capsys, *args):
    code = compare_runs.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_two_layouts_of_one_curve_pass_and_another_seed_fails(tmp_path, capsys):
    a = write_run(tmp_path / "a", LOSSES)
    b = write_run(tmp_path / "b", [x * (1 + 5e-5) for x in LOSSES], tp=2)
    code, out, _ = run(capsys, a, b)
    assert code == 0 and "(tp=2, fp32)" in out and "same curve over 5 steps" in out, out
    other_seed = write_run(tmp_path / "seed7", [7.6, 6.8, 6.3, 5.9, 5.6])
    code, out, _ = run(capsys, a, other_seed)
    assert code == 1 and "different curves from step 2" in out, out
    assert run(capsys, a, other_seed, "--steps", "1")[0] == 0  # the first step alone agrees


def test_a_run_moved_to_bf16_is_held_to_bf16_s_tolerance(tmp_path):
    a = read_run(write_run(tmp_path / "a", LOSSES))
    b = read_run(write_run(tmp_path / "b", [x * (1 + 3e-3) for x in LOSSES], "bfloat16"))
    result = compare(a, b)
    assert (result.loss_rtol, result.grad_norm_rtol) == TOLERANCES["bf16"] and result.within


@pytest.mark.parametrize("dtype, experts, drift, code", [
    ("float32", None, 5e-4, 1), ("float32", 8, 5e-4, 0), ("bfloat16", None, 3e-3, 0),
    ("bfloat16", None, 1e-2, 1),
])
def test_each_precision_has_its_tolerance(tmp_path, capsys, dtype, experts, drift, code):
    a = write_run(tmp_path / "a", LOSSES, dtype, experts)
    b = write_run(tmp_path / "b", [x * (1 + drift) for x in LOSSES], dtype, experts)
    assert run(capsys, a, b)[0] == code


def test_a_folder_without_metrics_is_one_line(tmp_path, capsys):
    a = write_run(tmp_path / "a", LOSSES)
    (tmp_path / "empty").mkdir()
    code, out, err = run(capsys, a, tmp_path / "empty")
    assert (code == 2
            and err
            == f"compare_runs: {tmp_path / 'empty'} has no metrics.jsonl: not a run's output_dir\n")
    # The same folder twice is said, not judged "same curve".
    code, out, err = run(capsys, a, tmp_path / "a" / ".." / "a")
    assert (code == 2 and "given twice: a run compared with itself is always the same curve" in err
            and not out)


def test_a_run_s_layout_resolves_dp_shard_and_ep_of_minus_one(tmp_path):
    run_dir = write_run(tmp_path / "moe", LOSSES, n_experts=8)
    rows = [{**json.loads(line), "world_size": 4}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["parallel"] |= {"dp_shard": -1, "ep": -1}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    assert read_run(run_dir).layout == "dp_shard=4 ep=4"
