"""scripts/bench.py, the README's benchmark command, runs end to end (a tiny shape)."""

import json
import subprocess
import sys

import pytest
from helpers import ENV, REPO


@pytest.mark.multiprocess
def test_bench_runs_the_trainer_beside_the_plain_loop(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "scripts/bench.py", "--runs", "llama_fsdp:1", "--threads", "1",
           "--steps", "3", "--warmup", "1", "--out", str(out), "training.seq_len=32",
           "training.global_batch_size=2"]
    result = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["plain PyTorch loop", "llama_fsdp"]
    assert all(r["tokens_per_s"] > 0 and r["mem_gib"] > 0 for r in rows)
