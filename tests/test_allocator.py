"""The CPU allocator's settings: large freed blocks come back without being faulted in again."""

import subprocess
import sys

import pytest
from helpers import ENV, REPO

PROBE = """
import resource, sys, torch
from trainer.run.allocator import reuse_freed_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
torch.ones(25_000_000)  # 100 MB: faulted in the first time either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(25_000_000)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=REPO, env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.split()[-1])


@pytest.mark.multiprocess
def test_reused_memory_is_not_faulted_in_again():
    pages = 100_000_000 // 4096
    default = page_faults("default")
    # Where glibc places the blocks varies from process to process: the better of two.
    reused = min(page_faults("reuse") for _ in range(2))
    # glibc maps and unmaps each 100 MB block: every allocation faults all its pages in again.
    assert default >= 9 * pages, default
    # Kept in the heap, most allocations land on memory already faulted in (measured: 1 to 5 of 10
    # faulted, as blocks are placed; 5 plus one page once in a CI run).
    assert reused <= 6 * pages, reused
