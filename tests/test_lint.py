"""The code passes the linter (ruff; its rules and line length are in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.tool
def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_stays_a_manual():
    """What a user runs and sets; measurements and design go to docs/."""
    assert len((REPO / "README.md").read_bytes()) <= 32_000
