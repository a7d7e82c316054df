"""scripts/gpu_check.py's CPU-runnable checks and its table: every line passes here, so that on a
lent GPU a FAIL points at the CUDA path and not at the script."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import warm_train

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.multiprocess
def test_gpu_check_runs_its_cpu_checks_and_its_table():
    # Its runs start the stand-in for train.py (forked
    # from the warm launcher, not ~3 s of imports each).
    script, env = warm_train({"OMP_NUM_THREADS": "1"})
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--cpu",
                             "--table",
                             f"--train={script}"], cwd=REPO, capture_output=True, text=True,
                            timeout=500, env={**os.environ, **env})
    lines = result.stdout.splitlines()
    assert lines[0].startswith("no GPU: the CUDA checks are skipped"), result.stdout + result.stderr
    checks = [line for line in lines if line.startswith(("PASS", "FAIL", "SKIP"))]
    passed = len(checks) == 9 and all(line.startswith("PASS") for line in checks)
    assert passed, result.stdout + result.stderr
    assert result.returncode == 0
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| run ")]
    assert len(rows) == 8 and not any("failed" in row for row in rows), result.stdout
    assert all(row.split(" | ")[1].replace(",", "").isdigit() for row in rows), result.stdout
