"""The optional extras (float8: torchao, ft: torchft, tensorboard, plot: matplotlib): without them the
fast tier passes, each test that needs one skipping with the command that installs it."""

import subprocess
import sys

import pytest
from helpers import ENV, REPO


@pytest.mark.multiprocess
def test_the_fast_tier_passes_with_the_extras_hidden():
    """As with only .[dev] installed: the extras' packages import as if absent (conftest.py's
    TRAINER_TEST_HIDE)."""
    env = {**ENV, "TRAINER_TEST_HIDE": "torchao,torchft,tensorboard,matplotlib"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not multiprocess", "-p", "no:cacheprovider",
                             "-rs", "-o", "addopts="], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=400)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    print(f"extras hidden: {summary}; {len(skipped)} skip reasons")
    assert any("needs torchao: pip install -e '.[float8]'" in line for line in skipped), skipped
    assert any("pip install -e '.[ft]'" in line or "torchft" in line for line in skipped), skipped
    assert " skipped" in summary and " failed" not in summary
