"""The optional extras (float8: torchao, ft: torchft, tensorboard, plot: matplotlib): without them
the fast tier passes, each test that needs one skipping with the command that installs it."""

import re
import subprocess
import sys

import pytest
from helpers import ENV, REPO

# What a test that reaches an extra says: its package, or the feature or key that needs it.
EXTRAS = re.compile(r"torchao|torchft|tensorboard|matplotlib|float8|fault_tolerance|plot")


@pytest.mark.multiprocess
def test_the_fast_tier_passes_with_the_extras_hidden():
    """As with only .[dev] installed: the extras' packages import as if absent (conftest.py's
    TRAINER_TEST_HIDE). Every test module is collected so (an unguarded import fails there); of the
    modules that name an extra or its feature, the fast tests that need one (their skip says how to
    install it) or name one run (the rest of the tier reaches none and runs in the suite itself: a
    second run of it here would cost minutes)."""
    env = {**ENV, "TRAINER_TEST_HIDE": "torchao,torchft,tensorboard,matplotlib",
           "TRAINER_TEST_EXTRAS": EXTRAS.pattern}
    tests = sorted(p for p in (REPO / "tests").glob("test_*.py") if EXTRAS.search(p.read_text()))
    pytest_args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    collected = subprocess.run([*pytest_args, "--collect-only", "tests"], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stdout[-4000:] + collected.stderr[-2000:]
    result = subprocess.run([*pytest_args, "-m", "not multiprocess", "-rs", *map(str, tests)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    print(f"extras hidden: {summary}; {len(skipped)} skip reasons")
    assert any("needs torchao: pip install -e '.[float8]'" in line for line in skipped), skipped
    assert any("pip install -e '.[ft]'" in line or "torchft" in line for line in skipped), skipped
    assert " skipped" in summary and " failed" not in summary
